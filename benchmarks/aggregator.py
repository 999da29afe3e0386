"""Aggregator capacity, simulated: how many workers one run's merge lane keeps busy.

usage: python benchmarks/aggregator.py [--workers 4,8,16,32,64] [--params 25000000] [--task-seconds 10]
                                       [--rules vc-asgd,default] [--overlap delta] [--tasks-per-worker 2]
                                       [--epochs 2] [--commit-every 1] [--rows 4] [--repeats 1]
                                       [--mem-gib 20] [--store DIR] [--wait-limit 600 | --no-wait]

Each row is one real ``vcdask.fit`` on a ``LocalCluster`` of ``min(W, 4)`` worker processes with
``W // processes`` threads each (W worker threads), a model of ``--params`` float32 parameters (a
``head`` of up to 1024 that the loss touches and a random ``body``: every version and every ``W_c`` is
written and read at full size) and a ``train_step`` that sleeps ``--task-seconds`` on a worker (not in
the caller's probe) and returns ``mean((x @ head)^2)``: one SGD step (lr 1e-4) changes the head a
little.  Each shard is one batch (``--rows`` rows), so a task is one step; ``n_shards`` is W times
``--tasks-per-worker``, for ``--epochs`` epochs; no validation.  ``vcdask.Retention(keep_last=2,
keep_epochs=False)`` bounds the store (100 MB a version at 25M parameters); each run's store is
removed after it.  ``--overlap`` sets ``vcdask.worker.overlap`` (delta, wait, newest) around ``fit``.
Before every run the script waits until no other ``benchmarks/`` or ``pytest`` process runs.

Where the numbers come from: each shard task's wall-clock start (Dask's task stream, by key), its
``seconds``, ``read_seconds``, ``train_seconds``, ``wait_seconds`` and ``steps_ahead`` (``FitResult.history``);
its arrival at the run = start + ``seconds`` (the hand-over is sent then); when its merge was done
(with ``commit_every=1`` also committed) = the timestamp of the run's ``update`` event (the scheduler logs
it after the merge).  The steady part of a run runs from the W-th arrival (every thread has finished
its first, cold task) to the W-th last (the drain begins); over it:

* ``ideal/s`` = W / task seconds; ``arrivals/s``, updates handed to the run; ``merges/s``, merges done
  (above ``arrivals/s`` where the window opens on the queued burst of the first round);
* ``idle %`` = 1 - (task time inside the window) / (W x window): a thread between tasks (with
  ``overlap=wait`` that includes the hand-over waiting for its own merge); ``train %``, the time in
  local steps (``train_seconds``, less the end wait a ``delta`` task spends inside it: ``wait_seconds``
  when ``steps_ahead`` > 0);
* ``backlog`` = arrivals so far - merges done so far (queue depth incl. the merge in progress), mean
  over the window (time-weighted) and max; ``lag s`` = merge done - arrival per update, median and max:
  bounded when the max stays near the median, growing when the lane falls behind;
* staleness (accepted updates) median / max; medians per task of ``wait_seconds``, ``read_seconds``
  (the base and rows) and ``upload_seconds`` (writing ``W_c``);
* ``service ms``: the lane's real time per update, the median (and mean) gap between two merges done
  where the second had arrived before the first was done (so the lane never waited for it); beside it
  the merge thread's own stages (``ParamsServer.stage_seconds``, last 256 merges, medians in ms: read
  ``W_c``, rule, commit), ``lane max/s`` = 1000 / their sum, and the retention's collections (in the
  merge thread, between merges: ``collect_seconds``) per merge;
* CPU over the whole ``fit`` in % of one core: ``sched`` (this process: scheduler, its loop, the merge
  thread, Icechunk's I/O threads), of which ``loop`` (the scheduler's event loop), ``workers`` (the
  worker processes), ``busy %`` / ``iowait %`` of the whole machine; peaks of PSS (this process and its
  children; ``sched``: this process alone) and of the store on disk, sampled every second; ``quiet``:
  no other benchmark or pytest process was seen during the run (checked every 5 s).

Before each run, and before its cluster starts, the script waits for other benchmark or pytest processes on
the machine to end (they would share its cores), saying first which ones, for at most ``--wait-limit``
seconds (then it goes on, and the row's ``quiet`` says ``no``); ``--no-wait`` does not wait.

The memory check, fitted to the PSS peaks of 25M-parameter runs (4 processes: 5.0 GiB at W=4, 8.2 at 16,
17.6 at 64): about 2.5 model sizes (4 x params bytes) per worker thread (its model copy, the
``W_c`` it hands over, the delta correction's difference), 6 per process and 6 more, plus 1.5 GiB; a
row that would need more than ``--mem-gib`` runs with fewer threads per process (its ``W`` column
says so: at 100M parameters, 4 threads in 20 GiB).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

import vcdask

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import choices_list, number_list, one_number
from _scratch import add_store_argument, scratch_store
from devices import markdown
from merge_bound import cpu_times


class FlatModel(torch.nn.Module):
    """``head`` (what the loss touches) and ``body`` (random, so every chunk is written), ``n_params`` in all."""

    def __init__(self, n_params: int, n_features: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.head = torch.nn.Parameter(0.01 * torch.randn(n_features, generator=g))
        self.body = torch.nn.Parameter(torch.randn(n_params - n_features, generator=g))

    def forward(self, x):
        return x @ self.head


@dataclass(frozen=True)
class SleepStep:
    """A step that "trains" for ``seconds`` on a Dask worker, then returns a cheap loss of the head."""

    seconds: float

    def __call__(self, model, batch):
        from distributed import get_worker

        try:
            get_worker()
            time.sleep(self.seconds)
        except ValueError:  # fit's probe of the step, in the calling process
            pass
        x, _y = batch
        return model(x).pow(2).mean()


def others() -> dict[int, str]:
    """Other benchmark or pytest processes running (not this one, its parents or its children): their
    command lines by process id."""
    me = psutil.Process()
    ours = {me.pid} | {p.pid for p in me.parents()} | {p.pid for p in me.children(recursive=True)}
    found = subprocess.run(["pgrep", "-f", "benchmarks/|pytest"], capture_output=True, text=True).stdout
    out = {}
    for pid in (int(p) for p in found.split()):
        if pid in ours:
            continue
        try:
            out[pid] = " ".join(psutil.Process(pid).cmdline())[:160]
        except psutil.Error:  # ended since
            pass
    return out


def wait_for_quiet(limit: float, poll: float = 10.0) -> float:
    """Wait until :func:`others` finds nothing, at most ``limit`` seconds (0: not at all), after saying which
    processes it waits for; the seconds waited."""
    found = others()
    if not found:
        return 0.0
    doing = f"waiting up to {limit:g} s (--wait-limit, --no-wait) for" if limit > 0 else "not waiting (--no-wait) for"
    print(f"  {doing} other benchmark/pytest processes:", flush=True)
    for pid, command in found.items():
        print(f"    {pid}: {command}", flush=True)
    t0 = time.monotonic()
    while found and (left := limit - (time.monotonic() - t0)) > 0:
        time.sleep(min(poll, left))
        found = others()
    waited = time.monotonic() - t0
    if found and limit > 0:
        print(f"  still running after {waited:.0f} s: going on (the row's 'quiet' will say no)", flush=True)
    return waited


class Peaks(threading.Thread):
    """Every second: the memory (PSS) of this process and of it with its children, the size of ``path`` on
    disk; every 5 s, whether another benchmark or pytest process runs (``disturbed``)."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.main, self.all, self.disk, self.disturbed = path, 0, 0, 0, False
        self._stop_at = threading.Event()

    def run(self) -> None:
        for i in itertools.count():
            if self._stop_at.wait(1.0):
                return
            me = psutil.Process()
            pss = [0]
            for p in [me, *me.children(recursive=True)]:
                try:  # proportional set size: the shared pages of PyTorch's libraries counted once
                    pss.append(p.memory_full_info().pss)
                except psutil.Error:
                    pass
            self.main, self.all = max(self.main, pss[1] if len(pss) > 1 else 0), max(self.all, sum(pss))
            size = 0
            for root, _dirs, files in os.walk(self.path):
                for f in files:
                    try:
                        size += os.lstat(os.path.join(root, f)).st_blocks * 512
                    except OSError:
                        pass
            self.disk = max(self.disk, size)
            if i % 5 == 4 and others():
                self.disturbed = True

    def stop(self) -> None:
        self._stop_at.set()
        self.join()


