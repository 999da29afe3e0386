"""Worker start-up under Dask's ``spawn`` start method against ``forkserver`` (vcdask.cluster.start_forkserver).

usage: python benchmarks/start_methods.py [--repeats 3]

Each repeat runs, for each start method, a fresh Python process that:

1. runs a first 1-epoch ``vcdask.fit`` on the embedded cluster (2 workers; the breast-cancer MLP of
   ``startup.py``): the time until its result is back, the cluster's start included;
2. SIGKILLs one worker process and times until its nanny's new worker has trained a shard: a second
   1-epoch fit on the same cluster, timed from the kill until its result;
3. closes the cluster and starts a second one in the same process, timed until it has run a fit.

Under ``forkserver`` the fork server imports PyTorch (and ``torch._dynamo``, which ``torch.optim``
imports on first use) once; every worker is forked with them.  Prints medians over ``--repeats``, and
the ratio of the two methods.  Stores are temporary directories, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, os, signal, sys, tempfile, time
import dask.config
dask.config.set({"distributed.worker.multiprocessing-method": sys.argv[1]})
sys.path.insert(0, sys.argv[2])
import vcdask
from startup import data, one_fit
from vcdask.cluster import close_embedded, embedded_client

def main():
    X, y = data()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        one_fit(X, y, f"{tmp}/a")
        out["first fit of a process (s)"] = time.perf_counter() - t0
        client = embedded_client()
        pid = next(iter(client.run(os.getpid).values()))
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while len(client.sync(client.scheduler.identity, n_workers=-1)["workers"]) == 2:
            time.sleep(0.01)
        client.wait_for_workers(2, timeout=120)
        one_fit(X, y, f"{tmp}/b")
        out["worker killed: fit until result (s)"] = time.perf_counter() - t0
        close_embedded()
        t0 = time.perf_counter()
        one_fit(X, y, f"{tmp}/c")
        out["second cluster of the process (s)"] = time.perf_counter() - t0
        close_embedded()
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def measure(method: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(HERE)],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{method}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> int:
    sys.path.insert(0, str(HERE))
    from devices import markdown

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"spawn": [], "forkserver": []}
    for _ in range(args.repeats):
        for method, got in runs.items():  # interleaved: the machine's drift hits both alike
            got.append(measure(method))
    medians = {m: {k: statistics.median(r[k] for r in got) for k in got[0]} for m, got in runs.items()}
    rows = [{"start method": m, **v} for m, v in medians.items()]
    rows.append(
        {
            "start method": "spawn / forkserver",
            **{k: medians["spawn"][k] / medians["forkserver"][k] for k in medians["spawn"]},
        }
    )
    print(f"embedded cluster, 2 workers, 1-epoch breast-cancer fits; medians of {args.repeats}")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
