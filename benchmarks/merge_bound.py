"""Merges per second in a real run whose merge path is the bottleneck.

usage: python benchmarks/merge_bound.py [--params 5000000] [--shards 60] [--epochs 2] [--workers 2]
                                        [--rules nesterov,vc-asgd] [--compression none,int8]
                                        [--fold on,off] [--tasks-per-slot 1] [--backlog default]
                                        [--next-base on] [--repeats 1] [--cpu]

A model of ``--params`` float32 parameters that trains in no time (a linear head on the digits and a
large table the loss does not touch) on many tiny shards: every task is a read, a few steps and an
upload, so the run is as fast as its merge thread.  Each row is one ``vcdask.fit`` on an embedded
cluster with a local-directory store (removed after): merges per second sustained (accepted merges
after the first epoch over the time they took), the median shard-task time,
and the median upload size; with queued merges folded into one commit (``fold on``:
``commit_every="auto"``) and committed one by one (``off``: the default ``commit_every=1``), or a number
``N``: a commit every ``N`` merges (``commit_every=N``).  ``--backlog``: the run's retention collects once
this many MiB of versions were committed since its last collection (``Retention(backlog_bytes=...)``;
``none``: every 10 s only, as before stop 39; ``default``: the default policy).  ``--next-base off``: each
task asks the run for its base as it starts (``vcdask.worker.next-base``; ``on``, the default: the
answer to the last task's hand-over brought it).  ``--repeats N``: each row is run N times, round robin
over the rows, and the table gives the median of each number (``each``: every run's merges/s).
``benchmarks/merge_path.py`` measures the merge path alone for the floor.  Where a task's time goes:
``read`` (the spec, rows and base version, including ``wait``, the wait for the merges before its base),
``train``, ``upload`` (writing ``W_c``), medians in seconds from the run's history.

``--cpu`` adds where the machine's CPU went over each whole ``fit``, in milliseconds per merge (user +
system; after a warm-up run, so no row pays for cold workers): ``sched``, the scheduler's process (of
which ``sched loop``, its event loop, which the client shares here, and ``sched icechunk``, Icechunk's
I/O threads; the rest is mostly the merge thread), ``workers``, the worker processes together (of which
``workers icechunk``), and the machine's ``kernel`` (system) and ``idle`` time.  The cores bound the
run: ``merges/s <= cores * 1000 / (sched + workers)``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

import vcdask

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import choices_list, number_list
from _scratch import scratch_store

#: The column the benchmark is about.
RATE = "merges/s (after epoch 1)"


class TableNet(torch.nn.Module):
    """Digits logits from a linear head; ``table`` is merged and stored like any parameter.

    The forward pass leaves ``table`` out, so it gets no gradient and Adam skips it: the tasks train in
    no time.  (Until stop 28 it added ``0.0 * table[:1]``, which gave the table a dense gradient of 5M
    zeros and Adam a 5M-value step at every batch: 66 ms of each task's 0.23 s.)
    """

    def __init__(self, n_params: int):
        super().__init__()
        self.head = torch.nn.Linear(64, 10)
        # random, as a trained model's are: Zarr skips writing chunks equal to the fill value, and a table of
        # zeros (until stop 32) made every commit write next to nothing
        self.table = torch.nn.Parameter(torch.randn(max(1, n_params - 650), generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return self.head(x.flatten(1))


def cpu_times() -> dict[str, float]:
    """CPU seconds so far (user + system) of this process, its threads by kind, its child processes and
    their Icechunk threads, and the machine's system and idle time."""
    import threading

    import psutil

    def kind(pid: int, tid: int, names: dict[int, str]) -> str:
        if tid in names:
            return names[tid]
        try:  # native threads: Icechunk's (Rust) I/O runtime names its threads "tokio-runtime-worker"
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:
            return "?"

    me = psutil.Process()
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = dict.fromkeys(("sched", "sched loop", "sched icechunk", "workers", "workers icechunk"), 0.0)
    times = me.cpu_times()
    out["sched"] = times.user + times.system  # with the threads that exited (a run's merge thread)
    for t in me.threads():
        k = kind(me.pid, t.id, names)
        if k == "IO loop":
            out["sched loop"] += t.user_time + t.system_time
        elif k.startswith("tokio"):
            out["sched icechunk"] += t.user_time + t.system_time
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            out["workers"] += times.user + times.system
            for t in child.threads():
                if kind(child.pid, t.id, {}).startswith("tokio"):
                    out["workers icechunk"] += t.user_time + t.system_time
    machine = psutil.cpu_times()
    out["kernel"], out["idle"] = machine.system, machine.idle
    return out


def run(args, rule: str, codec: str, client, commit_every, backlog: str = "default") -> dict:
    from vcdask.demo import digits

    (X, y), _ = digits()
    with scratch_store(None, "mergebound") as store:
        before = cpu_times() if args.cpu else {}
        t0 = time.perf_counter()
        result = vcdask.fit(
            TableNet(args.params),
            (X, y),
            merge=rule,
            commit_every=commit_every,
            tasks_per_slot=args.tasks_per_slot,
            n_shards=args.shards,
            max_epochs=args.epochs,
            batch_size=256,
            validation=None,
            compression=None if codec == "none" else codec,
            client=client,
            store=store,
            seed=0,
            progress=False,
            retention=_retention(backlog),
        )
        wall = time.perf_counter() - t0
        after = cpu_times() if args.cpu else {}
    h = result.history[result.history.accepted].sort_values("time")
    later = h[h.epoch > 1]
    span = later.time.iloc[-1] - h[h.epoch == 1].time.iloc[-1]
    return {
        "rule": rule,
        "compression": codec,
        "merges": len(h),
        RATE: len(later) / span if span > 0 else float("nan"),
        "task s (median)": float(h.seconds.median()),
        # where a task's time goes (medians, s): reading the spec, rows and its base (of which waiting for
        # the merges before that base), the steps, writing W_c
        **{f"{k} s": float(h[f"{k}_seconds"].median()) for k in ("read", "wait", "train", "upload")},
        "upload MB (median)": float(h.nbytes.median()) / 1e6,
        "wall s": wall,
        **{f"{k} ms": (after[k] - before[k]) / len(h) * 1e3 for k in after},
    }


def _set_config(values: dict) -> None:
    import dask.config

    dask.config.set(values)


def _retention(backlog: str) -> vcdask.Retention:
    if backlog == "default":
        return vcdask.Retention()
    return vcdask.Retention(backlog_bytes=None if backlog == "none" else int(float(backlog) * 2**20))


def _median_row(done: list[dict]) -> dict:
    """One row for the runs of a configuration: the median of each number, and every run's merges/s."""
    import statistics

    row = dict(done[0])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = statistics.median(float(r[key]) for r in done)
    if len(done) > 1:
        row["each"] = ", ".join(f"{float(r[RATE]):.1f}" for r in done)
    return row


def _commit_every(fold: str) -> int | str:
    return "auto" if fold == "on" else 1 if fold == "off" else int(fold)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--shards", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rules", default="nesterov,vc-asgd")
    ap.add_argument("--compression", default="none,int8")
    ap.add_argument(
        "--fold", default="on,off", help="on, off, N: commit queued merges together, one by one, or every N merges"
    )
    ap.add_argument("--backlog", default="default", help="MiB of versions that trigger a collection: N, none, default")
    ap.add_argument("--tasks-per-slot", type=int, default=1, help="shard tasks kept in flight per worker thread")
    ap.add_argument("--next-base", default="on", help="on, off: vcdask.worker.next-base on the workers")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row (the table gives medians)")
    ap.add_argument("--cpu", action="store_true", help="where the machine's CPU went, ms per merge")
    args = ap.parse_args(argv)
    for name in ("params", "shards", "workers", "tasks_per_slot", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.epochs < 2:  # merges/s is measured after the first epoch
        ap.error(f"--epochs must be >= 2 (merges/s is measured after epoch 1), got {args.epochs}")
    from vcdask.compress import COMPRESSIONS
    from vcdask.merge import rules as merge_rules

    folds = [str(f) for f in number_list(ap, "--fold", args.fold, int, minimum=1, words=("on", "off"))]
    rules = choices_list(ap, "--rules", args.rules, sorted(merge_rules))
    codecs = choices_list(ap, "--compression", args.compression, ("none", *COMPRESSIONS))
    number_list(ap, "--backlog", args.backlog, float, minimum=0, words=("default", "none"))
    backlogs = args.backlog.split(",")
    next_bases = choices_list(ap, "--next-base", args.next_base, ("on", "off"))
    from devices import markdown
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    configs = [
        (fold, rule, codec, backlog, next_base)
        for fold in folds
        for rule in rules
        for codec in codecs
        for backlog in backlogs
        for next_base in next_bases
    ]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    with embedded_cluster(n_workers=args.workers) as cluster, Client(cluster) as client:
        if args.cpu:  # the workers' first tasks import and load what later ones find ready
            run(
                argparse.Namespace(**{**vars(args), "shards": 4, "epochs": 2, "cpu": False}),
                "vc-asgd",
                "none",
                client,
                1,
            )
        for _ in range(args.repeats):  # round robin: a noisy minute spreads over the configurations
            for config in configs:
                fold, rule, codec, backlog, next_base = config
                client.run(_set_config, {"vcdask.worker.next-base": next_base == "on"})
                row = run(args, rule, codec, client, _commit_every(fold), backlog)
                runs[config].append(row)
                print({"fold": fold, "backlog MiB": backlog, "next base": next_base, **row}, flush=True)
    rows = []
    for (fold, _rule, _codec, backlog, next_base), done in runs.items():
        rows.append({"fold": fold, "backlog MiB": backlog, "next base": next_base, **_median_row(done)})
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} runs per row (merges/s of each run in 'each')")
    print(f"\n{args.params:,} parameters, {args.workers} workers, {args.shards} shards x {args.epochs} epochs")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
