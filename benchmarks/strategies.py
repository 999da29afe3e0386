"""Merge strategies: final accuracy and time to a target, beside single-process torch and torch DDP.

usage: python benchmarks/strategies.py [--task digits|wide] [--epochs 15] [--local-epochs 4] [--repeat 3]
                                       [--rules default,vc-asgd:0.5,vc-asgd:epoch,staleness:0.5,nesterov:0.7/0.9/4,sync]
The docs' wide-CNN table: --task wide --epochs 7 --local-epochs 6 --repeat 2.

Same data (scikit-learn digits, the demo's split), model, optimizer (Adam, lr 1e-3, batch 32)
and epoch budget for every row: ``epochs * local_epochs`` passes over the training data.
  * torch:    one process, all cores (the "dedicated machine" the paper compares against).
  * ddp:      torch DistributedDataParallel, gloo, 2 processes, each on half the data per pass.
  * vcdask:   vcdask.fit on an embedded LocalCluster with 2 worker processes, one row per rule.
Accuracy is on the same held-out test set (vcdask: the last version of each epoch).  The
``wide`` task uses a wider CNN (3.3M parameters) so that one shard takes >= 1 s (the table's
"shard s" column: the median seconds of a shard task's training).
Prints medians over ``--repeat`` seeds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _args import choices_list
from _scratch import add_store_argument, scratch_store
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits, digits_cnn
from vcdask.merge import VCASGD, Nesterov, Staleness


def wide_cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 96, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(96, 192, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(192 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


MODELS = {"digits": digits_cnn, "wide": wide_cnn}


RULE_NAMES = ("default", "vc-asgd", "staleness", "nesterov", "sync")
#: nesterov:LR/MOMENTUM/DELAY, each part left out taking its default
NESTEROV_DEFAULTS = ("0.7", "0.9", "1")


def rule_from(spec: str):
    """The ``merge=`` argument for one ``--rules`` item (``None``: fit's default rule).

    Raises
    ------
    ValueError
        An unknown rule name or a malformed argument; the message names the item.
    """
    name, _, arg = spec.partition(":")
    if name not in RULE_NAMES:
        raise ValueError(f"unknown rule {name!r} in {spec!r}; choose from {list(RULE_NAMES)}")
    if arg and name in ("default", "sync"):
        raise ValueError(f"rule {name!r} takes no argument, got {spec!r}")
    try:
        if name == "default":
            return None  # vcdask.fit's default rule
        if name == "vc-asgd":
            return VCASGD(alpha=arg if arg == "epoch" else float(arg or 0.5))
        if name == "staleness":
            return Staleness(alpha=float(arg or 0.5))
        if name == "nesterov":
            parts = arg.split("/") if arg else []
            if len(parts) > len(NESTEROV_DEFAULTS):
                raise ValueError("nesterov takes at most LR/MOMENTUM/DELAY")
            lr, mom, delay = parts + list(NESTEROV_DEFAULTS[len(parts) :])
            return Nesterov(lr=float(lr), momentum=float(mom), delay=int(delay))
        return "sync"
    except ValueError as e:
        raise ValueError(f"bad rule {spec!r}: {e}") from None


def _train_passes(model, opt, X, y, g, batch):
    model.train()
    order = torch.randperm(len(X), generator=g)
    for i in range(0, len(X), batch):
        idx = order[i : i + batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()


def torch_single(make, seed, X, y, Xt, yt, passes, every, target):
    model, g = make(seed), torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    t0, reached = time.perf_counter(), float("nan")
    for p in range(1, passes + 1):
        _train_passes(model, opt, Xb, yb, g, 32)
        if p % every == 0 and reached != reached and accuracy_on(model, Xt, yt) >= target:
            reached = time.perf_counter() - t0
    return reached, time.perf_counter() - t0, accuracy_on(model, Xt, yt)


def _ddp_worker(rank, world, port, task, seed, X, y, Xt, yt, passes, every, target, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(MODELS[task](seed))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    g = torch.Generator().manual_seed(seed)
    dist.barrier()
    t0, reached = time.perf_counter(), float("nan")
    for p in range(1, passes + 1):
        order = torch.randperm(len(Xb), generator=g)[rank::world]  # this rank's half of the pass
        model.train()
        for i in range(0, len(order), 32):
            idx = order[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(Xb[idx]), yb[idx]).backward()
            opt.step()
        if p % every == 0 and rank == 0 and reached != reached and accuracy_on(model.module, Xt, yt) >= target:
            reached = time.perf_counter() - t0
    if rank == 0:
        out.put((reached, time.perf_counter() - t0, accuracy_on(model.module, Xt, yt)))
    dist.destroy_process_group()


def torch_ddp(task, seed, X, y, Xt, yt, passes, every, target):
    import torch.multiprocessing as mp

    from vcdask.testing.s3 import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, 2, port, task, seed, X, y, Xt, yt, passes, every, target, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join(60)
    return result


def vcdask_run(make, rule, seed, client, X, y, Xt, yt, epochs, local_epochs, target, store):
    t0 = time.perf_counter()
    r = vcdask.fit(
        make(seed),
        (X, y),
        validation=(Xt, yt),
        max_epochs=epochs,
        local_epochs=local_epochs,
        n_shards=10,
        merge=rule,
        seed=seed,
        client=client,
        store=store,
        progress=False,
    )
    total = time.perf_counter() - t0
    setup = total - r.epochs.wall_time.max()
    hit = r.epochs[r.epochs.accuracy >= target].sort_values("wall_time")
    reached = float(hit.wall_time.iloc[0]) + setup if len(hit) else float("nan")
    shard = float(r.history[r.history.accepted].train_seconds.median())
    return reached, total, accuracy_on(r.model, Xt, yt), shard


def _median(values):
    finite = [v for v in values if v == v]
    return statistics.median(finite) if len(finite) > len(values) // 2 else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(MODELS), default="digits")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--local-epochs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--rules",
        default="default,vc-asgd:0.5,vc-asgd:epoch,staleness:0.5,nesterov:0.7/0.9/4,sync",
        help="a comma list of default, vc-asgd[:ALPHA|:epoch], staleness[:ALPHA], nesterov[:LR[/MOMENTUM[/DELAY]]], "
        "sync (default: %(default)s)",
    )
    ap.add_argument("--baselines", default="torch,ddp", help="a comma list of torch, ddp, or '' for none")
    add_store_argument(ap)
    args = ap.parse_args(argv)
    for name in ("epochs", "local_epochs", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    specs = args.rules.split(",")
    for spec in specs:  # every item checked before any training
        try:
            rule_from(spec)
        except ValueError as e:
            ap.error(f"--rules: {e}")
    baselines = choices_list(ap, "--baselines", args.baselines, ("torch", "ddp"), allow_empty=True)
    make = MODELS[args.task]
    (X, y), (Xt, yt) = digits()
    passes = args.epochs * args.local_epochs
    rows: dict[str, list] = {}
    with (
        scratch_store(args.store, "strategies") as store,
        embedded_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        # warm-up: worker processes import torch and fill their caches once, outside the measurements
        vcdask.fit(make(0), (X, y), max_epochs=1, n_shards=10, client=client, store=store, progress=False)
        for seed in range(args.repeat):
            for b in baselines:
                if b == "torch":
                    rows.setdefault("torch (1 process)", []).append(
                        torch_single(make, seed, X, y, Xt, yt, passes, args.local_epochs, args.target)
                    )
                elif b == "ddp":
                    rows.setdefault("torch DDP (gloo, 2 proc)", []).append(
                        torch_ddp(args.task, seed, X, y, Xt, yt, passes, args.local_epochs, args.target)
                    )
            for spec in specs:
                rows.setdefault(f"vcdask {spec}", []).append(
                    vcdask_run(
                        make,
                        rule_from(spec),
                        seed,
                        client,
                        X,
                        y,
                        Xt,
                        yt,
                        args.epochs,
                        args.local_epochs,
                        args.target,
                        store,
                    )
                )
                print(f"seed {seed} {spec}: {rows[f'vcdask {spec}'][-1]}", file=sys.stderr, flush=True)
    base = next(iter(rows))
    base_acc = _median([r[2] for r in rows[base]])
    base_total = _median([r[1] for r in rows[base]])
    print(
        f"\ntask {args.task}: {args.epochs} epochs x {args.local_epochs} local passes, 10 shards, target "
        f"{args.target}, median of {args.repeat} seeds, 2 cores"
    )
    print(
        f"| {'run':<28} | final acc | vs {base.split(' ')[0]:<6} | time to {args.target} (s) | total (s) | "
        f"total / {base.split(' ')[0]} | shard s |"
    )
    print(f"|{'-' * 30}|-----------|-----------|------------------|-----------|-------------|---------|")
    for name, values in rows.items():
        acc = _median([v[2] for v in values])
        reach = _median([v[0] for v in values])
        total = _median([v[1] for v in values])
        shard = _median([v[3] for v in values]) if len(values[0]) > 3 else float("nan")
        print(
            f"| {name:<28} | {acc:9.4f} | {100 * (acc - base_acc):+8.2f}p | {reach:16.1f} | {total:9.1f} | "
            f"{total / base_total:11.2f} | {shard:7.2f} |"
        )


if __name__ == "__main__":
    main()
