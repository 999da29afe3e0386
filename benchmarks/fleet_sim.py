"""Merge rules on a simulated fleet, in one process: loss at equal tokens, deterministic, no cluster.

usage: python benchmarks/fleet_sim.py [--task charlm|digits] [--workers 1,2,4,8] [--rules default,...]
                                      [--seeds 0,2] [--train-kb 256] [--shards N] [--epochs 2]
                                      [--ahead SHARE] [--jitter J] [--lookahead G]
                                      [--inner worker,fresh,direction] [--lr LR] [--beta2 B2]

``--task charlm`` (the default): the small CPU char-LM of issue 38 (``examples/char_lm.py``'s CharGPT, d_model
96, 3 layers, 4 heads, context 64, AdamW 5e-3, batch 32, ``--shards`` shards, ``--epochs`` epochs; validation
loss, the table in loss / torch's).  ``--task digits``: ``equal_tokens.py``'s digits (the demo CNN, Adam 1e-3,
batch 32, 8 epochs, the 90% of the demo's training split that ``fit`` trains on, ``--shards`` or ``fit``'s default
of 2 shards per worker; test accuracy, the table in points against torch).  Each is trained three ways from the same
initial weights, for the same passes over the same samples:

* ``torch``: ``char_lm.train_baseline`` (one process, one optimizer);
* ``ddp``: the same loop with a batch W times larger: what synchronous data parallelism over W workers with
  the same per-worker batch and learning rate computes (up to float rounding); ``ddp:sqrt``, ``ddp:linear`` and
  ``ddp:X`` the same with the learning rate times sqrt(W), W or X (the square-root and linear scaling rules
  for a W times larger batch);
* a merge rule over W simulated workers: the epochs' shards (a random partition of the sequences, shards in a
  random order per epoch) are dealt out round robin, W tasks in flight; each task trains one pass over its
  shard from the server's version at its dispatch with its worker's own AdamW (kept between its tasks, as
  ``optimizer_state="worker"``), and its ``W_c`` is merged in dispatch order, so every update after the first
  W is W - 1 merges stale (the staleness of W equal workers).  The rules are vcdask's own
  (:mod:`vcdask.merge`, applied to :class:`~vcdask.params.FlatParams` as the server applies them), plus two
  references that vcdask does not ship: ``sum`` adds each task's own progress ``W_c - W_base`` to ``W_s``
  (asynchronous SGD over local runs) and ``dn:LR/MOMENTUM`` is delayed Nesterov as Liu et al. (2024) define
  it, on the pseudo-gradient ``W_base - W_c``: ``lr/W`` of each at once, one momentum step on the mean every
  W arrivals.  Two more references set the asynchrony apart: ``sync[:ETA]`` runs the W tasks of each round
  from the same version and moves ``W_s`` by ``ETA`` (default 1) times their mean progress (synchronous
  local SGD, FedAvg; DiLoCo's outer step without momentum), and ``seq`` runs one task at a time, round robin
  over the W workers' optimizers (no staleness: what the W optimizers alone cost).

Rules (``--rules``, a comma list): ``default`` (``vcdask.merge.DEFAULT_RULE`` as ``fit`` sets it for W tasks
in flight), ``nesterov:LR/MOMENTUM`` (delayed over W, the default's bias correction), ``staleness:ALPHA/A``
(weight ``(1 - ALPHA) / (staleness + 1) ** A``), ``vc-asgd:ALPHA``, ``sum``, ``dn:LR/MOMENTUM``, ``ddp``,
``sync[:ETA]``, ``seq``, and ``probe:STEPS/PULLS[/MOMENTA][#ROWS]``, :class:`vcdask.merge.Probe` with
those candidates (``_``-separated lists; e.g. ``probe:0.5_1_1.5_2_3/0_0.5_1``): ``W_s += (a * p + b * (W_base -
W_s)) / (staleness + 1)``, ``p = W_c - W_base``, ``(a, b)`` chosen by the training loss of the candidates on ROWS
(default: the rule's, 64) fixed training rows drawn at random.

Two options bring the simulation closer to a real run.  ``--ahead SHARE``: each task after a worker's first
trains the first ``SHARE`` of its steps from its worker's own last ``W_c`` and then corrects by ``W_s - W_c``
(``vcdask.worker.overlap="delta"``: the merged version came only then; a real run records this as
``steps_ahead``, at most half a task's steps).  ``--jitter J``: task lengths uniform in ``1 +- J`` (drawn from
a stream of their own, seeded), merged in the order they end, so staleness varies around ``W - 1`` as it does
on a real cluster; 0 (the default) merges in dispatch order.  ``--lookahead G`` (measured and dropped,
see the docs' benchmarks page): each task after the first W trains from ``W_s + G (W_s - W_s of W - 1
merges before)``, where ``W_s`` would be when its update comes back if it moved on as it did.
``--inner`` (a comma list, each a row of its own): what a worker's optimizer starts each task with:
``worker`` (the default) its state from its previous task, as ``optimizer_state="worker"``; ``fresh`` a
new optimizer, as ``optimizer_state="fresh"``; ``direction`` its previous state with the first moment
(Adam's ``exp_avg``, SGD's momentum buffer) zeroed, the second moment and step count kept (not a vcdask
option: measured, see the docs' benchmarks page).  ``--lr`` and ``--beta2`` set the inner optimizer's (and
torch's) learning rate and second-moment decay (the tasks' own: 5e-3 and 0.99 for the char-LM's AdamW, 1e-3
and 0.999 for digits' Adam).

Nothing here waits on a clock, so a row is the same on every run and machine (up to the float rounding of
the torch build); rounding alone moves this task's loss by 1-2% (see the docs' benchmarks page), so compare
rules over several seeds.  Prints each run as it ends, then the table of medians of loss / torch's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import char_lm  # noqa: E402

from vcdask.merge import DEFAULT_RULE, VCASGD, Arrival, Auto, Nesterov, Probe, Staleness, for_run  # noqa: E402
from vcdask.params import flatten  # noqa: E402

LR, BATCH = 5e-3, 32
CONFIG = char_lm.GPTConfig(d_model=96, n_layers=3, n_heads=4, context=64)


@dataclasses.dataclass
class Task:
    """One task of the simulation: its training rows, how to build, train and score its model."""

    name: str
    X: torch.Tensor
    Y: torch.Tensor
    make: Callable[[], torch.nn.Module]
    optimizer: Callable
    step: Callable
    epochs: int
    shards: int
    score: Callable[[torch.nn.Module], float]
    batch: int = BATCH

    def relative(self, value: float, torch_value: float) -> float:
        """The table's entry: loss / torch's (char-LM), accuracy points against torch's (digits)."""
        return value / torch_value if self.name == "charlm" else 100 * (value - torch_value)


