"""Merge rules on a simulated fleet, in one process: loss at equal tokens, deterministic, no cluster.

usage: python benchmarks/fleet_sim.py [--workers 1,2,4,8] [--rules default,staleness:0/1,...] [--seeds 0,2]
                                      [--train-kb 256] [--shards 8] [--epochs 2]

The small CPU char-LM of issue 38 (``examples/char_lm.py``'s CharGPT, d_model 96, 3 layers, 4 heads, context
64, AdamW 5e-3, batch 32) trained three ways from the same initial weights, for the same passes over the
same sequences:

* ``torch``: ``char_lm.train_baseline`` (one process, one optimizer);
* ``ddp``: the same loop with a batch W times larger: what synchronous data parallelism over W workers with
  the same per-worker batch and learning rate computes (up to float rounding);
* a merge rule over W simulated workers: the epochs' shards (a random partition of the sequences, shards in a
  random order per epoch) are dealt out round robin, W tasks in flight; each task trains one pass over its
  shard from the server's version at its dispatch with its worker's own AdamW (kept between its tasks, as
  ``optimizer_state="worker"``), and its ``W_c`` is merged in dispatch order, so every update after the first
  W is W - 1 merges stale (the staleness of W equal workers).  The rules are vcdask's own
  (:mod:`vcdask.merge`, applied to :class:`~vcdask.params.FlatParams` as the server applies them), plus two
  references that vcdask does not ship: ``sum`` adds each task's own progress ``W_c - W_base`` to ``W_s``
  (asynchronous SGD over local runs) and ``dn:LR/MOMENTUM`` is delayed Nesterov as Liu et al. (2024) define
  it, on the pseudo-gradient ``W_base - W_c``: ``lr/W`` of each at once, one momentum step on the mean every
  W arrivals.

Rules (``--rules``, a comma list): ``default`` (``vcdask.merge.DEFAULT_RULE`` as ``fit`` sets it for W tasks
in flight), ``nesterov:LR/MOMENTUM`` (delayed over W, the default's bias correction), ``staleness:ALPHA/A``
(weight ``(1 - ALPHA) / (staleness + 1) ** A``), ``vc-asgd:ALPHA``, ``sum``, ``dn:LR/MOMENTUM``, ``ddp``.

Nothing here waits on a clock, so a row is the same on every run and machine (up to the float rounding of
the torch build); rounding alone moves this task's loss by 1-2% (see the docs' benchmarks page), so compare
rules over several seeds.  Prints each run as it ends, then the table of medians of loss / torch's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import char_lm  # noqa: E402

from vcdask.merge import DEFAULT_RULE, VCASGD, Arrival, Nesterov, Staleness, for_run  # noqa: E402
from vcdask.params import flatten  # noqa: E402

LR, BATCH = 5e-3, 32
CONFIG = char_lm.GPTConfig(d_model=96, n_layers=3, n_heads=4, context=64)


def vcdask_rule(text: str, workers: int):
    """A rule of :mod:`vcdask.merge` from its ``--rules`` spelling, as a run of ``workers`` tasks sets it."""
    name, _, arg = text.partition(":")
    if name == "default":
        return for_run(DEFAULT_RULE, in_flight=workers)
    if name == "nesterov":
        lr, momentum = map(float, arg.split("/"))
        return Nesterov(lr=lr, momentum=momentum, bias_correction="trust", delay=workers)
    if name == "staleness":
        alpha, a = map(float, arg.split("/"))
        return Staleness(alpha=alpha, a=a)
    if name == "vc-asgd":
        return VCASGD(alpha=float(arg))
    return None


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def load(model: torch.nn.Module, v: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(v.clone(), model.parameters())


def torch_loss(args, data, seed: int, batch: int = BATCH) -> float:
    (X, Y), (Xv, Yv) = data
    model = char_lm.CharGPT(CONFIG, seed=seed)
    common = {"local_epochs": 1, "batch_size": batch, "lr": LR, "device": torch.device("cpu"), "seed": seed}
    char_lm.train_baseline(model, X, Y, epochs=args.epochs, **common)
    return char_lm.validation_loss(model, Xv, Yv, device=torch.device("cpu"))


@dataclasses.dataclass
class Outer:
    """The server: ``W_s`` and one rule (vcdask's, or a reference one)."""

    rule_text: str
    workers: int
    ws: torch.Tensor
    step: int = 0

    def __post_init__(self) -> None:
        self.rule = vcdask_rule(self.rule_text, self.workers)
        self.flat = flatten({"w": self.ws.clone()})
        self.state = self.rule.init_state(self.flat) if self.rule is not None else None
        self.momentum = torch.zeros_like(self.ws)
        self.pending = torch.zeros_like(self.ws)
        self.arrivals = 0

    def merge(self, w_c: torch.Tensor, base: torch.Tensor, base_step: int, epoch: int) -> None:
        staleness = self.step - base_step
        self.step += 1
        if self.rule is not None:
            self.flat.arrays["float32"].copy_(self.ws)
            self.rule.apply(self.flat, flatten({"w": w_c}), self.state, Arrival(epoch, staleness, 1))
            self.ws = self.flat.arrays["float32"].clone()
        elif self.rule_text == "sum":
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


def fleet_loss(args, data, seed: int, workers: int, rule: str) -> float:
    (X, Y), (Xv, Yv) = data
    g = torch.Generator().manual_seed(seed)
    Xt, Yt = torch.from_numpy(X), torch.from_numpy(Y)
    shards = torch.randperm(len(Xt), generator=g).chunk(args.shards)
    tasks = [(e, s) for e in range(1, args.epochs + 1) for s in torch.randperm(len(shards), generator=g).tolist()]
    server = Outer(rule, workers, vector(char_lm.CharGPT(CONFIG, seed=seed)))
    models = [char_lm.CharGPT(CONFIG, seed=seed) for _ in range(workers)]
    optimizers = [char_lm.make_optimizer(LR)(m.parameters()) for m in models]
    queue = [(w, tasks[w], server.ws.clone(), 0) for w in range(min(workers, len(tasks)))]
    issued = len(queue)
    while queue:
        w, (epoch, shard), base, base_step = queue.pop(0)
        model, optimizer = models[w], optimizers[w]
        load(model, base)
        model.train()
        rows = shards[shard][torch.randperm(len(shards[shard]), generator=g)]
        for i in range(0, len(rows), BATCH):
            idx = rows[i : i + BATCH]
            optimizer.zero_grad(set_to_none=True)
            char_lm.train_step(model, (Xt[idx], Yt[idx])).backward()
            optimizer.step()
        server.merge(vector(model), base, base_step, epoch)
        if issued < len(tasks):
            queue.append((w, tasks[issued], server.ws.clone(), server.step))
            issued += 1
    final = char_lm.CharGPT(CONFIG, seed=seed)
    load(final, server.ws)
    return char_lm.validation_loss(final, Xv, Yv, device=torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--rules", default="ddp,default,staleness:0/1")
    ap.add_argument("--seeds", default="0,2")
    ap.add_argument("--train-kb", type=int, default=256)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = char_lm.load_data(args.train_kb * 1024, 32 * 1024, CONFIG.context)
    ratios: dict[tuple[int, str], list[float]] = {}
    for seed in map(int, args.seeds.split(",")):
        base = torch_loss(args, data, seed)
        print(f"seed {seed}: torch {base:.4f}", flush=True)
        for workers in map(int, args.workers.split(",")):
            for rule in args.rules.split(","):
                if rule == "ddp" and workers == 1:
                    continue
                if rule == "ddp":
                    loss = torch_loss(args, data, seed, batch=BATCH * workers)
                else:
                    loss = fleet_loss(args, data, seed, workers, rule)
                ratios.setdefault((workers, rule), []).append(loss / base)
                print(f"seed {seed} W={workers} {rule}: {loss:.4f} ({loss / base:.3f}x torch)", flush=True)
    print(f"\nloss / torch's at equal tokens, median over seeds {args.seeds}\n")
    print("| W | rule | median | by seed |\n|---|---|---|---|")
    for (workers, rule), values in ratios.items():
        print(f"| {workers} | {rule} | {statistics.median(values):.3f} | {' '.join(f'{v:.3f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
