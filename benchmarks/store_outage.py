"""How long a store request takes to fail when S3 is down, and how many requests it makes.

usage: python benchmarks/store_outage.py [--repeat 5] [--max-tries 1 3 6]

A loopback S3 server (moto) behind a proxy that answers every request with 503 SlowDown
(``vcdask.testing.faulty_proxy.FaultyProxy``).  For each ``max_tries``: a branch look-up, a commit and a read of
a version through a vcdask store, timed to their ``StoreError``, with the 503s the proxy answered.
The peer row is the same look-up through Icechunk alone, opened as a repository normally is
(``Repository.open(storage, config)`` with the same retries), which keeps the client its first request
built with Icechunk's defaults (earth-mover/icechunk#2342).  Each ``max_tries`` is measured in a process
of its own: the AWS SDK's retry quota (500 tokens, 5 a retry, shared by a process's clients) runs out
after about 100 retries, and requests are then tried once until some succeed.  Then one ``fit`` run with
``store_outage_timeout=3``: seconds from the outage to the run's error.  Medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import icechunk
import torch

import vcdask
from vcdask.errors import StoreError
from vcdask.testing.faulty_proxy import FaultyProxy
from vcdask.testing.s3 import moto_server


def failing(fn, proxy: FaultyProxy, repeat: int) -> tuple[list[float], list[int]]:
    """Seconds until ``fn()`` raises, and the 503s answered meanwhile, ``repeat`` times."""
    seconds, requests = [], []
    for _ in range(repeat):
        before, start = proxy.faults.counts["503"], time.monotonic()
        try:
            fn()
        except (StoreError, icechunk.IcechunkError):
            pass
        else:
            raise AssertionError("a request succeeded against a store answering 503 to everything")
        seconds.append(time.monotonic() - start)
        requests.append(proxy.faults.counts["503"] - before)
    return seconds, requests


def spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def icechunk_alone(bucket: str, prefix: str, proxy: FaultyProxy, max_tries: int) -> icechunk.Repository:
    storage = icechunk.s3_storage(
        bucket=bucket,
        prefix=prefix,
        endpoint_url=proxy.endpoint_url,
        allow_http=True,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        force_path_style=True,
    )
    retries = icechunk.StorageRetriesSettings(max_tries=max_tries)
    return icechunk.Repository.open(
        storage, config=icechunk.RepositoryConfig(storage=icechunk.StorageSettings(retries=retries))
    )


def run_past_timeout(location: str, options: dict, proxy: FaultyProxy) -> float:
    """Seconds from the store going down to the end of a run with ``store_outage_timeout=3``."""
    from vcdask.demo import digits, digits_cnn

    (X, y), _ = digits()
    out: dict = {}
    store = vcdask.open_store(location, **options)

    def target():
        try:
            vcdask.fit(
                digits_cnn(0),
                (X[:600], y[:600]),
                store=store,
                max_epochs=50,
                n_shards=4,
                progress=False,
                resilience=vcdask.Resilience(store_outage_timeout=3),
            )
        except Exception as e:  # noqa: BLE001 - the run's error is what is measured
            out["error"] = e

    before = set(store.branches())
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while not set(store.branches()) - before:
        time.sleep(0.2)
    (run_id,) = set(store.branches()) - before
    while len(store.versions(run_id)) < 3:
        time.sleep(0.2)
    proxy.set_faults(p_503=1.0)
    start = time.monotonic()
    thread.join(300)
    proxy.set_faults()
    assert "store_outage_timeout" in str(out.get("error")), out
    return time.monotonic() - start


def measure(store, version: str, alone, proxy: FaultyProxy, repeat: int) -> list[tuple[str, str, str]]:
    """(request, seconds to fail, 503s answered) for each request, the store answering 503 to everything."""
    rows = []
    for what, fn in [
        ("look-up", lambda: store.head("main")),
        ("commit", lambda: store.commit({"w": torch.zeros(1000)})),
        ("read", lambda: store.read(version)),
        ("look-up, Icechunk alone", lambda: alone.lookup_branch("main")),
    ]:
        seconds, requests = failing(fn, proxy, repeat if "alone" not in what else min(repeat, 2))
        rows.append((what, spread(seconds), spread([float(r) for r in requests], ".0f")))
    return rows


def rows_for(max_tries: int, repeat: int) -> list[tuple]:
    """The table's rows for one ``max_tries`` (run in a process of its own)."""
    with moto_server() as s3, FaultyProxy(s3.endpoint_url, seed=0) as proxy:
        bucket = s3.new_bucket()
        options = {"endpoint_url": proxy.endpoint_url, "access_key_id": "testing", "secret_access_key": "testing"}
        store = vcdask.open_store(f"s3://{bucket}/runs", max_tries=max_tries, **options)
        version = store.commit({"w": torch.ones(1000)})
        alone = icechunk_alone(bucket, "runs", proxy, max_tries)
        proxy.set_faults(p_503=1.0)
        return [(max_tries, *row) for row in measure(store, version, alone, proxy, repeat)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tries", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--skip-fit", action="store_true", help="leave out the run with store_outage_timeout=3")
    ap.add_argument("--rows-for", type=int, help=argparse.SUPPRESS)  # one max_tries, in this process: JSON rows
    args = ap.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    if args.rows_for is not None:
        print(json.dumps(rows_for(args.rows_for, args.repeat)))
        return
    print("| max_tries | request | seconds to fail, median (min-max) | 503s answered |")
    print("|---|---|---|---|")
    for max_tries in args.max_tries:
        cmd = [sys.executable, __file__, "--rows-for", str(max_tries), "--repeat", str(args.repeat)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    if not args.skip_fit:
        with moto_server() as s3, FaultyProxy(s3.endpoint_url, seed=0) as proxy:
            options = {"endpoint_url": proxy.endpoint_url, "access_key_id": "testing", "secret_access_key": "testing"}
            took = run_past_timeout(f"s3://{s3.new_bucket()}/runs", options, proxy)
            print(
                f"\nfit with store_outage_timeout=3 (embedded cluster): its error {took:.1f} s after the store "
                "went down"
            )


if __name__ == "__main__":
    main()
