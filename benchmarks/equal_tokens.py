"""Loss at equal tokens: single-process torch, torch DDP and ``vcdask.fit``'s defaults, on four tasks.

usage: python benchmarks/equal_tokens.py [--tasks charlm,digits,tabular,diabetes] [--workers 1,2,4,8]
                                         [--ddp-workers 2,4,8] [--seeds 0,1,2] [--set NAME=VALUE ...]
                                         [--vary NAME=V1,V2,...]
                                         [--skip-ddp] [--skip-vcdask] [--schedule constant|cosine]
                                         [--grow-from N] [--epochs N] [--local-epochs N]

Every trainer makes the same number of passes over the same training data, from the same seeded initial
weights, with the same optimizer, learning rate and batch size per worker:

* ``torch, 1 process``: a plain loop in this process, one torch thread (``char_lm.train_baseline`` for the
  char-LM, the loop of ``benchmarks/defaults.py`` for the others);
* ``DDP W=n``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, n spawned processes of one thread;
  each epoch one shuffled permutation shared by all ranks, padded to a multiple of n with its first indices
  (as ``DistributedSampler`` pads) and dealt out ``[rank::n]``; gradients all-reduced every step, so a DDP
  step sees n batches;
* ``vcdask W=n``: ``vcdask.fit`` with its defaults (and ``--set`` overrides) on a ``LocalCluster`` of n
  worker processes with one thread each, started once per n, warmed up by a tiny fit, and reused for every
  task and seed; each fit's store is a scratch directory removed after it.  No validation on the cluster
  (``validation=None``, fit's default): the final model is scored here.

Tasks (``--tasks``):

* ``charlm``:   ``examples/char_lm.py``'s CharGPT (d_model 96, 3 layers, 4 heads, context 64) on 256 KiB of
  the standard library's source, AdamW 5e-3 (constant), batch 32, 8 shards, 2 epochs; validation loss on
  32 KiB of held-out files (lower is better);
* ``digits``:   the demo CNN on the demo's digits split, as ``benchmarks/defaults.py`` (Adam 1e-3, batch
  32, 8 epochs, fit's default shards); test accuracy and cross-entropy;
* ``tabular``:  ``benchmarks/defaults.py``'s breast-cancer MLP (6 shards, 8 epochs); test accuracy and
  cross-entropy;
* ``diabetes``: scikit-learn's bundled diabetes table (442 rows, 10 features; features and target
  standardised on the training rows), a fixed 20% test split, an MLP 10-64-64-1, Adam 1e-3, batch 16, MSE,
  6 shards, 20 epochs; test MSE (of the standardised target).  Torch clearly learns: over seeds 0-4 its
  median test MSE goes from 1.03 (the initial weights) to 0.485 after 5 epochs and 0.505 after 20 (a slight
  overfit from epoch 10 on, kept so that the many-worker trainers, with fewer and larger steps, get enough
  steps): a trainer below torch here has not necessarily learned more, and one that moves further per
  token overfits more (delayed Nesterov, the default rule at W=1 before issue 38, seed 0: 0.50 after 5
  epochs, 0.65-0.83 after 20).

``--vary NAME=V1,V2,...`` trains vcdask once per value of one ``fit`` argument (read as ``--set`` reads
it; no value may hold a comma), each a row of its own (``vcdask W=n NAME=V``), on the same cluster after the
same torch and DDP baselines: an A/B at the cost of its vcdask runs alone.

``--grow-from N`` starts each vcdask run on a fresh cluster of N workers and scales it to W once the run
has merged its first result: a fleet still starting when the run begins (``vcdask W=N->W``; its rule column
is the rule it ended with, and the tasks in flight that rule is for).

``--schedule cosine`` decays every trainer's learning rate on a cosine from its value to 0 over its own
steps: torch and each DDP rank per optimizer step (``LambdaLR``; the char-LM's torch then uses the same loop
as the other tasks), vcdask over the run's global count of local steps (``lr_schedule=
vcdask.lr_schedules.Cosine()``).  The default, ``constant``, keeps each optimizer's learning rate.

Seeds (``--seeds``) change the initial weights and the data order of every trainer alike (and the
breast-cancer split, as in ``defaults.py``). Prints progress to stderr and, per task, a markdown table: per
trainer the median of each metric over the seeds, its ratio to torch's (losses) or difference in points
(accuracy), the values by seed, for a vcdask row beside a DDP row of as many workers the median over seeds of
its first metric against DDP's of the same seed (and the seeds where it is no worse), the median over seeds of
the largest staleness of a merged update and of the mean local steps a merged task trained ahead of its merged
base (vcdask; ``steps_ahead``, see :mod:`vcdask.overlap`) and the median wall seconds of one training. Loss at
equal tokens does not depend on wall time: 8 worker processes on 2 cores measure the same thing as 8 machines,
only slower. A vcdask run is not deterministic, though: the order its results arrive in is the machine's, and
on the char-LM that alone moves a seed's loss by several per cent (see the docs' benchmarks page): compare
medians over six seeds or more.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))  # (inherited by spawned DDP ranks and workers: char_lm)

import char_lm  # noqa: E402
from _scratch import scratch_store  # noqa: E402

TASKS = ("charlm", "digits", "tabular", "diabetes")
#: metric names by kind of task, and whether each is a loss (ratio to torch) or an accuracy (points)
METRICS = {
    "lm": {"val loss": "loss"},
    "classification": {"test accuracy": "accuracy", "test loss": "loss"},
    "regression": {"test mse": "loss"},
}


def log(message: str) -> None:
    """A progress line, to stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


