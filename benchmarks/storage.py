"""Store size of a run: bytes written per merge and final store size, per merge rule, with and without retention.

usage: python benchmarks/storage.py [--params 5000000] [--merges 120] [--shards 10] [--repeat 1]
                                    [--rules vc-asgd staleness nesterov sync]

For each merge rule of the ``vcdask.merge`` registry (configured as ``fit`` configures it: ``for_run``
with 4 tasks in flight), a run of ``--merges`` merges of a ``--params`` float32 model (one flat
tensor: a version stores the same bytes whatever the layer shapes) in a fresh local store, once
keeping every version (``fit(retention=False)``) and once with the default ``vcdask.Retention()``.

It drives the run's parameter server directly (``vcdask.engine.params_server.ParamsServer``) instead of
a full ``fit``: the bytes are the same (the same merge, commit, rule-state and retention code in the
same merge-thread order), without spending the minutes of training a 5M-parameter model on 2 cores.
Each merge reads a client update written to the store as a worker writes it (``updates.write_update``);
``in_use_step`` is set as the run's loop sets it (the oldest base of 4 tasks in flight), and the
epoch's last shard commits at once and completes its epoch, as in a run.

Measured per run: bytes written per merge (new or grown objects under the store after each merge,
the worker's upload excluded; median over the merges), the final size of the store directory, the
versions left on the branch, the median seconds per merge (read update, merge, commit, and any
collection), the collections with their median seconds, and the final store against the same rule's
"keep all" run of this invocation.  With ``--repeat N`` each cell is the median over N runs.  At the
default size (5M parameters, 120 merges) the header also gives the issue's earlier measurement, made
before retention existed (6.6 GB for the default rule), for comparison.  Stores are made under a
temporary directory and deleted after each run; the script stops if the disk has less than 10 GB free.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vcdask import Retention, open_store
from vcdask.engine.params_server import ParamsServer
from vcdask.merge import get_rule, rules
from vcdask.params import flatten
from vcdask.updates import update_path, write_update

#: The issue's earlier measurement, before retention: 120 merges of a 5M-parameter model, default rule.
#: Shown only for a run of that size, labelled as the earlier measurement.
BEFORE_GB = 6.6
BEFORE_SIZE = {"params": 5_000_000, "merges": 120}
IN_FLIGHT = 4


def files(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def one_run(root: Path, rule_name: str, retention: Retention | None, args) -> dict[str, float]:
    """One run of ``args.merges`` merges in a fresh store under ``root``; its numbers."""
    store_path = root / f"{rule_name}-{'kept' if retention else 'all'}"
    store = open_store(store_path)
    run = "run-bench"
    g = torch.Generator().manual_seed(0)
    params = flatten({"w": torch.randn(args.params, generator=g)})
    store.create_branch(run)
    store.commit(params, {"run_id": run, "step": 0, "epoch": 0, "merged": []}, branch=run)
    rows_per_shard = 1000
    rule = get_rule(rule_name).for_run(samples_per_epoch=rows_per_shard * args.shards, in_flight=IN_FLIGHT)
    server = ParamsServer(store, run, rule, run, retention=retention)
    server.load()
    written, seconds = [], []
    for i in range(args.merges):
        epoch, shard = i // args.shards + 1, i % args.shards
        step = server.step
        noise = torch.randn(args.params, generator=g) * 0.01
        path = update_path(run, epoch, shard, 0)
        write_update(store.files, path, flatten({"w": server.params.arrays["float32"] + noise}))
        record = dict(epoch=epoch, shard=shard, attempt=0, base_step=max(0, step - IN_FLIGHT + 1), update=path)
        record["n_samples"] = rows_per_shard
        server.in_use_step = record["base_step"]  # the oldest base of the tasks in flight
        before = files(store_path)
        t = time.perf_counter()
        out = server.merge(record, completes=shard == args.shards - 1)
        seconds.append(time.perf_counter() - t)
        assert out["accepted"], out
        after = files(store_path)
        written.append(sum(n - before.get(p, 0) for p, n in after.items() if n > before.get(p, 0)))
    server.commit()
    server.in_use_step = server.version_step
    server.collect(final=True)  # as the run does when it ends
    collections = server.collect_seconds
    versions = len(store.versions(run))
    size = sum(files(store_path).values())
    shutil.rmtree(store_path)
    return {
        "written_mib": statistics.median(written) / 2**20,
        "store_gb": size / 1e9,
        "versions": versions,
        "merge_s": statistics.median(seconds),
        "collections": len(collections),
        "collect_s": statistics.median(collections) if collections else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--merges", type=int, default=120)
    ap.add_argument("--shards", type=int, default=10, help="shards per epoch (epochs = merges / shards)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--rules",
        nargs="+",
        default=["vc-asgd", "staleness", "nesterov", "sync"],
        help=f"merge rules, of {sorted(rules)} (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    for name in ("params", "merges", "shards", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    unknown = [r for r in args.rules if r not in rules]
    if unknown:
        ap.error(f"--rules: unknown {unknown}; choose from {sorted(rules)}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="vcdask-storage-bench-"))
    cells: dict[tuple[str, str], dict[str, float]] = {}
    try:
        for rule_name in args.rules:
            for label, retention in (("keep all", None), ("Retention()", Retention())):
                runs = []
                for _ in range(args.repeat):
                    free = shutil.disk_usage(root).free / 1e9
                    if free < 10:
                        raise SystemExit(f"only {free:.1f} GB free on {root}: stopping")
                    runs.append(one_run(root, rule_name, retention, args))
                cells[(rule_name, label)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                c = cells[(rule_name, label)]
                print(f"  {rule_name:10} {label:12} {c['store_gb']:.3f} GB, {c['versions']:.0f} versions", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    epochs = args.merges // args.shards
    earlier = ""
    if args.params == BEFORE_SIZE["params"] and args.merges == BEFORE_SIZE["merges"]:
        earlier = (
            f"; the earlier measurement at this size, before retention and rule state beside the newest version "
            f"only: {BEFORE_GB} GB for the default rule"
        )
    print(
        f"\n{args.params / 1e6:g}M float32 parameters, {args.merges} merges ({epochs} epochs of {args.shards} "
        f"shards), local directory store, median of {args.repeat} run(s){earlier}\n"
    )
    columns = ["rule", "versions kept", "written per merge (MiB)", "final store (GB)", "vs keep all", "s per merge"]
    columns.append("collections (median s)")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for (rule_name, label), c in cells.items():
        collected = f"{c['collections']:.0f} ({c['collect_s']:.3f})" if c["collections"] else "-"
        kept_all = cells[(rule_name, "keep all")]["store_gb"]  # the same rule, every version kept, this run
        print(
            f"| {rule_name}, {label} | {c['versions']:.0f} | {c['written_mib']:.1f} | {c['store_gb']:.3f} | "
            f"{100 * c['store_gb'] / kept_all:.1f}% | {c['merge_s']:.3f} | {collected} |"
        )
    print(f"\nfree disk now: {shutil.disk_usage(os.path.dirname(root)).free / 1e9:.0f} GB")


if __name__ == "__main__":
    main()