def make_task(args, data, seed: int, workers: int) -> Task:
    betas = {} if args.beta2 is None else {"betas": (0.9, args.beta2)}
    if args.task == "charlm":
        (X, Y), (Xv, Yv) = data
        optimizer = functools.partial(char_lm.make_optimizer(args.lr or LR), **betas)
        return Task("charlm", torch.from_numpy(X), torch.from_numpy(Y), lambda: char_lm.CharGPT(CONFIG, seed=seed),
                    optimizer, char_lm.train_step, args.epochs, args.shards or 8,
                    lambda m: char_lm.validation_loss(m, Xv, Yv, device=torch.device("cpu")))  # fmt: skip
    from vcdask.data import SHARDS_PER_THREAD
    from vcdask.demo import accuracy_on, digits_cnn

    (X, y), (Xt, yt) = data
    n = len(X) - len(X) // 10  # fit holds out 10% of the rows for validation
    optimizer = functools.partial(torch.optim.Adam, lr=args.lr or 1e-3, **betas)
    return Task("digits", torch.from_numpy(X[:n]), torch.from_numpy(y[:n]), lambda: digits_cnn(seed),
                optimizer, lambda m, b: F.cross_entropy(m(b[0]), b[1]), 8,
                args.shards or max(2, SHARDS_PER_THREAD * workers), lambda m: accuracy_on(m, Xt, yt))  # fmt: skip


