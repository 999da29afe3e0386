"""Mixed-speed workers: time to a target accuracy, vcdask vs torch DDP (gloo) vs single-process torch.

usage: python benchmarks/heterogeneous.py [--task digits|wide] [--slow 1,2,5] [--passes 12] [--target 0.95]
                                          [--local-epochs 1] [--shards N]
                                          [--seeds 0,1,2] [--kill-every 0] [--peers torch,ddp]
                                          [--vcdask default,adaptive,worker-state,fresh-state,no-correction,vc-asgd,
                                                    probe,agreement,adam-correction,trust,no-hand-over,
                                                    no-next-base,no-inline-base,
                                                    no-base-before-commit,commit-every-2]

Two worker processes of one thread each; worker 1 is made ``--slow`` times slower by a **per-batch
delay**: before each training batch it sleeps ``(slow - 1) * c``, where ``c`` is the median time of one
batch (forward, backward, Adam step, batch 32, one thread) measured on this machine at start-up.  The
same delay, on the same rank, slows DDP, so both see the same hardware.  A sleeping worker gives its
core back, as a slower machine would.  The trainers (``--peers`` picks the baselines: a comma list of
``torch`` and ``ddp``, an empty string for none):

* ``torch``:  one process, one thread, all the data (the pace of one fast worker; no slow one).
* ``ddp``:    ``DistributedDataParallel``, gloo, 2 processes; each pass split between the ranks, batch 32
  per rank; every step waits for the slow rank.  With ``--kill-every``: rank 1 is killed that often and,
  as ``torchrun --max-restarts`` does, both ranks restart from the last per-pass checkpoint.
* ``vcdask``: ``vcdask.fit`` on an embedded LocalCluster with 2 worker processes, its defaults except the
  pass budget (``max_epochs = passes / local_epochs``: ``--local-epochs`` passes over its shard per task,
  in ``--shards`` shards, fit's default without it), one row per ``--vcdask`` variant.  With ``--kill-every``: the
  busy slow worker's process is SIGKILLed that often; its nanny starts it again.

Everyone makes the same number of passes over the training data.  Accuracy is measured afterwards on
the same held-out test set, for snapshots taken about ten times per pass (torch, DDP) and for every
version (vcdask), so evaluation costs no run any time.  Time to target counts from the call that starts
training (vcdask: ``fit`` with its staging and first commit, to the moment each version was committed;
DDP: after the process group is up).  (Until stop 22 a vcdask version counted from its update's arrival
plus the run's overhead outside its history, the time after the last merge included; measured on digits
that was 7-10 ms later than the commit, the median over a run.)
Prints medians over seeds, the ratio vcdask / DDP, the passes over the data each trainer took to the
target (vcdask: shards merged over shards per epoch; DDP: both ranks' batches) and the work each vcdask
worker did; then each vcdask variant against the same seed's DDP and torch (the medians of per-seed
ratios and differences).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _args import choices_list, number_list  # noqa: E402
from _scratch import scratch_store  # noqa: E402
from strategies import MODELS  # noqa: E402

import vcdask  # noqa: E402
from vcdask.demo import accuracy_on, digits  # noqa: E402
from vcdask.merge import Nesterov  # noqa: E402

SNAPSHOTS_PER_PASS = 10


class SlowStep:
    """The default step, slowed by ``delay`` seconds per batch on the Dask workers named in ``slow``."""

    def __init__(self, slow: set, delay: float):
        self.slow, self.delay = slow, delay

    def __call__(self, model, batch):
        x, y = batch
        if self.delay > 0:
            try:
                from distributed import get_worker

                name = get_worker().name
            except ValueError:  # the probe on the client
                name = None
            if name in self.slow:
                time.sleep(self.delay)
        return torch.nn.functional.cross_entropy(model(x), y)


def batch_seconds(task: str, X: np.ndarray, y: np.ndarray) -> float:
    """Median seconds of one training batch (batch 32, Adam, one thread) of ``task``'s model here."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = MODELS[task](0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        xb, yb = torch.from_numpy(X[:32]), torch.from_numpy(y[:32])
        times = []
        for _ in range(25):
            t = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[5:])
    finally:
        torch.set_num_threads(previous)


