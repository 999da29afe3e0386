"""A character-level GPT trained on the Python standard library's own source: vcdask beside plain torch.

usage: python examples/char_lm.py [--quick] [--device auto|cpu|cuda|cuda:N|mps] [--store DIR] [--seeds N[,N...]]
                                  [--check] [--tolerance 0.05] [--merge default|vc-asgd|staleness|sync|nesterov]
                                  [--train-kb N] [--epochs N] [--local-epochs N] [--shards N] ...

1. build a byte-level corpus from a fixed, sorted list of the standard library's ``.py`` files (every
   Python has them; no download): every tenth file goes to validation, the rest to training; cut both
   into sequences of ``--context`` bytes, the targets shifted by one byte;
2. train a small GPT (token and position embeddings, pre-norm causal self-attention blocks) with
   ``vcdask.fit`` and a next-token ``train_step``, asynchronously on a Dask cluster (an embedded
   LocalCluster unless ``--scheduler`` is given), validating with an ``eval_step``;
3. train the same model (same initial weights, optimizer, learning rate and batch size) in this process
   with plain torch on the same number of tokens;
4. score both on the same held-out sequences and print a table: method, tokens, validation loss (nats per
   byte), perplexity, wall seconds.

With ``--check`` the exit code is 3 when vcdask's validation loss is more than ``--tolerance`` (default 5%)
above the baseline's, or with several seeds (``--seeds 0,2,4``) when the median of the ratios is; 0 otherwise.
``--device auto`` trains on the GPU when there is one (the workers use their own accelerators; the baseline
uses this process's).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes: a fixed vocabulary, nothing unknown
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
WORSE_THAN_BASELINE = 3


# -- the corpus ---------------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, without its tests and installed packages, sorted by path.

    Returns
    -------
    list of pathlib.Path
        Sorted by their path relative to the standard library's folder, so the order is the same on
        every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus(train_bytes: int, val_bytes: int, every: int = 10) -> tuple[bytes, bytes]:
    """Training and validation text: the standard library's source, split by file.

    Files are taken in :func:`stdlib_files` order; every ``every``-th goes to validation, the others
    to training, each side until it holds its number of bytes (files are joined by a blank line).

    Parameters
    ----------
    train_bytes, val_bytes : int
        Bytes of training and validation text.
    every : int, default 10
        One file in ``every`` is a validation file.

    Returns
    -------
    (bytes, bytes)
        The training and the validation text, UTF-8, exactly ``train_bytes`` and ``val_bytes`` long.

    Raises
    ------
    ValueError
        The standard library holds less text than asked for.
    """
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    need = {False: train_bytes, True: val_bytes}
    have = {False: 0, True: 0}
    for i, path in enumerate(stdlib_files()):
        side = i % every == every - 1
        if have[side] >= need[side]:
            if all(have[s] >= need[s] for s in (False, True)):
                break
            continue
        text = path.read_bytes() + b"\n\n"
        parts[side].append(text)
        have[side] += len(text)
    if have[False] < train_bytes or have[True] < val_bytes:
        raise ValueError(
            f"the standard library has {have[False]} training and {have[True]} validation bytes; "
            f"asked for {train_bytes} and {val_bytes}"
        )
    return b"".join(parts[False])[:train_bytes], b"".join(parts[True])[:val_bytes]


def sequences(text: bytes, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``text`` into non-overlapping inputs of ``context`` bytes and their next-byte targets.

    Parameters
    ----------
    text : bytes
    context : int
        Sequence length in bytes (tokens).

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        Token ids ``X`` and targets ``Y``, both int64 of shape ``(n, context)``; ``Y[i, t]`` is the byte
        after ``X[i, t]``.
    """
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    n = (len(ids) - 1) // context
    return ids[: n * context].reshape(n, context), ids[1 : n * context + 1].reshape(n, context)


