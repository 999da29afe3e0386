"""Helpers for the chaos suite: real faults in real processes, no mocks of vcdask."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import torch
from distributed.diagnostics.plugin import WorkerPlugin

import vcdask


def worker_info(client) -> dict:
    """The scheduler's workers (address -> info), asked of the scheduler directly.

    ``client.scheduler_info()["workers"]`` is racy in distributed 2026.8: the method refreshes the client's
    cached identity and returns the cache, and the client's periodic refresh (every 2 s, without
    per-worker entries) can replace it in between, so ``"workers"`` is sometimes empty.  A test that waited
    for ``victim not in client.scheduler_info()["workers"]`` then went on before the victim had left.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def busy_workers(client) -> list[str]:
    """Workers processing a vcdask training task right now."""
    return [a for a, keys in client.processing().items() if any(str(k).startswith("vcdask-train-") for k in keys)]


def worker_pid(client, address: str) -> int:
    return client.run(os.getpid, workers=[address])[address]


def _executing_training(dask_worker=None) -> list[str]:
    return [str(ts.key) for ts in dask_worker.state.executing if str(ts.key).startswith("vcdask-train-")]


def _started_keys(dask_scheduler=None) -> list[str]:
    """Training copies the live runs have seen start (their deadlines are running)."""
    plugin = dask_scheduler.plugins.get("vcdask")
    return [row["key"] for row in (plugin.copies() if plugin is not None else ()) if row["started"]]


def wait_for_executing_worker(client, timeout: float = 60) -> str:
    """A worker whose thread is running a training task right now (not merely holding one queued),
    and whose copy the run has seen start: stopped any earlier, the run would see a copy that never
    started (re-issued without blame) rather than one running past its deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        executing = {key: address for address, keys in client.run(_executing_training).items() for key in keys}
        started = set(client.run_on_scheduler(_started_keys)) if executing else set()
        for key in sorted(set(executing) & started):
            return executing[key]
        time.sleep(0.01)
    raise TimeoutError("no worker was executing a training task")


def _running_started_on(address: str, based: bool = False, dask_scheduler=None) -> list[str]:
    """Training copies the live runs have seen start (and, with ``based``, got their base version) that
    the scheduler still has processing on ``address``."""
    plugin = dask_scheduler.plugins.get("vcdask")
    copies = plugin.copies() if plugin is not None else ()
    keys = [row["key"] for row in copies if row["started"] and (row["based"] or not based)]
    # A copy that finished there just before the stop, its result not yet read by the run: the run
    # gives up on the stopped worker after results.PATIENCE and reads that result from the store
    # (test_a_result_its_worker_cannot_hand_over_is_read_from_the_store).  A different fault from the
    # one these tests inject (a frozen running copy), and it would shift their timing: try another moment.
    # (The run releases a result once read, so any task still in memory there is one.)
    for ts in dask_scheduler.tasks.values():
        if ts.state == "memory" and any(ws.address == address for ws in ts.who_has or ()):
            return []
    out = []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and ts.state == "processing" and ts.processing_on is not None:
            if ts.processing_on.address == address:
                out.append(str(key))
    return out


def stop_worker_mid_task(client, timeout: float = 60, based: bool = False) -> tuple[str, int]:
    """SIGSTOP a worker while it runs a training copy the run has seen start; return (address, pid).

    ``based``: only a copy that has its base version (it trains; before it asks, a copy has no
    staleness, only a deadline).

    Between finding such a worker and stopping it, a loaded machine may finish that copy and start the
    next one before the run hears of it: stopped then, the run sees a copy that never started (re-issued
    without blame).  So after the stop the scheduler is asked (it is not stopped) whether a started copy
    is still running there; if not, the worker is resumed and another try made."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        victim = wait_for_executing_worker(client, timeout=max(1.0, deadline - time.monotonic()))
        pid = worker_pid(client, victim)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)  # messages the worker sent before it stopped reach the scheduler
        if client.run_on_scheduler(_running_started_on, victim, based):
            return victim, pid
        os.kill(pid, signal.SIGCONT)
    raise TimeoutError("could not stop a worker in the middle of a started training copy")


