"""A scheduled retraining job: start from the last released model, train on fresh data, release the result.

usage: python examples/retrain_from_tag.py --store vcdask-runs [--tag-prefix release-] [--epochs 5]

1. open the store and find the newest tag named <prefix>N (none yet: start from a fresh model);
2. load that version into the model;
3. train with vcdask.fit on this batch of data (here: the digits' training split, resampled with the
   day's seed), and score it on the fixed test split;
4. tag the new version <prefix>N+1 and print where it is.

Run it from cron, a CI schedule or an Airflow task; point --store at s3://... to share releases.
"""

from __future__ import annotations

import argparse
import re

import numpy as np

import vcdask
from vcdask.demo import accuracy_on, digits, digits_cnn


def latest_release(store, prefix: str) -> tuple[int, str | None]:
    """(N, version) of the newest tag <prefix>N, or (0, None); the prefix is matched as text, not as a pattern."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)")
    numbered = [(int(m.group(1)), v) for t, v in store.tags().items() if (m := pattern.fullmatch(t))]
    return max(numbered) if numbered else (0, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="vcdask-runs")
    ap.add_argument("--tag-prefix", default="release-")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="stands in for 'today's data'")
    args = ap.parse_args()

    store = vcdask.open_store(args.store)
    number, version = latest_release(store, args.tag_prefix)
    model = digits_cnn()
    if version is not None:
        store.read(version).load_into(model)
        print(f"starting from {args.tag_prefix}{number} (version {version})")
    else:
        print("no release yet: starting from a fresh model")

    # a fixed test split (the same every day, never trained on); today's data is a seeded sample of the rest
    (X, y), (X_test, y_test) = digits()
    rows = np.random.default_rng(args.seed).choice(len(X), size=len(X) * 3 // 4, replace=False)
    before = accuracy_on(model, X_test, y_test)
    result = vcdask.fit(
        model,
        (X[rows], y[rows]),
        validation=0.1,
        max_epochs=args.epochs,
        local_epochs=4,
        alpha=0.5,
        store=store,
        seed=args.seed,
        progress=False,
    )
    after = accuracy_on(result.model, X_test, y_test)
    tag = f"{args.tag_prefix}{number + 1}"
    store.tag(tag, result.version)
    print(f"test accuracy {before:.4f} -> {after:.4f}")
    print(f"tagged {tag} = version {result.version} (run {result.run_id}) in {store.location}")


if __name__ == "__main__":
    main()