# -- the tasks ----------------------------------------------------------------------------------------------
@dataclass
class Task:
    """One task at one seed: what every trainer gets, and what vcdask.fit is given besides defaults."""

    name: str
    kind: str  # a key of METRICS
    init: torch.nn.Module  # the seeded initial model; each trainer trains a deep copy
    train: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    step: Callable  # (model, (x, y)) -> loss, for torch and DDP
    optimizer: Callable  # params -> optimizer
    batch: int
    epochs: int
    fit: dict = field(default_factory=dict)


def classify_step(model: torch.nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of one batch ``(x, y)``: what vcdask's default step does for integer labels."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def regress_step(model: torch.nn.Module, batch) -> torch.Tensor:
    """MSE of one batch ``(x, y)``, the output reshaped to the target's shape, as vcdask's default step."""
    x, y = batch
    return F.mse_loss(model(x).reshape(y.shape), y)


@functools.cache
def _charlm_data():
    return char_lm.load_data(256 * 1024, 32 * 1024, 64)


def diabetes_data(test_fraction: float = 0.2):
    """scikit-learn's diabetes table, a fixed split (seed 0); features and target standardised on the train rows."""
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(X))
    X, y = X[order].astype(np.float32), y[order].astype(np.float32)
    n_test = int(round(len(X) * test_fraction))
    X = (X - X[n_test:].mean(0)) / (X[n_test:].std(0) + 1e-6)
    y = (y - y[n_test:].mean()) / y[n_test:].std()
    return (X[n_test:], y[n_test:]), (X[:n_test], y[:n_test])


def diabetes_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))


def make_task(name: str, seed: int) -> Task:
    """The task ``name`` at ``seed`` (see the module's docstring)."""
    adam = functools.partial(torch.optim.Adam, lr=1e-3)  # vcdask.fit's default optimizer
    if name == "charlm":
        config = char_lm.GPTConfig(d_model=96, n_layers=3, n_heads=4, context=64)
        train, test = _charlm_data()
        steps = {"train_step": char_lm.train_step, "eval_step": char_lm.eval_step}
        opt = char_lm.make_optimizer(5e-3)
        fit = {**steps, "optimizer": opt, "n_shards": 8}
        return Task(name, "lm", char_lm.CharGPT(config, seed=seed), train, test, char_lm.train_step, opt, 32, 2, fit)
    if name in ("digits", "tabular"):
        from defaults import _classifier  # the very setup of defaults.py

        c = _classifier(name, seed)
        return Task(name, "classification", c["model"], c["train"], c["test"], classify_step, adam, 32, c["epochs"],
                    c["fit"])  # fmt: skip
    if name == "diabetes":
        train, test = diabetes_data()
        fit = {"n_shards": 6, "batch_size": 16}
        return Task(name, "regression", diabetes_mlp(seed), train, test, regress_step, adam, 16, 20, fit)
    raise ValueError(f"unknown task {name!r}; choose from {list(TASKS)}")


