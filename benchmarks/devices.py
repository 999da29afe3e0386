"""Time per shard on each kind of worker: CPU only, one CUDA worker, and one run mixing both.

usage: python benchmarks/devices.py [--tasks wide,lm] [--setups cpu,cuda,mixed] [--precisions 32,bf16]
                                    [--epochs 2]

Each setup is a real cluster of Dask worker processes (``distributed.SpecCluster`` with ``Nanny``
workers, one thread each); a CPU worker is one started with ``CUDA_VISIBLE_DEVICES=""``, so
``device="auto"`` puts it on its CPU while a GPU worker of the same run trains on CUDA.

* ``wide``: the wide CNN of ``benchmarks/strategies.py`` (3.3M parameters) on 8x8 digits, Adam.
* ``lm``: the character-level GPT of ``examples/char_lm.py`` with next-token loss (custom
  ``train_step`` / ``eval_step``), AdamW.

The table gives, per task, setup, precision and device: shards merged, the median seconds of
training per shard (``train_seconds``: the local steps) and of the whole task (reading the version
and rows, training, uploading ``W_c``), the run's wall time, and its final validation metric.
``cpu`` setups are the peer measured in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import vcdask

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from _args import choices_list  # noqa: E402


def _cluster(setup: str):
    from distributed import Nanny, Scheduler, SpecCluster

    cpu = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": ""}}}
    gpu = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}}
    workers = {"cpu": {"cpu-0": cpu, "cpu-1": cpu}, "cuda": {"gpu-0": gpu}, "mixed": {"gpu-0": gpu, "cpu-0": cpu}}
    return SpecCluster(
        workers=workers[setup],
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}},
    )


def _wide():
    from strategies import wide_cnn

    from vcdask.demo import digits

    (X, y), val = digits()
    kwargs = {"validation": val, "n_shards": 8, "local_epochs": 2, "batch_size": 32, "lr": 1e-3}
    return wide_cnn(0), (X, y), kwargs, "accuracy"


def _lm():
    import char_lm

    train, val = char_lm.load_data(256 * 1024, 32 * 1024, 64)
    torch.manual_seed(0)
    model = char_lm.CharGPT(char_lm.GPTConfig(context=64, d_model=128, n_layers=5, n_heads=4))
    kwargs = {
        "validation": val,
        "train_step": char_lm.train_step,
        "eval_step": char_lm.eval_step,
        "optimizer": char_lm.make_optimizer(2e-3),
        "n_shards": 8,
        "local_epochs": 1,
        "batch_size": 32,
    }
    return model, train, kwargs, "loss"


TASKS = {"wide": _wide, "lm": _lm}


def run(task: str, setup: str, precision: str, epochs: int) -> list[dict]:
    model, data, kwargs, metric = TASKS[task]()
    store = tempfile.mkdtemp(prefix="vcdask-bench-devices-")
    from distributed import Client

    try:
        with _cluster(setup) as cluster, Client(cluster) as client:
            t0 = time.perf_counter()
            result = vcdask.fit(
                model,
                data,
                client=client,
                store=store,
                max_epochs=epochs,
                precision=precision,
                progress=False,
                **kwargs,
            )
            wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(store, ignore_errors=True)
    merged = result.history[result.history.outcome == "merged"]
    rows = []
    for device, part in merged.groupby("device"):
        rows.append(
            {
                "task": task,
                "setup": setup,
                "precision": precision,
                "device": str(device),
                "shards": len(part),
                "train s/shard": float(np.median(part.train_seconds)),
                "task s/shard": float(np.median(part.seconds)),
                "wall s": wall,
                metric: float(result.metrics[metric]),
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="wide,lm", help="a comma list of wide, lm")
    ap.add_argument("--setups", default="cpu,cuda,mixed", help="a comma list of cpu, cuda, mixed")
    ap.add_argument("--precisions", default="32,bf16", help="a comma list of 32, bf16, 16-mixed (GPU setups)")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    from vcdask.device import check_precision

    tasks = choices_list(ap, "--tasks", args.tasks, TASKS)
    setups = choices_list(ap, "--setups", args.setups, ("cpu", "cuda", "mixed"))
    precisions_gpu = args.precisions.split(",")
    for precision in precisions_gpu:  # (as fit takes them: 32-true and bf16-mixed too)
        try:
            check_precision(precision)
        except ValueError as e:
            ap.error(f"--precisions: {e}")
    if args.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {args.epochs}")
    if not torch.cuda.is_available():
        print("no CUDA device here: only the cpu setup runs")
    rows: list[dict] = []
    for task in tasks:
        for setup in setups:
            if setup != "cpu" and not torch.cuda.is_available():
                continue
            precisions = precisions_gpu if setup != "cpu" else ["32"]
            for precision in precisions:
                rows.extend(run(task, setup, precision, args.epochs))
                print(rows[-1], flush=True)
    print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (floats to 3 decimals)."""
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