def load_task_data(args):
    if args.task == "charlm":
        return char_lm.load_data(args.train_kb * 1024, 32 * 1024, CONFIG.context)
    from vcdask.demo import digits

    return digits()


def vcdask_rule(text: str, workers: int):
    """A rule of :mod:`vcdask.merge` from its ``--rules`` spelling, as a run of ``workers`` tasks sets it."""
    name, _, arg = text.partition(":")
    if name == "default":  # (nothing here runs on a clock: "auto" is its fallback, as fit's where a probe costs)
        rule = for_run(DEFAULT_RULE, in_flight=workers)
        return rule.fallback if isinstance(rule, Auto) else rule
    if name == "nesterov":
        lr, momentum = map(float, arg.split("/"))
        return Nesterov(lr=lr, momentum=momentum, bias_correction="trust", delay=workers)
    if name == "staleness":
        alpha, a = map(float, arg.split("/"))
        return Staleness(alpha=alpha, a=a)
    if name == "vc-asgd":
        return VCASGD(alpha=float(arg))
    if name == "probe":  # (spelled as benchmarks/defaults.py spells it for --set)
        from defaults import _value

        return _value(text)
    return None


RULE_SPELLINGS = (
    "default, nesterov:LR/MOMENTUM, staleness:ALPHA/A, vc-asgd:ALPHA, sum, dn:LR/MOMENTUM, ddp[:sqrt|:linear|:X], "
    "sync[:ETA], seq, probe:STEPS/PULLS[/MOMENTA][#ROWS]"
)


def check_rule(text: str) -> None:
    """Raise ``ValueError`` (naming ``text`` and the spellings) unless ``text`` is a ``--rules`` item this runs."""
    name, _, arg = text.partition(":")
    try:
        if name == "ddp":
            ddp_lr_scale(text, 2)
            return
        if name in ("sum", "seq") and not arg:
            return
        if name == "sync":
            float(arg or 1)
            return
        if name == "dn":
            _lr, _mu = map(float, arg.split("/"))
            return
        if name in ("default", "nesterov", "staleness", "vc-asgd", "probe") and vcdask_rule(text, 2) is not None:
            return
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"bad rule {text!r} ({e}); the spellings: {RULE_SPELLINGS}") from None
    raise ValueError(f"unknown rule {text!r}; the spellings: {RULE_SPELLINGS}")