@torch.no_grad()
def score(task: Task, model: torch.nn.Module) -> dict[str, float]:
    """The task's metrics (:data:`METRICS`) of ``model`` on its held-out set, computed here."""
    model = model.cpu().eval()
    X, y = task.test
    if task.kind == "lm":
        return {"val loss": char_lm.validation_loss(model, X, y, device=torch.device("cpu"))}
    out, target = model(torch.from_numpy(X)), torch.from_numpy(y)
    if task.kind == "regression":
        return {"test mse": float(F.mse_loss(out.reshape(target.shape), target))}
    accuracy = float((out.argmax(1) == target).float().mean())
    return {"test accuracy": accuracy, "test loss": float(F.cross_entropy(out, target))}


# -- the trainers -------------------------------------------------------------------------------------------
def train_passes(
    model, step, optimizer, X, y, batch: int, epochs: int, seed: int, rank: int = 0, world: int = 1,
    schedule: str = "constant",
):  # fmt: skip
    """``epochs`` shuffled passes; with ``world > 1`` this rank's slice of each pass (one permutation for all
    ranks, seeded by ``seed``, padded to a multiple of ``world`` as ``DistributedSampler`` does).
    ``schedule="cosine"``: the learning rate on a cosine to 0 over this rank's steps."""
    opt = optimizer(model.parameters())
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    g = torch.Generator().manual_seed(seed)
    per_rank = -(-len(Xb) // world)
    total = epochs * -(-per_rank // batch)
    lr = None
    if schedule == "cosine":
        from vcdask.lr_schedules import Cosine

        lr = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(Cosine(), total=total))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(Xb), generator=g)
        order = torch.cat([order, order[: -len(order) % world]])  # every rank the same number of steps
        for idx in order[rank::world].split(batch):
            opt.zero_grad(set_to_none=True)
            step(model, (Xb[idx], yb[idx])).backward()
            opt.step()
            if lr is not None:
                lr.step()


def train_torch(task: Task, seed: int, schedule: str = "constant") -> torch.nn.Module:
    """Single-process torch in this process (one thread): a trained copy of ``task.init``."""
    model = copy.deepcopy(task.init)
    if task.name == "charlm" and schedule == "constant":
        X, Y = task.train
        char_lm.train_baseline(
            model, X, Y, epochs=task.epochs, local_epochs=1, batch_size=task.batch, lr=5e-3,
            device=torch.device("cpu"), seed=seed,
        )  # fmt: skip
    else:
        train_passes(model, task.step, task.optimizer, *task.train, task.batch, task.epochs, seed, schedule=schedule)
    return model


def _ddp_rank(
    rank: int, world: int, port: int, model, step, optimizer, X, y, batch, epochs, seed, out: str, schedule: str
) -> None:
    """One DDP process: train its slices, all-reducing gradients; rank 0 saves the final state_dict to ``out``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # (torch.multiprocessing hands the model's tensors to every rank in one shared memory: without a copy of
    # its own each rank's optimizer would step the same weights, W steps per step, racing)
    model = copy.deepcopy(model)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        train_passes(ddp, step, optimizer, X, y, batch, epochs, seed, rank, world, schedule)
        if rank == 0:
            torch.save(ddp.module.state_dict(), out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_ddp(task: Task, seed: int, world: int, schedule: str = "constant") -> torch.nn.Module:
    """Torch DDP over ``world`` spawned processes: a copy of ``task.init`` holding rank 0's final weights."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vcdask-bench-ddp-") as tmp:
        out = os.path.join(tmp, "state.pt")
        init = copy.deepcopy(task.init)  # (spawning moves its tensors to shared memory: never the task's own)
        args = (world, free_port(), init, task.step, task.optimizer, *task.train, task.batch, task.epochs)
        for attempt in (1, 2):  # (a rank of gloo on 2 busy cores now and then aborts as it tears down)
            try:
                mp.start_processes(
                    _ddp_rank, args=(*args, seed, out, schedule), nprocs=world, join=True, start_method="spawn"
                )
                break
            except mp.ProcessExitedException:
                if os.path.exists(out):  # rank 0 had saved the trained model: only the teardown failed
                    break
                if attempt == 2:
                    raise
                log(f"DDP W={world}: a rank aborted before the end; once more")
        model = copy.deepcopy(task.init)
        model.load_state_dict(torch.load(out))
    return model