def load_data(
    train_bytes: int, val_bytes: int, context: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Training and validation sequences from the standard library's source (see :func:`corpus`).

    Parameters
    ----------
    train_bytes, val_bytes : int
    context : int

    Returns
    -------
    ((X, Y), (X_val, Y_val))
        int64 arrays of shape ``(n, context)``.
    """
    train, val = corpus(train_bytes, val_bytes)
    return sequences(train, context), sequences(val, context)


# -- the model ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    """The size of a :class:`CharGPT`."""

    context: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab: int = VOCAB


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual.

    Parameters
    ----------
    d_model, n_heads : int
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small GPT over bytes: token and position embeddings, pre-norm blocks, a final norm, a linear head.

    Parameters
    ----------
    config : GPTConfig
    seed : int, default 0
        Seeds the initial weights (GPT-2's: normal with std 0.02, residual projections scaled down by
        ``sqrt(2 * n_layers)``), so two models made with the same seed are equal.

    Examples
    --------
    >>> model = CharGPT(GPTConfig(context=64, d_model=128, n_layers=4, n_heads=4))
    >>> model(torch.zeros(2, 64, dtype=torch.long)).shape
    torch.Size([2, 64, 256])
    """

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.Sequential(*(Block(config.d_model, config.n_heads) for _ in range(config.n_layers)))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    continue  # biases and norms keep torch's init (zeros, ones)
                std = 0.02 / math.sqrt(2 * config.n_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-byte logits, shape ``(batch, time, vocab)``, for token ids ``idx`` of shape ``(batch, time)``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(x)))


def n_parameters(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


# -- the steps vcdask runs (and the baseline uses too) ------------------------------------------------------
def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte, in nats."""
    logits = model(x.long())
    return F.cross_entropy(logits.flatten(0, 1), y.long().flatten())


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """vcdask's ``train_step``: the next-token loss of one batch ``(x, y)`` (vcdask calls backward)."""
    x, y = batch
    return next_token_loss(model, x, y)


def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vcdask's ``eval_step``: the batch's mean next-token loss (vcdask averages it over the validation set)."""
    x, y = batch
    return {"loss": next_token_loss(model, x, y)}


def make_optimizer(lr: float) -> functools.partial:
    """The optimizer both runs use: AdamW with nanoGPT's character-model betas, as ``params -> optimizer``."""
    return functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)