def memory_plan(workers: int, params: int, budget_gib: float) -> tuple[int, int]:
    """(processes, threads per process) for ``workers`` threads, fewer threads where memory would not do."""
    procs = min(workers, 4)
    threads = workers // procs
    need = lambda t: 4 * params * (2.5 * procs * t + 6 * procs + 6) + 1.5 * 2**30  # noqa: E731
    while threads > 1 and need(threads) > budget_gib * 2**30:
        threads -= 1
    return procs, threads


def _clip(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    return float(np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).sum())


def measure(result, stream: list[dict], events: list, n_threads: int, task_seconds: float) -> dict:
    """The row's numbers from the history, the task stream and the run's events (see the docstring)."""
    from vcdask.engine.events import train_key

    starts = {}
    for t in stream:
        compute = [s for s in t.get("startstops", ()) if s.get("action") == "compute"]
        if compute:
            starts[str(t["key"])] = compute[0]["start"]
    h = result.history[result.history.seconds.notna()].copy()
    h["start"] = [
        starts.get(train_key(result.run_id, int(r.epoch), int(r.shard), int(r.attempt)), np.nan) for r in h.itertuples()
    ]
    h = h[h.start.notna()]
    h["arrival"] = h.start + h.seconds
    done = sorted(ts for ts, e in events if e.get("type") == "update")
    merged_at = {(e["epoch"], e["shard"]): ts for ts, e in events if e.get("type") == "update" and e["accepted"]}
    arrivals = np.sort(h.arrival.to_numpy())
    n = len(arrivals)
    if n > 2 * n_threads + 1:
        a, b = arrivals[n_threads - 1], arrivals[n - n_threads - 1]
    else:  # too few tasks for a steady part: the whole run
        a, b = h.start.min(), arrivals[-1]
    window = b - a
    # queue depth on a 20 ms grid: arrivals so far - merges done so far
    grid = np.arange(a, b, 0.02)
    backlog = np.searchsorted(arrivals, grid, side="right") - np.searchsorted(np.asarray(done), grid, side="right")
    backlog = np.clip(backlog, 0, None)
    merges = sum(1 for ts in merged_at.values() if a < ts <= b)
    # the lane's service time: from one merge done to the next, where the next had arrived already
    d = np.asarray(done)
    queued = np.searchsorted(arrivals, d[:-1], side="right") > np.arange(1, len(d))
    service = np.diff(d)[queued]
    lag = np.array(
        [
            merged_at.get((int(r.epoch), int(r.shard)), np.nan) - r.arrival
            for r in h[h.accepted.astype(bool)].itertuples()
        ]
    )
    in_steps = h.train_seconds - np.where(h.steps_ahead > 0, h.wait_seconds.fillna(0), 0)
    step_start = (h.start + h.read_seconds).to_numpy()
    acc = h[h.accepted.astype(bool)]
    row = {
        "ideal/s": n_threads / task_seconds,
        "arrivals/s": float(((arrivals > a) & (arrivals <= b)).sum() / window),
        "merges/s": merges / window,
        "idle %": 100 * (1 - _clip(h.start.to_numpy(), h.arrival.to_numpy(), a, b) / (n_threads * window)),
        "train %": 100 * _clip(step_start, step_start + in_steps.to_numpy(), a, b) / (n_threads * window),
        "backlog mean": float(backlog.mean()) if len(backlog) else float("nan"),
        "backlog max": int(backlog.max()) if len(backlog) else 0,
        "lag s med": float(np.nanmedian(lag)) if len(lag) else float("nan"),
        "lag s max": float(np.nanmax(lag)) if len(lag) else float("nan"),
        "stale med": float(acc.staleness.median()),
        "stale max": int(acc.staleness.max()),
        "wait s": float(h.wait_seconds.median()),
        "read s": float(h.read_seconds.median()),
        "upload s": float(h.upload_seconds.median()),
        "service ms": 1e3 * float(np.median(service)) if len(service) else float("nan"),
        "service mean ms": 1e3 * float(np.mean(service)) if len(service) else float("nan"),
        "window s": float(window),
        "rejected": int((h.outcome == "rejected").sum()),
    }
    return {k: v if isinstance(v, (int, str)) else float(v) for k, v in row.items()}