def train_vcdask(
    task: Task, seed: int, client, overrides: dict, grow: Callable[[], None] | None = None
) -> tuple[torch.nn.Module, dict[str, float], str]:
    """``vcdask.fit`` with its defaults (and ``overrides``) on ``client``; the final model, its
    :func:`merge_stats`, and the rule that merged (``merge="auto"``'s choice, where it chose).
    ``grow``: called once the run has merged its first result (the cluster scaled up: a fleet still
    starting when the run begins)."""
    import vcdask

    passes = overrides.get("local_epochs", 1)  # (main checked that it divides every task's epochs)
    with scratch_store(None, "equal-tokens") as store:
        handle = vcdask.fit(
            copy.deepcopy(task.init),
            task.train,
            max_epochs=task.epochs // passes,  # the same tokens: each task makes `passes` passes over its shard
            **{**task.fit, **overrides},  # --set wins
            seed=seed,
            client=client,
            store=store,
            progress=False,
            wait=False,
        )
        if grow is not None:
            while handle.status()["step"] < 1 and not handle.done():
                time.sleep(0.02)
            grow()
        result = handle.result()
        meta = result.store.read(result.version).metadata
    merged = result.history[result.history["outcome"] == "merged"]
    rule, state = meta.get("merge", {}), meta.get("rule_state", {})
    if state.get("chosen") is None:
        name = rule.get("name", "?")  # (fit's default as the fleet grew: the tasks in flight it is for)
        name += f"/{meta['merge_in_flight']}" if grow is not None and "merge_in_flight" in meta else ""
        return result.model, merge_stats(merged), name
    # merge="auto": its choice, its probe's rows, how busy the probe would keep the merge thread (measured)
    busy = "?" if state.get("busy") is None else f"{state['busy']:.0%}"
    return (
        result.model,
        merge_stats(merged),
        f"auto:{state['chosen']}{'-light' if state.get('light') else ''}/{state['probe_rows']} ({busy})",
    )


def merge_stats(merged) -> dict[str, float]:
    """Of a run's merged updates: the largest staleness, and the mean of the local steps each trained from its
    worker's own last update before the merged version came (``overlap="delta"``; 0 with ``"wait"``)."""
    return {
        "staleness": float(merged["staleness"].astype(float).max()),
        "ahead": float(merged["steps_ahead"].astype(float).fillna(0).mean()),
    }


def warm_up(client, workers: int) -> None:
    """A tiny fit: the workers' imports and first steps, paid once per cluster outside the measurements."""
    import vcdask

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    with scratch_store(None, "equal-tokens-warm") as store:
        vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, n_shards=workers, client=client, store=store,
                   progress=False)  # fmt: skip


