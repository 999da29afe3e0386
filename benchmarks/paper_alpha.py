"""The paper's alpha experiment on digits: alpha 0.7, 0.95, 0.999 and e/(e+1), 4 parallel shard slots.

usage: python benchmarks/paper_alpha.py [--epochs 20] [--local-epochs 2] [--repeat 2]
                                       [--png docs/_static/paper_alpha.png]

The default ``--png`` is the documentation's figure in this repository (found from this script, wherever it
is run from); a relative ``--png`` given on the command line is relative to the current directory.

VC-ASGD with each alpha on an embedded LocalCluster of 4 single-thread worker processes (4 shards
train at once, as the paper's 4 volunteer slots), every version validated, so each epoch has the
min/max band of the versions it produced (the paper's Fig. 3).  Prints validation accuracy at a few
epochs (median over ``--repeat`` seeds) and writes accuracy vs wall time with the bands as a PNG.
Then says whether the paper's orderings hold here: 0.7 fastest early, 0.95 better late, 0.999
slowest, e/(e+1) best overall.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path

from _scratch import add_store_argument, scratch_store
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import digits, digits_cnn

ALPHAS = {"0.7": 0.7, "0.95": 0.95, "0.999": 0.999, "e/(e+1)": "epoch"}
DEFAULT_PNG = Path(__file__).resolve().parent.parent / "docs" / "_static" / "paper_alpha.png"


def marks_for(epochs: int) -> list[int]:
    """The epochs the table shows: 1, 2, 3, 5, the middle and the last, those a run of ``epochs`` reaches."""
    return sorted(e for e in {1, 2, 3, 5, epochs // 2, epochs} if 1 <= e <= epochs)


def _writable_png(ap: argparse.ArgumentParser, path: Path) -> Path:
    """``path`` with its folder created, checked before any training; ``ap.error`` if it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--png: cannot create the folder {str(path.parent)!r}: {e}")
    if path.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        ap.error(f"--png: cannot write {str(path)!r}")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--png", type=Path, default=DEFAULT_PNG, help="where the plot goes (default: %(default)s)")
    add_store_argument(ap)
    args = ap.parse_args(argv)
    for name in ("epochs", "local_epochs", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    png = _writable_png(ap, args.png)
    if importlib.util.find_spec("matplotlib") is None:
        ap.error("the plot needs matplotlib: pip install matplotlib")
    (X, y), (Xt, yt) = digits()
    runs: dict[str, list] = {name: [] for name in ALPHAS}
    with (
        scratch_store(args.store, "alpha") as store,
        embedded_cluster(n_workers=4, threads_per_worker=1) as cluster,
        Client(cluster, set_as_default=False) as c,
    ):
        # warm-up: worker processes import torch and fill their caches once, outside the measurements
        vcdask.fit(
            digits_cnn(0),
            (X, y),
            max_epochs=1,
            n_shards=10,
            merge="vc-asgd",
            alpha=0.5,
            tasks_per_slot=1,
            client=c,
            store=store,
            progress=False,
        )
        for seed in range(args.repeat):
            for name, alpha in ALPHAS.items():
                r = vcdask.fit(
                    digits_cnn(seed),
                    (X, y),
                    validation=(Xt, yt),
                    max_epochs=args.epochs,
                    local_epochs=args.local_epochs,
                    n_shards=10,
                    merge="vc-asgd",
                    alpha=alpha,
                    seed=seed,
                    tasks_per_slot=1,
                    client=c,
                    store=store,
                    progress=False,
                )
                runs[name].append(r.epochs)
    marks = marks_for(args.epochs)
    med = {
        name: {e: statistics.median(float(ep.loc[e, "accuracy"]) for ep in eps) for e in marks}
        for name, eps in runs.items()
    }
    time_ = {name: statistics.median(float(ep.wall_time.max()) for ep in eps) for name, eps in runs.items()}
    print(
        f"\nvalidation accuracy by epoch (median of {args.repeat} seeds), 4 shard slots, {args.local_epochs} local "
        "passes per shard, 10 shards"
    )
    print("| alpha | " + " | ".join(f"epoch {e}" for e in marks) + " | wall time (s) |")
    print("|---|" + "---|" * len(marks) + "---|")
    for name in ALPHAS:
        print(f"| {name} | " + " | ".join(f"{med[name][e]:.4f}" for e in marks) + f" | {time_[name]:.1f} |")
    early, late = marks[min(1, len(marks) - 1)], marks[-1]
    checks = {
        "0.7 fastest early": med["0.7"][early] >= max(med[n][early] for n in ALPHAS),
        "0.95 better than 0.7 late": med["0.95"][late] > med["0.7"][late],
        "0.999 slowest": all(med["0.999"][e] <= min(med[n][e] for n in ALPHAS) for e in marks),
        "e/(e+1) best at the end": med["e/(e+1)"][late] >= max(med[n][late] for n in ALPHAS),
    }
    print(f"\nthe paper's orderings here (early = epoch {early}, late = epoch {late}):")
    for claim, holds in checks.items():
        print(f"  {claim}: {'holds' if holds else 'does NOT hold'}")
    _plot(runs, png, args)
    print(f"\nplot: {png}")


def _plot(runs, path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for (name, eps), color in zip(runs.items(), ["C0", "C1", "C2", "C3"], strict=True):
        ep = eps[0].sort_values("wall_time")  # seed 0, as the paper plots one run per alpha
        for ax, x in ((axes[0], ep.wall_time), (axes[1], ep.index)):
            ax.plot(x, ep.accuracy, color=color, label=f"alpha {name}")
            ax.fill_between(x, ep.accuracy_min, ep.accuracy_max, color=color, alpha=0.2)
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("epoch")
    for ax in axes:
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(
        f"VC-ASGD on digits, 4 shard slots, {args.local_epochs} local passes per shard "
        "(band: min/max over the epoch's versions)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