def resolve_device(device: str) -> torch.device:
    """This process's device for ``device``: ``"auto"`` is CUDA, then MPS, when there is one, else the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


@torch.no_grad()
def validation_loss(
    model: nn.Module, X: np.ndarray, Y: np.ndarray, *, device: torch.device, batch_size: int = 256
) -> float:
    """Mean next-byte loss of ``model`` over every token of ``(X, Y)``, in nats.

    Parameters
    ----------
    model : torch.nn.Module
    X, Y : numpy.ndarray
        Token ids and targets, shape ``(n, context)``.
    device : torch.device
    batch_size : int, default 256

    Returns
    -------
    float
    """
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(X), batch_size):
        x = torch.from_numpy(X[i : i + batch_size]).to(device)
        y = torch.from_numpy(Y[i : i + batch_size]).to(device)
        total += float(next_token_loss(model, x, y)) * len(x)
        count += len(x)
    return total / count


def cosine_schedule(epoch: int, step: int = 0, *, epochs: int, floor: float = 0.1) -> float:
    """A learning-rate factor that follows a cosine from 1 down to ``floor``, one value per epoch.

    The value of epoch ``e`` (from 1) is the cosine at the middle of that epoch; ``step`` (a task's
    local step) is ignored, so every shard task of an epoch, and the baseline's passes of that epoch,
    train with the same learning rate.  Usable as ``vcdask.fit(..., lr_schedule=...)`` once ``epochs``
    is bound (``functools.partial(cosine_schedule, epochs=10)``).

    Parameters
    ----------
    epoch : int
        The run's epoch, from 1.
    step : int, default 0
        Ignored.
    epochs : int
        The run's number of epochs.
    floor : float, default 0.1

    Returns
    -------
    float
    """
    del step
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (epoch - 0.5) / epochs))


def train_baseline(
    model: nn.Module,
    X: np.ndarray,
    Y: np.ndarray,
    *,
    epochs: int,
    local_epochs: int,
    batch_size: int,
    lr: float,
    device: torch.device,
    lr_schedule=None,
    on_epoch=None,
    seed: int = 0,
) -> int:
    """Plain single-process torch: ``epochs * local_epochs`` shuffled passes over ``(X, Y)``, one optimizer.

    The same tokens as a vcdask run of ``epochs`` epochs of ``local_epochs`` passes over every shard, and
    the same learning rate in each of them.

    Parameters
    ----------
    model : torch.nn.Module
        Trained in place, on ``device``.
    X, Y : numpy.ndarray
    epochs, local_epochs : int
        vcdask's ``max_epochs`` and ``local_epochs``.
    batch_size : int
    lr : float
    device : torch.device
    lr_schedule : callable, optional
        ``lr_schedule(epoch, step) -> factor`` as given to vcdask; called with each pass's epoch (from 1).
    on_epoch : callable, optional
        ``on_epoch(epoch, model)`` after each epoch's passes (to validate, say).
    seed : int, default 0
        Seeds the order of the sequences.

    Returns
    -------
    int
        Tokens trained on.
    """
    model.to(device).train()
    optimizer = make_optimizer(lr)(model.parameters())
    Xt, Yt = torch.from_numpy(X).to(device), torch.from_numpy(Y).to(device)
    g = torch.Generator().manual_seed(seed)
    tokens = 0
    for epoch in range(1, epochs + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1.0 if lr_schedule is None else lr_schedule(epoch, 0))
        for _ in range(local_epochs):
            order = torch.randperm(len(Xt), generator=g).to(device)
            for i in range(0, len(Xt), batch_size):
                idx = order[i : i + batch_size]
                optimizer.zero_grad(set_to_none=True)
                train_step(model, (Xt[idx], Yt[idx])).backward()
                optimizer.step()
                tokens += idx.numel() * Xt.shape[1]
        if on_epoch is not None:
            on_epoch(epoch, model)
            model.train()
    return tokens


def unigram_loss(train: np.ndarray, Y: np.ndarray) -> float:
    """Validation loss of byte frequencies alone (counted on ``train``, add-one smoothed): the loss to beat.

    Parameters
    ----------
    train : numpy.ndarray
        Training token ids.
    Y : numpy.ndarray
        Validation targets.

    Returns
    -------
    float
        Mean next-byte loss in nats of a model that ignores the context.
    """
    counts = np.bincount(train.ravel(), minlength=VOCAB) + 1.0
    return float(-np.log(counts / counts.sum())[Y.ravel()].mean())


@torch.no_grad()
def generate(model: CharGPT, prompt: str, n_bytes: int = 200, *, temperature: float = 0.8, seed: int = 0) -> str:
    """Sample ``n_bytes`` more bytes after ``prompt`` (decoded as UTF-8, bad bytes replaced).

    Parameters
    ----------
    model : CharGPT
    prompt : str
    n_bytes : int, default 200
    temperature : float, default 0.8
    seed : int, default 0

    Returns
    -------
    str
        The prompt and what the model wrote after it.
    """
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    for _ in range(n_bytes):
        logits = model(ids[:, -model.config.context :])[:, -1] / temperature
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


# -- the script ---------------------------------------------------------------------------------------------
QUICK = {"train_kb": 128, "val_kb": 32, "epochs": 4, "shards": 32}


def seeds(text: str) -> tuple[int, ...]:
    """``--seed``'s value: ``"0"`` or ``"0,2,4"``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or integers separated by commas, got {text!r}") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a seed given twice: {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a small run for CI (a few minutes on 2 cores): {QUICK}")
    ap.add_argument("--train-kb", type=int, default=1024, help="KiB of training text (default: %(default)s)")
    ap.add_argument("--val-kb", type=int, default=64, help="KiB of validation text (default: %(default)s)")
    ap.add_argument("--context", type=int, default=64, help="sequence length in bytes (default: %(default)s)")
    ap.add_argument("--d-model", type=int, default=128, help="width (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=5, help="transformer blocks (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=6, help="vcdask max_epochs (default: %(default)s)")
    ap.add_argument("--local-epochs", type=int, default=1, help="passes over its shard per task (default: %(default)s)")
    ap.add_argument("--shards", type=int, default=64, help="vcdask n_shards (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per batch, both runs (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3, help="AdamW's peak learning rate, both (default: %(default)s)")
    ap.add_argument(
        "--schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="learning rate by epoch, both runs: a cosine from --lr down to --lr/10, or constant (default: cosine)",
    )
    ap.add_argument("--merge", default="default", help="vcdask merge rule (default: vcdask's default rule)")
    ap.add_argument(
        "--optimizer-state", choices=["fresh", "worker"], default="fresh", help="vcdask (default: %(default)s)"
    )
    ap.add_argument("--tasks-per-slot", type=int, default=1, help="vcdask (default: %(default)s)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: %(default)s)")
    ap.add_argument("--precision", choices=["32", "bf16", "16-mixed"], default="32", help="vcdask (default: 32)")
    ap.add_argument("--store", default="vcdask-runs", help="vcdask parameter store (default: %(default)s)")
    ap.add_argument("--scheduler", help="address of a Dask scheduler (default: an embedded LocalCluster)")
    ap.add_argument(
        "--workers",
        type=int,
        help="worker processes of the embedded LocalCluster (default: one per GPU, else one per core)",
    )
    ap.add_argument(
        "--seed",
        "--seeds",
        dest="seed",
        type=seeds,
        metavar="N[,N...]",
        default=(0,),
        help="initial weights and data order; several, comma-separated, train one after the other on one cluster, "
        "and --check takes the median of their ratios to torch (default: 0)",
    )
    ap.add_argument("--skip-baseline", action="store_true", help="train with vcdask only")
    ap.add_argument("--check", action="store_true", help="exit 3 if vcdask's loss is not within --tolerance")
    ap.add_argument("--tolerance", type=float, default=0.05, help="relative (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    positive = ("train_kb", "val_kb", "context", "d_model", "layers", "heads", "epochs", "local_epochs", "shards")
    for name in (*positive, "batch_size", "tasks_per_slot"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers is not None and args.scheduler:
        ap.error("--workers sizes the embedded cluster: drop it with --scheduler")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.check and args.skip_baseline:
        ap.error("--check compares with the baseline: drop --skip-baseline")
    from vcdask.device import check_device
    from vcdask.merge import rules

    if args.merge != "default" and args.merge not in rules:
        ap.error(f"--merge: unknown rule {args.merge!r}; choose from {['default', *sorted(rules)]}")
    try:
        check_device(args.device)
    except ValueError as e:
        ap.error(f"--device: {e}")
    return args


def lr_schedule(args: argparse.Namespace):
    """The learning-rate schedule both runs follow: ``(epoch, step) -> factor``, or None for a constant."""
    return functools.partial(cosine_schedule, epochs=args.epochs) if args.schedule == "cosine" else None


def open_client(args: argparse.Namespace, stack: contextlib.ExitStack):
    """The Dask client the vcdask runs use: ``--scheduler``'s, or an embedded cluster's (one worker per core,
    or per GPU where there are GPUs), closed with ``stack``."""
    if args.scheduler:
        from distributed import Client

        return stack.enter_context(Client(args.scheduler))
    from vcdask.cluster import embedded_cluster

    gpus = torch.cuda.device_count() if args.device in ("auto", "cuda") else 0
    return stack.enter_context(embedded_cluster(n_workers=args.workers or gpus or None))


def train_vcdask(model: nn.Module, train, val, args: argparse.Namespace, *, client=None, seed: int | None = None):
    """Train ``model`` with :func:`vcdask.fit` as ``args`` say (at ``seed``, default the first of ``--seed``) on
    ``client`` (default: :func:`open_client`'s); return its :class:`vcdask.FitResult`."""
    import vcdask

    with contextlib.ExitStack() as stack:
        return vcdask.fit(
            model,
            train,
            train_step=train_step,
            eval_step=eval_step,
            validation=val,
            device=args.device,
            precision=args.precision,
            optimizer=make_optimizer(args.lr),
            lr_schedule=lr_schedule(args),
            optimizer_state=args.optimizer_state,
            batch_size=args.batch_size,
            n_shards=args.shards,
            local_epochs=args.local_epochs,
            max_epochs=args.epochs,
            merge=None if args.merge == "default" else args.merge,
            tasks_per_slot=args.tasks_per_slot,
            validate_every=args.shards,  # an epoch's last version is always validated; skip the others
            client=client if client is not None else open_client(args, stack),
            store=args.store,
            seed=args.seed[0] if seed is None else seed,
            progress=False,
        )


def compare(args: argparse.Namespace, seed: int, data, config: GPTConfig, device: torch.device, client) -> float:
    """One seed: vcdask on ``client``, then (unless ``--skip-baseline``) plain torch on the same tokens; print
    both and the table; return vcdask's validation loss over torch's (NaN without the baseline)."""
    (X, Y), (Xv, Yv) = data
    passes = args.epochs * args.local_epochs
    rows = [("unigram (byte counts)", X.size, unigram_loss(X, Yv), float("nan"))]

    t0 = time.perf_counter()
    result = train_vcdask(CharGPT(config, seed=seed), (X, Y), (Xv, Yv), args, client=client, seed=seed)
    wall = time.perf_counter() - t0
    merged = int(result.history["accepted"].sum())
    tokens = passes * X.size * merged // (args.epochs * args.shards)  # exact when every shard was merged
    model = result.model.to(device)
    loss = validation_loss(model, Xv, Yv, device=device)
    rows.append(("vcdask", tokens, loss, wall))
    devices = sorted(set(result.history["device"].dropna())) if "device" in result.history else []
    print(
        f"vcdask: run {result.run_id}, {merged} of {args.epochs * args.shards} shard tasks merged on "
        f"{result.history['worker'].nunique()} workers ({', '.join(devices) or '?'}), final version "
        f"{result.version}\n  validation loss by epoch: {', '.join(f'{v:.4f}' for v in result.epochs['loss'])} "
        f"(eval_step on the workers; {loss:.4f} recomputed here)"
    )
    print(f"  sample: {generate(model, 'def ', 120)!r}")

    if not args.skip_baseline:
        baseline = CharGPT(config, seed=seed)
        by_epoch: list[float] = []

        def on_epoch(_epoch: int, m: nn.Module) -> None:
            by_epoch.append(validation_loss(m, Xv, Yv, device=device))

        t0 = time.perf_counter()
        tokens = train_baseline(
            baseline,
            X,
            Y,
            epochs=args.epochs,
            local_epochs=args.local_epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            lr_schedule=lr_schedule(args),
            on_epoch=on_epoch if args.epochs > 1 else None,
            device=device,
            seed=seed,
        )
        wall = time.perf_counter() - t0
        loss = validation_loss(baseline, Xv, Yv, device=device)
        rows.append((f"torch, 1 process ({device.type})", tokens, loss, wall))
        print(
            f"torch: validation loss by epoch: {', '.join(f'{v:.4f}' for v in by_epoch) or f'{loss:.4f}'} "
            f"(wall time includes validating every epoch)\n  sample: {generate(baseline, 'def ', 120)!r}"
        )

    print()
    print(f"{'method':<26} {'tokens':>10} {'val loss':>9} {'perplexity':>10} {'wall (s)':>9}")
    for method, tokens, loss, wall in rows:
        print(f"{method:<26} {tokens:>10} {loss:>9.4f} {math.exp(loss):>10.3f} {wall:>9.1f}")
    return float("nan") if args.skip_baseline else rows[1][2] / rows[2][2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    data = load_data(args.train_kb * 1024, args.val_kb * 1024, args.context)
    (X, _), (Xv, _) = data
    config = GPTConfig(context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    passes = args.epochs * args.local_epochs
    print(
        f"corpus: the standard library's source, {len(X)} training and {len(Xv)} validation sequences of "
        f"{args.context} bytes; CharGPT {n_parameters(CharGPT(config)) / 1e6:.2f}M parameters; "
        f"{args.epochs} epochs x {args.local_epochs} local passes over {args.shards} shards = {passes} passes, "
        f"AdamW lr {args.lr:g} ({args.schedule}), batch {args.batch_size}"
    )
    ratios = []
    with contextlib.ExitStack() as stack:  # one cluster for every seed: its workers stay warm
        client = open_client(args, stack)
        for seed in args.seed:
            if len(args.seed) > 1:
                print(f"\n== seed {seed}")
            ratios.append(compare(args, seed, data, config, device, client))
    if args.skip_baseline:
        return 0
    ratio = statistics.median(ratios)
    within = ratio <= 1 + args.tolerance
    by_seed = ""
    if len(ratios) > 1:
        by_seed = f", seeds {', '.join(map(str, args.seed))}: {', '.join(f'{r:.4f}' for r in ratios)}; median"
    print(
        f"\nvcdask / torch validation loss at equal tokens{by_seed}: {ratio:.4f} "
        f"({'within' if within else 'NOT within'} {args.tolerance:.0%})"
    )
    return 0 if within or not args.check else WORSE_THAN_BASELINE


if __name__ == "__main__":
    sys.exit(main())
