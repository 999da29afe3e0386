"""Robust merging over many seeds: false rejections of honest workers and missed attacks of hostile ones.

usage: python benchmarks/robust.py [--attacks none,flip,scale,noise,pair] [--optimizers sgd,adam]
                                   [--data iid,sorted] [--seeds 0,...,9] [--max-epochs 8]
                                   [--resilience max_norm_ratio=3.0,min_cosine=0.0,no_worker_timeout=30]
                                   [--model mlp|cnn]

Every run is ``vcdask.fit`` of an MLP 64-64-10 (``--model mlp``, issue 40's model: plain SGD at lr 0.1 trains
it) or the demo CNN (``--model cnn``: SGD at lr 0.1 does not train it, 0.12-0.17 accuracy) on the demo's digits
(``vcdask.demo.digits(seed)``, the split and the initial weights seeded per run), 8 shards, ``--max-epochs``
epochs, on a ``LocalCluster`` of 4 spawned
worker processes with one thread each, started once, warmed up by a tiny fit and reused for every run; each
run's store is a scratch directory removed after it.  Robust merging is ``vcdask.Resilience(**--resilience)``
(``none``: no screen, to see what an attack costs unscreened).

Attacks (``--attacks``) are made through user code, as ``tests/chaos_helpers.py``'s ``Saboteur``: the run's
optimizer misbehaves on the hostile worker(s) only, the first of the sorted worker addresses (the first two
for ``pair``), and is honest elsewhere, the server's own probe step on the scheduler included:

* ``none``:  all four workers honest: every rejection is a false one;
* ``flip``:  the gradient's sign flipped at every local step (the task climbs the loss);
* ``scale``: every local step scaled tenfold;
* ``noise``: Gaussian noise (std 0.5) added to the parameters after every local step (a broken machine);
* ``pair``:  two colluding workers, both flipping their gradients: each sends its shard's uphill direction,
  the same one up to what their shards differ by, two of four updates at a time against the reference.

Optimizers (``--optimizers``): ``sgd`` (plain SGD, lr 0.1, as issue 40) and ``adam`` (Adam, lr 1e-3).
Data (``--data``): ``iid`` (fit's seeded shuffle) or ``sorted``: the training rows sorted by label and
``shuffle=False``, so each shard holds one or two classes and honest updates point in different directions.
Both get the same validation set, a random 10% of the training rows passed as ``validation=(X, y)``
(``validation=0.1`` would hold out the last rows, all 9s once sorted, and bias the screen's probe).

Per (optimizer, data, attack), over the seeds: runs, runs failed (``vcdask.RunFailedError``, its last line
in the progress), honest workers excluded, false rejections (honest updates rejected, any reason, % of the
honest updates that reached a decision), hostile updates merged (missed attacks, % of the hostile ones
decided), the screens that rejected (``direction``, ``norm``, ``probe``, other: the reason's first word),
and the median test accuracy.  A screen must never exclude an honest worker nor fail a run.  Progress per
run goes to stderr, the tables to stdout.  On 2 cores a run of 8 epochs of the MLP takes 1-2 s; a run
that ends with every worker excluded waits ``no_worker_timeout`` (30 s here) first.  The whole grid (both
optimizers, both kinds of data, 10 seeds: 200 runs) took 6.5 min.
"""

from __future__ import annotations

import argparse
import collections
import functools
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # inherited by the spawned workers: they unpickle robust.Hostile* by reference

from _scratch import scratch_store  # noqa: E402

ATTACKS = ("none", "flip", "scale", "noise", "pair")
OPTIMIZERS = {"sgd": 0.1, "adam": 1e-3}  # name -> learning rate
DATA = ("iid", "sorted")
SCALE, NOISE_STD = 10.0, 0.5


def log(message: str) -> None:
    """A progress line, to stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


# -- the hostile optimizer ----------------------------------------------------------------------------------
class _Hostile:
    """The base optimizer, except on a worker whose address is in ``hostile``, where its steps are ``mode``:
    ``"flip"`` (gradient sign flipped), ``"scale"`` (tenfold) or ``"noise"`` (Gaussian noise added)."""

    def __init__(self, params, *, hostile: tuple[str, ...] = (), mode: str = "flip", **kwargs):
        super().__init__(list(params), **kwargs)
        try:
            from distributed import get_worker

            self.mode = mode if get_worker().address in hostile else None
        except ValueError:  # the pre-flight check on the client, the screen's probe step on the scheduler
            self.mode = None

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.mode == "flip":
            for p in params:
                p.grad.neg_()
        before = [p.detach().clone() for p in params] if self.mode == "scale" else []
        out = super().step(closure)
        with torch.no_grad():
            for p, b in zip(params, before, strict=False):
                p.copy_(b + SCALE * (p - b))
            if self.mode == "noise":
                for p in params:
                    p.add_(torch.randn_like(p), alpha=NOISE_STD)
        return out


class HostileSGD(_Hostile, torch.optim.SGD):
    """SGD with :class:`_Hostile`'s misbehaviour on the hostile workers."""


