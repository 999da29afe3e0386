"""A run's accuracy version by version, for several outer rules side by side (the first epochs up close).

usage: python benchmarks/first_versions.py [--task digits|wide] [--slow 2] [--passes 3] [--seeds 0,1,2]
                                           [--rules default,adam,agreement,trust,no-correction,vc-asgd]
                                           [--versions 12] [--target 0.95]

What `heterogeneous.py` sums up as one time to target, seen from inside: the same two worker processes
(worker 1 made ``--slow`` times slower by the same per-batch delay), the same models and data, one
``vcdask.fit`` per rule and seed, and the test accuracy of each of the first ``--versions`` versions in
the order they were committed.  Each window of the default rule (``delay`` arrivals: one momentum step)
also gets the cosine between its mean pseudo-gradient and the momentum before it, and the gain the rule
put on the momentum term: where a step overshot, the next window's pseudo-gradient points back (cosine
near -1).  A minute or two per rule and seed on 2 cores.

Rules: ``default`` (fit's default), ``adam`` (``Nesterov(0.5, 0.9)`` with Adam's bias correction, the
default until stop 29), ``agreement`` and ``trust`` (the same with that ``bias_correction``), ``no-correction``
and ``vc-asgd``.  Prints one table of accuracies per version (median over seeds) and, per rule, the
median time to ``--target`` and final accuracy.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _scratch import scratch_store  # noqa: E402
from heterogeneous import SlowStep, batch_seconds  # noqa: E402
from strategies import MODELS  # noqa: E402

import vcdask  # noqa: E402
from vcdask.demo import accuracy_on, digits  # noqa: E402
from vcdask.merge import Nesterov  # noqa: E402
from vcdask.merge.nesterov import _dot  # noqa: E402

#: (cosine, gain) of each momentum step of the run going on (the embedded cluster's scheduler, where the
#: rule runs, is in this process; ``fit`` runs a copy of the rule, made by ``for_run``)
WINDOWS: list[tuple[float, float]] = []


class Watched(Nesterov):
    """``Nesterov``, keeping each momentum step's cosine (window mean vs momentum) and gain in WINDOWS."""

    def _momentum_gain(self, state, m, g, server):
        mom = {k: v for k, v in m.arrays.items() if v.is_floating_point()}
        gg, mm = _dot(g, g), _dot(mom, mom)
        cosine = _dot(g, mom) / math.sqrt(gg * mm) if gg and mm else float("nan")
        gain = super()._momentum_gain(state, m, g, server)
        WINDOWS.append((cosine, gain))
        return gain


RULES = {
    "default": lambda: None,
    "adam": lambda: Watched(lr=0.5, momentum=0.9, bias_correction=True),
    "agreement": lambda: Watched(lr=0.5, momentum=0.9, bias_correction="agreement"),
    "trust": lambda: Watched(lr=0.5, momentum=0.9, bias_correction="trust"),
    "no-correction": lambda: Watched(lr=0.5, momentum=0.9, bias_correction=False),
    "vc-asgd": lambda: "vc-asgd",
}


def one_run(client, task, rule_name, seed, X, y, Xt, yt, delay, passes):
    """(accuracy per version in commit order, seconds to each version's commit, windows) of one fit."""
    rule = RULES[rule_name]()
    WINDOWS.clear()
    with scratch_store(None, "first-versions") as store:
        t0 = time.time()
        r = vcdask.fit(
            MODELS[task](seed),
            (X, y),
            max_epochs=passes,
            seed=seed,
            train_step=SlowStep({1}, delay),
            client=client,
            store=store,
            retention=False,
            progress=False,
            **({} if rule is None else {"merge": rule}),
        )
        merged = r.history[r.history.accepted]
        committed = {v.id: v.written_at.timestamp() - t0 for v in vcdask.open_store(store).versions(r.run_id)}
        order = sorted(merged.version_id, key=committed.__getitem__)
        acc = [accuracy_on(vcdask.load(store, MODELS[task](seed), version=v, branch=r.run_id), Xt, yt) for v in order]
    return acc, [committed[v] for v in order], list(WINDOWS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["digits", "wide"], default="wide")
    ap.add_argument("--slow", type=float, default=2.0)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rules", default="adam,agreement")
    ap.add_argument("--versions", type=int, default=12)
    ap.add_argument("--target", type=float, default=0.95)
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        ap.error(f"unknown rules {unknown}; valid rules: {sorted(RULES)}")
    seeds = [int(s) for s in args.seeds.split(",")]

    from distributed import Client

    from vcdask.cluster import embedded_cluster

    (X, y), (Xt, yt) = digits()
    c = batch_seconds(args.task, X, y)
    print(f"{args.task}: one batch {c * 1e3:.1f} ms; worker 1 {args.slow}x slower; {args.passes} passes", flush=True)
    torch.set_num_threads(1)
    runs: dict[str, list] = {r: [] for r in rules}
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        with scratch_store(None, "first-versions") as store:  # warm the workers up (imports, first task)
            vcdask.fit(
                MODELS[args.task](0), (X[:320], y[:320]), max_epochs=1, client=client, store=store, progress=False
            )
        for seed in seeds:
            for rule in rules:
                acc, times, windows = one_run(
                    client, args.task, rule, seed, X, y, Xt, yt, c * (args.slow - 1), args.passes
                )
                reached = next((t for a, t in zip(acc, times, strict=True) if a >= args.target), math.nan)
                runs[rule].append((acc, reached, windows))
                cos = " ".join(f"{w[0]:+.2f}/{w[1]:.1f}" for w in windows[:6])
                print(
                    f"seed {seed} {rule}: reached {reached:.2f} s, final {acc[-1]:.4f}; cosine/gain {cos}", flush=True
                )
    n = args.versions
    print(f"\nTest accuracy of versions 1-{n} in commit order (median over seeds {args.seeds}):\n")
    print("| rule | " + " | ".join(str(i) for i in range(1, n + 1)) + f" | time to {args.target} (s) | final |")
    print("|---|" + "---|" * (n + 2))
    for rule, rs in runs.items():
        cells = [statistics.median(a[i] for a, _, _ in rs if len(a) > i) for i in range(n)]
        reached = statistics.median(r for _, r, _ in rs)
        final = statistics.median(a[-1] for a, _, _ in rs)
        print(f"| {rule} | " + " | ".join(f"{v:.3f}" for v in cells) + f" | {reached:.2f} | {final:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
