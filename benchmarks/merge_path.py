"""Latency of one server merge for a 5M-parameter model: read W_c + merge + commit.

usage: python benchmarks/merge_path.py [--params 5000000] [--updates 30] [--rules vc-asgd,nesterov]

Runs the real merge path (vcdask.engine.params_server.ParamsServer, the code the scheduler plugin's
merge thread runs) over a stream of client updates written by vcdask.updates, against a
local directory store and the loopback S3 server (moto), committing every merge and
every 5th merge, with the paper's rule (``vc-asgd``, alpha 0.9) and the default rule (``nesterov``:
its momentum and delayed pseudo-gradient are rule state, stored with every commit).  Beside it,
measured in the same run: the bare in-memory ``lerp_`` (the physical floor of the arithmetic).  A
second table splits each merge into its stages (``ParamsServer.stage_seconds``); ``commit`` is per
commit.  The paper's Redis parameter server took 870 ms per update.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from vcdask import open_store
from vcdask.engine.params_server import STAGES, ParamsServer
from vcdask.merge import DEFAULT_RULE
from vcdask.params import flatten
from vcdask.schedules import Constant
from vcdask.testing.s3 import moto_server
from vcdask.updates import update_path, write_update


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def make_rule(name: str):
    if name == "vc-asgd":
        return Constant(0.9)
    if name == "nesterov":
        return replace(DEFAULT_RULE, delay=2)  # fit's delay for 2 workers, one task each
    raise ValueError(f"unknown rule {name!r}: choose from vc-asgd, nesterov")


def run(store, n_params: int, n_updates: int, commit_every: int, rule: str = "vc-asgd"):
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
    for rec in records:
        rec["base_step"] = state.step  # fresh: nothing rejected as stale
        t = time.perf_counter()
        state.merge(rec)
        latencies.append((time.perf_counter() - t) * 1e3)
    state.commit()
    total = time.perf_counter() - t_start
    return latencies, n_updates / total, {k: statistics.median(v) * 1e3 for k, v in state.stage_seconds.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--rules", default="vc-asgd,nesterov")
    args = ap.parse_args()
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
        stores = [
            ("local directory", open_store(d)),
            ("local S3 server (moto)", open_store(f"s3://{s3.new_bucket()}/bench", **s3.options())),
        ]
        for name, store in stores:
            for rule in args.rules.split(","):
                for every in (1, 5):
                    lat, rate, split = run(store, args.params, args.updates, every, rule)
                    rows.append((name, rule, every, lat, rate))
                    stages.append((name, rule, every, split))
    print(
        f"\n{args.params:,} float32 parameters ({args.params * 4 / 1e6:.0f} MB), {args.updates} updates per row, "
        "times in ms (torch 1 thread)\n"
    )
    print("| merge path | rule | commit every | p50 | p95 | merges/s sustained | p50 / lerp floor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    floor = statistics.median(lerp)
    for name, rule, every, lat, rate in rows:
        print(
            f"| {name} | {rule} | {every} | {statistics.median(lat):.1f} | {pct(lat, 0.95):.1f} | {rate:.1f} "
            f"| {statistics.median(lat) / floor:.0f}x |"
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
