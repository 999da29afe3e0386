"""Fresh vs worker-persistent inner optimizer state (``optimizer_state="fresh"`` / ``"worker"``).

usage: python benchmarks/inner_state.py [--tasks digits,wide,lm] [--workers 2] [--epochs 6] [--seeds 0,1,2]

Each task trains with vcdask's default merge rule on an embedded cluster of ``--workers`` worker
processes (one thread each; ``device="auto"``, so on a GPU machine they share its GPU), once per
seed and state, the same data, shards and epochs for both.  The table gives the median over seeds
of the final validation metric (accuracy for digits / the wide CNN, loss for the LM: lower is
better), of the metric's best epoch, and of the wall time, with the two states side by side.

* ``digits``: the demo CNN (40k parameters) on 8x8 digits, Adam 1e-3, 10 shards, 2 local epochs.
* ``wide``: the wide CNN of ``benchmarks/strategies.py`` (3.3M parameters), Adam 1e-3.
* ``lm``: a small character GPT of ``examples/char_lm.py`` (2 blocks, width 96), AdamW 2e-3.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import vcdask

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from _args import choices_list, number_list  # noqa: E402


def _digits(seed: int, wide: bool = False):
    from strategies import MODELS

    from vcdask.demo import digits

    train, val = digits()
    model = MODELS["wide" if wide else "digits"](seed)
    return model, train, {"validation": val, "n_shards": 10, "local_epochs": 2, "lr": 1e-3}, "accuracy"


def _lm(seed: int):
    import char_lm

    train, val = char_lm.load_data(128 * 1024, 24 * 1024, 64)
    torch.manual_seed(seed)
    model = char_lm.CharGPT(char_lm.GPTConfig(context=64, d_model=96, n_layers=2, n_heads=4))
    kwargs = {
        "validation": val,
        "train_step": char_lm.train_step,
        "eval_step": char_lm.eval_step,
        "optimizer": char_lm.make_optimizer(2e-3),
        "n_shards": 8,
        "local_epochs": 1,
        "validate_every": 8,
    }
    return model, train, kwargs, "loss"


TASKS = {"digits": _digits, "wide": lambda seed: _digits(seed, wide=True), "lm": _lm}


def run(task: str, state: str, seed: int, epochs: int, client) -> dict:
    model, data, kwargs, metric = TASKS[task](seed)
    store = tempfile.mkdtemp(prefix="vcdask-bench-inner-")
    try:
        t0 = time.perf_counter()
        result = vcdask.fit(
            model,
            data,
            client=client,
            store=store,
            max_epochs=epochs,
            seed=seed,
            optimizer_state=state,
            progress=False,
            **kwargs,
        )
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(store, ignore_errors=True)
    values = result.epochs[metric]
    best = values.min() if metric == "loss" else values.max()
    return {"final": float(values.iloc[-1]), "best": float(best), "wall": wall, "metric": metric}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="digits,wide,lm", help="a comma list of %(default)s")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args(argv)
    tasks = choices_list(ap, "--tasks", args.tasks, TASKS)
    seeds = number_list(ap, "--seeds", args.seeds, int, minimum=0)
    if args.workers < 1 or args.epochs < 1:
        ap.error(f"--workers and --epochs must be >= 1, got {args.workers} and {args.epochs}")
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    rows = []
    with embedded_cluster(n_workers=args.workers) as cluster, Client(cluster) as client:
        for task in tasks:
            by_state = {}
            for state in ("fresh", "worker"):
                runs = [run(task, state, seed, args.epochs, client) for seed in seeds]
                by_state[state] = runs
                print(task, state, [round(r["final"], 4) for r in runs], flush=True)
            metric = by_state["fresh"][0]["metric"]
            row = {"task": task, "metric": metric}
            for state, runs in by_state.items():
                row[f"{state} final"] = statistics.median(r["final"] for r in runs)
                row[f"{state} best"] = statistics.median(r["best"] for r in runs)
                row[f"{state} wall s"] = statistics.median(r["wall"] for r in runs)
            rows.append(row)
    from devices import markdown

    print(
        f"\n{args.workers} workers, {args.epochs} epochs, seeds {seeds}, device: "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