def stages(cluster, run_id: str) -> dict:
    """Median ms per stage of the run's merge thread, and its collections (the scheduler runs in this process)."""
    try:
        server = cluster.scheduler.plugins["vcdask"].runs[run_id].server
    except (AttributeError, KeyError):
        return {}
    ms = {k: 1e3 * statistics.median(v) if v else 0.0 for k, v in server.stage_seconds.items()}
    out = {f"{k} ms": ms.get(k, 0.0) for k in ("read", "rule", "commit")}
    total = sum(ms.values())
    out["lane max/s"] = 1e3 / total if total > 0 else float("nan")
    out["collect ms/merge"] = 1e3 * sum(getattr(server, "collect_seconds", ())) / max(1, server.head.step)
    return out


def run(args, rule: str, cluster, client, n_threads: int, root: str, tag: str) -> dict:
    import dask.config
    from distributed import get_task_stream

    from vcdask.engine.events import topic

    n_features = min(1024, args.params // 2)
    n_shards = n_threads * args.tasks_per_worker
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(n_shards * args.rows, n_features, generator=gen).numpy()
    y = np.zeros(len(X), dtype=np.float32)
    model = FlatModel(args.params, n_features)
    commit_every = args.commit_every if args.commit_every == "auto" else int(args.commit_every)
    store = os.path.join(root, tag)
    peaks = Peaks(root)
    peaks.start()
    before, io0 = cpu_times(), psutil.cpu_times()
    t0 = time.perf_counter()
    try:
        with dask.config.set({"vcdask.worker.overlap": args.overlap}), get_task_stream(client) as ts:
            result = vcdask.fit(
                model,
                (X, y),
                train_step=SleepStep(args.task_seconds),
                optimizer=torch.optim.SGD,
                lr=1e-4,
                max_epochs=args.epochs,
                n_shards=n_shards,
                batch_size=args.rows,
                shuffle=False,
                merge=None if rule == "default" else rule,
                validation=None,
                commit_every=commit_every,
                retention=vcdask.Retention(keep_last=2, keep_epochs=False),
                client=client,
                store=store,
                seed=0,
                progress=False,
            )
        wall = time.perf_counter() - t0
        after, io1 = cpu_times(), psutil.cpu_times()
    finally:
        peaks.stop()
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    row = measure(result, ts.data, client.get_events(topic(result.run_id)), n_threads, args.task_seconds)
    row.update(stages(cluster, result.run_id))
    cpu = {k: 100 * (after[k] - before[k]) / wall for k in ("sched", "sched loop", "workers")}
    row.update({"sched cpu %": cpu["sched"], "loop %": cpu["sched loop"], "workers cpu %": cpu["workers"]})
    total = sum(io1) - sum(io0)
    row["busy %"] = 100 * (1 - (io1.idle - io0.idle + io1.iowait - io0.iowait) / total)
    row["iowait %"] = 100 * (io1.iowait - io0.iowait) / total
    row.update({"pss peak GiB": peaks.all / 2**30, "sched pss GiB": peaks.main / 2**30})
    row.update({"store peak GB": peaks.disk / 1e9, "wall s": wall, "quiet": "no" if peaks.disturbed else "yes"})
    return row


def median_row(done: list[dict]) -> dict:
    row = dict(done[0])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = statistics.median(float(r[key]) for r in done)
    if len(done) > 1:
        row["each merges/s"] = ", ".join(f"{r['merges/s']:.2f}" for r in done)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="4,8,16,32,64", help="worker threads per row")
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--task-seconds", type=float, default=10.0, help="each task's 'training' (a sleep)")
    ap.add_argument("--rules", default="vc-asgd,default", help="merge rules (default: fit's default rule)")
    ap.add_argument("--overlap", default="delta", choices=("delta", "wait", "newest"))
    ap.add_argument("--tasks-per-worker", type=int, default=2, help="shards per worker thread and epoch")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--commit-every", default="1", help="fit's commit_every: N or auto")
    ap.add_argument("--rows", type=int, default=4, help="rows per shard (= the batch: one step per task)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, round robin (the table: medians)")
    ap.add_argument("--mem-gib", type=float, default=20.0, help="memory the rows may plan for")
    add_store_argument(ap)
    ap.add_argument(
        "--wait-limit",
        type=float,
        default=600.0,
        metavar="S",
        help="before each run: wait at most S seconds for other benchmark or pytest processes to end (%(default)s)",
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for other benchmark or pytest processes")
    args = ap.parse_args(argv)
    from vcdask.merge import rules as merge_rules

    workers = number_list(ap, "--workers", args.workers, int, minimum=1)
    rules = choices_list(ap, "--rules", args.rules, ["default", *sorted(merge_rules)])
    one_number(ap, "--commit-every", args.commit_every, int, minimum=1, words=("auto",))
    for name in ("tasks_per_worker", "epochs", "rows", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.params < 2 or args.task_seconds < 0 or args.mem_gib <= 0 or args.wait_limit < 0:
        ap.error("--params must be >= 2, --task-seconds and --wait-limit >= 0, --mem-gib > 0")
    wait_limit = 0.0 if args.no_wait else args.wait_limit
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    t_start = time.perf_counter()
    rows = []
    with scratch_store(args.store, "aggregator") as root:
        for w in workers:
            procs, threads = memory_plan(w, args.params, args.mem_gib)
            n_threads = procs * threads
            label = str(n_threads) if n_threads == w else f"{n_threads} (of {w}: memory)"
            if any(r["threads"] == n_threads for r in rows):
                print(f"W={w}: {n_threads} threads fit in {args.mem_gib} GiB, as in a row before: skipped")
                continue
            if n_threads != w:
                print(f"W={w}: {procs} x {threads} threads fit in {args.mem_gib} GiB, not {w}", flush=True)
            kw = dict(threads_per_worker=threads, host="127.0.0.1", dashboard_address=None, memory_limit=0)
            runs: dict[str, list[dict]] = {r: [] for r in rules}
            for i in range(args.repeats):
                for rule in rules:
                    # a fresh cluster per run: a worker thread keeps the model copies of its last runs, and
                    # at 64 threads of 25M parameters a second run's copies took the machine to 23 GiB
                    waited = wait_for_quiet(wait_limit)  # before the cluster starts: its own processes are ours
                    if waited > 0:
                        print(f"  (waited {waited:.0f} s for other benchmark/pytest processes)", flush=True)
                    with embedded_cluster(n_workers=procs, **kw) as cluster, Client(cluster) as client:
                        row = run(args, rule, cluster, client, n_threads, root, f"w{w}-{rule}-{i}")
                    runs[rule].append(row)
                    print({"W": label, "rule": rule, **row}, flush=True)
            rows += [
                {"W": label, "threads": n_threads, "procs x threads": f"{procs}x{threads}", "rule": r, **median_row(d)}
                for r, d in runs.items()
            ]
    print(
        f"\n{args.params:,} parameters, {args.task_seconds:g} s tasks, overlap={args.overlap}, "
        f"commit_every={args.commit_every}, {args.tasks_per_worker} tasks per worker x {args.epochs} epochs"
    )
    print(markdown(rows))
    print(f"\nwall {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
