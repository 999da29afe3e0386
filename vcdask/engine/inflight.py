"""The run's tasks on the cluster: one record per copy it handed out, and their Dask futures.

:class:`TaskTable` is the run core's record of them (no I/O: it reads Dask's task table in memory to
know where a task is processing, which no plugin hook reports); :class:`InFlight`, the shell's, adds
the client that submits and cancels them and their futures.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["InFlight", "TaskRecord", "TaskTable", "run_client_security"]


@dataclass
class TaskRecord:
    """A shard or validation task in flight (the run's event loop only)."""

    kind: Literal["update", "validation"]
    epoch: int = 0
    shard: int = 0
    attempt: int = 0
    step: int = 0  # the step of its base version (a validation: of the version it measures)
    version: str | None = None  # the version a validation task measures
    submitted: float = 0.0
    started: float | None = None  # reported by the task when it begins to run
    # started as far as the hand-over before it knows (its base went back with it): it may still wait
    # behind other work on its worker; the task's own start, or its deadline as a queued copy's, decides
    handed: bool = False
    worker: str | None = None
    placed: str | None = None  # the one worker a shard copy was placed on (loosely: Dask may move it)
    based: bool = False  # the task asked for its base version (``step`` is the version it trains from)
    overdue: bool = False  # a copy was re-issued because this one missed its deadline (or was stuck)
    arrived: float | None = None  # (the run's clock) when its result came in: its history row's time

    def copy_of(self, epoch: int, shard: int) -> bool:
        return self.kind == "update" and (self.epoch, self.shard) == (epoch, shard)

    @property
    def began(self) -> bool:
        """Whether it said it began to run (not only the hand-over before it: it may wait behind other work).
        What a worker answers for: a late copy, a copy lost with it, the work a preemption wastes."""
        return self.started is not None and not self.handed


def run_client_security(scheduler: Any) -> Any:
    """The security a run's client inside the scheduler connects with: the scheduler's own, its
    certificate standing in for a client certificate where the scheduler was given none (TLS
    clusters usually give each role its own; a scheduler needs only its own to serve)."""
    security = getattr(scheduler, "security", None)
    if security is None or security.tls_client_cert or not security.tls_scheduler_cert:
        return security
    from distributed.security import Security

    fields = {k: getattr(security, k) for k in Security.__slots__ if k != "extra_conn_args"}
    fields.update(tls_client_cert=security.tls_scheduler_cert, tls_client_key=security.tls_scheduler_key)
    return Security(extra_conn_args=security.extra_conn_args, **fields)


class TaskTable:
    """The run's records of its tasks in flight, and of the results handed over but not merged yet.

    Parameters
    ----------
    scheduler : distributed.Scheduler
        Only its task table is read (``scheduler.tasks``: each task's state and the worker processing it).
    """

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.records: dict[str, TaskRecord] = {}
        #: Records the tasks handed over as they finished (:class:`~.core.messages.HandOver`), not yet
        #: merged (or, for a validation, recorded): their tasks are out of :attr:`records`, their results in hand.
        self.handed: deque[tuple[TaskRecord, dict[str, Any]]] = deque()
        #: Records whose results are being read back or merged (out of :attr:`records` and :attr:`handed`):
        #: until the merge is in, each is still a running copy of its shard (:meth:`copy_running`).
        self.settling: list[TaskRecord] = []
        #: Keys taken by a hand-over whose futures Dask has not reported done yet (Dask's late reports)
        self.stale: set[str] = set()

    def add(self, key: str, task: TaskRecord) -> None:
        self.records[key] = task

    def pop(self, key: str) -> TaskRecord | None:
        return self.records.pop(key, None)

    # -- views ----------------------------------------------------------------------------------
    def updates(self) -> Iterator[tuple[str, TaskRecord]]:
        """(key, record) of the shard copies in flight."""
        return ((k, t) for k, t in list(self.records.items()) if t.kind == "update")

    def training(self) -> int:
        """Shard copies that hold a slot (in flight and not overdue)."""
        return sum(not t.overdue for _, t in self.updates())

    def copy_running(self, epoch: int, shard: int) -> bool:
        """Whether a copy of (epoch, shard) that is not overdue is in flight, or any copy's result was
        handed over and waits to be merged, or is being read back or merged."""
        return (
            any(t.copy_of(epoch, shard) and not t.overdue for t in self.records.values())
            or any(t.copy_of(epoch, shard) for t, _ in self.handed)
            or any(t.copy_of(epoch, shard) for t in self.settling)
        )

    def settle(self, task: TaskRecord) -> None:
        """``task``'s result is being read back or merged: it counts as a running copy until :meth:`settled`."""
        if not any(t is task for t in self.settling):
            self.settling.append(task)

    def settled(self, task: TaskRecord) -> None:
        """``task``'s result is merged, turned down, or lost: it no longer counts as a running copy."""
        self.settling = [t for t in self.settling if t is not task]

    def unstarted_copies(self, epoch: int, shard: int) -> tuple[str, ...]:
        """The keys of the copies of (epoch, shard) in flight that no worker has started (they can be
        cancelled; a running one cannot be stopped)."""
        return tuple(k for k, t in self.updates() if t.copy_of(epoch, shard) and not t.began)

    def validating(self, step: int) -> bool:
        """Whether a validation of the version at ``step`` was handed over and waits to be recorded."""
        return any(t.kind == "validation" and t.step == step for t, _ in self.handed)

    def processing_on(self, key: str) -> str | None:
        """The worker the scheduler has ``key`` processing on (None while queued, or gone)."""
        ts = self.scheduler.tasks.get(key)
        return ts.processing_on.address if ts is not None and ts.processing_on is not None else None

    def stranded(self, key: str, connected: Collection[str]) -> bool:
        """Whether Dask holds ``key`` waiting for workers of which none is ``connected``: a copy it will
        never start.  Dask parks a task that has no worker to go to as ``no-worker`` (every worker left
        while it was queued), and when a worker joins it starts only the parked tasks whose restrictions
        name that worker, loose ones (``allow_other_workers``) included.  A copy placed on workers that
        all left waits for them for good: Nannies bring workers back at new addresses, a spot fleet at
        new machines."""
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state != "no-worker":
            return False
        restricted = getattr(ts, "worker_restrictions", None) or ()
        return bool(restricted) and not any(address in connected for address in restricted)

    def held(self) -> Counter[str]:
        """Shard copies per worker: where Dask has each processing, or, until Dask has assigned it
        (the run's own submit reaches the scheduler a message later), the worker it was placed on.

        Without the second, two copies sent in one turn of the loop to the same free worker both
        found it free, and the second queued behind the first there (behind a frozen worker, for as
        long as its deadline)."""
        held: Counter[str] = Counter()
        for key, task in self.updates():
            worker = self.processing_on(key)
            if worker is None and self.state(key) in ("forgotten", "released", "waiting", "queued", "no-worker"):
                worker = task.placed  # not assigned yet (a finished copy, in memory, holds no worker)
            if worker is not None:
                held[worker] += 1
        return held

    def state(self, key: str) -> str:
        ts = self.scheduler.tasks.get(key)
        return ts.state if ts is not None else "forgotten"

    def table(self) -> list[dict[str, Any]]:
        """Shard copies in flight: where they run and what state Dask has them in."""
        return [
            {
                "key": k,
                "epoch": t.epoch,
                "shard": t.shard,
                "attempt": t.attempt,
                "overdue": t.overdue,
                "started": t.started is not None,
                "based": t.based,
                "started_on": t.worker,
                "worker": self.processing_on(k),
                "state": self.state(k),
            }
            for k, t in self.updates()
        ]


class InFlight(TaskTable):
    """The task table with the run's client and the futures of the tasks submitted (the shell's).

    Parameters
    ----------
    scheduler : distributed.Scheduler
    """

    def __init__(self, scheduler: Any):
        super().__init__(scheduler)
        self.client: Any = None
        self.completed: Any = None  # distributed.as_completed over every future submitted
        #: The futures of the tasks submitted, until Dask reports them done (a task out of the table,
        #: handed over or given up, keeps its future until then: it may still be cancelled)
        self.futures: dict[str, Any] = {}

    async def open(self, name: str) -> None:
        """Connect an asynchronous client to this scheduler, with the scheduler's own security (TLS
        certificates), so a run works on a cluster that requires encryption."""
        from distributed import Client, as_completed

        self.client = await Client(
            self.scheduler.address,
            asynchronous=True,
            set_as_default=False,
            name=name,
            security=run_client_security(self.scheduler),
        )
        self.completed = as_completed([], loop=self.client.loop, with_results=False)

    def send(self, fn: Callable[..., Any], *args: Any, key: str, **kwargs: Any) -> str:
        """Submit ``fn(*args)`` as task ``key`` (its record is in the table already)."""
        future = self.client.submit(fn, *args, key=key, **kwargs)
        self.futures[key] = future
        self.completed.add(future)
        return key

    def forget(self, key: str) -> Any:
        """Let go of the future of ``key`` (Dask reported it done, cancelled or erred); it, or None."""
        return self.futures.pop(key, None)

    async def cancel(self, keys: Iterable[str]) -> None:
        futures = [self.futures[k] for k in keys if k in self.futures]
        if futures:
            await self.client.cancel(futures)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.cancel(list(self.futures.values()))
            await self.client.close()
            _let_go_of_loop(self.client)

    def workers_seen(self) -> dict[str, tuple[str, int]]:
        """What Dask says of each connected worker (for :class:`~.core.messages.Tick`): its status (``running``,
        ``paused`` by its memory manager, ``closing_gracefully``, ...) and its threads running no task, as its
        last heartbeat said (any client's tasks; a task that seceded holds no thread)."""
        seen = {}
        for address, ws in self.scheduler.workers.items():
            busy = sum(ts in ws.processing and ts not in ws.long_running for ts in ws.executing)
            seen[address] = (getattr(ws.status, "name", str(ws.status)), max(0, ws.nthreads - busy))
        return seen

    def results_waiting(self) -> bool:
        """Whether results wait to be read: handed over, or finished futures that are not only Dask's late
        reports of handed-over ones (a ready future may still be one, costing the reader a turn)."""
        if self.handed:
            return True
        completed = self.completed
        return completed is not None and completed.count() > len(self.stale) and completed.has_ready()


def _let_go_of_loop(client: Any) -> None:
    """Give back the count an asynchronous client took on its event loop's runner.  distributed's
    ``Client.close()`` gives it back only for a synchronous client, so a cluster whose scheduler drove a run
    kept its "IO loop" thread, sockets and objects after ``cluster.close()``: one more each time a notebook
    closed a cluster (or ``close_embedded()``) and started another.  Never the last count: that is the
    loop this runs on, which is not the run's to stop."""
    from distributed.utils import LoopRunner

    runner = getattr(client, "_loop_runner", None)
    if runner is None or not runner.is_started():
        return
    count, _ = LoopRunner._all_loops.get(runner.loop, (0, None))
    if count > 1:
        runner.stop()
