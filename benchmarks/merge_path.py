"""Latency of one server merge for a 5M-parameter model: read W_c + merge + commit.

usage: python benchmarks/merge_path.py [--params 5000000] [--updates 30] [--rules vc-asgd,nesterov]
                                       [--stores local,s3] [--every 1,5] [--queued no,yes] [--checksums on,off]

Runs the real merge path (vcdask.engine.params_server.ParamsServer, the code the scheduler plugin's
merge thread runs) over a stream of client updates written by vcdask.updates, against a
local directory store and the loopback S3 server (moto), committing every merge and
every 5th merge, one update at a time (``--queued no``) and with the next update queued behind each
(``yes``: the fleet outpaces the merges; the run then names it and the server reads it on its side thread
while the merge before it runs), with the paper's rule (``vc-asgd``, alpha 0.9) and the default rule (``nesterov``:
its momentum and delayed pseudo-gradient are rule state, stored with every commit).  Beside it,
measured in the same run: the bare in-memory ``lerp_`` (the physical floor of the arithmetic), and the
floor of a whole merge and commit on each store's disk: a memory copy of the parameters plus writing the
same bytes to a file in the same directory (``--stores local``: the local directory's; the default
rule also writes its state, two more vectors, so its floor is three times that).  A
second table splits each merge into its stages (``ParamsServer.stage_seconds``); ``commit`` is per
commit.  The paper's Redis parameter server took 870 ms per update.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import replace

import dask
import torch
from _args import choices_list, number_list

from vcdask import open_store
from vcdask.engine.params_server import STAGES, ParamsServer
from vcdask.merge import DEFAULT_RULE, VCASGD
from vcdask.params import flatten
from vcdask.testing.s3 import moto_server
from vcdask.updates import update_path, write_update


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


RULES = ("vc-asgd", "nesterov")


def make_rule(name: str):
    if name == "vc-asgd":
        return VCASGD(alpha=0.9)
    if name == "nesterov":
        return replace(DEFAULT_RULE, delay=2)  # fit's delay for 2 workers, one task each
    raise ValueError(f"unknown rule {name!r}: choose from {', '.join(RULES)}")


def copy_and_write(n_params: int, directory: str, repeats: int = 5) -> list[float]:
    """Milliseconds to copy ``n_params`` float32 values in memory and write the same bytes to a new file
    in ``directory`` (closed, not synced: as a store's writes): a merge-and-commit's floor on that disk."""
    src, dst = torch.randn(n_params), torch.empty(n_params)
    times = []
    for i in range(repeats):
        path = os.path.join(directory, f"floor-{i}.bin")
        t = time.perf_counter()
        dst.copy_(src)
        with open(path, "wb") as f:
            f.write(memoryview(dst.numpy()).cast("B"))
        times.append((time.perf_counter() - t) * 1e3)
        os.remove(path)
    return times


def run(store, n_params: int, n_updates: int, commit_every: int, rule: str = "vc-asgd", read_ahead: bool = True):
    torch.manual_seed(0)
    branch = f"bench-{commit_every}-{time.monotonic_ns()}"
    store.create_branch(branch)
    store.commit(flatten({"w": torch.randn(n_params)}), {"step": 0}, branch=branch)
    state = ParamsServer(store, branch, make_rule(rule), "bench", commit_every=commit_every)
    state.load()
    records = []
    for i in range(n_updates):  # the workers' uploads, done before timing
        path = update_path("bench", 1, i, 0)
        write_update(store.files, path, flatten({"w": torch.randn(n_params)}))
        records.append({"epoch": 1, "shard": i, "attempt": 0, "base_step": 0, "update": path})
    latencies = []
    t_start = time.perf_counter()
    for i, rec in enumerate(records):
        rec["base_step"] = state.step  # fresh: nothing rejected as stale
        # the next update is queued behind this one (the fleet outpaces the merges): the run names it, and
        # the server reads it on its side thread while this one is merged and committed
        ahead = records[i + 1]["update"] if read_ahead and i + 1 < len(records) else None
        t = time.perf_counter()
        state.merge(rec, ahead=ahead)
        latencies.append((time.perf_counter() - t) * 1e3)
    state.commit()
    state.side.drain()  # (the merged updates' deletes)
    total = time.perf_counter() - t_start
    state.side.close()
    return latencies, n_updates / total, {k: statistics.median(v) * 1e3 for k, v in state.stage_seconds.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--rules", default="vc-asgd,nesterov", help="a comma list of vc-asgd, nesterov")
    ap.add_argument("--stores", default="local,s3", help="local (a directory) and/or s3 (moto on loopback)")
    ap.add_argument("--every", default="1,5", help="commit_every values, a comma list")
    ap.add_argument(
        "--queued",
        default="no,yes",
        help="whether the next update is queued behind each merge (the server reads it ahead), a comma list",
    )
    ap.add_argument(
        "--checksums",
        default="on",
        help="record (and verify) each version's checksums (vcdask.store.checksums), a comma list of on/off",
    )
    args = ap.parse_args()
    if args.params < 1 or args.updates < 1:
        ap.error(f"--params and --updates must be >= 1, got {args.params} and {args.updates}")
    rules = choices_list(ap, "--rules", args.rules, RULES)
    kinds = choices_list(ap, "--stores", args.stores, ("local", "s3"))
    everies = number_list(ap, "--every", args.every, int, minimum=1)
    queueds = choices_list(ap, "--queued", args.queued, ("no", "yes"))
    checksums = choices_list(ap, "--checksums", args.checksums, ("on", "off"))
    torch.set_num_threads(1)
    ws, wc = torch.randn(args.params), torch.randn(args.params)
    lerp = []
    for _ in range(50):
        t = time.perf_counter()
        ws.lerp_(wc, 0.1)
        lerp.append((time.perf_counter() - t) * 1e3)
    rows = [("bare lerp_ in memory (floor)", "-", "-", lerp, 1e3 / statistics.median(lerp))]
    stages = []
    with moto_server() as s3, tempfile.TemporaryDirectory() as d:
        stores = [("local directory", open_store(d))] if "local" in kinds else []
        if "s3" in kinds:
            stores.append(("local S3 server (moto)", open_store(f"s3://{s3.new_bucket()}/bench", **s3.options())))
        if "local" in kinds:
            disk = copy_and_write(args.params, d)
            rows.insert(1, ("floor: memory copy + write the same bytes to the same disk", "-", "-", disk, 0.0))
        for name, store in stores:
            for rule in rules:
                for every in everies:
                    for queued, sums in itertools.product(queueds, checksums):
                        label = f"{name}, next queued" if queued == "yes" else name
                        label += ", no checksums" if sums == "off" else ""
                        with dask.config.set({"vcdask.store.checksums": sums == "on"}):
                            lat, rate, split = run(store, args.params, args.updates, every, rule, queued == "yes")
                        rows.append((label, rule, every, lat, rate))
                        stages.append((label, rule, every, split))
    print(
        f"\n{args.params:,} float32 parameters ({args.params * 4 / 1e6:.0f} MB), {args.updates} updates per row, "
        "times in ms (torch 1 thread)\n"
    )
    print("| merge path | rule | commit every | p50 | p95 | merges/s sustained | p50 / lerp floor | p50 / disk floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    floor = statistics.median(lerp)
    disk_floor = statistics.median(rows[1][3]) if "local" in kinds else float("nan")
    for name, rule, every, lat, rate in rows:
        on_disk = statistics.median(lat) / disk_floor if "directory" in name or "floor:" in name else float("nan")
        print(
            f"| {name} | {rule} | {every} | {statistics.median(lat):.1f} | {pct(lat, 0.95):.1f} | {rate:.1f} "
            f"| {statistics.median(lat) / floor:.0f}x | {on_disk:.2f}x |"
        )
    print("\nWhere a merge's time goes (ms, median per stage; commit: per commit)\n")
    print("| merge path | rule | commit every | " + " | ".join(STAGES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in STAGES) + " |")
    for name, rule, every, split in stages:
        print(
            f"| {name} | {rule} | {every} | " + " | ".join(f"{split.get(k, float('nan')):.1f}" for k in STAGES) + " |"
        )


if __name__ == "__main__":
    main()