def ddp_lr_scale(text: str, workers: int) -> float:
    """``ddp``'s learning rate against the task's: ``ddp`` 1, ``ddp:sqrt`` sqrt(W), ``ddp:linear`` W, ``ddp:X`` X."""
    arg = text.partition(":")[2]
    if arg in ("", "sqrt", "linear"):
        return {"": 1.0, "sqrt": workers**0.5, "linear": float(workers)}[arg]
    return float(arg)


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def load(model: torch.nn.Module, v: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(v.clone(), model.parameters())


def train_rows(
    task: Task, model: torch.nn.Module, optimizer, rows: torch.Tensor, batch: int = BATCH, between=None
) -> None:
    """One pass over ``rows`` (in this order), ``batch`` rows a step; ``between(step)`` before each step."""
    model.train()
    for step, i in enumerate(range(0, len(rows), batch)):
        if between is not None:
            between(step)
        idx = rows[i : i + batch]
        optimizer.zero_grad(set_to_none=True)
        task.step(model, (task.X[idx], task.Y[idx])).backward()
        optimizer.step()


def torch_score(task: Task, seed: int, batch: int = BATCH, lr_scale: float = 1.0) -> float:
    """One process, one optimizer (``batch = W x 32``: DDP over W workers; ``lr_scale`` times the task's rate)."""
    g = torch.Generator().manual_seed(seed)
    model = task.make()
    optimizer = task.optimizer(model.parameters(), lr=lr_scale * task.optimizer.keywords["lr"])
    for _ in range(task.epochs):
        train_rows(task, model, optimizer, torch.randperm(len(task.X), generator=g), batch)
    return task.score(model)


@dataclasses.dataclass
class Outer:
    """The server: ``W_s`` and one rule (vcdask's, or a reference one)."""

    rule_text: str
    workers: int
    ws: torch.Tensor
    step: int = 0
    task: Task | None = None  # (the probe rules evaluate candidates on its rows)

    def __post_init__(self) -> None:
        self.rule = vcdask_rule(self.rule_text, self.workers)
        self.flat = flatten({"w": self.ws.clone()})
        self.state = self.rule.init_state(self.flat) if self.rule is not None else None
        self.momentum = torch.zeros_like(self.ws)
        self.pending = torch.zeros_like(self.ws)
        self.arrivals = 0
        self.forwards = 0  # probe forward passes (the rule's rows each)
        if isinstance(self.rule, Probe):
            assert self.task is not None, "the probe rule scores candidates on the task's rows"
            self.probe_model = self.task.make()
            idx = torch.randperm(len(self.task.X), generator=torch.Generator().manual_seed(12345))[: self.rule.rows]
            self.probe_rows = (self.task.X[idx], self.task.Y[idx])

    def probe_loss(self, params) -> float:
        """The training loss of ``params`` (flat) on the probe rows, as the server's probe computes it."""
        self.forwards += 1
        load(self.probe_model, params.arrays["float32"])
        self.probe_model.eval()
        with torch.no_grad():
            return float(self.task.step(self.probe_model, self.probe_rows))

    def merge(self, w_c: torch.Tensor, base: torch.Tensor, base_step: int, epoch: int) -> None:
        staleness = self.step - base_step
        self.step += 1
        if self.rule is not None:
            self.flat.arrays["float32"].copy_(self.ws)
            extra = {"base": flatten({"w": base}), "loss": self.probe_loss} if isinstance(self.rule, Probe) else {}
            self.rule.apply(self.flat, flatten({"w": w_c}), self.state, Arrival(epoch, staleness, 1, **extra))
            self.ws = self.flat.arrays["float32"].clone()
        elif self.rule_text in ("sum", "seq"):
            self.ws = self.ws + (w_c - base)
        elif self.rule_text.startswith("dn:"):
            lr, mu = map(float, self.rule_text[3:].split("/"))
            g = base - w_c
            self.pending += g
            self.arrivals += 1
            self.ws = self.ws - lr * g / self.workers
            if self.arrivals == self.workers:
                self.momentum = mu * self.momentum + self.pending / self.workers
                self.ws = self.ws - lr * mu * self.momentum
                self.pending.zero_()
                self.arrivals = 0
        else:
            raise ValueError(f"unknown rule {self.rule_text!r}")


def reset_direction(optimizer) -> None:
    """Forget where ``optimizer`` was heading and keep its sense of scale (``--inner direction``).

    Adam's first moment (``exp_avg``) and SGD's momentum buffer are zeroed; Adam's second moment and
    step count are kept, so the step size stays calibrated and the first moment builds up again from 0.
    """
    for state in optimizer.state.values():
        for name in ("exp_avg", "momentum_buffer"):
            if isinstance(state.get(name), torch.Tensor):
                state[name].zero_()


def fleet_score(
    task: Task,
    seed: int,
    workers: int,
    rule: str,
    ahead: float = 0.0,
    jitter: float = 0.0,
    lookahead: float = 0.0,
    inner: str = "worker",
) -> float:
    g = torch.Generator().manual_seed(seed)
    shards = torch.randperm(len(task.X), generator=g).chunk(task.shards)
    tasks = [(e, s) for e in range(1, task.epochs + 1) for s in torch.randperm(len(shards), generator=g).tolist()]
    server = Outer(rule.partition(":")[0] if rule.startswith("sync") else rule, workers, vector(task.make()), task=task)
    models = [task.make() for _ in range(workers)]
    optimizers = [task.optimizer(m.parameters()) for m in models]

    own: list[torch.Tensor | None] = [None] * workers  # each worker's last W_c (``ahead``: its next task's start)

    def run(w: int, shard: int, base: torch.Tensor) -> torch.Tensor:
        rows = shards[shard][torch.randperm(len(shards[shard]), generator=g)]
        steps = -(-len(rows) // task.batch)
        first = own[w]
        k = min(int(ahead * steps), steps - 1) if first is not None else 0  # (corrected before its last step)

        def correct(step: int) -> None:  # the delta rule: model = base + (model - W_c) after ``k`` steps
            if k and step == k and first is not None:
                load(models[w], base + (vector(models[w]) - first))

        load(models[w], first if k and first is not None else base)
        if inner == "fresh":
            optimizers[w] = task.optimizer(models[w].parameters())
        elif inner == "direction" and first is not None:
            reset_direction(optimizers[w])
        train_rows(task, models[w], optimizers[w], rows, between=correct)
        w_c = own[w] = vector(models[w])
        return w_c

    if rule.startswith("sync"):  # rounds of W tasks from one version, FedAvg with an outer step
        eta = float(rule.partition(":")[2] or 1)
        for r in range(0, len(tasks), workers):
            mean = torch.stack([run(w, s, server.ws) for w, (_, s) in enumerate(tasks[r : r + workers])]).mean(0)
            server.ws = server.ws + eta * (mean - server.ws)
    else:  # one at a time in the order they end; ``seq`` keeps one task in flight, round robin over the workers
        in_flight = 1 if rule == "seq" else workers
        clock = torch.Generator().manual_seed(seed + 7919)  # (task lengths: their own stream, as the data's)

        def ends(start: float) -> float:  # a task's length: 1, or uniform in 1 +- jitter
            return start + 1.0 + jitter * (2 * float(torch.rand(1, generator=clock)) - 1)

        queue = [(ends(0.0), w, w, tasks[w], server.ws.clone(), 0) for w in range(min(in_flight, len(tasks)))]
        issued = len(queue)
        history = [server.ws.clone()]  # W_s after each merge, the last ``in_flight`` of them

        def base_now() -> torch.Tensor:  # ``lookahead``: W_s moved on as over the last W - 1 merges, times G
            if not lookahead or len(history) < in_flight:
                return server.ws.clone()
            return server.ws + lookahead * (server.ws - history[-in_flight])

        while queue:
            queue.sort(key=lambda q: q[:2])  # (the first to end; ties in dispatch order)
            end, _, w, (epoch, shard), base, base_step = queue.pop(0)
            server.merge(run(w, shard, base), base, base_step, epoch)
            history = [*history[-(in_flight - 1) :], server.ws.clone()] if in_flight > 1 else [server.ws.clone()]
            if issued < len(tasks):
                nxt = (w + 1) % workers if rule == "seq" else w
                queue.append((ends(end), issued, nxt, tasks[issued], base_now(), server.step))
                issued += 1
    final = task.make()
    load(final, server.ws)
    if server.forwards:
        print(
            f"    [{rule} W={workers}] {server.forwards / server.step:.1f} probe forward passes per merge", flush=True
        )
    return task.score(final)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("charlm", "digits"), default="charlm")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--rules", default="ddp,default,staleness:0/1")
    ap.add_argument("--seeds", default="0,2")
    ap.add_argument("--train-kb", type=int, default=256)
    shards_help = "shards (default: 8 for the char-LM, fit's default for digits: 2 per worker, at least 2)"
    ap.add_argument("--shards", type=int, default=None, help=shards_help)
    ap.add_argument("--epochs", type=int, default=2)
    ahead_help = "the share of each task's steps taken from its worker's own W_c before the delta correction"
    ap.add_argument("--ahead", type=float, default=0.0, help=ahead_help)
    jitter_help = "task lengths uniform in 1 +- JITTER (0: all equal, merged in dispatch order, W - 1 stale)"
    ap.add_argument("--jitter", type=float, default=0.0, help=jitter_help)
    lookahead_help = "each task's base W_s + G (W_s - W_s of W - 1 merges before): where W_s will be at its merge"
    ap.add_argument("--lookahead", type=float, default=0.0, metavar="G", help=lookahead_help)
    lr_help = "the inner (and torch's) learning rate (default: the task's, 5e-3 char-LM, 1e-3 digits)"
    ap.add_argument("--lr", type=float, default=None, help=lr_help)
    beta2_help = "Adam's second-moment decay, inner and torch's (default: the task's, 0.99 char-LM, 0.999 digits)"
    ap.add_argument("--beta2", type=float, default=None, help=beta2_help)
    inner_help = "a comma list of the workers' inner optimizer state: worker (kept), fresh, direction (%(default)s)"
    ap.add_argument("--inner", default="worker", help=inner_help)
    args = ap.parse_args(argv)
    for name in ("ahead", "jitter"):
        if not 0.0 <= getattr(args, name) < 1.0:
            ap.error(f"--{name} must be in [0, 1), got {getattr(args, name)}")
    if unknown := set(args.inner.split(",")) - {"worker", "fresh", "direction"}:
        ap.error(f"--inner must be a comma list of worker, fresh, direction; got {sorted(unknown)}")
    if args.beta2 is not None and not 0.0 <= args.beta2 < 1.0:
        ap.error(f"--beta2 must be in [0, 1), got {args.beta2}")
    if args.lookahead < 0:
        ap.error(f"--lookahead must be 0 or more, got {args.lookahead}")
    for rule in args.rules.split(","):
        try:
            check_rule(rule)
        except ValueError as e:
            ap.error(f"--rules: {e}")
    for name in ("workers", "seeds"):
        try:
            values = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            ap.error(f"--{name} takes a comma list of integers, got {getattr(args, name)!r}")
        if min(values) < (1 if name == "workers" else 0):
            ap.error(f"--{name}: got {getattr(args, name)!r}; each must be >= {1 if name == 'workers' else 0}")
    torch.set_num_threads(1)
    data = load_task_data(args)
    ratios: dict[tuple[int, str, str], list[float]] = {}
    unit = "loss / torch's" if args.task == "charlm" else "accuracy points against torch's"
    for seed in map(int, args.seeds.split(",")):
        base = torch_score(make_task(args, data, seed, 1), seed)
        print(f"seed {seed}: torch {base:.4f}", flush=True)
        for workers in map(int, args.workers.split(",")):
            task = make_task(args, data, seed, workers)
            for rule in args.rules.split(","):
                is_ddp = rule.partition(":")[0] == "ddp"
                for inner in ["-"] if is_ddp else args.inner.split(","):
                    if is_ddp and workers == 1:
                        continue
                    if is_ddp:
                        value = torch_score(task, seed, BATCH * workers, ddp_lr_scale(rule, workers))
                    else:
                        value = fleet_score(task, seed, workers, rule, args.ahead, args.jitter, args.lookahead, inner)
                    ratios.setdefault((workers, rule, inner), []).append(task.relative(value, base))
                    print(f"seed {seed} W={workers} {rule} {inner}: {value:.4f} ({task.relative(value, base):.3f})",
                          flush=True)  # fmt: skip
    print(f"\n{args.task}: {unit} at equal tokens, median over seeds {args.seeds}\n")
    print("| W | rule | inner state | median | by seed |\n|---|---|---|---|---|")
    for (workers, rule, inner), values in ratios.items():
        by_seed = " ".join(f"{v:.3f}" for v in values)
        print(f"| {workers} | {rule} | {inner} | {statistics.median(values):.3f} | {by_seed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
