"""Sample efficiency of ``vcdask.fit``'s defaults: four tasks at equal epochs, beside single-process torch.

usage: python benchmarks/defaults.py [--tasks digits,wide,tabular,charlm] [--seeds 0,1,2]
                                     [--set NAME=VALUE ...] [--workers 2]

Each task is trained by ``vcdask.fit`` with its defaults (only the model, the data, the optimizer's
learning rate, the epochs and, where the task needs them, its steps and schedule are given) and by a
plain single-process torch loop making the same passes over the same data with the same optimizer.
``--set`` changes one of ``fit``'s arguments for every vcdask run (repeatable), to measure a
candidate default against the same torch numbers, e.g. ``--set optimizer_state=fresh``,
``--set tasks_per_slot=1``, ``--set merge=nesterov:0.5/0.9`` (lr/momentum of the outer step),
``--set merge=staleness:0/1`` (FedAsync's rule: alpha, and the exponent ``a`` of the staleness decay), or
``--set merge=probe:0.5_1_1.5_2_3/0_0.5_1[/0_0.5_0.9][#ROWS]`` (``vcdask.merge.Probe``'s candidate steps,
pulls, momenta and its probe rows).

* ``digits``:  the demo CNN (40k parameters) on 8x8 digits, Adam 1e-3, 8 epochs; test accuracy.
* ``wide``:    the wide CNN of ``strategies.py`` (3.3M parameters), the same data, 4 epochs.
* ``tabular``: scikit-learn's breast-cancer table (569 rows, 30 standardised features, 2 classes), an MLP
  30-32-2, Adam 1e-3, 6 shards, 8 epochs (the issue's "tabular task the benchmarks never saw").
* ``charlm``:  ``examples/char_lm.py``'s CharGPT (1.07M parameters) on 128 KiB of the standard library's
  source, AdamW 5e-3 with a cosine schedule, 32 shards, 4 epochs; validation loss (lower is better).

Prints, per task, the median over seeds of vcdask's and torch's final metric and their difference
(points of accuracy, or per cent of loss).  The acceptance bar of the defaults: within 1 point (3% of
loss) of torch on every task.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from _args import choices_list, number_list  # noqa: E402
from _scratch import scratch_store  # noqa: E402
from strategies import _train_passes  # noqa: E402

import vcdask  # noqa: E402
from vcdask.demo import accuracy_on, digits, digits_cnn  # noqa: E402


def tabular(seed: int = 0):
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(X))
    X, y = X[order].astype(np.float32), y[order].astype(np.int64)
    n_test = len(X) // 5
    mean, std = X[n_test:].mean(0), X[n_test:].std(0) + 1e-6
    X = (X - mean) / std
    return (X[n_test:], y[n_test:]), (X[:n_test], y[:n_test])


def tabular_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(30, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _classifier(name: str, seed: int) -> dict:
    from strategies import wide_cnn

    if name == "tabular":
        train, test = tabular(seed)
        return {"model": tabular_mlp(seed), "train": train, "test": test, "epochs": 8, "fit": {"n_shards": 6}}
    train, test = digits()
    make = {"digits": digits_cnn, "wide": wide_cnn}[name]
    return {"model": make(seed), "train": train, "test": test, "epochs": 8 if name == "digits" else 4, "fit": {}}


def torch_classifier(task: dict, seed: int) -> float:
    model = task["model"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    (X, y), (Xt, yt) = task["train"], task["test"]
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    g = torch.Generator().manual_seed(seed)
    for _ in range(task["epochs"]):
        _train_passes(model, opt, Xb, yb, g, 32)
    return accuracy_on(model, Xt, yt)


def vcdask_classifier(task: dict, seed: int, client, overrides: dict) -> float:
    with scratch_store(None, "defaults") as store:
        r = vcdask.fit(
            task["model"],
            task["train"],
            seed=seed,
            client=client,
            store=store,
            progress=False,
            **{"max_epochs": task["epochs"], **task["fit"], **overrides},  # --set wins
        )
    return accuracy_on(r.model, *task["test"])


TASKS = ("digits", "wide", "tabular", "charlm")
#: fit's arguments this script gives itself, for every task and for the char-LM (not open to --set)
FIXED = ("model", "data", "extra", "client", "store", "seed", "progress")
CHARLM_FIXED = ("train_step", "eval_step", "optimizer", "lr_schedule")

CHARLM = {"train_kb": 128, "val_kb": 32, "context": 64, "epochs": 4, "shards": 32, "lr": 5e-3}


def _charlm_data():
    import char_lm

    return char_lm.load_data(CHARLM["train_kb"] * 1024, CHARLM["val_kb"] * 1024, CHARLM["context"])


def charlm_torch(seed: int, data) -> float:
    import char_lm

    (X, Y), (Xv, Yv) = data
    model = char_lm.CharGPT(char_lm.GPTConfig(context=CHARLM["context"]), seed=seed)
    schedule = functools.partial(char_lm.cosine_schedule, epochs=CHARLM["epochs"])
    cpu = torch.device("cpu")
    char_lm.train_baseline(
        model, X, Y, epochs=CHARLM["epochs"], local_epochs=1, batch_size=32, lr=CHARLM["lr"],
        device=cpu, lr_schedule=schedule, seed=seed,
    )  # fmt: skip
    return char_lm.validation_loss(model, Xv, Yv, device=cpu)


def charlm_vcdask(seed: int, data, client, overrides: dict) -> float:
    import char_lm

    (X, Y), (Xv, Yv) = data
    with scratch_store(None, "defaults") as store:
        r = vcdask.fit(
            char_lm.CharGPT(char_lm.GPTConfig(context=CHARLM["context"]), seed=seed),
            (X, Y),
            train_step=char_lm.train_step,
            eval_step=char_lm.eval_step,
            optimizer=char_lm.make_optimizer(CHARLM["lr"]),
            lr_schedule=functools.partial(char_lm.cosine_schedule, epochs=CHARLM["epochs"]),
            **{"n_shards": CHARLM["shards"], "max_epochs": CHARLM["epochs"], **overrides},  # --set wins
            seed=seed,
            client=client,
            store=store,
            progress=False,
        )
    return char_lm.validation_loss(r.model, Xv, Yv, device=torch.device("cpu"))


def _value(text: str):
    from vcdask.merge import Nesterov, Probe, Staleness

    if text.startswith("staleness:"):  # staleness:ALPHA/A: FedAsync's weight (1 - ALPHA) / (staleness + 1) ** A
        alpha, a = text.split(":", 1)[1].split("/")
        return Staleness(alpha=float(alpha), a=float(a))
    if text.startswith("nesterov:"):  # nesterov:LR/MOMENTUM[/nobc|/adam|/agreement|/trust]: the correction
        lr, momentum, *rest = text.split(":", 1)[1].split("/") + ["0.9"] * (text.count("/") == 0)
        correction = {"nobc": False, "adam": True, "agreement": "agreement", "trust": "trust"}[(rest or ["adam"])[0]]
        return Nesterov(lr=float(lr), momentum=float(momentum), bias_correction=correction)
    if text.startswith("probe:"):  # probe:STEPS/PULLS[/MOMENTA][#ROWS]: vcdask.merge.Probe, _-lists
        spec, _, rows = text.split(":", 1)[1].partition("#")
        grids = [[float(v) for v in part.split("_")] for part in spec.split("/")]
        return Probe(*grids, **({"rows": int(rows)} if rows else {}))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(TASKS), help="a comma list of %(default)s")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="one of vcdask.fit's arguments (repeatable)"
    )
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    tasks = choices_list(ap, "--tasks", args.tasks, TASKS)
    seeds = number_list(ap, "--seeds", args.seeds, int, minimum=0)
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    fixed = FIXED + (CHARLM_FIXED if "charlm" in tasks else ())
    settable = [
        p.name
        for p in inspect.signature(vcdask.fit).parameters.values()
        if p.name not in fixed and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set takes NAME=VALUE, got {item!r}")
        if name not in settable:
            ap.error(
                f"--set: {name!r} is not one of fit's arguments this benchmark leaves open; choose from {settable}"
            )
        try:
            overrides[name] = _value(value)
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"--set: cannot read {item!r}: {e!r}")
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    torch.set_num_threads(1)  # the torch loop on one core, as each worker is
    rows = []
    with embedded_cluster(n_workers=args.workers) as cluster, Client(cluster) as client:
        for name in tasks:
            vc, tc = [], []
            t0 = time.perf_counter()
            for seed in seeds:
                if name == "charlm":
                    data = _charlm_data()
                    tc.append(charlm_torch(seed, data))
                    vc.append(charlm_vcdask(seed, data, client, overrides))
                else:
                    tc.append(torch_classifier(_classifier(name, seed), seed))
                    vc.append(vcdask_classifier(_classifier(name, seed), seed, client, overrides))
                print(f"{name} seed {seed}: torch {tc[-1]:.4f} vcdask {vc[-1]:.4f}", flush=True)
            v, t = statistics.median(vc), statistics.median(tc)
            loss = name == "charlm"
            rows.append(
                {
                    "task": name,
                    "metric": "val loss" if loss else "test accuracy",
                    "torch": t,
                    "vcdask": v,
                    "difference": f"{100 * (v / t - 1):+.1f}%" if loss else f"{100 * (v - t):+.2f} pt",
                    "within bar": (v <= 1.03 * t) if loss else (v >= t - 0.01),
                    "by seed (vcdask)": " ".join(f"{x:.3f}" for x in vc),
                    "wall s": time.perf_counter() - t0,
                }
            )
    from devices import markdown

    print(
        f"\nvcdask.fit defaults{' with ' + str(overrides) if overrides else ''}; seeds {seeds}; {args.workers} workers"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
