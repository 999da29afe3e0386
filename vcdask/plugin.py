"""The scheduler plugin: owns every run's state and applies VC-ASGD merges in arrival order.

Runs live on the scheduler, not in the process that called ``fit``: each run drives its
shard tasks through an asynchronous Dask client opened inside the scheduler, keeps the
server parameters ``W_s`` in memory, and merges each arriving update in a dedicated
thread (read ``W_c`` from the store, ``lerp_``, commit), so the scheduler's event loop
only ever handles small records.  Clients talk to it through the handlers below
(``client.scheduler.vcdask_status(run_id=...)``), as distributed's shuffle plugin does.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from distributed import SchedulerPlugin

from .errors import VcdaskError
from .server import ServerState
from .task import RunSpec, load_spec, train_shard, validate_version

logger = logging.getLogger(__name__)

__all__ = ["PLUGIN_NAME", "RunNotFoundError", "VcdaskPlugin"]

PLUGIN_NAME = "vcdask"
MAX_ATTEMPTS = 4  # per (epoch, shard) when tasks die with their workers


class RunNotFoundError(VcdaskError, KeyError):
    """No run with that id on this scheduler."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class _Task:
    kind: str  # "update" or "validation"
    epoch: int = 0
    shard: int = 0
    attempt: int = 0
    step: int = 0