def first_reaching(points: list[tuple[float, dict, float]], task: str, seed: int, Xt, yt, target: float):
    """(time to target or nan, passes over the data to target or nan, final accuracy) of
    ``(seconds, state_dict, passes)`` snapshots, evaluated here."""
    model = MODELS[task](seed)
    reached = at_pass = acc = float("nan")
    for seconds, state, passes in points:
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        acc = accuracy_on(model, Xt, yt)
        if acc >= target and reached != reached:
            reached, at_pass = seconds, passes
    return reached, at_pass, acc


# -- single-process torch ---------------------------------------------------------------------------


def torch_single(task, seed, X, y, passes):
    torch.set_num_threads(1)
    model, g = MODELS[task](seed), torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    steps = -(-len(X) // 32)
    every = max(1, steps // SNAPSHOTS_PER_PASS)
    points, n = [], 0
    t0 = time.perf_counter()
    for _ in range(passes):
        model.train()
        order = torch.randperm(len(Xb), generator=g)
        for i in range(0, len(Xb), 32):
            idx = order[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(Xb[idx]), yb[idx]).backward()
            opt.step()
            n += 1
            if n % every == 0:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                points.append((time.perf_counter() - t0, state, n / steps))
    points.append((time.perf_counter() - t0, {k: v.clone() for k, v in model.state_dict().items()}, passes))
    return points, {"total": time.perf_counter() - t0}


# -- torch DDP --------------------------------------------------------------------------------------


def _ddp_rank(rank, port, task, seed, X, y, passes, delay, start_pass, ckpt, out, origin):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = MODELS[task](seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if start_pass:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    model = torch.nn.parallel.DistributedDataParallel(model)
    Xb, yb = torch.from_numpy(X), torch.from_numpy(y)
    every = max(1, -(-len(X) // 64) // SNAPSHOTS_PER_PASS)
    dist.barrier()
    t0 = origin if origin is not None else time.perf_counter()  # (perf_counter is system-wide on Linux)
    out.put(("up", rank, t0))
    n = 0
    for p in range(start_pass, passes):
        order = torch.randperm(len(Xb), generator=torch.Generator().manual_seed(seed * 1000 + p))[rank::2]
        model.train()
        for i in range(0, len(order), 32):
            done = p + min(1.0, (i + 32) / len(order))  # passes over the data once this step is taken (both ranks)
            if rank == 1 and delay:
                time.sleep(delay)
            idx = order[i : i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(Xb[idx]), yb[idx]).backward()
            opt.step()
            n += 1
            if rank == 0 and n % every == 0:
                state = {k: v.numpy().copy() for k, v in model.module.state_dict().items()}  # (not via shared memory)
                out.put(("point", time.perf_counter() - t0, state, done))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            out.put(("pass", p + 1, time.perf_counter() - t0))
    if rank == 0:
        state = {k: v.numpy().copy() for k, v in model.module.state_dict().items()}  # (not via shared memory)
        out.put(("done", time.perf_counter() - t0, state, passes))
    dist.destroy_process_group()


def torch_ddp(task, seed, X, y, passes, delay, kill_every):
    """Snapshots of a DDP run; with ``kill_every``, rank 1 is killed that often and the job restarts."""
    import queue

    import torch.multiprocessing as mp

    from vcdask.testing.s3 import free_port

    ctx = mp.get_context("spawn")
    points: list = []
    done_passes, restarts, origin = 0, 0, None
    with tempfile.TemporaryDirectory(prefix="vcdask-bench-ddp-") as tmp:
        ckpt = os.path.join(tmp, "ckpt.pt")
        while True:
            out, port = ctx.Queue(), free_port()
            procs = [
                ctx.Process(
                    target=_ddp_rank, args=(r, port, task, seed, X, y, passes, delay, done_passes, ckpt, out, origin)
                )
                for r in range(2)
            ]
            for p in procs:
                p.start()
            kill_at = time.perf_counter() + kill_every if kill_every else float("inf")
            finished = killed = False
            while not finished and not killed:
                try:
                    msg = out.get(timeout=0.05)
                except queue.Empty:
                    msg = None
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"a DDP rank failed: {[p.exitcode for p in procs]}") from None
                if msg and msg[0] == "up":
                    origin = msg[2] if origin is None else origin
                    if kill_every:
                        kill_at = time.perf_counter() + kill_every
                elif msg and msg[0] == "point":
                    points.append(msg[1:])
                elif msg and msg[0] == "pass":
                    done_passes = msg[1]
                elif msg and msg[0] == "done":
                    points.append(msg[1:])
                    finished = True
                if not finished and time.perf_counter() >= kill_at:
                    os.kill(procs[1].pid, signal.SIGKILL)  # the agent sees a rank die and stops the others
                    procs[0].kill()
                    killed = True
                    restarts += 1
            for p in procs:
                p.join(30)
            if finished:
                break
    # (a restarted job re-does the passes after its checkpoint; their earlier snapshots still count as reached)
    return points, {"total": time.perf_counter() - origin, "restarts": restarts}


# -- vcdask -----------------------------------------------------------------------------------------


class Killer(threading.Thread):
    """SIGKILL worker 1's process every ``period`` seconds while it runs a task (its nanny restarts it)."""

    def __init__(self, client, period: float):
        super().__init__(daemon=True)
        self.client, self.period, self.stopped, self.kills = client, period, threading.Event(), 0

    def run(self):
        while not self.stopped.wait(self.period):
            info = self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"]
            victim = next((a for a, w in info.items() if str(w.get("name")) == "1"), None)
            if victim is None:
                continue
            try:
                pid = self.client.run(os.getpid, workers=[victim])[victim]
                os.kill(pid, signal.SIGKILL)
                self.kills += 1
            except Exception:  # noqa: BLE001 - the worker was already gone
                pass

    def stop(self):
        self.stopped.set()
        self.join()


#: ``--vcdask`` variants: fit's defaults, and the options each other one sets
VARIANTS = {
    "default": {},
    "adaptive": {"speed_adaptive": True},
    "worker-state": {"optimizer_state": "worker"},
    "fresh-state": {"optimizer_state": "fresh"},
    # the default rule without its momentum bias correction (stop 28: the correction's first step overshoots)
    "no-correction": {"merge": Nesterov(lr=0.5, momentum=0.9, bias_correction=False)},
    "vc-asgd": {"merge": "vc-asgd"},
    # stop 48: each merge's step, pull-back and momentum chosen by a probe of the training loss
    "probe": {"merge": "probe"},
    # stop 29: the correction bounded to half the parameters' norm per momentum step, and scaled by how
    # far each window's pseudo-gradient agrees with the momentum
    "agreement": {"merge": Nesterov(lr=0.5, momentum=0.9, bias_correction="agreement")},
    "adam-correction": {"merge": Nesterov(lr=0.5, momentum=0.9, bias_correction=True)},
    # stop 30: Adam's correction until a momentum step would pass the bound; "agreement" from then on
    "trust": {"merge": Nesterov(lr=0.5, momentum=0.9, bias_correction="trust")},
    # stop 31: the defaults, with the run reading every result through Dask (before tasks handed them over)
    "no-hand-over": {},
    # stop 40: the defaults, with each task asking for its base as it starts (before, the hand-over's
    # answer brought the base of the worker's next task)
    "no-next-base": {},
    # stop 41: the defaults, with workers reading every base from the store (before, a small model's
    # base came with the run's answer that gave it)
    "no-inline-base": {},
    # stop 41: the defaults, with bases given once committed (before, a small model's base went out as
    # soon as it was merged, while the merge thread committed it)
    "no-base-before-commit": {},
    # stop 59: a version every second merge, half the commits (the server's share of the machine's two cores)
    "commit-every-2": {"commit_every": 2},
}
#: Dask config set on the workers for a variant's run (and set back after)
WORKER_CONFIG = {
    "no-hand-over": {"vcdask.worker.hand-over": False},
    "no-next-base": {"vcdask.worker.next-base": False},
}
#: Dask config set on the scheduler for a variant's run (and set back after)
SCHEDULER_CONFIG = {
    "no-inline-base": {"vcdask.worker.inline-base-bytes": 0},
    "no-base-before-commit": {"vcdask.worker.base-before-commit": False},
}


def _set_config(values: dict) -> dict:
    """Set ``values`` in this process's Dask config; return what they were."""
    import dask.config

    before = {k: dask.config.get(k) for k in values}
    dask.config.set(values)
    return before


def vcdask_run(variant, task, seed, X, y, passes, delay, kill_every, client, local_epochs=1, shards=None):
    kwargs = dict(VARIANTS[variant])
    if local_epochs > 1:
        kwargs["local_epochs"] = local_epochs
    if shards is not None:
        kwargs["n_shards"] = shards
    with scratch_store(None, "hetero") as store:
        killer = Killer(client, kill_every) if kill_every else None
        config = WORKER_CONFIG.get(variant, {})
        if config:
            client.run(_set_config, config)
        on_scheduler = SCHEDULER_CONFIG.get(variant, {})
        if on_scheduler:  # (the scheduler may run in this process: keep what it had)
            on_scheduler_before = client.run_on_scheduler(_set_config, on_scheduler)
        t0, wall0 = time.perf_counter(), time.time()
        if killer:
            killer.start()
        try:
            r = vcdask.fit(
                MODELS[task](seed),
                (X, y),
                max_epochs=max(1, passes // local_epochs),
                seed=seed,
                train_step=SlowStep({1}, delay),
                client=client,
                store=store,
                retention=False,
                progress=False,
                **kwargs,
            )
            total = time.perf_counter() - t0
        finally:
            if killer:
                killer.stop()
            import dask.config

            if config:
                client.run(_set_config, {k: dask.config.get(k) for k in config})
            if on_scheduler:
                client.run_on_scheduler(_set_config, on_scheduler_before)
        h = r.history
        merged = h[h.accepted].sort_values("time")
        # each version counts from the moment it was committed (same machine, same clock as wall0)
        committed = {v.id: v.written_at.timestamp() - wall0 for v in vcdask.open_store(store).versions(r.run_id)}
        n_shards = merged.shard.nunique()  # passes: shards merged, over shards per epoch
        points = []
        for i, row in enumerate(merged.itertuples()):
            if not isinstance(row.version_id, str):  # committed with the merges after it (commit_every > 1)
                continue
            model = vcdask.load(store, MODELS[task](seed), version=row.version_id, branch=r.run_id)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            points.append((committed[row.version_id], state, (i + 1) * local_epochs / n_shards))
    work = h[h.accepted].groupby("worker").size()
    # worker 0 is never slowed nor killed; worker 1 may come back at a new address after a kill
    fast = next(
        (
            a
            for a, w in client.sync(client.scheduler.identity, n_workers=-1)["workers"].items()
            if str(w.get("name")) == "0"
        ),
        None,
    )
    share = 1.0 - float(work.get(fast, 0)) / max(1, int(work.sum()))
    return points, {
        "total": total,
        "slow share": share,
        "merged": int(len(merged)),
        "lost": int((~h.accepted).sum()),
        "kills": killer.kills if killer else 0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(MODELS), default="digits")
    ap.add_argument("--slow", default="1,2,5", help="slowdowns of worker 1 (1: equal workers)")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--local-epochs", type=int, default=1, help="vcdask: passes over its shard per task")
    ap.add_argument("--shards", type=int, default=None, help="vcdask: n_shards (default: fit's)")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--kill-every", type=float, default=0.0, help="seconds between kills of worker 1 (0: none)")
    ap.add_argument("--vcdask", default="default", help=f"variants: {', '.join(VARIANTS)}")
    ap.add_argument(
        "--peers", default="torch,ddp", help="baselines: a comma list of torch, ddp, or '' for none (%(default)s)"
    )
    args = ap.parse_args(argv)
    unknown = set(args.vcdask.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown --vcdask variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    peers = choices_list(ap, "--peers", args.peers, ("torch", "ddp"), allow_empty=True)
    seeds = number_list(ap, "--seeds", args.seeds, int, minimum=0)
    slows = number_list(ap, "--slow", args.slow, float, minimum=1)
    if args.passes < 1 or args.local_epochs < 1 or (args.shards is not None and args.shards < 1):
        got = f"{args.passes}, {args.local_epochs} and {args.shards}"
        ap.error(f"--passes, --local-epochs and --shards must be >= 1, got {got}")
    if args.kill_every < 0 or not 0 < args.target <= 1:
        ap.error(f"--kill-every must be >= 0 and --target in (0, 1], got {args.kill_every} and {args.target}")
    (X, y), (Xt, yt) = digits()
    c = batch_seconds(args.task, X, y)
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    rows, paired = [], []
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        # warm-up: worker processes import torch and vcdask once, outside the measurements
        vcdask_run("default", args.task, 0, X[:320], y[:320], 1, 0.0, 0.0, client)
        torch_runs = {}
        for slow in slows:
            delay = (slow - 1) * c
            runs: dict[str, list] = {}
            for seed in seeds:
                trainers = []
                if "torch" in peers:
                    if seed not in torch_runs:
                        torch_runs[seed] = torch_single(args.task, seed, X, y, args.passes)
                    trainers.append(("torch, 1 process", lambda s=seed: torch_runs[s]))
                if "ddp" in peers:
                    trainers.append(
                        (
                            "torch DDP, 2 ranks",
                            lambda s=seed, d=delay: torch_ddp(args.task, s, X, y, args.passes, d, args.kill_every),
                        )
                    )
                for v in args.vcdask.split(","):
                    trainers.append(
                        (
                            f"vcdask {v}",
                            lambda s=seed, v=v, d=delay: vcdask_run(
                                v,
                                args.task,
                                s,
                                X,
                                y,
                                args.passes,
                                d,
                                args.kill_every,
                                client,
                                args.local_epochs,
                                args.shards,
                            ),
                        )
                    )
                for name, make in trainers:
                    points, info = make()
                    reached, at_pass, acc = first_reaching(points, args.task, seed, Xt, yt, args.target)
                    runs.setdefault(name, []).append({"reached": reached, "passes": at_pass, "final": acc, **info})
                    print(
                        f"slow {slow} seed {seed} {name}: reached {reached:.2f} (pass {at_pass:.2f}) "
                        f"final {acc:.4f} {info}",
                        flush=True,
                    )
            ddp = statistics.median(r["reached"] for r in runs.get("torch DDP, 2 ranks", [{"reached": float("nan")}]))
            ref = statistics.median(r["final"] for r in runs.get("torch, 1 process", [{"final": float("nan")}]))
            for name, rs in runs.items():
                med = _median_reached([r["reached"] for r in rs])
                final = statistics.median(r["final"] for r in rs)
                rows.append(
                    {
                        "slow worker": f"{slow:g}x",
                        "trainer": name,
                        f"time to {args.target} (s)": med,
                        "vs DDP": med / ddp,
                        f"passes to {args.target}": _median_reached([r["passes"] for r in rs]),
                        "final acc": final,
                        "points vs torch": 100 * (final - ref),
                        "total (s)": statistics.median(r["total"] for r in rs),
                        "slow worker's share": statistics.median(r.get("slow share", float("nan")) for r in rs),
                    }
                )
            paired += seed_by_seed(f"{slow:g}x", runs)
    from devices import markdown

    print(
        f"\ntask {args.task}, {args.passes} passes, seeds {seeds}, one batch {1000 * c:.1f} ms (1 thread), "
        f"kill every {args.kill_every or '-'} s, {os.cpu_count()} cores"
    )
    print(markdown(rows))
    if paired:
        print("\nseed by seed (each vcdask run against the same seed's DDP and torch; medians over the seeds)")
        print(markdown(paired))
    return 0


def _median_reached(values: list[float]) -> float:
    """The median over seeds of a time (or passes) to target; nan (never) where most seeds never got there."""
    finite = [v for v in values if v == v]
    return statistics.median(finite) if len(finite) > len(values) // 2 else float("nan")


def seed_by_seed(slow: str, runs: dict[str, list]) -> list[dict]:
    """Each vcdask variant against the same seed's peers: one test image moves a median of finals by a
    step, and the peers' own seeds spread as much as the variants do (stop 36: torch alone ended between
    0.958 and 0.981 over seeds 0-9)."""
    inf = float("inf")
    ddp, torch_ = runs.get("torch DDP, 2 ranks"), runs.get("torch, 1 process")
    out = []
    for name, rs in runs.items():
        if not name.startswith("vcdask") or not (ddp or torch_):
            continue
        row: dict = {"slow worker": slow, "trainer": name}
        if ddp:  # a run that never reaches the target took forever; a seed neither reached says nothing
            pairs = [(r["reached"], d["reached"]) for r, d in zip(rs, ddp, strict=True)]
            pairs = [(a if a == a else inf, b if b == b else inf) for a, b in pairs]
            ratios = [a / b for a, b in pairs if a < inf or b < inf]
            row["time / DDP's"] = statistics.median(ratios) if ratios else float("nan")
            row["seeds at or under DDP's time"] = f"{sum(x <= 1 for x in ratios)} of {len(ratios)}"
        if torch_:
            row["points vs torch"] = statistics.median(
                100 * (r["final"] - t["final"]) for r, t in zip(rs, torch_, strict=True)
            )
        out.append(row)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
