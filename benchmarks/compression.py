"""Compressed updates (``fit(compression=...)``): bytes per update and the accuracy they cost.

usage: python benchmarks/compression.py [--tasks digits,wide] [--codecs none,fp16,int8,int4]
                                        [--workers 2] [--epochs 6] [--seeds 0,1,2]
       python benchmarks/compression.py --speed [--params 5000000] [--codecs none,fp16,bf16,int8,int4]

Each task trains with vcdask's defaults on an embedded cluster of ``--workers`` worker processes
(one thread each), once per seed and codec: the same data, shards, epochs and seeds for every codec.
The table gives the median over seeds of the bytes one update takes in the store (``history.nbytes``),
its ratio to full float32 updates (``none``) measured in the same run, the final validation accuracy,
and its difference from ``none`` in points (negative: the codec cost accuracy).  Runs of one seed differ
by a few points from arrival order alone, and one validation image is 0.56 points, so the table also gives
the **paired** difference: per seed, the codec's accuracy minus float32's, as mean +- standard error over
the seeds (and the same for the validation loss, which moves in finer steps).  Resolving a 0.3-point
cost takes a dozen seeds or more.

* ``digits``: the demo CNN (40k parameters) on 8x8 digits, 10 shards, 2 local epochs.
* ``wide``: the wide CNN of ``benchmarks/strategies.py`` (3.3M parameters), the same data.

``--speed``: what a codec costs in CPU instead, one thread, no cluster: the median milliseconds of a
worker's ``encode`` (``W_c - W_base``, error feedback, quantization) of ``--params`` float32 values, at
every step of a run (its kept memory reused), and of the merge thread's ``decode``; the floor is one
copy of the values into new memory (``clone``), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vcdask

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _args import choices_list, number_list  # noqa: E402
from _scratch import scratch_store  # noqa: E402


def _task(name: str, seed: int):
    from strategies import MODELS

    from vcdask.demo import digits

    train, val = digits()
    return MODELS[name](seed), train, {"validation": val, "n_shards": 10, "local_epochs": 2, "lr": 1e-3}


def run(task: str, codec: str, seed: int, epochs: int, client) -> dict:
    model, data, kwargs = _task(task, seed)
    with scratch_store(None, "compression") as store:
        t0 = time.perf_counter()
        result = vcdask.fit(
            model,
            data,
            client=client,
            store=store,
            max_epochs=epochs,
            seed=seed,
            compression=None if codec == "none" else codec,
            progress=False,
            **kwargs,
        )
        wall = time.perf_counter() - t0
    merged = result.history[result.history.accepted]
    return {
        "accuracy": float(result.epochs["accuracy"].iloc[-1]),
        "loss": float(result.epochs["loss"].iloc[-1]) if "loss" in result.epochs else float("nan"),
        "nbytes": float(merged.nbytes.median()),
        "merged": len(merged),
        "wall": wall,
    }


def _paired(runs: list[dict], ref: list[dict], key: str, scale: float, relative: bool = False) -> str:
    """Mean +- standard error over seeds of ``runs[i][key] - ref[i][key]`` (``relative``: over ``ref``)."""
    diffs = [scale * (r[key] - f[key]) / (f[key] if relative else 1.0) for r, f in zip(runs, ref, strict=True)]
    if len(diffs) < 2 or any(d != d for d in diffs):
        return "nan"
    return f"{statistics.mean(diffs):+.2f} +- {statistics.stdev(diffs) / len(diffs) ** 0.5:.2f}"


def speed(n: int, codecs: list[str], repeat: int = 25) -> list[dict]:
    """Median ms of encode and decode of ``n`` float32 values per codec, and of a clone (the floor)."""
    from vcdask import compress
    from vcdask.params import flatten

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(n // 1000, 1000)  # about n values, not a whole number of blocks
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=g))
    base = flatten(model)

    def median_ms(f) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times[3:])

    floor = median_ms(lambda: base.arrays["float32"].clone())
    rows = []
    for codec in codecs:
        if codec == "none":
            continue
        times = {"encode": [], "decode": []}
        for _ in range(repeat):
            with torch.no_grad():
                model.weight.add_(1e-3 * torch.randn(model.weight.shape, generator=g))
            w_c = flatten(model)
            t = time.perf_counter()
            update = compress.encode(codec, w_c, base, "v", run_id=f"speed-{codec}")
            times["encode"].append(time.perf_counter() - t)
            t = time.perf_counter()
            update.decode(base)
            times["decode"].append(time.perf_counter() - t)
        enc, dec = (1000 * statistics.median(times[k][3:]) for k in ("encode", "decode"))
        values = base.layout.sizes["float32"]
        rows.append(
            {
                "compression": codec,
                "values": values,
                "encode ms": round(enc, 2),
                "decode ms": round(dec, 2),
                "clone ms (floor)": round(floor, 2),
                "encode / floor": round(enc / floor, 1),
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="digits,wide", help="a comma list of digits, wide")
    ap.add_argument("--codecs", default="none,fp16,int8,int4", help="a comma list of none, fp16, bf16, int8, int4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--speed", action="store_true", help="encode and decode ms per codec instead (no cluster)")
    ap.add_argument("--params", type=int, default=5_000_000, help="values encoded with --speed")
    args = ap.parse_args(argv)
    from strategies import MODELS

    from vcdask.compress import COMPRESSIONS

    codecs = choices_list(ap, "--codecs", args.codecs, ("none", *COMPRESSIONS))
    if args.speed:
        from devices import markdown

        if args.params < 1000:
            ap.error(f"--params must be >= 1000 with --speed, got {args.params}")
        print(markdown(speed(args.params, codecs)))
        return 0
    tasks = choices_list(ap, "--tasks", args.tasks, sorted(MODELS))
    seeds = number_list(ap, "--seeds", args.seeds, int, minimum=0)
    if args.workers < 1 or args.epochs < 1:
        ap.error(f"--workers and --epochs must be >= 1, got {args.workers} and {args.epochs}")
    if codecs[0] != "none":
        ap.error("--codecs must start with none (the float32 updates the others are compared with)")
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    rows = []
    with embedded_cluster(n_workers=args.workers) as cluster, Client(cluster) as client:
        for task in tasks:
            ref: dict = {}
            for codec in codecs:
                runs = [run(task, codec, seed, args.epochs, client) for seed in seeds]
                print(task, codec, [(round(r["accuracy"], 4), int(r["nbytes"])) for r in runs], flush=True)
                nbytes = statistics.median(r["nbytes"] for r in runs)
                acc = statistics.median(r["accuracy"] for r in runs)
                ref = ref or {"nbytes": nbytes, "accuracy": acc, "runs": runs}
                rows.append(
                    {
                        "task": task,
                        "compression": codec,
                        "bytes/update": int(nbytes),
                        "vs float32": nbytes / ref["nbytes"],
                        "accuracy": acc,
                        "points vs float32": 100 * (acc - ref["accuracy"]),
                        "paired points": _paired(runs, ref["runs"], "accuracy", 100.0),
                        "paired loss %": _paired(runs, ref["runs"], "loss", 100.0, relative=True),
                        "accuracy by seed": " ".join(f"{r['accuracy']:.3f}" for r in runs),
                        "wall s": statistics.median(r["wall"] for r in runs),
                    }
                )
    from devices import markdown

    print(
        f"\n{args.workers} workers, {args.epochs} epochs, seeds {seeds}, device: "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