class Run:
    """One training run: queue, in-flight tasks, dedup, versions, history."""

    def __init__(self, scheduler, spec: RunSpec):
        self.scheduler = scheduler
        self.spec = spec
        self.store = spec.store
        self.id = spec.run_id
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"vcdask-merge-{self.id[-6:]}")
        self.status = "starting"
        self.error: str | None = None
        self.done = asyncio.Event()
        self.started = time.time()
        self.client = None
        self.ac = None
        # W_s: touched only by the merge thread; the loop reads its counters between merges
        self.state = ServerState(spec.store, spec.branch, spec.alpha, spec.run_id,
                                 commit_every=spec.commit_every, keep_updates=spec.keep_updates)
        # scheduling state (event loop only)
        self.rng = random.Random(spec.seed)
        self.queue: dict[int, list[int]] = {}
        self.dispatch_epoch = 0
        self.merged: dict[int, set[int]] = {}
        self.attempts: dict[tuple[int, int], int] = {}
        self.home: dict[int, str] = {}  # shard -> worker that last trained it (and caches its rows)
        self.in_flight: dict[str, _Task] = {}
        self.futures: dict[str, Any] = {}
        self.history: list[dict] = []
        self.validations: dict[int, dict] = {}
        self.epoch_end: dict[int, tuple[int, float]] = {}  # epoch -> (step, wall seconds)
        self.epochs: list[dict] = []
        self.stopping: str | None = None

    # -- helpers --------------------------------------------------------------------------
    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _event(self, kind: str, **data) -> None:
        self.scheduler.log_event(f"vcdask-run-{self.id}", {"type": kind, "run_id": self.id, **data})

    def _slots(self) -> int:
        threads = sum(ws.nthreads for ws in self.scheduler.workers.values())
        return max(1, self.spec.tasks_per_slot * threads)

    def _n_training(self) -> int:
        return sum(t.kind == "update" for t in self.in_flight.values())

    # -- the driver -----------------------------------------------------------------------
    async def drive(self) -> None:
        from distributed import Client, as_completed

        try:
            self.client = await Client(self.scheduler.address, asynchronous=True, set_as_default=False,
                                       name=f"vcdask-{self.id}")
            await self._in_thread(self.state.load)
            self.status = "running"
            self._event("started", version=self.state.version, step=self.state.step)
            self.ac = as_completed([], loop=self.client.loop, with_results=False)
            self._fill(None)
            async for future in self.ac:
                freed = await self._on_done(future)
                if self._finished():
                    break
                self._fill(freed)
            await self._finish()
        except asyncio.CancelledError:
            self.status = "cancelled"
            raise
        except Exception:
            self.status = "error"
            self.error = traceback.format_exc()
            logger.error("vcdask run %s failed:\n%s", self.id, self.error)
            self._event("failed", error=self.error)
        finally:
            await self._cleanup()
            self.done.set()

    async def _on_done(self, future) -> str | None:
        """Handle one finished task; return the worker it freed (for sticky dispatch)."""
        task = self.in_flight.pop(future.key, None)
        self.futures.pop(future.key, None)
        if task is None:
            return None
        if future.status == "cancelled":
            if task.kind == "update":
                self._record_cancelled(task)
            return None
        try:
            record = await future
        except Exception as exc:  # noqa: BLE001 - a task's error is data for the policy in _task_failed
            await self._task_failed(task, exc)
            return None
        finally:
            future.release()
        if task.kind == "validation":
            self._on_validation(record)
            return None
        # The worker is free now: give it its next shard before merging this result, so
        # training never waits for the merge thread (the new task starts from the newest
        # committed version, one merge staler than after the merge).
        if not self._finished():
            self._fill(record["worker"])
        await self._on_update(record)
        return None

    def _record_cancelled(self, task: _Task) -> None:
        self.history.append({"epoch": task.epoch, "shard": task.shard, "attempt": task.attempt, "worker": None,
                             "update": None,
                             "base_version": task.step, "new_version": None, "version_id": None, "alpha": None,
                             "staleness": None, "train_loss": float("nan"), "seconds": float("nan"),
                             "accepted": False, "reason": f"cancelled: {self.stopping}",
                             "time": time.time() - self.started})

    def _finished(self) -> bool:
        return self.stopping is not None or len(self.epochs) >= self.spec.max_epochs

    # -- dispatch -------------------------------------------------------------------------
    def _next_shard(self, worker: str | None) -> tuple[int, int] | None:
        while not self.queue.get(self.dispatch_epoch):
            if self.dispatch_epoch >= self.spec.max_epochs:
                return None
            self.dispatch_epoch += 1
            order = list(range(self.spec.shards.n_shards))
            self.rng.shuffle(order)
            self.queue[self.dispatch_epoch] = order
            self.merged.setdefault(self.dispatch_epoch, set())
        queue = self.queue[self.dispatch_epoch]
        pick = next((s for s in queue if worker is not None and self.home.get(s) == worker), queue[0])
        queue.remove(pick)
        return self.dispatch_epoch, pick

    def _fill(self, freed_worker: str | None) -> None:
        while self.stopping is None and self._n_training() < self._slots():
            nxt = self._next_shard(freed_worker)
            if nxt is None:
                return
            self._submit_shard(*nxt)
            freed_worker = None

    def _submit_shard(self, epoch: int, shard: int) -> str:
        attempt = self.attempts.get((epoch, shard), 0)
        self.attempts[(epoch, shard)] = attempt + 1
        key = f"vcdask-train-{self.id}-e{epoch}-s{shard}-a{attempt}"
        home = self.home.get(shard)
        where = {"workers": [home], "allow_other_workers": True} if home in self.scheduler.workers else {}
        version, step = self.state.head
        future = self.client.submit(train_shard, self.store, self.id, epoch, shard, attempt, version, step,
                                    key=key, **where)
        self._track(future, _Task("update", epoch, shard, attempt, step))
        return key

    def _submit_validation(self) -> None:
        version, step = self.state.head
        key = f"vcdask-validate-{self.id}-v{step}"
        if key in self.futures or step in self.validations:
            return
        future = self.client.submit(validate_version, self.store, self.id, version, step, key=key, priority=10)
        self._track(future, _Task("validation", step=step))

    def _track(self, future, task: _Task) -> None:
        self.in_flight[future.key] = task
        self.futures[future.key] = future
        self.ac.add(future)

    def reissue(self, epoch: int, shard: int) -> str:
        """Train (epoch, shard) once more from the current version; the first result to arrive wins."""
        if self.ac is None or self.done.is_set():
            raise RuntimeError(f"run {self.id} is not running")
        return self._submit_shard(epoch, shard)

    # -- results --------------------------------------------------------------------------
    async def _on_update(self, rec: dict) -> None:
        epoch, shard = rec["epoch"], rec["shard"]
        row = {"epoch": epoch, "shard": shard, "attempt": rec["attempt"], "worker": rec["worker"],
               "update": rec["update"],
               "base_version": rec["base_step"], "new_version": None, "version_id": None, "alpha": None,
               "staleness": None, "train_loss": rec["train_loss"], "seconds": rec["seconds"],
               "read_seconds": rec["read_seconds"], "train_seconds": rec["train_seconds"],
               "upload_seconds": rec["upload_seconds"],
               "accepted": False, "reason": None, "time": time.time() - self.started}
        merged = self.merged.setdefault(epoch, set())
        epoch_complete = False
        if shard in merged:
            row["reason"] = "duplicate: (epoch, shard) already merged"
            await self._in_thread(self.store.files.delete, rec["update"])
        else:
            epoch_complete = len(merged) + 1 == self.spec.shards.n_shards
            row.update(await self._in_thread(self.state.merge, rec, epoch_complete))
            merged.add(shard)
            self.home[shard] = rec["worker"]
            if epoch_complete:
                self.epoch_end[epoch] = (self.state.step, time.time() - self.started)
        self.history.append(row)
        self._event("update", **{k: row[k] for k in ("epoch", "shard", "worker", "accepted", "new_version",
                                                    "staleness", "alpha", "train_loss", "reason")})
        if not row["accepted"]:
            return
        if self.spec.validation is None:
            self._close_epochs()
            return
        due = epoch_complete or self.state.step % self.spec.validate_every == 0
        if self.state.committed and due:
            self._submit_validation()

    def _on_validation(self, rec: dict) -> None:
        self.validations[rec["step"]] = rec["metrics"]
        self._event("validation", step=rec["step"], metrics=rec["metrics"])
        self._close_epochs()

    def _close_epochs(self) -> None:
        """Record every epoch whose shards are all merged (and whose end version is validated)."""
        while True:
            epoch = len(self.epochs) + 1
            if epoch not in self.epoch_end:
                return
            end_step, wall = self.epoch_end[epoch]
            if self.spec.validation is not None and end_step not in self.validations:
                return
            merges = [h for h in self.history if h["epoch"] == epoch and h["accepted"]]
            row = {"epoch": epoch, "version": end_step, "wall_time": wall,
                   "train_loss": _mean([h["train_loss"] for h in merges])}
            if self.spec.validation is not None:
                # the band: every validated version that merged one of this epoch's updates
                end = self.validations[end_step]
                seen = [self.validations[h["new_version"]] for h in merges if h["new_version"] in self.validations]
                for name in end:
                    values = [m[name] for m in seen]
                    row[name] = end[name]
                    row[f"{name}_mean"] = _mean(values)
                    row[f"{name}_min"] = min(values)
                    row[f"{name}_max"] = max(values)
            self.epochs.append(row)
            self._event("epoch", **row)
            target = self.spec.target
            if target and all(_reached(name, goal, row.get(name)) for name, goal in target.items()):
                self.stopping = f"target {target} reached at epoch {epoch}"

    async def _task_failed(self, task: _Task, exc: BaseException) -> None:
        from distributed.scheduler import KilledWorker

        if task.kind == "update" and isinstance(exc, (KilledWorker, OSError)):
            if self.attempts.get((task.epoch, task.shard), 0) < MAX_ATTEMPTS and shard_not_merged(self, task):
                logger.warning("run %s: shard %d of epoch %d lost with its worker (%s); re-issuing",
                               self.id, task.shard, task.epoch, exc)
                self._submit_shard(task.epoch, task.shard)
                return
        raise RuntimeError(f"{task.kind} task (epoch {task.epoch}, shard {task.shard}) failed: {exc!r}") from exc

    # -- the end --------------------------------------------------------------------------
    async def _finish(self) -> None:
        leftover = [k for k, t in self.in_flight.items() if t.kind == "update"]
        if leftover:
            await self.client.cancel([self.futures[k] for k in leftover])
            for key in leftover:
                self._record_cancelled(self.in_flight.pop(key))
                self.futures.pop(key, None)
        await self._in_thread(self.state.commit)
        version, step = self.state.head
        if self.spec.validation is not None and step not in self.validations:
            rec = await self.client.submit(validate_version, self.store, self.id, version, step,
                                           key=f"vcdask-validate-{self.id}-final", priority=10)
            self.validations[rec["step"]] = rec["metrics"]
        await self._in_thread(self._drop_leftover_updates)
        self.status = "finished"
        self._event("finished", version=self.state.version, step=self.state.step, reason=self.stopping or "max_epochs")

    def _drop_leftover_updates(self) -> None:
        if self.spec.keep_updates:
            return
        for path in self.store.files.list(f"{self.id}/updates"):
            self.store.files.delete(path)

    async def _cleanup(self) -> None:
        if self.client is not None:
            try:
                await self.client.cancel(list(self.futures.values()))
                await self.client.close()
            except Exception:  # noqa: BLE001 - closing after a failure; the failure is already recorded
                logger.debug("closing the client of run %s", self.id, exc_info=True)
        self.executor.shutdown(wait=False)

    # -- views ----------------------------------------------------------------------------
    def status_dict(self) -> dict:
        last = self.epochs[-1] if self.epochs else {}
        return {"run_id": self.id, "status": self.status, "error": self.error, "step": self.state.step,
                "version": self.state.version, "epochs_done": len(self.epochs), "max_epochs": self.spec.max_epochs,
                "n_shards": self.spec.shards.n_shards,
                "merged_in_epoch": len(self.merged.get(len(self.epochs) + 1, ())),
                "in_flight": self._n_training(), "last_epoch": last, "stopping": self.stopping,
                "elapsed": time.time() - self.started}

    def result_dict(self) -> dict:
        return {**self.status_dict(), "history": self.history, "epochs": self.epochs,
                "final_metrics": self.validations.get(self.state.version_step), "branch": self.spec.branch}


