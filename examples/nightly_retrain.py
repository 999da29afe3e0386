"""A nightly retraining job with a quality gate: release the new model only if it is better.

The same job needs no Python: ``vcdask train job.yaml`` (docs/user-guide/scheduled-jobs.md) reads the model
factory, data, store, start, fit options and release rule from a YAML file, checks it all before any cluster
work, and exits 0 released / 3 not better / 2 bad job file / 1 failed.  This script spells the same steps out
with the Python API, as a starting point for a gate that needs logic of its own.

usage: python examples/nightly_retrain.py --store STORE [--tag-prefix nightly-] [--epochs 5] [--seed N]
                                          [--min-gain 0.0] [--scheduler tcp://host:8786]

1. open the store and find the newest tag named <prefix>N (none yet: start from a fresh model);
2. load that release with vcdask.load and score it on a fixed holdout set: the baseline to beat;
3. train it further with vcdask.fit on today's batch of data (here: the digits, resampled with --seed);
4. score the candidate on the same holdout set;
5. candidate > baseline + min-gain (strictly better, as ``vcdask train``'s release rule): tag it <prefix>N+1
   and exit 0; otherwise tag nothing (the old release stays the newest), log where the candidate is, and
   exit 3.

Exit codes, as ``vcdask train``'s: 0 released; 3 candidate not better, nothing released; 2 bad arguments or
the store not found; 1 anything else (with a traceback in the log).

Run it from cron, a CI schedule or an Airflow task; point --store at s3://... to share releases
(credentials from the usual AWS chain, --endpoint-url for an S3-compatible service).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

import numpy as np

import vcdask
from vcdask.demo import accuracy_on, digits, digits_cnn
from vcdask.errors import StoreNotFoundError

logger = logging.getLogger("nightly_retrain")

RELEASED, NOT_BETTER, NOT_FOUND = 0, 3, 2


def latest_release(store, prefix: str) -> tuple[int, str | None]:
    """(N, tag name) of the newest tag <prefix>N, or (0, None)."""
    numbered = [(int(m.group(1)), t) for t in store.tags() if (m := re.fullmatch(rf"{re.escape(prefix)}(\d+)", t))]
    return max(numbered) if numbered else (0, None)


def todays_data(seed: int):
    """Today's training batch and the fixed holdout set every release is scored on.

    The holdout is the digits test split (the same every day); "today's data" is a seeded 75% sample
    of the training split, standing in for whatever arrived since the last run."""
    (X, y), holdout = digits(seed=0)
    rows = np.random.default_rng(seed).choice(len(X), size=len(X) * 3 // 4, replace=False)
    return (X[rows], y[rows]), holdout


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="store location: a directory or s3://bucket/prefix")
    ap.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, ...)")
    ap.add_argument("--tag-prefix", default="nightly-", help="releases are tagged <prefix>1, <prefix>2, ...")
    ap.add_argument("--epochs", type=int, default=5, help="epochs of training on today's data")
    ap.add_argument("--seed", type=int, default=0, help="stands in for 'today's data'")
    ap.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="holdout accuracy the candidate must add to the release's to be released "
        "(negative: tolerate a small drop; default: %(default)s)",
    )
    ap.add_argument("--scheduler", help="address of a Dask scheduler (default: an embedded LocalCluster)")
    args = ap.parse_args(argv)
    if args.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {args.epochs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    try:
        store = vcdask.open_store(args.store, mode="a", **options)
    except StoreNotFoundError as e:
        logger.error("%s", e)
        return NOT_FOUND

    (X, y), (X_holdout, y_holdout) = todays_data(args.seed)
    number, tag = latest_release(store, args.tag_prefix)
    if tag is None:
        model, baseline = digits_cnn(seed=args.seed), None
        logger.info("no release tagged %s<N> yet: training a fresh model", args.tag_prefix)
    else:
        model = vcdask.load(store, tag=tag)
        baseline = accuracy_on(model, X_holdout, y_holdout)
        logger.info("release %s (version %s): holdout accuracy %.4f", tag, model.vcdask_version["id"], baseline)

    client = None
    if args.scheduler:
        from distributed import Client

        client = Client(args.scheduler)
    try:
        result = vcdask.fit(
            model,
            (X, y),
            validation=0.1,
            max_epochs=args.epochs,
            local_epochs=4,
            alpha=0.5,
            store=store,
            seed=args.seed,
            client=client,
            progress=False,
        )
    finally:
        if client is not None:
            client.close()
    candidate = accuracy_on(result.model, X_holdout, y_holdout)
    logger.info(
        "candidate version %s (run %s, %d epochs): holdout accuracy %.4f",
        result.version,
        result.run_id,
        len(result.epochs),
        candidate,
    )

    if baseline is not None and candidate <= baseline + args.min_gain:
        logger.warning(
            "not released: candidate %.4f is not above release %s %.4f + min gain %.4f; %s stays the newest "
            "release (the candidate remains on branch %s)",
            candidate,
            tag,
            baseline,
            args.min_gain,
            tag,
            result.run_id,
        )
        return NOT_BETTER
    new_tag = f"{args.tag_prefix}{number + 1}"
    store.tag(new_tag, result.version)
    logger.info(
        "released %s = version %s in %s (holdout accuracy %s -> %.4f)",
        new_tag,
        result.version,
        store.location,
        "none" if baseline is None else f"{baseline:.4f}",
        candidate,
    )
    return RELEASED


if __name__ == "__main__":
    sys.exit(main())
