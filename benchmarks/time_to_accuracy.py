"""Time to accuracy: vcdask.fit on 2 worker processes vs a plain single-process torch loop.

usage: python benchmarks/time_to_accuracy.py [--target 0.97] [--epochs 20] [--local-epochs 4] [--repeat 3]

Same data (scikit-learn digits, the demo's split), model (the demo's CNN), optimizer
(Adam, lr 1e-3, batch 32) and budget: both make ``epochs * local_epochs`` passes over
the training data.  Accuracy is measured on the same held-out test set after every
epoch (vcdask: the epoch's last version; torch: after every ``local_epochs`` passes).
Prints medians over ``--repeat`` seeds and the ratios the project tracks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _args import one_number
from _scratch import add_store_argument, scratch_store
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits, digits_cnn


def torch_baseline(
    seed: int, X, y, Xt, yt, passes: int, every: int, target: float, threads: int
) -> tuple[float, float, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _torch_loop(seed, X, y, Xt, yt, passes, every, target)
    finally:
        torch.set_num_threads(previous)


def _torch_loop(seed, X, y, Xt, yt, passes, every, target):
    model = digits_cnn(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    reached = float("nan")
    for p in range(1, passes + 1):
        model.train()
        order = torch.randperm(len(Xb), generator=g)
        for i in range(0, len(Xb), 32):
            idx = order[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(Xb[idx]), yb[idx]).backward()
            opt.step()
        if p % every == 0:
            acc = accuracy_on(model, Xt, yt)
            if acc >= target and reached != reached:
                reached = time.perf_counter() - t0
    return reached, time.perf_counter() - t0, accuracy_on(model, Xt, yt)


def vcdask_run(seed: int, client, X, y, Xt, yt, epochs: int, local_epochs: int, alpha, target: float, store: str):
    t0 = time.perf_counter()
    r = vcdask.fit(
        digits_cnn(seed),
        (X, y),
        validation=(Xt, yt),
        max_epochs=epochs,
        local_epochs=local_epochs,
        n_shards=10,
        alpha=alpha,
        seed=seed,
        validate_every=10,
        client=client,
        store=store,
        progress=False,
    )
    total = time.perf_counter() - t0
    setup = total - r.epochs.wall_time.iloc[-1]  # staging, initial commit, plugin start, final result
    hit = r.epochs[r.epochs.accuracy >= target]
    reached = float(hit.wall_time.iloc[0]) + setup if len(hit) else float("nan")
    return reached, total, accuracy_on(r.model, Xt, yt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=4)
    ap.add_argument("--alpha", default="0.5", help="vc-asgd's alpha: a number in [0, 1] or epoch")
    ap.add_argument("--repeat", type=int, default=3, help="seeds (>= 1)")
    add_store_argument(ap)
    args = ap.parse_args(argv)
    for name in ("epochs", "local_epochs", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.target <= 1:
        ap.error(f"--target is a test accuracy in (0, 1], got {args.target}")
    alpha = one_number(ap, "--alpha", args.alpha, float, minimum=0, maximum=1, words=("epoch",))
    (X, y), (Xt, yt) = digits()
    rows = {"torch": [], "torch1": [], "vcdask": []}
    t = time.perf_counter()
    with (
        scratch_store(args.store, "tta") as store,
        embedded_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        startup = time.perf_counter() - t
        for seed in range(args.repeat):
            rows["vcdask"].append(
                vcdask_run(seed, client, X, y, Xt, yt, args.epochs, args.local_epochs, alpha, args.target, store)
            )
            for key, threads in (("torch", 2), ("torch1", 1)):
                rows[key].append(
                    torch_baseline(
                        seed, X, y, Xt, yt, args.epochs * args.local_epochs, args.local_epochs, args.target, threads
                    )
                )
    med = {k: [statistics.median(c) for c in zip(*v, strict=True)] for k, v in rows.items()}
    print(
        f"\ndigits ({len(X)} train / {len(Xt)} test), demo CNN, Adam 1e-3, batch 32, "
        f"{args.epochs * args.local_epochs} passes over the data; vcdask: {args.epochs} epochs x "
        f"{args.local_epochs} local epochs, 10 shards, alpha={alpha}, 2 worker processes; "
        f"median of {args.repeat} seeds; LocalCluster start-up {startup:.1f} s (not included)\n"
    )
    print(f"| trainer | time to {args.target} test acc (s) | total time (s) | final test accuracy |")
    print("| --- | --- | --- | --- |")
    for name, label in (
        ("torch", "single-process torch loop, 2 threads"),
        ("torch1", "single-process torch loop, 1 thread"),
        ("vcdask", "vcdask.fit, 2 worker processes x 1 thread"),
    ):
        r, tot, acc = med[name]
        print(f"| {label} | {r:.1f} | {tot:.1f} | {acc:.4f} |")
    rv, tv, av = med["vcdask"]
    for key, label in (("torch", "2-thread"), ("torch1", "1-thread")):
        rt, tt, at = med[key]
        print(
            f"ratios vcdask / {label} torch: time to target {rv / rt:.2f}, total time {tv / tt:.2f}; "
            f"accuracy difference {100 * (av - at):+.2f} points"
        )
    print(
        "per-seed (time to target, total, final acc):",
        {k: [tuple(round(x, 3) for x in r) for r in v] for k, v in rows.items()},
    )


if __name__ == "__main__":
    main()