def shard_not_merged(run: Run, task: _Task) -> bool:
    return task.shard not in run.merged.get(task.epoch, ())


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _reached(name: str, goal: float, value: float | None) -> bool:
    if value is None:
        return False
    return value <= goal if name == "loss" or name.endswith("error") or name in ("mse", "mae") else value >= goal


class VcdaskPlugin(SchedulerPlugin):
    """Registered once per scheduler by :func:`vcdask.fit`; hosts any number of runs."""

    name = PLUGIN_NAME

    def __init__(self):
        self.runs: dict[str, Run] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "vcdask_start": self.handle_start,
            "vcdask_status": self.handle_status,
            "vcdask_result": self.handle_result,
            "vcdask_wait": self.handle_wait,
            "vcdask_stop": self.handle_stop,
            "vcdask_reissue": self.handle_reissue,
            "vcdask_runs": self.handle_runs,
        })

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    def _run(self, run_id: str) -> Run:
        try:
            return self.runs[run_id]
        except KeyError:
            raise RunNotFoundError(f"no vcdask run {run_id!r} on this scheduler; runs: {sorted(self.runs)}") from None

    async def handle_start(self, comm=None, store: bytes = b"", run_id: str = "") -> str:
        """Load the run's spec from the store (off the loop) and start driving it."""
        if run_id in self.runs:
            return run_id
        store_obj = pickle.loads(store)
        loop = asyncio.get_running_loop()
        spec = await loop.run_in_executor(None, load_spec, store_obj, run_id)
        run = self.runs[run_id] = Run(self.scheduler, spec)
        self.tasks[run_id] = asyncio.ensure_future(run.drive())
        return run_id

    async def handle_status(self, comm=None, run_id: str = "") -> dict:
        return self._run(run_id).status_dict()

    async def handle_result(self, comm=None, run_id: str = "") -> dict:
        return self._run(run_id).result_dict()

    async def handle_wait(self, comm=None, run_id: str = "", timeout: float | None = None) -> dict:
        run = self._run(run_id)
        try:
            await asyncio.wait_for(run.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return run.status_dict()

    async def handle_stop(self, comm=None, run_id: str = "", reason: str = "stopped by the user") -> dict:
        """Stop dispatching, cancel the shards in flight, commit what is merged, and finish."""
        run = self._run(run_id)
        if not run.done.is_set() and run.stopping is None:
            run.stopping = reason
            await run.client.cancel([f for k, f in run.futures.items() if run.in_flight[k].kind == "update"])
        return run.status_dict()

    async def handle_reissue(self, comm=None, run_id: str = "", epoch: int = 0, shard: int = 0) -> str:
        return self._run(run_id).reissue(epoch, shard)

    async def handle_runs(self, comm=None) -> dict:
        return {run_id: run.status for run_id, run in self.runs.items()}
