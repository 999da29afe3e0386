"""Start-up of ``vcdask.fit`` on the embedded default: the first call of a process against later ones.

usage: python benchmarks/startup.py [--repeats 3]

The first ``fit`` of a process starts the embedded ``LocalCluster`` (worker processes import torch and
vcdask); later calls reuse it (issue 14).  Each row is a 1-epoch fit of a small MLP on scikit-learn's
breast-cancer table (569 rows, 30 features): the time until ``fit(wait=False)`` returns (the data staged,
the initial version committed), until the first merge, and until the result is back.  ``fresh cluster``
closes the embedded cluster first (what every ``fit`` paid before issue 14, without its shutdown).
Prints medians over ``--repeats``; the store is a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from devices import markdown  # noqa: E402

import vcdask  # noqa: E402
from vcdask.cluster import close_embedded  # noqa: E402


def data():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    return ((X - X.mean(0)) / X.std(0)).astype("float32"), y


def one_fit(X, y, store) -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    t0 = time.perf_counter()
    handle = vcdask.fit(model, (X, y), max_epochs=1, store=store, wait=False)
    returned = time.perf_counter() - t0
    while handle.status()["step"] == 0 and not handle.done():
        time.sleep(0.002)
    first_merge = time.perf_counter() - t0
    handle.result()
    return {"fit returns (s)": returned, "first merge (s)": first_merge, "result (s)": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    X, y = data()
    rows: dict[str, list[dict[str, float]]] = {"fresh cluster (first call)": [], "shared cluster (later call)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            close_embedded()
            rows["fresh cluster (first call)"].append(one_fit(X, y, f"{tmp}/store"))
            rows["shared cluster (later call)"].append(one_fit(X, y, f"{tmp}/store"))
        close_embedded()
    table = []
    for name, runs in rows.items():
        table.append({"fit": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    ratio = table[0]["result (s)"] / table[1]["result (s)"]
    print(f"1-epoch fit, 569 rows, medians of {args.repeats}; a later call is {ratio:.0f}x faster")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