class HostileAdam(_Hostile, torch.optim.Adam):
    """Adam with :class:`_Hostile`'s misbehaviour on the hostile workers."""


def hostile_class(optimizer: str) -> type:
    """HostileSGD or HostileAdam of the module ``robust`` (not ``__main__``, which cloudpickle would send by
    value): the workers import it from benchmarks/ on their inherited sys.path."""
    import robust

    return robust.HostileSGD if optimizer == "sgd" else robust.HostileAdam


# -- one run ------------------------------------------------------------------------------------------------
def make_data(seed: int, data: str):
    """``(train, validation, test)`` of digits at ``seed``; train sorted by label for ``"sorted"``."""
    from vcdask.demo import digits

    (X, y), test = digits(seed)  # rows already in a seeded random order
    n_val = int(round(0.1 * len(X)))
    X, y, val = X[:-n_val], y[:-n_val], (X[-n_val:], y[-n_val:])
    if data == "sorted":
        order = np.argsort(y, kind="stable")
        X, y = X[order], y[order]
    return (X, y), val, test


def make_model(name: str, seed: int) -> torch.nn.Module:
    """``mlp``: 64-64-10 with a ReLU (issue 40's model, which plain SGD at lr 0.1 trains); ``cnn``: the demo's."""
    from vcdask.demo import digits_cnn

    if name == "cnn":
        return digits_cnn(seed)
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def one_run(client, addresses, args, optimizer: str, data: str, attack: str, seed: int) -> dict:
    import vcdask
    from vcdask.demo import accuracy_on

    hostile = {"none": (), "pair": tuple(addresses[:2])}.get(attack, tuple(addresses[:1]))
    mode = "flip" if attack == "pair" else attack
    cls = hostile_class(optimizer)
    train, val, (Xt, yt) = make_data(seed, data)
    row: dict = {"failed": None, "accuracy": float("nan"), "reasons": collections.Counter()}
    t0 = time.perf_counter()
    with scratch_store(None, "robust") as store:
        try:
            result = vcdask.fit(
                make_model(args.model, seed),
                train,
                optimizer=functools.partial(cls, lr=OPTIMIZERS[optimizer], hostile=hostile, mode=mode),
                validation=val,
                shuffle=data == "iid",
                resilience=args.resilience,
                max_epochs=args.max_epochs,
                n_shards=8,
                seed=seed,
                client=client,
                store=store,
                progress=False,
                retention=False,
            )
        except vcdask.RunFailedError as e:
            row["failed"] = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            row["seconds"] = time.perf_counter() - t0
            return row
    row["seconds"] = time.perf_counter() - t0
    h = result.history
    bad = h.worker.isin(hostile)
    for who, rows in (("honest", h[~bad]), ("hostile", h[bad])):
        row[f"{who} merged"] = int((rows.outcome == "merged").sum())
        row[f"{who} rejected"] = int((rows.outcome == "rejected").sum())
        reasons = rows[rows.outcome == "rejected"].reason.fillna("").map(screen_of)
        row["reasons"].update(f"{who} {r}" for r in reasons)
    w = result.workers
    row["honest excluded"] = int((w.excluded.notna() & ~w.worker.isin(hostile)).sum())
    row["hostile excluded"] = int((w.excluded.notna() & w.worker.isin(hostile)).sum())
    row["accuracy"] = accuracy_on(result.model, Xt, yt)
    return row


def screen_of(reason: str) -> str:
    """Which check rejected an update, from its history ``reason``."""
    for prefix, name in (("update direction", "direction"), ("update norm", "norm"), ("probe loss", "probe")):
        if reason.startswith(prefix):
            return name
    return (reason.split() or ["?"])[0]


