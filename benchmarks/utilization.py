"""How much of the hardware vcdask uses: tokens per second beside plain single-process torch on the same model.

usage: python benchmarks/utilization.py [--workers 1,2] [--variants wait,delta,newest] [--repeats 1]
                                        [--validate-every none|auto|N]
                                        [--d-model 96] [--layers 3] [--heads 4] [--context 64] [--batch 32]
                                        [--train-kb 256] [--shards 8] [--epochs 2] [--lr 5e-3]
                                        [--device auto] [--precision 32] [--store DIR]

The character-level GPT of ``examples/char_lm.py`` (its corpus, model, next-token ``train_step`` and
``eval_step``, AdamW and plain-torch loop, imported from there) is trained, from the same initial weights
on the same training sequences with the same optimizer, learning rate and batch size:

* by ``torch``: ``char_lm.train_baseline`` in this process (one torch thread, as each worker has);
* by ``vcdask.fit`` on a ``LocalCluster`` of W worker processes (one thread each), once per value of
  ``vcdask.worker.overlap`` (``--variants``): ``wait``, a worker waits for its update to be merged before
  its next task trains; ``delta``, it trains its next shard at once from its own ``W_c`` and corrects by
  ``merged - W_c`` when the merge arrives; ``newest``, its next task starts from the newest version without
  waiting for its own merge.  Each worker count's cluster is started once (and warmed up by a small fit)
  outside the timings and serves every variant and repeat.

Both final models are scored here on the same held-out sequences with ``char_lm.validation_loss``; the
fits validate nothing themselves (``validation=None``: no epoch-end validation in their wall time) unless
``--validate-every`` says so (``1``: every committed merge; ``auto``: fit's default, at most a twentieth of
the shard tasks' time), to measure what validating on the workers costs.

The table gives per trainer: tokens trained (of merged updates for vcdask), wall seconds of the training
(for vcdask the ``fit`` call: staging, initial commit, run, collection), tokens/s and its ratio to torch
(W=2 against torch: what two worker processes give over one torch process), tokens/s over the training
span (from the first task's start to the arrival of the last update, from ``FitResult.history``), the
share of the workers' time spent in local steps (sum of ``train_seconds`` / (W x fit wall)), ``cpu share``
(the workers' CPU seconds over W x wall; torch: this process's over its wall, a few per cent above 1 from
the idle clusters' threads here; well below 1 on CPU means the cores were shared with something else),
``main cpu s`` (this process's CPU seconds during the fit: scheduler, merges, staging), validation loss
and its ratio to torch's, and the median per task of ``read_seconds`` (of which ``wait_seconds``),
``train_seconds``, ``upload_seconds``, ``seconds`` and staleness.  ``--repeats N`` runs every row N times,
round robin, and prints medians.  On CUDA, ``train_seconds`` ends without a device sync: queued kernels
may finish in ``upload_seconds``.

The GPU configuration of the issue::

    python benchmarks/utilization.py --device cuda --d-model 512 --layers 8 --heads 8 --context 256 \\
        --batch 64 --train-kb 2048 --shards 8 --epochs 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))  # (inherited by the spawned workers: they import char_lm)

import char_lm  # noqa: E402
from _scratch import add_store_argument, scratch_store  # noqa: E402
from devices import markdown  # noqa: E402

import vcdask  # noqa: E402

VARIANTS = ("wait", "delta", "newest")
TASK_COLUMNS = {"read s": "read_seconds", "wait s": "wait_seconds", "train s": "train_seconds"}
TASK_COLUMNS |= {"upload s": "upload_seconds", "task s": "seconds", "staleness": "staleness"}
COLUMNS = ["trainer", "tokens", "wall s", "tokens/s", "x torch", "span s", "span tokens/s", "span x torch"]
COLUMNS += ["train share", "cpu share", "main cpu s", "val loss", "loss x torch", "merged", "other"]
COLUMNS += [*TASK_COLUMNS, "tokens/s each"]


def log(message: str) -> None:
    """A progress line, to stderr (the table goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; ``workers`` a list of ints and ``variants`` a list of names."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=96, help="width (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=3, help="transformer blocks (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    ap.add_argument("--context", type=int, default=64, help="sequence length in bytes (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per batch, both (default: %(default)s)")
    ap.add_argument("--train-kb", type=int, default=256, help="KiB of training text (default: %(default)s)")
    ap.add_argument("--val-kb", type=int, default=32, help="KiB of validation text (default: %(default)s)")
    ap.add_argument("--shards", type=int, default=8, help="vcdask n_shards (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the data, both (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3, help="AdamW's learning rate, both (default: %(default)s)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="both (default: auto)")
    ap.add_argument(
        "--precision", choices=["32", "bf16"], default="32", help="both; bf16: bfloat16 autocast (default: 32)"
    )
    ap.add_argument(
        "--optimizer-state", choices=["fresh", "worker", "auto"], default="fresh", help="vcdask (default: fresh)"
    )
    ap.add_argument("--workers", default="1,2", help="worker processes per cluster, a comma list (default: 1,2)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="vcdask.worker.overlap values, a comma list")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, round robin; the table gives medians")
    ap.add_argument(
        "--validate-every",
        default="none",
        help="vcdask's validation on the cluster: none (the default: validation=None), an integer or auto "
        "(fit's validate_every, on the same held-out sequences); the table's loss is measured here either way",
    )
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order (default: %(default)s)")
    add_store_argument(ap)
    args = ap.parse_args(argv)
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers takes a comma list of integers, got {args.workers!r}")
    if args.validate_every not in ("none", "auto"):
        try:
            args.validate_every = int(args.validate_every)
        except ValueError:
            ap.error(f"--validate-every takes none, auto or an integer, got {args.validate_every!r}")
    args.variants = args.variants.split(",")
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        ap.error(f"unknown --variants {unknown}; choose from {list(VARIANTS)}")
    positive = ("d_model", "layers", "heads", "context", "batch", "train_kb", "val_kb", "shards", "epochs", "repeats")
    for name in positive:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.workers) < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    return args


def autocast(args: argparse.Namespace, device: torch.device):
    """The baseline's precision context: bfloat16 autocast as vcdask's ``precision="bf16"``, else none."""
    if args.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def process_cpu() -> float:
    """CPU seconds of the process it runs in, all threads (here, or on a worker through ``client.run``)."""
    return time.process_time()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that wall times include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the two trainers ---------------------------------------------------------------------------------------
def train_torch(args: argparse.Namespace, config: char_lm.GPTConfig, data, device: torch.device) -> dict:
    """One plain-torch run of ``args.epochs`` shuffled passes; its tokens, wall seconds and validation loss."""
    (X, Y), (Xv, Yv) = data
    model = char_lm.CharGPT(config, seed=args.seed)
    common = {"local_epochs": 1, "batch_size": args.batch, "lr": args.lr, "device": device, "seed": args.seed}
    with autocast(args, device):
        sync(device)
        t0, cpu0 = time.perf_counter(), process_cpu()
        tokens = char_lm.train_baseline(model, X, Y, epochs=args.epochs, **common)
        sync(device)
        wall, cpu = time.perf_counter() - t0, process_cpu() - cpu0
    loss = char_lm.validation_loss(model, Xv, Yv, device=device)
    return {"tokens": tokens, "wall s": wall, "tokens/s": tokens / wall, "cpu share": cpu / wall, "val loss": loss}


def fit(
    args: argparse.Namespace, config: char_lm.GPTConfig, X, Y, client, store: str, n_shards: int, epochs: int, val=None
):
    """``vcdask.fit`` of a fresh model on ``(X, Y)`` as char_lm calls it; validating ``val`` on the cluster
    as ``--validate-every`` says (none: no validation there)."""
    validation = {} if val is None or args.validate_every == "none" else {"validate_every": args.validate_every}
    return vcdask.fit(
        char_lm.CharGPT(config, seed=args.seed),
        (X, Y),
        train_step=char_lm.train_step,
        eval_step=char_lm.eval_step,
        optimizer=char_lm.make_optimizer(args.lr),
        optimizer_state=args.optimizer_state,
        batch_size=args.batch,
        n_shards=n_shards,
        max_epochs=epochs,
        device=args.device,
        precision=args.precision,
        client=client,
        store=store,
        seed=args.seed,
        progress=False,
        validation=val if validation else None,
        **validation,
    )


def train_vcdask(args, config, data, device, client, workers: int, variant: str, store: str) -> dict:
    """One ``vcdask.fit`` with ``vcdask.worker.overlap`` set to ``variant``; its row (see :func:`task_breakdown`)."""
    import dask.config

    (X, Y), (Xv, Yv) = data
    workers_cpu0 = sum(client.run(process_cpu).values())
    with dask.config.set({"vcdask.worker.overlap": variant}):
        t0, cpu0 = time.perf_counter(), process_cpu()
        result = fit(args, config, X, Y, client, store, args.shards, args.epochs, val=(Xv, Yv))
        wall, cpu = time.perf_counter() - t0, process_cpu() - cpu0
    workers_cpu = sum(client.run(process_cpu).values()) - workers_cpu0
    loss = char_lm.validation_loss(result.model.to(device), Xv, Yv, device=device)
    row = task_breakdown(result.history, len(X), args, workers, wall)
    return {**row, "cpu share": workers_cpu / (workers * wall), "main cpu s": cpu, "val loss": loss}


def task_breakdown(history, n: int, args: argparse.Namespace, workers: int, wall: float) -> dict:
    """Tokens, speeds, training share and per-task medians of one fit from its ``FitResult.history``.

    Parameters
    ----------
    history : pandas.DataFrame
        ``FitResult.history``: one row per shard-task outcome.
    n : int
        Training sequences (for the shards' sizes).
    args : argparse.Namespace
    workers : int
    wall : float
        Seconds of the ``fit`` call.

    Returns
    -------
    dict
        ``tokens`` of merged updates, ``wall s``, ``tokens/s``, ``span s`` and ``span tokens/s`` (from the
        first task's start to the last update's arrival), ``train share`` (sum of every task's
        ``train_seconds`` over ``workers x wall``), ``merged`` and ``other`` (outcomes not merged), and the
        median of each of :data:`TASK_COLUMNS` over the merged tasks.
    """
    from vcdask.data import Shards

    merged = history[history["outcome"] == "merged"]
    sizes = [stop - start for start, stop in map(Shards(n, args.shards).bounds, merged["shard"].astype(int))]
    tokens = int(round(float(np.dot(sizes, merged["fraction"].astype(float))))) * args.context
    timed = history[history["time"].notna() & history["seconds"].notna()]
    ends, seconds = timed["time"].astype(float), timed["seconds"].astype(float)
    span = float(merged["time"].astype(float).max() - (ends - seconds).min()) if len(merged) else float("nan")
    row = {
        "tokens": tokens,
        "wall s": wall,
        "tokens/s": tokens / wall,
        "span s": span,
        "span tokens/s": tokens / span,
        "train share": float(history["train_seconds"].astype(float).sum()) / (workers * wall),
        "merged": len(merged),
        "other": len(history) - len(merged),
    }
    for name, column in TASK_COLUMNS.items():
        values = merged[column].astype(float).dropna() if column in merged else []
        row[name] = float(np.median(values)) if len(values) else None
    return row


def warm_up(args, config, data, client, workers: int, store: str) -> None:
    """What a first run pays once per process (imports, CUDA context, kernels), paid outside the timings."""
    (X, Y), _ = data
    few = min(len(X), 2 * workers * args.batch)
    fit(args, config, X[:few], Y[:few], client, store, n_shards=workers, epochs=1)


def open_cluster(stack: contextlib.ExitStack, workers: int):
    """A ``LocalCluster`` of ``workers`` processes with one thread each (vcdask's embedded kind), and its client."""
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    cluster = stack.enter_context(embedded_cluster(n_workers=workers, host="127.0.0.1", dashboard_address=":0"))
    return stack.enter_context(Client(cluster))


# -- the table ----------------------------------------------------------------------------------------------
def summarise(runs: dict[tuple[int, str], list[dict]], repeats: int) -> list[dict]:
    """One row per trainer: the medians of its runs, with ratios to torch's medians."""
    rows = []
    for (workers, variant), done in runs.items():
        keys = [k for k in done[0] if all(isinstance(r.get(k), int | float) for r in done)]
        row = {"trainer": "torch, 1 process" if workers == 0 else f"vcdask {workers}w {variant}"}
        row |= {k: statistics.median(r[k] for r in done) for k in keys}
        row |= {k: int(round(row[k])) for k in ("tokens", "tokens/s", "span tokens/s", "merged", "other") if k in row}
        if repeats > 1:
            row["tokens/s each"] = " ".join(f"{r['tokens/s']:.0f}" for r in done)
        rows.append(row)
    torch_row = rows[0]
    for row in rows:
        row["x torch"] = row["tokens/s"] / torch_row["tokens/s"]
        if "span tokens/s" in row:
            row["span x torch"] = row["span tokens/s"] / torch_row["tokens/s"]
        row["loss x torch"] = row["val loss"] / torch_row["val loss"]
    return [{k: row.get(k) for k in COLUMNS if any(k in r for r in rows)} for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = char_lm.resolve_device(args.device)
    torch.set_num_threads(1)  # the torch loop on one core, as each worker process is (RunSpec.torch_threads)
    data = char_lm.load_data(args.train_kb * 1024, args.val_kb * 1024, args.context)
    config = char_lm.GPTConfig(context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    (X, Y), (Xv, _) = data
    summary = (
        f"CharGPT {char_lm.n_parameters(char_lm.CharGPT(config)) / 1e6:.2f}M parameters (d_model {args.d_model}, "
        f"{args.layers} layers, {args.heads} heads, context {args.context}); {len(X)} training sequences "
        f"({X.size} tokens) in {args.shards} shards x {args.epochs} epochs, {len(Xv)} validation sequences; "
        f"AdamW lr {args.lr:g}, batch {args.batch}, device {args.device} ({device}), precision {args.precision}, "
        f"optimizer_state {args.optimizer_state}; {args.repeats} run(s) per row"
    )
    log(summary)
    t_start = time.perf_counter()
    runs: dict[tuple[int, str], list[dict]] = {(0, "-"): []}
    runs |= {(w, v): [] for w in args.workers for v in args.variants}
    with scratch_store(args.store, "utilization") as root, contextlib.ExitStack() as stack:
        clients = {}
        for workers in args.workers:
            t0 = time.perf_counter()
            clients[workers] = open_cluster(stack, workers)
            warm_up(args, config, data, clients[workers], workers, os.path.join(root, f"warm-{workers}"))
            log(f"cluster of {workers} workers started and warmed up in {time.perf_counter() - t0:.1f} s")
        with autocast(args, device):  # the baseline's first steps (imports, kernels) outside its timings
            few = min(len(X), 2 * args.batch)
            char_lm.train_baseline(
                char_lm.CharGPT(config), X[:few], Y[:few], epochs=1, local_epochs=1,
                batch_size=args.batch, lr=args.lr, device=device,
            )  # fmt: skip
        for repeat in range(args.repeats):  # round robin: a noisy minute spreads over the rows
            for workers, variant in runs:
                if workers == 0:
                    row = train_torch(args, config, data, device)
                else:
                    store = os.path.join(root, f"w{workers}-{variant}-{repeat}")
                    row = train_vcdask(args, config, data, device, clients[workers], workers, variant, store)
                    if args.store is None:  # a large model's versions add up over the runs: drop them as we go
                        shutil.rmtree(store, ignore_errors=True)
                runs[(workers, variant)].append(row)
                shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
                log(f"[{repeat + 1}/{args.repeats}] {'torch' if workers == 0 else f'{workers}w {variant}'}: {shown}")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    print(f"\n{summary}")
    if args.repeats > 1:
        print(f"medians of {args.repeats} runs per row (tokens/s of each run in 'tokens/s each')")
    print(markdown(summarise(runs, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
