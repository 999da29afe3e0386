"""The demo: a small CNN on scikit-learn's digits, trained with VC-ASGD on the embedded default."""

from __future__ import annotations

import time

import dask.system
import numpy as np
import torch

__all__ = ["accuracy_on", "digits", "digits_cnn", "run_demo"]


def digits(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits as float32 images (n, 1, 8, 8) in [0, 1]; a seeded train/test split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the demo needs scikit-learn: pip install 'vcdask[demo]'") from None
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(seed).permutation(len(X))
    X, y = X[order], y[order].astype(np.int64)
    n_test = int(round(len(X) * test_fraction))
    return (X[n_test:], y[n_test:]), (X[:n_test], y[:n_test])


def digits_cnn(seed: int = 0) -> torch.nn.Module:
    """A small CNN for 8x8 digits (about 40k parameters), its weights drawn from ``seed`` (torch's global generator
    is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _cnn()


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def accuracy_on(model: torch.nn.Module, X: np.ndarray, y: np.ndarray) -> float:
    """Accuracy of ``model`` on ``(X, y)``."""
    model.eval()
    with torch.no_grad():
        return float((model(torch.from_numpy(X)).argmax(1).numpy() == y).mean())


def run_demo(store: str = "vcdask-runs", max_epochs: int = 20, progress: bool = True) -> dict:
    """Train, save history (CSV) and an accuracy-vs-time plot (PNG) in the run folder, print the outcome.

    ``store`` is any store location (a path, a ``file://`` URL, an object store): the files go beside the
    run, through the store's files (``<store>/runs/<run_id>/``)."""
    import vcdask

    from .result import trained_with

    (X, y), (X_test, y_test) = digits()
    print(
        f"digits: {len(X)} training and {len(X_test)} test images; training a small CNN with VC-ASGD "
        f"on an embedded LocalCluster ({dask.system.CPU_COUNT} worker processes)"
    )
    t0 = time.perf_counter()
    result = vcdask.fit(
        digits_cnn(),
        (X, y),
        validation=0.1,
        max_epochs=max_epochs,
        n_shards=10,
        local_epochs=4,
        alpha=0.5,
        store=store,
        progress=progress,
    )
    assert isinstance(result, vcdask.FitResult)  # (fit waits by default)
    wall = time.perf_counter() - t0
    acc = accuracy_on(result.model, X_test, y_test)
    folder = _save(result)
    print(
        f"\n{len(result.epochs)} epochs, {int(result.history['accepted'].sum())} merges in {wall:.1f} s "
        f"({result.stop_reason or 'max_epochs reached'})"
    )
    print(f"trained with: {trained_with(result.settings)} (result.settings)")
    print(f"final test accuracy: {acc:.4f}")
    print(f"store: {result.store.location} (branch {result.run_id}, version {result.version})")
    print(f"history, epochs and plot: {folder}/")
    print(
        f"load it again: model = vcdask.load({str(result.store.location)!r}, version={result.version!r})"
        " (the run's model, its final parameters)"
    )
    return {"test_accuracy": acc, "wall_time": wall, "result": result}


def _save(result) -> str:
    """Write the run's history and epochs (CSV) and its plot (PNG) beside the run, in the store's run folder
    (``<store>/runs/<run_id>/``), through the store's own files: a ``file://`` URL or an object store as well
    as a path.  Returns where they are: a path for a local store, else a URL."""
    files = result.store.files
    files.put(f"{result.run_id}/history.csv", result.history.to_csv(index=False).encode())
    files.put(f"{result.run_id}/epochs.csv", result.epochs.to_csv().encode())
    png = _plot(result)
    if png is not None:
        files.put(f"{result.run_id}/accuracy.png", png)
    url = files.url(result.run_id)
    return url.removeprefix("file://") if url.startswith("file://") else url  # fsspec's local URL: a plain path


def _plot(result) -> bytes | None:
    """The accuracy-vs-time plot as PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import io

    e = result.epochs
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(
        e["wall_time"], e["accuracy_min"], e["accuracy_max"], alpha=0.25, label="min-max over the epoch's versions"
    )
    ax.plot(e["wall_time"], e["accuracy"], marker="o", label="epoch's last version")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"VC-ASGD on digits ({result.run_id})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()