# -- the table ----------------------------------------------------------------------------------------------
def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}% ({part})" if whole else f"- ({part})"


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["failed"] is None]
    total = {k: sum(r.get(k, 0) for r in ok) for k in ("honest merged", "honest rejected", "hostile merged")}
    hostile = total["hostile merged"] + sum(r.get("hostile rejected", 0) for r in ok)
    reasons = sum((r["reasons"] for r in ok), collections.Counter())
    acc = [r["accuracy"] for r in ok]
    return {
        "runs": len(rows),
        "failed": len(rows) - len(ok),
        "honest excluded": sum(r.get("honest excluded", 0) for r in ok),
        "false rejections": pct(total["honest rejected"], total["honest merged"] + total["honest rejected"]),
        "hostile merged": pct(total["hostile merged"], hostile),
        "hostile excluded": sum(r.get("hostile excluded", 0) for r in ok),
        "rejected by": ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
        "median test accuracy": statistics.median(acc) if acc else None,
    }


def markdown(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows])


# -- main ---------------------------------------------------------------------------------------------------
def parse_resilience(text: str):
    import vcdask

    if text.strip().lower() == "none":
        return None
    options = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = None if value.strip() == "None" else float(value)
    return vcdask.Resilience(**options)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def words(allowed):
        def parse(text: str) -> list[str]:
            bad = [w for w in text.split(",") if w not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not among {list(allowed)}")
            return text.split(",")

        return parse

    ap.add_argument(
        "--attacks", type=words(ATTACKS), default=list(ATTACKS), help="a comma list of none,flip,scale,noise,pair (all)"
    )
    ap.add_argument(
        "--optimizers", type=words(tuple(OPTIMIZERS)), default=list(OPTIMIZERS), help="a comma list of sgd,adam (both)"
    )
    ap.add_argument("--data", type=words(DATA), default=list(DATA), help="a comma list of iid,sorted (both)")
    ap.add_argument(
        "--seeds", type=lambda s: [int(x) for x in s.split(",")], default=list(range(10)), help="a comma list (0,...,9)"
    )
    ap.add_argument("--max-epochs", type=int, default=8, help="epochs per run (%(default)s)")
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="the model (%(default)s)")
    robust = "max_norm_ratio=3.0,min_cosine=0.0,no_worker_timeout=30"
    ap.add_argument("--resilience", type=parse_resilience, default=robust,
                    help="Resilience options as name=value,... or 'none' (default: %(default)s)")  # fmt: skip
    return ap.parse_args(argv)


def warm_up(client) -> None:
    """A tiny fit: the spawned workers' imports and first steps, paid once outside the measurements."""
    import vcdask

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    with scratch_store(None, "robust-warm") as store:
        vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, n_shards=4, client=client, store=store,
                   progress=False)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"command: {shlex.join(['python', *sys.argv])}")
    print(f"resilience: {args.resilience}\n")
    import dask.config
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    torch.set_num_threads(1)
    grid = [(o, d, a) for o in args.optimizers for d in args.data for a in args.attacks]
    runs: dict[tuple, list[dict]] = {key: [] for key in grid}
    t_start = time.perf_counter()
    with (
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}),
        embedded_cluster(n_workers=4) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        client.wait_for_workers(4, timeout=120)
        warm_up(client)
        # the scheduler's own answer: scheduler_info()["workers"] can come back empty (tests/chaos_helpers.py)
        addresses = sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        log(f"cluster of 4 workers ready in {time.perf_counter() - t_start:.1f} s; hostile first: {addresses[:2]}")
        n, i = len(grid) * len(args.seeds), 0
        for seed in args.seeds:
            for key in grid:
                i += 1
                r = one_run(client, addresses, args, *key, seed)
                runs[key].append(r)
                what = f"FAILED: {r['failed']}" if r["failed"] else (
                    f"honest {r['honest merged']} merged / {r['honest rejected']} rejected, hostile "
                    f"{r['hostile merged']} merged / {r['hostile rejected']} rejected, honest excluded "
                    f"{r['honest excluded']}, accuracy {r['accuracy']:.3f}, {dict(r['reasons'])}"
                )  # fmt: skip
                log(f"[{i}/{n}] {' '.join(key)} seed {seed}: {r['seconds']:.1f} s, {what}")
    for optimizer in args.optimizers:
        for data in args.data:
            print(f"\n### {optimizer} (lr {OPTIMIZERS[optimizer]:g}), {data} data, {args.max_epochs} epochs\n")
            print(markdown([{"attack": a, **summary(runs[(optimizer, data, a)])} for a in args.attacks]))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