class Killer(threading.Thread):
    """SIGKILLs a random busy worker process every ``period`` seconds, keeping at least one alive."""

    def __init__(self, client, period: float, seed: int = 0):
        super().__init__(daemon=True)
        self.client, self.period, self.rng = client, period, random.Random(seed)
        self.stop_event = threading.Event()
        self.kills: list[str] = []

    def run(self):
        while not self.stop_event.wait(self.period):
            try:
                busy = busy_workers(self.client)
                if busy and len(worker_info(self.client)) > 1:
                    victim = self.rng.choice(busy)
                    os.kill(worker_pid(self.client, victim), signal.SIGKILL)
                    self.kills.append(victim)
            except Exception:  # noqa: BLE001 - the victim may already be gone; try again next period
                continue

    def stop(self):
        self.stop_event.set()
        self.join(10)


def fit_in_thread(**kwargs):
    out: dict = {}

    def target():
        try:
            out["result"] = vcdask.fit(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def running_run(client, timeout: float = 60, min_step: int = 0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            runs = client.sync(client.scheduler.vcdask_runs) or {}
        except Exception:  # noqa: BLE001 - the plugin is not registered yet
            runs = {}
        for run_id, status in runs.items():
            if status == "running" and client.sync(client.scheduler.vcdask_status, run_id=run_id)["step"] >= min_step:
                return run_id
        time.sleep(0.05)
    raise TimeoutError("no run is running")


def start_worker(
    scheduler_address: str, env: dict[str, str] | None = None, name: str = "bad-worker"
) -> subprocess.Popen:
    """A separate `dask worker` process (1 thread, no nanny: a SIGKILL ends it) with extra environment variables."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            scheduler_address,
            "--nthreads",
            "1",
            "--no-nanny",
            "--name",
            name,
            "--no-dashboard",
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_victim(
    client, plugin: WorkerPlugin, n_workers: int = 2, name: str = "victim"
) -> tuple[subprocess.Popen, str]:
    """Start a warm worker process ``name`` beside the cluster's (:func:`start_worker`), wait for the
    cluster to hold ``n_workers``, and register ``plugin`` on the workers; the process and its address.
    Warm as the forked embedded workers are (conftest.py): cold, its first shard ran past its deadline."""
    proc = start_worker(client.scheduler.address, name=name)
    try:
        client.wait_for_workers(n_workers, timeout=60)
        address = next(a for a, w in worker_info(client).items() if w["name"] == name)
        client.run(warm_up, workers=[address])
        client.register_plugin(plugin)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return proc, address


class HandoverFault(WorkerPlugin):
    """A Dask worker plugin: on the worker named ``name``, the first request for the result of a shard
    task sends the worker process ``signum`` — SIGKILL: it dies holding a finished result the run has not
    read; SIGSTOP: it freezes holding one.  (It wraps the worker's ``get_data`` handler, the one every
    result read reaches, whether through the scheduler or straight from the client.)"""

    name = "vcdask-test-handover-fault"

    def __init__(self, worker_name: str, signum: int):
        self.worker_name, self.signum = worker_name, signum

    def setup(self, worker) -> None:
        if worker.name != self.worker_name:
            return
        original, signum, fired = worker.handlers["get_data"], self.signum, []

        async def get_data(comm=None, keys=(), **kwargs):
            if not fired and any(str(k).startswith("vcdask-train-") for k in keys):
                fired.append(True)
                os.kill(os.getpid(), signum)
            return await original(comm=comm, keys=keys, **kwargs)

        worker.handlers["get_data"] = get_data
        # and the worker's tasks do not hand their records to the run as they finish (a best-effort
        # shortcut, vcdask.worker._hand_over): the run asks this worker for them, as when that fails
        worker.scheduler = _RefusingHandOver(worker.scheduler)


class _RefusingHandOver:
    """A worker's connection to the scheduler on which a task's ``vcdask_finished`` call fails."""

    def __init__(self, rpc):
        self._rpc = rpc

    def __getattr__(self, name):
        if name == "vcdask_finished":

            async def refuse(**kwargs):
                raise OSError("the test refuses the hand-over")

            return refuse
        return getattr(self._rpc, name)


class KillOnFinish(WorkerPlugin):
    """A Dask worker plugin: on the worker named ``name``, the first shard task to finish kills the worker
    process (SIGKILL) as its result is stored in the worker's memory: after the task handed its record
    to the run, before Dask reports it done."""

    name = "vcdask-test-kill-on-finish"

    def __init__(self, worker_name: str):
        self.worker_name, self.fired = worker_name, False

    def setup(self, worker) -> None:
        self.mine = worker.name == self.worker_name

    def transition(self, key, start, finish, **kwargs) -> None:
        if self.mine and not self.fired and finish == "memory" and str(key).startswith("vcdask-train-"):
            self.fired = True
            os.kill(os.getpid(), signal.SIGKILL)


class FreezeOnStart(WorkerPlugin):
    """A Dask worker plugin: on the worker named ``name``, the first task whose key starts with ``prefix``
    freezes the worker process (SIGSTOP) as it begins to execute, before it can run or hand anything back.
    The scheduler still sees the worker connected, with the task processing there."""

    name = "vcdask-test-freeze-on-start"

    def __init__(self, worker_name: str, prefix: str):
        self.worker_name, self.prefix, self.fired = worker_name, prefix, False

    def setup(self, worker) -> None:
        self.mine = worker.name == self.worker_name

    def transition(self, key, start, finish, **kwargs) -> None:
        if self.mine and not self.fired and finish == "executing" and str(key).startswith(self.prefix):
            self.fired = True
            os.kill(os.getpid(), signal.SIGSTOP)


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in /proc (R running, S sleeping, T stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class ChaosNet(torch.nn.Module):
    """The demo CNN plus a spare parameter that forward never uses (a faulty optimizer reshapes it).

    ``parameters()`` yields the module's own parameters before its children's: spare comes first."""

    def __init__(self, seed: int = 0):
        super().__init__()
        from vcdask.demo import digits_cnn

        self.net = digits_cnn(seed)
        self.spare = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.net(x)


class FaultyAdam(torch.optim.Adam):
    """Adam, except on a worker whose VCDASK_TEST_FAULT is set: each shard's update comes back broken,
    in turn with NaN values, a wrong-shaped tensor, and a huge norm.  A real misbehaving worker, made
    through user code (the optimizer), not by patching vcdask."""

    tasks = 0

    def __init__(self, params, lr=1e-3):
        params = list(params)
        super().__init__(params, lr=lr)
        self.kind, self.broken = None, False
        if os.environ.get("VCDASK_TEST_FAULT"):
            self.kind = ["nan", "shape", "norm"][FaultyAdam.tasks % 3]
            FaultyAdam.tasks += 1

    def step(self, closure=None):
        out = super().step(closure)
        if self.kind is not None and not self.broken:
            self.broken = True  # once per shard: x1e4 every step would overflow into inf
            params = self.param_groups[0]["params"]  # ChaosNet: [spare, net.0.weight, ...]
            with torch.no_grad():
                if self.kind == "nan":
                    params[1].fill_(float("nan"))
                elif self.kind == "norm":
                    for q in params:
                        q.mul_(1e4)
                else:  # the spare parameter changes shape: forward is unaffected
                    params[0].data = torch.zeros(params[0].shape[0] + 1)
        return out


def warm_up() -> bool:
    """Import what a shard task needs, so a fresh worker takes its first shard at full speed (a spawned
    worker's first ``torch.optim`` optimizer imports ``torch._dynamo``: 3.5-4 s)."""
    import torch._dynamo  # noqa: F401

    import vcdask.worker  # noqa: F401

    return True


class PoisonNet(torch.nn.Module):
    """A model that kills the worker process running it when it sees a poisoned sample (value 999)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    def forward(self, x):
        if bool((x > 100).any()):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


class SlowOn:
    """The default step, slowed by ``delay`` seconds per batch on the worker at ``address`` (a slow machine)."""

    def __init__(self, address: str, delay: float):
        self.address, self.delay = address, delay

    def __call__(self, model, batch):
        x, y = batch
        try:
            from distributed import get_worker

            here = get_worker().address
        except ValueError:  # the pre-flight probe on the client
            here = None
        if here == self.address:
            time.sleep(self.delay)
        return torch.nn.functional.cross_entropy(model(x), y)


class HeldWhileFlagged:
    """The default step, ``delay`` seconds per batch; while the file ``flag`` exists, a batch first marks
    the file ``seen`` and waits for ``flag`` to go.  A test holds a shard task mid-training with it, breaks
    something (the store, a connection), then lets the task go on into the fault."""

    def __init__(self, flag: str, seen: str, delay: float = 0.0):
        self.flag, self.seen, self.delay = flag, seen, delay

    def __call__(self, model, batch):
        x, y = batch
        if os.path.exists(self.flag):
            with open(self.seen, "a") as f:
                f.write(f"{os.getpid()}\n")
            while os.path.exists(self.flag):
                time.sleep(0.02)
        time.sleep(self.delay)
        return torch.nn.functional.cross_entropy(model(x), y)


class Saboteur(torch.optim.Adam):
    """Adam, except on the worker at ``hostile``: its steps go uphill (``"flip"``: the gradient's sign
    flipped, the classic sign-flipping attack), are ``"scale"``d tenfold, or carry ``"noise"`` (a broken
    machine).  A hostile or broken worker made through user code (the optimizer), not by patching vcdask."""

    def __init__(self, params, lr=1e-3, hostile: str = "", mode: str = "flip"):
        super().__init__(list(params), lr=lr)
        try:
            from distributed import get_worker

            self.mode = mode if get_worker().address == hostile else None
        except ValueError:  # the pre-flight check on the client
            self.mode = None

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.mode == "flip":
            for p in params:
                p.grad.neg_()
            return super().step(closure)
        if self.mode == "noise":
            out = super().step(closure)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn_like(p), alpha=0.5)
            return out
        if self.mode == "scale":
            before = [p.detach().clone() for p in params]
            out = super().step(closure)
            with torch.no_grad():
                for p, b in zip(params, before, strict=True):
                    p.copy_(b + 10 * (p - b))
            return out
        return super().step(closure)


class SlowerOnceFlagged(SlowOn):
    """:class:`SlowOn`, and once the file ``flag`` exists, ``after`` seconds per training batch on that
    worker (a machine that slows down, e.g. throttled as its instance is being reclaimed).  Each slowed
    batch first appends a line to ``flag + ".seen"``: a test knows a shard's batch began after the flag.

    A validation also calls the train step (for its loss, with no ``eval_step``), with the model in eval
    mode: its batches are not slowed and leave no mark.  Until stop 38 they were, and a validation running
    on the worker at the flag wrote the mark while no shard ran there (CI: "no shard running on the
    victim" for 60 s)."""

    def __init__(self, address: str, delay: float, flag: str, after: float):
        super().__init__(address, delay)
        self.flag, self.after = flag, after

    def __call__(self, model, batch):
        try:
            from distributed import get_worker

            if model.training and get_worker().address == self.address and os.path.exists(self.flag):
                with open(self.flag + ".seen", "a") as f:
                    f.write(f"{time.time()}\n")
                time.sleep(self.after)
        except ValueError:
            pass
        return super().__call__(model, batch)


class NaNOnWorkerZero(torch.optim.Adam):
    """Adam, except on the worker named 0 (a LocalCluster's first): every update it trains comes back
    with NaN weights, so the run rejects it.  User code, not a patch of vcdask."""

    def step(self, closure=None):
        from distributed import get_worker

        out = super().step(closure)
        if get_worker().name == 0:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out


def copies_in_flight(dask_scheduler=None) -> list[dict]:
    """For ``client.run_on_scheduler``: every shard copy in flight in the live runs, with its worker and
    state (what a test that waited in vain reports)."""
    plugin = dask_scheduler.plugins.get("vcdask")
    return [
        {"key": row["key"], "worker": row["started_on"], **{k: row[k] for k in ("based", "overdue", "started")}}
        for row in (plugin.copies() if plugin else ())
    ]


def superseded_on(address, dask_scheduler=None) -> bool:
    """For ``client.run_on_scheduler``: whether a late copy still runs on ``address`` whose shard another
    copy has since merged (its own result, once back, can only be late)."""
    plugin = dask_scheduler.plugins.get("vcdask")
    return any(
        row["started_on"] == address and row["overdue"] and row["merged"] for row in (plugin.copies() if plugin else ())
    )


def copies_started_on(address, dask_scheduler=None) -> list[str]:
    """For ``client.run_on_scheduler``: the keys of the shard copies running on ``address`` (started from
    their base, not overdue) in the live runs."""
    plugin = dask_scheduler.plugins.get("vcdask")
    return [
        row["key"]
        for row in (plugin.copies() if plugin else ())
        if row["based"] and row["started_on"] == address and not row["overdue"]
    ]