# -- the table ----------------------------------------------------------------------------------------------
def table(task: Task, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per trainer: medians over seeds, against torch's (the first trainer), values by seed."""
    base = runs["torch, 1 process"]
    rows = []
    for trainer, done in runs.items():
        row: dict = {"trainer": trainer}
        for metric, kind in METRICS[task.kind].items():
            value, torch_value = (statistics.median(r[metric] for r in rs) for rs in (done, base))
            row[metric] = value
            if kind == "loss":
                row[f"{metric} / torch"] = f"{value / torch_value:.3f}"
            else:
                row[f"{metric} - torch"] = f"{100 * (value - torch_value):+.2f} pt"
            row[f"{metric} by seed"] = " ".join(f"{r[metric]:.4f}" for r in done)
        for key, column in (("staleness", "max staleness"), ("ahead", "steps ahead")):
            values = [r[key] for r in done if key in r]
            row[column] = statistics.median(values) if values else None
        if (against := _vs_ddp(task, trainer, done, runs)) is not None:
            row["vs DDP"] = against
        rules = [r["rule"] for r in done if "rule" in r]
        if rules:
            row["rule"] = " ".join(rules)
        row["wall s"] = statistics.median(r["wall s"] for r in done)
        rows.append(row)
    return rows


def _vs_ddp(task: Task, trainer: str, done: list[dict], runs: dict[str, list[dict]]) -> str | None:
    """A vcdask row's first metric against DDP's with as many workers, seed by seed: the median ratio (a loss)
    or difference in points (an accuracy), and how many seeds are no worse; None without such a DDP row."""
    if not trainer.startswith("vcdask W="):
        return None
    workers = trainer.split()[1].removeprefix("W=").split("->")[-1]
    ddp = {r["seed"]: r for r in runs.get(f"DDP W={workers}", [])}
    pairs = [(r, ddp[r["seed"]]) for r in done if r["seed"] in ddp]
    if not pairs:
        return None
    metric, kind = next(iter(METRICS[task.kind].items()))
    if kind == "loss":
        ratios = [r[metric] / d[metric] for r, d in pairs]
        return f"{statistics.median(ratios):.3f} ({sum(x <= 1 for x in ratios)} of {len(ratios)} at or under)"
    points = [100 * (r[metric] - d[metric]) for r, d in pairs]
    return f"{statistics.median(points):+.2f} pt ({sum(x >= 0 for x in points)} of {len(points)} at or over)"


def run_one(runs, task: Task, trainer: str, seed: int, train: Callable) -> None:
    """Train with ``train()`` (a model, or a model, its :func:`merge_stats` and its rule), score it, file and
    log the result."""
    t0 = time.perf_counter()
    out = train()
    model, stats, rule = out if isinstance(out, tuple) else (out, {}, None)
    record = {**score(task, model), "wall s": time.perf_counter() - t0, "seed": seed, **stats}
    if rule is not None:
        record["rule"] = rule
    runs[task.name].setdefault(trainer, []).append(record)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("seed", "wall s", "rule"))
    shown += f", rule {record['rule']}" if "rule" in record else ""
    log(f"{task.name} seed {seed} {trainer}: {shown} ({record['wall s']:.1f} s)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; the comma lists as lists and ``--set`` as a dict ``overrides``."""
    from defaults import _value

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(TASKS), help="a comma list of %(default)s")
    ap.add_argument("--workers", default="1,2,4,8", help="vcdask worker processes, a comma list (%(default)s)")
    ap.add_argument("--ddp-workers", default="2,4,8", help="DDP world sizes, a comma list (%(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="a comma list (default: %(default)s)")
    set_help = "a vcdask.fit argument, its value read as defaults.py reads it (repeatable)"
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=set_help)
    vary_help = "one vcdask row per value of one fit argument (read as --set reads it)"
    ap.add_argument("--vary", default=None, metavar="NAME=V1,V2,...", help=vary_help)
    ap.add_argument("--skip-ddp", action="store_true", help="no DDP rows")
    ap.add_argument("--skip-vcdask", action="store_true", help="no vcdask rows")
    epochs_help = "passes over the data for every trainer of every task (default: each task's own)"
    ap.add_argument("--epochs", type=int, default=None, metavar="N", help=epochs_help)
    local_help = "passes over its shard in each vcdask task, with epochs / N epochs: the same tokens (default: 1)"
    ap.add_argument("--local-epochs", type=int, default=1, metavar="N", help=local_help)
    grow_help = "start each vcdask run on a fresh cluster of this many workers, scaled to W after its first merge"
    ap.add_argument("--grow-from", type=int, default=None, metavar="N", help=grow_help)
    ap.add_argument(
        "--schedule", choices=["constant", "cosine"], default="constant", help="learning rates (%(default)s)"
    )
    args = ap.parse_args(argv)
    args.tasks = args.tasks.split(",")
    if unknown := [t for t in args.tasks if t not in TASKS]:
        ap.error(f"unknown --tasks {unknown}; choose from {list(TASKS)}")
    for name in ("workers", "ddp_workers", "seeds"):
        try:
            setattr(args, name, [int(v) for v in getattr(args, name).split(",")])
        except ValueError:
            ap.error(f"--{name.replace('_', '-')} takes a comma list of integers, got {getattr(args, name)!r}")
    if min(args.workers + args.ddp_workers) < 1:
        ap.error("--workers and --ddp-workers must be >= 1")
    if args.epochs is not None and args.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.local_epochs < 1:
        ap.error(f"--local-epochs must be >= 1, got {args.local_epochs}")
    args.overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set takes NAME=VALUE, got {item!r}")
        args.overrides[name] = _value(value)
    if args.local_epochs > 1:  # (a --set local_epochs wins)
        args.overrides = {"local_epochs": args.local_epochs, **args.overrides}
    args.variants = [("", {})]  # (a row's label suffix, its overrides on top of --set)
    if args.vary is not None:
        name, sep, values = args.vary.partition("=")
        if not sep or not name or not values:
            ap.error(f"--vary takes NAME=V1,V2,..., got {args.vary!r}")
        args.variants = [(f" {name}={value}", {name: _value(value)}) for value in values.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the torch loop on one core, as each DDP rank and each worker
    t_start = time.perf_counter()
    tasks = {(name, seed): make_task(name, seed) for name in args.tasks for seed in args.seeds}
    if args.epochs is not None:
        tasks = {key: replace(task, epochs=args.epochs) for key, task in tasks.items()}
    for _label, extra in args.variants:  # before any training: every variant's passes divide every task's epochs
        passes = {**args.overrides, **extra}.get("local_epochs", 1)
        if not isinstance(passes, int) or passes < 1:
            raise SystemExit(f"local_epochs must be an integer >= 1, got {passes!r}")
        if bad := sorted({t.name for t in tasks.values() if t.epochs % passes}):
            raise SystemExit(f"local_epochs={passes} does not divide the epochs of {bad}")
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in args.tasks}
    for (_name, seed), task in tasks.items():
        run_one(runs, task, "torch, 1 process", seed, functools.partial(train_torch, task, seed, args.schedule))
        for world in [] if args.skip_ddp else args.ddp_workers:
            train = functools.partial(train_ddp, task, seed, world, args.schedule)
            run_one(runs, task, f"DDP W={world}", seed, train)
    if args.schedule == "cosine":
        from vcdask.lr_schedules import Cosine

        args.overrides = {"lr_schedule": Cosine(), **args.overrides}
    if not args.skip_vcdask:
        from distributed import Client

        from vcdask.cluster import embedded_cluster

        for workers in args.workers:
            # a fleet still starting: a fresh cluster per run, grown after its first merge
            if args.grow_from is not None:
                for (_name, seed), task in tasks.items():
                    for label, extra in args.variants:
                        with embedded_cluster(n_workers=args.grow_from, host="127.0.0.1") as cluster:
                            with Client(cluster) as client:
                                warm_up(client, args.grow_from)
                                grow = functools.partial(cluster.scale, workers)
                                overrides = {**args.overrides, **extra}
                                train = functools.partial(train_vcdask, task, seed, client, overrides, grow)
                                run_one(runs, task, f"vcdask W={args.grow_from}->{workers}{label}", seed, train)
                continue
            t0 = time.perf_counter()
            with embedded_cluster(n_workers=workers, host="127.0.0.1") as cluster, Client(cluster) as client:
                warm_up(client, workers)
                log(f"cluster of {workers} workers started and warmed up in {time.perf_counter() - t0:.1f} s")
                for (_name, seed), task in tasks.items():
                    for label, extra in args.variants:  # (the variants of one seed one after the other)
                        train = functools.partial(train_vcdask, task, seed, client, {**args.overrides, **extra})
                        run_one(runs, task, f"vcdask W={workers}{label}", seed, train)
    from devices import markdown

    setting = f"vcdask.fit defaults{' with ' + str(args.overrides) if args.overrides else ''}"
    setting += f", one row per {args.vary}" if args.vary else ""
    print(f"\nloss at equal tokens; {setting}; learning rates {args.schedule}; seeds {args.seeds}")
    for name in args.tasks:
        task = tasks[(name, args.seeds[0])]
        print(f"\n### {name} ({task.epochs} epochs, batch {task.batch} per worker)\n")
        print(markdown(table(task, runs[name])))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
