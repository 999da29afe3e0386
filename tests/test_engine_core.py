"""The run's core (vcdask.engine.core) driven by scripted event sequences: no cluster, no processes,
no store, no event loop.  Each fault path the cluster tests reach through ``fit`` (loss, re-issue,
duplicate, deadline, preemption window, outage pause, stop, cancel, give-up) is played here event by
event, and what the core decides is read off the effects it returns and the state it keeps.

What stands in for Dask is its task table (the only part of Dask the core reads: each task's state and
the worker processing it), moved by the script as Dask would move it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vcdask import Resilience
from vcdask.data import Shards
from vcdask.engine.committing import Head
from vcdask.engine.core import Phase, RunState, handle
from vcdask.engine.core import messages as m
from vcdask.engine.core.arrivals import OUTSIDE
from vcdask.engine.core.dispatching import submit_validation
from vcdask.errors import StoreUnreachableError
from vcdask.spec import RunSpec

RUN = "run-core"


class Clock:
    """Monotonic and wall seconds, moved by the script."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class _Worker:
    address: str


@dataclass
class _Task:
    state: str = "queued"
    processing_on: _Worker | None = None
    worker_restrictions: set[str] | None = None  # the workers its placement names (loose or strict)


class Dask:
    """Dask's task table as the core reads it (``scheduler.tasks``), moved by the script."""

    def __init__(self) -> None:
        self.tasks: dict[str, _Task] = {}

    def sent(self, effects: list[m.Effect]) -> list[m.Submit]:
        subs = [fx for fx in effects if isinstance(fx, m.Submit)]
        for fx in subs:
            self.tasks[fx.key] = _Task(worker_restrictions=set(fx.where.get("workers", ())) or None)
        return subs

    def all_left(self) -> None:
        """Every worker left: Dask parks the tasks it had queued or processing as ``no-worker``."""
        for task in self.tasks.values():
            if task.state in ("queued", "processing"):
                task.state, task.processing_on = "no-worker", None

    def run(self, key: str, worker: str) -> None:
        self.tasks[key] = _Task("processing", _Worker(worker))

    def finish(self, key: str) -> None:
        self.tasks[key] = _Task("memory")


class Script:
    """A run's core with a scripted Dask, clock and merge thread."""

    def __init__(self, *, n_shards: int = 4, max_epochs: int = 1, workers=("a", "b"), keep_updates=False, **res):
        self.clock, self.dask = Clock(), Dask()
        spec = RunSpec(
            run_id=RUN,
            store=None,
            branch=RUN,
            model=torch.nn.Linear(1, 1),
            loss=None,
            optimizer=None,
            local_epochs=1,
            batch_size=8,
            seed=0,
            train=None,
            shards=Shards(10 * n_shards, n_shards),
            validation=res.pop("validation", None),
            metrics={},
            classification=True,
            x_dtype=torch.float32,
            max_epochs=max_epochs,
            merge=res.pop("merge", None),
            target=None,
            commit_every=1,
            validate_every=res.pop("validate_every", "auto"),
            keep_updates=keep_updates,
            resilience=Resilience(**res),
        )
        self.state = RunState(spec, {w: 1 for w in workers}, self.dask, clock=self.clock, wall=self.clock)
        self.state.head = Head(step=0, version="v0", version_step=0)
        self.state.phase = Phase.RUNNING

    def __call__(self, event: m.Event) -> list[m.Effect]:
        effects = handle(self.state, event)
        self.dask.sent(effects)
        return effects

    def reissued(self) -> tuple[str, str]:
        """The first shard task sent out, and a copy of it re-issued (neither started)."""
        key = keys(self(m.Poll()))[0]
        task = self.state.tasks.records[key]
        return key, keys(self(m.Reissue(task.epoch, task.shard)))[0]

    # -- what a task and the merge thread do --------------------------------------------------------
    def start(self, key: str, worker: str) -> None:
        self.dask.run(key, worker)
        self(m.Started(key, worker))

    def record(self, key: str, worker: str, seconds: float = 2.0) -> dict[str, Any]:
        task = self.state.tasks.records[key]
        return {
            "kind": "update",
            "epoch": task.epoch,
            "shard": task.shard,
            "attempt": task.attempt,
            "worker": worker,
            "seconds": seconds,
            "train_loss": 1.0,
            "read_seconds": 0.1,
            "train_seconds": seconds - 0.2,
            "upload_seconds": 0.1,
            "update": f"{RUN}/updates/{task.epoch}-{task.shard}-{task.attempt}",
            "base_step": task.step,
        }

    def merge(
        self, effects: list[m.Effect], accept: bool = True, fault: str | None = None, alpha: float | None = 0.5
    ) -> list[m.Effect]:
        """The merge thread merges (or turns down) the result a :class:`Merge` effect names, and commits."""
        [fx] = [fx for fx in effects if isinstance(fx, m.Merge)]
        head = self.state.head
        if accept:
            step = head.step + 1
            head = Head(step=step, version=f"v{step}", version_step=step)
            outcome = {
                "accepted": True,
                "staleness": 0,
                "alpha": alpha,
                "new_version": step,
                "version_id": head.version,
            }
        else:
            outcome = {"accepted": False, "staleness": 0, "reason": f"rejected: {fault}", "fault": fault}
        return self(m.Merged(fx.task, fx.record, outcome, head))

    def finish_task(self, key: str, worker: str, **kw: Any) -> list[m.Effect]:
        """Task ``key`` hands its record over as it finishes, and the driver merges it."""
        rec = self.record(key, worker, **kw)
        self.dask.finish(key)
        self(m.HandOver(key, rec))
        task, record = self.state.tasks.handed.popleft()
        return self(m.Result(task, record, taken=True))


def keys(effects: list[m.Effect], kind: type = m.Submit) -> list[str]:
    return [fx.key for fx in effects if isinstance(fx, kind)]


def emitted(effects: list[m.Effect], kind: str) -> list[dict[str, Any]]:
    return [fx.fields for fx in effects if isinstance(fx, m.Emit) and fx.kind == kind]


def rows(state: RunState, outcome: str) -> list[dict[str, Any]]:
    return [h for h in state.ledger.history if h["outcome"] == outcome]


def test_an_epoch_runs_each_shard_once_with_a_workers_next_shard_sent_as_it_hands_over():
    s = Script()
    first = keys(s(m.Poll()))
    assert len(first) == 2 and s.state.tasks.training() == 2  # one per slot
    done = set()
    while not s.state.finished():
        key = next(k for k, t in s.state.tasks.updates() if t.started is None)
        worker = "a" if len(done) % 2 == 0 else "b"
        s.start(key, worker)
        rec = s.record(key, worker)
        s.dask.finish(key)
        nxt = s(m.HandOver(key, rec))
        [reply] = [fx.value for fx in nxt if isinstance(fx, m.Reply)]
        assert reply == keys(nxt)  # the freed worker's next shard went out with the hand-over
        task, record = s.state.tasks.handed.popleft()
        effects = s.merge(s(m.Result(task, record, taken=True)))
        assert emitted(effects, "update")[0]["accepted"]
        done.add((task.epoch, task.shard))
    assert done == {(1, shard) for shard in range(4)} and len(rows(s.state, "merged")) == 4
    assert s.state.arrived == s.state.settled == 4 and s.state.handed_over == 4
    assert s.state.ledger.epochs[0]["epoch"] == 1


def test_a_copy_lost_with_its_worker_is_re_issued_and_its_worker_blamed():
    from distributed.scheduler import KilledWorker

    s = Script()
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))  # Dask reports it done (erred): the shell reads it back
    effects = s(m.TaskFailed(task, KilledWorker(key, _Worker("a"), 3)))
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert again.args[:3] == (task.epoch, task.shard, 1)  # the same shard, attempt 1
    assert emitted(effects, "lost")[0]["worker"] == "a" and s.state.pool.record("a").failed == 1
    assert rows(s.state, "lost")[0]["shard"] == task.shard and s.state.dispatch.failures[(1, task.shard)] == 1


def test_a_shard_given_up_after_os_errors_says_what_the_error_said():
    """An ``OSError`` on a worker (its environment: a path it cannot read) is a lost copy, tried elsewhere; when the
    shard is given up, the run's error named only its type ("last: FileNotFoundError"), not the path."""
    s = Script(n_shards=2, max_attempts=2)
    key = keys(s(m.Poll()))[0]
    for attempt, worker in enumerate(("a", "b")):
        s.start(key, worker)
        task = s.state.tasks.records[key]
        s(m.Completed(key))
        effects = s(m.TaskFailed(task, FileNotFoundError(2, "No such file or directory", f"/data/{worker}.csv")))
        if attempt == 0:
            [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
            key = again.key
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    assert "failed 2 times (last: FileNotFoundError: [Errno 2] No such file or directory: '/data/b.csv')" in (
        fail.failure.message
    )


def test_a_record_that_cannot_be_read_back_is_a_lost_copy_re_issued_without_blame():
    s = Script()
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    [read] = [fx for fx in s(m.Completed(key)) if isinstance(fx, m.Read)]
    effects = s(m.Lost(read.task, "its worker left"))
    assert len(keys(effects)) == 1 and s.state.dispatch.failures[(1, read.task.shard)] == 0
    assert "its worker left" in rows(s.state, "lost")[0]["reason"] and s.state.pool.record("a").failed == 0


def test_a_second_copy_of_a_merged_shard_is_recorded_a_duplicate_and_its_update_deleted_once():
    for keep in (False, True):
        s = Script(keep_updates=keep)
        key, copy = s.reissued()
        s.start(key, "a")
        s.start(copy, "b")
        s.merge(s.finish_task(key, "a"))
        path = s.record(copy, "b")["update"]
        effects = s.finish_task(copy, "b")
        assert not any(isinstance(fx, m.Merge) for fx in effects)  # never merged twice
        assert [r["reason"] for r in rows(s.state, "duplicate")] == ["duplicate: (epoch, shard) already merged"]
        assert [fx.path for fx in effects if isinstance(fx, m.DropUpdate)] == ([] if keep else [path])
        assert s.state.arrived == s.state.settled == 2


def test_a_copy_past_its_deadline_is_re_issued_elsewhere_and_a_late_result_recorded_late():
    s = Script(deadline_floor=5.0)
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    s.clock.advance(30.0)
    assert s(m.Tick()) == []  # the first shards' deadline: nothing measured yet
    s.clock.advance(60.0)
    effects = s(m.Tick())
    [again] = [fx for fx in effects if isinstance(fx, m.Submit) and fx.args[1] == s.state.tasks.records[key].shard]
    assert again.where["workers"] == ["b"]  # away from the late worker
    assert emitted(effects, "reissue")[0]["why"].startswith("ran past its")
    assert s.state.tasks.records[key].overdue and s.state.pool.record("a").timed_out == 1
    s.start(again.key, "b")
    s.merge(s.finish_task(again.key, "b"))
    effects = s.finish_task(key, "a")  # the late copy comes back after all
    assert rows(s.state, "late")[0]["reason"].startswith("late: (epoch, shard) already merged")


def test_a_notice_re_issues_what_would_not_finish_in_its_window_and_lets_the_rest_finish():
    s = Script(workers=("a", "b"))
    first = keys(s(m.Poll()))
    s.start(first[0], "a")
    s.merge(s.finish_task(first[0], "a", seconds=10.0))  # a: 10 s a shard
    running = next(k for k, t in s.state.tasks.updates() if t.placed == "a" or t.started is None)
    s.start(running, "a")
    s.clock.advance(2.0)
    effects = s(m.Preempt("a", window=60.0))
    [(reissued, kept)] = [fx.value for fx in effects if isinstance(fx, m.Reply)]
    assert reissued == [] and kept == [running]  # 8 s left fits the window
    assert "a" in s.state.pool.draining and emitted(effects, "preempted")[0]["kept"] == 1
    effects = s(m.Settle("a", tuple(kept)))  # the margin is reached and it still runs there
    [moved] = [fx.value for fx in effects if isinstance(fx, m.Reply)]
    assert len(moved) == 1 and s.state.tasks.records[running].overdue
    assert [fx.where for fx in effects if isinstance(fx, m.Submit)] == [{"workers": ["b"]}]
    assert s.state.pool.record("a").faults == 0  # a notice is nobody's fault


def test_a_notice_too_short_for_the_running_copy_re_issues_it_at_once():
    s = Script()
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    [(reissued, kept)] = [fx.value for fx in s(m.Preempt("a", window=1.0)) if isinstance(fx, m.Reply)]
    assert len(reissued) == 1 and kept == [] and s.state.tasks.records[key].overdue


def test_a_store_outage_pauses_dispatch_with_backoff_and_fails_the_run_past_its_timeout():
    s = Script(store_outage_timeout=100.0)
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    effects = s(m.TaskFailed(task, StoreUnreachableError("the store is down")))
    assert emitted(effects, "paused")[0]["cause"] == "store" and s.state.pool.record("a").faults == 0
    assert (task.epoch, task.shard) in s.state.dispatch.returned
    assert keys(s(m.Poll())) == []  # holding off (backoff)
    s.clock.advance(60.0)
    [again] = [fx for fx in s(m.Poll()) if isinstance(fx, m.Submit)]
    assert again.args[1] == task.shard  # sent first once the backoff is over
    s.start(again.key, "b")
    [read] = [fx for fx in s(m.Completed(again.key)) if isinstance(fx, m.Read)]
    s.clock.advance(60.0)  # the store has been out 120 s now
    effects = s(m.TaskFailed(read.task, StoreUnreachableError("still down")))
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    assert fail.failure.kind == "store" and "store_outage_timeout=100" in fail.failure.message
    assert str(fail.failure).startswith("StoreOutageError: ")


def test_the_store_answering_again_ends_the_pause():
    s = Script()
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    s(m.TaskFailed(task, StoreUnreachableError("blip")))
    s.clock.advance(60.0)
    again = keys(s(m.Poll()))[0]
    s.start(again, "a")
    effects = s.finish_task(again, "a")
    assert emitted(effects, "resumed")[0]["cause"] == "store" and s.state.outage.why is None


@pytest.mark.parametrize("cancel", [False, True])
def test_stop_cancels_every_copy_out_once_and_the_end_turns_down_what_is_left(cancel):
    s = Script()
    out = keys(s(m.Poll()))
    [fx] = s(m.Stop("stopped by the user", cancel=cancel))
    assert isinstance(fx, m.Cancel) and sorted(fx.keys) == sorted(out)
    assert s.state.finished() and s.state.cancelled is cancel and s.state.stopping == "stopped by the user"
    assert s(m.Stop("again")) == [] and keys(s(m.Poll())) == []  # stopped once; nothing more goes out
    s(m.Completed(out[0], cancelled=True))
    assert rows(s.state, "cancelled")[0]["reason"] == "cancelled: stopped by the user"
    [fx] = [fx for fx in s(m.Finish()) if isinstance(fx, m.Cancel)]
    assert fx.keys == (out[1],) and len(rows(s.state, "cancelled")) == 2 and not s.state.tasks.records


def test_a_cancelled_copy_of_a_merged_shard_is_recorded_superseded():
    s = Script()
    key, copy = s.reissued()
    s.start(key, "a")
    effects = s.merge(s.finish_task(key, "a"))
    assert [fx.keys for fx in effects if isinstance(fx, m.Cancel)] == [(copy,)]  # not started: cancelled
    s(m.Completed(copy, cancelled=True))
    assert rows(s.state, "cancelled")[0]["reason"] == "cancelled: superseded: another copy of this shard was merged"


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_shard_that_fails_every_attempt_stops_the_run_or_is_skipped(policy):
    s = Script(n_shards=2, max_attempts=2, on_shard_failure=policy)
    key = keys(s(m.Poll()))[0]
    shard = s.state.tasks.records[key].shard
    effects: list[m.Effect] = []
    for attempt in range(2):
        s.start(key, "a" if attempt == 0 else "b")
        effects = s.merge(s.finish_task(key, "a" if attempt == 0 else "b"), accept=False, fault="norm")
        key = next((k for k in keys(effects)), key)
    if policy == "stop":
        [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
        assert fail.failure.kind == "shard"
        assert fail.failure.message.startswith(f"shard {shard} of epoch 1 failed 2 times")
        assert fail.failure.message.endswith("on_shard_failure='stop'")
    else:
        assert not any(isinstance(fx, m.Fail) for fx in effects)
        assert s.state.ledger.skipped == {1: {shard}} and rows(s.state, "skipped")
        # for the run's progress (its next commit): the other shard is not merged, so the epoch goes on
        assert [fx for fx in effects if isinstance(fx, m.Skip)] == [m.Skip(1, shard, None)]


def test_non_finite_updates_of_one_shard_from_two_workers_give_it_up_naming_its_samples():
    s = Script(n_shards=2)
    key = keys(s(m.Poll()))[0]
    shard = s.state.tasks.records[key].shard
    s.start(key, "a")
    again = keys(s.merge(s.finish_task(key, "a"), accept=False, fault="non-finite"))
    assert s.state.pool.record("a").rejected == 1
    s.start(again[0], "b")
    effects = s.merge(s.finish_task(again[0], "b"), accept=False, fault="non-finite")
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    start = shard * 10
    assert f"non-finite (NaN/inf) on 2 workers (a, b): the data of samples {start}-{start + 9}" in fail.failure.message
    assert s.state.pool.record("a").rejected == 0  # forgiven: the data's doing


def test_no_usable_worker_pauses_the_run_and_fails_it_past_no_worker_timeout():
    s = Script(workers=("a",), no_worker_timeout=30.0)
    s(m.Left("a"))
    effects = s(m.Poll())
    [woke] = keys(effects)  # (one copy, unrestricted: an adaptive cluster scaled to zero starts a worker for it)
    assert emitted(effects, "paused")[0]["cause"] == "workers"
    s.clock.advance(20.0)
    assert (
        not [fx for fx in s(m.Poll()) if isinstance(fx, m.Fail)] and "no usable worker for 20 s" in s.state.no_workers
    )
    s(m.Joined("b", 2))
    effects = s(m.Poll())
    assert emitted(effects, "resumed")[0]["cause"] == "workers" and len(keys(effects)) == 1  # (beside the first)
    s(m.Left("b"))
    s(m.Poll())
    s.clock.advance(31.0)
    [fail] = [fx for fx in s(m.Poll()) if isinstance(fx, m.Fail)]
    assert str(fail.failure).startswith(f"NoWorkersError: run {RUN} had no usable worker for 30 s")


def test_a_worker_excluded_for_rejections_names_the_last_one_while_the_run_waits_and_when_it_fails():
    """The only worker's every update is over ``max_update_norm`` (a threshold set too low): it is excluded,
    and the run waits for a usable worker.  The pool's states (logged as the wait starts) and the final
    NoWorkersError say what the rejections were, not only their count: the setting is named at once."""
    s = Script(n_shards=4, workers=("a",), max_attempts=5, max_worker_failures=3, no_worker_timeout=30.0)
    why = "update norm 0.41 > max_update_norm=1e-09"
    s(m.Poll())
    for _ in range(3):
        key = next(k for k, t in s.state.tasks.records.items() if t.kind == "update" and not t.overdue)
        s.start(key, "a")
        s.merge(s.finish_task(key, "a"), accept=False, fault=why)
        s(m.Poll())
    assert s.state.pool.record("a").excluded
    assert s.state.pool.unusable() == {
        "a": f"0 failed, 0 timed out, 3 rejected (max_worker_failures=3); last: rejected: {why}"
    }
    s.clock.advance(31.0)
    [fail] = [fx for fx in s(m.Poll()) if isinstance(fx, m.Fail)]
    assert str(fail.failure).startswith(f"NoWorkersError: run {RUN} had no usable worker for 30 s") and why in str(
        fail.failure
    )
    assert "training" not in str(fail.failure)  # (rejected for their norm, not NaN)


def test_workers_excluded_for_nan_from_the_start_name_the_training_as_the_likelier_cause():
    """A learning rate the training diverges at: every update NaN from the first version, the only worker
    excluded, and the run waited ``no_worker_timeout`` (300 s by default), then failed naming the worker alone.
    It still waits (a broken device sends NaN too, and a good worker may join), but the pause and the error say
    the training is the likelier cause.  Not said once something merged (test_the_only_worker_sending_one_shard_
    back_nan...), nor for rejections of another kind (test_a_worker_excluded_for_rejections...)."""
    s = Script(n_shards=2, workers=("a",), max_attempts=4, max_worker_failures=3, no_worker_timeout=30.0)
    key = keys(s(m.Poll()))[0]
    _nan_from_a(s, key, s.state.tasks.records[key].shard, times=3)
    s(m.Poll())
    assert "nothing was merged: the likelier cause is the training" in s.state.no_workers
    s.clock.advance(31.0)
    [fail] = [fx for fx in s(m.Poll()) if isinstance(fx, m.Fail)]
    assert str(fail.failure).startswith(f"NoWorkersError: run {RUN} had no usable worker for 30 s")
    assert "a learning rate it diverges at: fit's lr=" in str(fail.failure)


def test_with_no_worker_connected_one_copy_goes_out_unrestricted_for_an_adaptive_cluster_to_see():
    """An adaptive cluster scaled to zero (``cluster.adapt(minimum=0)``, a spot fleet's default) starts
    workers only for tasks it holds: with no worker connected the run sends one copy, unrestricted, and
    no more; once a worker joins the rest follow.  Workers connected but all excluded get nothing."""
    s = Script(workers=())
    effects = s(m.Poll())
    [submit] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert submit.kind == "update" and submit.where == {} and emitted(effects, "paused")
    assert keys(s(m.Poll())) == [] and s.state.tasks.training() == 1  # one, not one per poll
    s(m.Joined("a", 2))
    assert keys(s(m.Poll())) and s.state.tasks.training() == s.state.pool.slots() > 1  # (two threads)
    excluded = Script(workers=("a",), max_worker_failures=1)
    excluded.state.pool.fault("a", "failed")
    assert not excluded.state.pool.usable() and keys(excluded(m.Poll())) == []


def test_a_copy_queued_for_workers_that_all_left_is_sent_again_as_soon_as_one_is_usable():
    """Every worker left while copies were queued: Dask parks them as ``no-worker`` and, once a worker
    joins, starts only those whose placement names it, loose or not.  The run sends a copy placed on
    workers that all left again at its next tick, without blame, not after its "never started" patience
    (~30 s with the defaults; found in the chaos test where a whole pool is replaced)."""
    s = Script(n_shards=4, workers=("a", "b"))
    placed, unplaced = keys(s(m.Poll()))
    s.dask.tasks[placed].worker_restrictions = {"a"}  # sticky to its home (allow_other_workers=True)
    s(m.Left("a"))
    s(m.Left("b"))
    s.dask.all_left()
    assert keys(s(m.Tick())) == [] and keys(s(m.Poll())) == []  # nowhere to send it yet
    s(m.Joined("c", 1))
    s.dask.run(unplaced, "c")  # Dask starts the unrestricted one on the worker that joined
    s(m.Started(unplaced, "c"))
    effects = s(m.Tick())  # no clock advance: nothing is late
    [again] = keys(effects)
    task, copy = s.state.tasks.records[placed], s.state.tasks.records[again]
    assert (copy.epoch, copy.shard, copy.attempt) == (task.epoch, task.shard, task.attempt + 1)
    assert task.overdue and not copy.overdue
    [why] = emitted(effects, "reissue")
    assert why["why"] == "was queued for workers that all left" and why["worker"] is None
    assert s.state.dispatch.failures.get((task.epoch, task.shard), 0) == 0  # not counted against the shard
    assert keys(s(m.Tick())) == []  # once
    # a copy whose placement still names a connected worker is not stranded: Dask starts it there
    s.dask.tasks[again] = type(s.dask.tasks[again])("no-worker", worker_restrictions={"gone", "c"})
    assert not s.state.tasks.stranded(again, s.state.pool.connected)


def test_a_validation_queued_for_workers_that_all_left_is_run_again_as_soon_as_one_is_usable():
    """The same for a validation placed on some workers only (away from a stuck one): an epoch waits for
    its numbers, and would wait out the validation's patience."""
    from vcdask.engine.core.dispatching import submit_validation

    s = Script(workers=("a", "b"), validation=object())
    submit_validation(s.state, "v0", 0)
    [first] = s.dask.sent(s.state.out)
    s.dask.tasks[first.key].worker_restrictions = {"a"}
    s(m.Left("a"))
    s(m.Left("b"))
    s.dask.all_left()
    assert keys(s(m.Tick())) == []
    s(m.Joined("c", 1))
    [again] = [fx for fx in s(m.Tick()) if isinstance(fx, m.Submit)]
    assert again.kind == "validation" and again.args == ("v0", 0) and again.key != first.key
    assert s.state.tasks.records[first.key].overdue and keys(s(m.Tick())) == []


def test_an_epochs_last_merge_is_committed_then_validated_and_the_epoch_closes_on_its_numbers():
    s = Script(n_shards=2, validation=object())
    out = keys(s(m.Poll()))
    for key, worker in zip(out, "ab", strict=True):
        s.start(key, worker)
    s.merge(s.finish_task(out[0], "a"))
    [merge] = [fx for fx in s.finish_task(out[1], "b") if isinstance(fx, m.Merge)]
    assert merge.completes  # the epoch's last shard
    # the merge thread merged it; the commit of its version is still to come
    head = Head(step=2, version="v1", version_step=1)
    outcome = {"accepted": True, "staleness": 0, "alpha": 0.5, "new_version": 2}
    effects = s(m.Merged(merge.task, merge.record, outcome, head))
    assert [type(fx) for fx in effects if not isinstance(fx, m.Emit)] == [m.Commit]
    assert s.state.settled == 1  # the tasks waiting for it get their base once the epoch's end is committed
    effects = s(m.Committed(Head(step=2, version="v2", version_step=2)))
    assert s.state.settled == 2
    [validate] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert validate.kind == "validation" and validate.args == ("v2", 2) and validate.priority == 10
    assert s.state.ledger.epochs == []  # the epoch waits for its numbers
    task = s.state.tasks.pop(validate.key)
    s(m.Result(task, {"kind": "validation", "step": 2, "metrics": {"loss": 0.5}, "seconds": 1.0}))
    assert s.state.ledger.epochs[0]["loss"] == 0.5 and s.state.finished()


def test_a_late_validation_is_run_again_elsewhere():
    s = Script(n_shards=2, validation=object(), deadline_floor=1.0)
    effects = s(m.Resumed({1: {0, 1}}, {1: (2, "v2")}, {(1, 0): 1, (1, 1): 1}))
    [validate] = [fx for fx in effects if isinstance(fx, m.Submit)]
    s.start(validate.key, "a")
    s.clock.advance(200.0)
    [again] = [fx for fx in s(m.Tick()) if isinstance(fx, m.Submit)]
    assert again.kind == "validation" and again.args == ("v2", 2) and again.where == {"workers": ["b"]}


def test_a_resumed_run_takes_the_uploads_it_found_out_of_the_queues_and_counts_them_to_settle():
    s = Script(n_shards=3)
    pending = ({"epoch": 1, "shard": 2, "attempt": 0, "base_step": 1},)
    s(m.Resumed({1: {0}}, {}, {(1, 0): 1}, pending))
    assert s.state.dispatch.queue[1] == [1] and s.state.arrived == 1 and s.state.ledger.merged == {1: {0}}
    assert [fx.args[:3] for fx in s(m.Poll()) if isinstance(fx, m.Submit)] == [(1, 1, 0)]


def test_a_resumed_run_trains_no_shard_it_gave_up_and_its_earlier_epochs_keep_their_rows():
    """What the store and the run's record say of the last session: shard 2 of epoch 2 was given up (it is
    not trained again), epoch 1 ended at step 3 with its loss, time and skip (its row keeps them)."""
    s = Script(n_shards=3, max_epochs=2)
    row = {"epoch": 1, "version": 3, "wall_time": 12.5, "train_loss": 0.75, "skipped": 1}
    s(m.Resumed({1: {0, 1, 2}, 2: {0}}, {1: (3, "v3")}, {(2, 0): 1, (2, 2): 3}, (), {2: {2}}, {1: row}))
    assert s.state.dispatch.queue[2] == [1] and s.state.ledger.skipped == {2: {2}}
    s(m.CloseEpochs())  # (as the shell does once the uploads found are merged)
    [epoch] = s.state.ledger.epochs
    assert epoch == {"epoch": 1, "version": 3, "wall_time": 12.5, "train_loss": 0.75, "skipped": 1}
    [key] = [k for k in keys(s(m.Poll()))]
    assert s.state.tasks.records[key].shard == 1 and s.state.tasks.records[key].epoch == 2
    s.start(key, "a")
    s.merge(s.finish_task(key, "a"))  # the last shard left: epoch 2 ends, its one skip counted
    assert [e["epoch"] for e in s.state.ledger.epochs] == [1, 2] and s.state.ledger.epochs[1]["skipped"] == 1


def test_a_resumed_runs_earlier_epochs_keep_their_bands_and_its_wall_time_counts_on():
    """A run extended by ``resume(max_epochs=)``: epoch 1's band (mean, min and max over the versions validated in
    it) was replaced by its end value alone, and epoch 2's ``wall_time`` counted from 0 again, before epoch 1's."""
    s = Script(n_shards=2, max_epochs=2, validation=object())
    row = {"epoch": 1, "version": 2, "wall_time": 12.5, "train_loss": 0.75, "skipped": 0}
    row |= {"loss": 0.4, "loss_mean": 0.6, "loss_min": 0.4, "loss_max": 0.8}
    s(m.Resumed({1: {0, 1}}, {1: (2, "v2")}, {}, (), {}, {1: row}, None))
    s.state.head = Head(step=2, version="v2", version_step=2)

    def validate(step):
        [key] = [k for k, t in s.state.tasks.records.items() if t.kind == "validation"]
        return s(m.Result(s.state.tasks.pop(key), {"kind": "validation", "step": step, "metrics": {"loss": 0.3}}))

    validate(2)
    assert s.state.ledger.epochs[0] == row | {"loss": 0.3}  # (validated again: the end value is this session's)
    s.clock.advance(2.0)
    for key in keys(s(m.Poll())):
        s.start(key, "a")
        s.merge(s.finish_task(key, "a"))
    validate(4)
    assert s.state.ledger.epochs[1]["epoch"] == 2 and s.state.ledger.epochs[1]["wall_time"] == 12.5 + 2.0


@pytest.mark.parametrize("resumed_at", [None, 0])
def test_a_target_and_patience_count_from_a_resume_that_extends_a_run_not_from_one_after_a_crash(resumed_at):
    """A run given more epochs after it ended counts its target and patience from the epochs it trains now
    (``resumed_at`` None: the epochs done); one whose scheduler died goes on as its last session counted (here
    from its start): epoch 1 reached the target, so it stops."""
    s = Script(n_shards=2, max_epochs=3, validation=object())
    s.state.ledger.target = {"loss": 0.5}
    s(m.Resumed({1: {0, 1}}, {1: (2, "v2")}, {}, (), {}, {}, resumed_at))
    assert s.state.ledger.resumed_at == (1 if resumed_at is None else 0)
    [validate] = [k for k in s.state.tasks.records if s.state.tasks.records[k].kind == "validation"]
    s(m.Result(s.state.tasks.pop(validate), {"kind": "validation", "step": 2, "metrics": {"loss": 0.4}}))
    assert [e["epoch"] for e in s.state.ledger.epochs] == [1]
    assert (s.state.stopping is None) == (resumed_at is None)


def test_a_start_recorded_on_a_worker_stands_and_one_elsewhere_restarts_the_clock():
    s = Script()
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    first = s.state.tasks.records[key].started
    s.clock.advance(10.0)
    s(m.Started(key, "a", instance="m5.large", market="spot"))  # the hand-over's answer said so first
    assert s.state.tasks.records[key].started == first and s.state.pool.record("a").instance == "m5.large"
    s(m.Started(key, "b"))  # Dask moved it
    assert s.state.tasks.records[key].started == first + 10.0 and s.state.tasks.records[key].worker == "b"


def test_a_copy_queued_behind_a_late_one_moves_elsewhere_without_blame():
    s = Script(workers=("a", "b", "c"))
    late, queued, _ = keys(s(m.Poll()))
    s.start(late, "a")
    s.dask.run(queued, "a")  # Dask queued it on a too; it has not started
    s.dask.tasks[queued].state = "queued"
    s.clock.advance(100.0)
    effects = s(m.Tick())
    moved = [fx for fx in effects if isinstance(fx, m.Submit) and fx.args[1] == s.state.tasks.records[queued].shard]
    assert len(moved) == 1 and "a" not in moved[0].where.get("workers", ["b"])
    assert s.state.tasks.records[queued].overdue and s.state.dispatch.failures.get((1, moved[0].args[1]), 0) == 0
    assert s.state.pool.record("a").timed_out == 1  # the late copy's worker only


def test_the_watchdog_cancels_copies_of_merged_shards_that_no_worker_runs():
    s = Script()
    key, copy = s.reissued()
    s.start(key, "a")
    s.dask.run(copy, "b")
    s.merge(s.finish_task(key, "a"))
    assert not [fx for fx in s(m.Tick()) if isinstance(fx, m.Cancel)]  # running on b: its result will be late
    s.dask.tasks[copy] = type(s.dask.tasks[copy])("released")  # its worker died: nobody runs it
    [cancel] = [fx for fx in s(m.Tick()) if isinstance(fx, m.Cancel)]
    assert copy in cancel.keys


def test_a_validation_lost_with_its_worker_is_tried_again_then_fails_the_run():
    s = Script(n_shards=2, validation=object())
    s(m.Resumed({1: {0, 1}}, {1: (2, "v2")}, {(1, 0): 1, (1, 1): 1}))
    for attempt in range(10):
        [(key, task)] = [(k, t) for k, t in s.state.tasks.records.items() if t.kind == "validation"]
        assert task.attempt == attempt
        [read] = [fx for fx in s(m.Completed(key)) if isinstance(fx, m.Read)]
        effects = s(m.TaskFailed(read.task, ConnectionResetError("worker died")))
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]  # the tenth loss
    assert fail.failure.kind == "task" and "validation task" in fail.failure.message


def test_with_nothing_left_to_run_or_wait_for_an_incomplete_run_fails_as_stuck():
    """The net under the run's bookkeeping: copies it lost track of (no path of the run's own does that)."""
    s = Script(n_shards=2)
    out = keys(s(m.Poll()))
    assert s(m.Idle()) == []  # copies are out
    for key in out:
        s.state.tasks.pop(key)
    [fail] = [fx for fx in s(m.Idle()) if isinstance(fx, m.Fail)]
    assert fail.failure.kind == "stuck" and "epoch 1 is not complete" in fail.failure.message


def test_copies_and_validations_cancelled_from_outside_the_run_are_sent_again():
    """``client.restart()`` cancels every client's futures, the run's own included: a copy the run did not
    cancel (its shard neither merged nor given up, the run not stopping) is sent again without blame,
    and so is a validation an epoch waits for.  The run used to drop the copy, train every later epoch,
    and fail as stuck on the shard it had dropped."""
    s = Script(n_shards=2, max_attempts=1, validation=object())
    out = keys(s(m.Poll()))
    for key in out:
        s(m.Completed(key, cancelled=True))
    assert [r["reason"] for r in rows(s.state, "cancelled")] == [f"cancelled: {OUTSIDE}"] * 2
    again = sorted((t.epoch, t.shard, t.attempt) for _, t in s.state.tasks.updates())
    assert again == [(1, 0, 1), (1, 1, 1)] and s.state.failure is None  # (max_attempts=1: not counted)
    assert all(r.faults == 0 for r in s.state.pool.records.values()) and s.state.ledger.skipped == {}
    s(m.Committed(Head(step=1, version="v1", version_step=1)))
    submit_validation(s.state)
    [(key, task)] = [(k, t) for k, t in s.state.tasks.records.items() if t.kind == "validation"]
    s(m.Completed(key, cancelled=True))
    [(_, retry)] = [(k, t) for k, t in s.state.tasks.records.items() if t.kind == "validation"]
    assert (retry.step, retry.attempt) == (task.step, 1)


def test_the_end_turns_down_what_was_handed_over_and_takes_no_more_hand_overs():
    s = Script()
    out = keys(s(m.Poll()))
    s.start(out[0], "a")
    s(m.HandOver(out[0], s.record(out[0], "a")))
    assert s.state.arrived == 1 and s.state.settled == 0
    left = sorted(k for k, _ in s.state.tasks.updates())
    [cancel] = [fx for fx in s(m.Finish()) if isinstance(fx, m.Cancel)]
    assert s.state.settled == 1 and not s.state.tasks.handed  # nobody waits for its base on it
    assert sorted(cancel.keys) == left and out[1] in left and not s.state.tasks.records
    assert [r["reason"] for r in rows(s.state, "cancelled")] == ["cancelled: run finished"] * (1 + len(left))
    assert s(m.HandOver(out[1], {"worker": "b"})) == [m.Reply([])] and s.state.handed_over == 1


def test_a_commit_that_a_merge_folded_into_is_made_again_before_the_validation_goes_out():
    s = Script(n_shards=2, validation=object(), on_shard_failure="skip", max_attempts=1)
    out = keys(s(m.Poll()))
    s.start(out[0], "a")
    s.merge(s.finish_task(out[0], "a"))
    from distributed.scheduler import KilledWorker

    s.state.head = Head(step=1, version="v0", version_step=0)  # merged, not committed yet (commit_every > 1)
    s.start(out[1], "b")
    [read] = [fx for fx in s(m.Completed(out[1])) if isinstance(fx, m.Read)]
    effects = s(m.TaskFailed(read.task, KilledWorker(out[1], _Worker("b"), 3)))  # one attempt: skipped, epoch ends
    # the skip reaches the run's progress before the commit that stores it (the epoch ends at step 1)
    assert [fx for fx in effects if not isinstance(fx, m.Emit)] == [m.Skip(1, read.task.shard, 1), m.Commit()]
    # meanwhile the driver merged a result the commit did not include (folded): the head is not committed
    assert s(m.Committed(Head(step=2, version="v1", version_step=1))) == [m.Commit()]
    [validate] = [fx for fx in s(m.Committed(Head(step=2, version="v2", version_step=2))) if isinstance(fx, m.Submit)]
    assert validate.kind == "validation" and validate.args == ("v2", 2) and not s.state.validate_committed


def test_the_core_refuses_what_is_not_an_event():
    with pytest.raises(TypeError, match="not an event of a run's core"):
        handle(Script().state, "tick")  # type: ignore[arg-type]


def test_each_merge_carries_the_tasks_in_flight_when_its_result_came():
    """fit's default rule follows a fleet that grows (vcdask.engine.following): the merge thread learns
    the tasks in flight from each merge's record, as the pool counts them when the result arrives."""
    s = Script(workers=("a",))
    [key] = keys(s(m.Poll()))
    s.start(key, "a")
    s(m.Joined("b", 2))  # a worker of two threads joins while the first task trains
    [merge] = [fx for fx in s.finish_task(key, "a") if isinstance(fx, m.Merge)]
    assert merge.record["in_flight"] == 3


def test_the_status_alpha_is_the_newest_merges_whatever_rule_the_spec_started_with():
    """A run on fit's default may move on from its spec's rule as its fleet grows (engine/following.py):
    the status shows the alpha the newest merge used, as the panel's update events do (None for a rule
    without one); before the first merge, the spec's rule's."""
    from vcdask.engine.views import _alpha_now
    from vcdask.merge import VCASGD

    s = Script(workers=("a",), merge=VCASGD(alpha=0.7))
    assert _alpha_now(s.state) == pytest.approx(0.7)
    [key] = keys(s(m.Poll()))
    s.start(key, "a")
    s.merge(s.finish_task(key, "a"), alpha=0.25)
    assert _alpha_now(s.state) == 0.25
    key = next(k for k, t in s.state.tasks.updates() if t.started is None)  # (sent with the hand-over)
    s.start(key, "a")
    s.merge(s.finish_task(key, "a"), alpha=None)  # delayed Nesterov, grown into: no alpha
    assert _alpha_now(s.state) is None


@pytest.mark.parametrize("running", [False, True], ids=["queued", "running"])
def test_a_shard_blamed_for_its_data_is_given_up_in_the_next_epoch_too_whose_copy_failed_first(running):
    """Epochs overlap: the bad shard's next-epoch copy comes back NaN (from ``a`` again) before its
    first-epoch retry does (from ``b``).  Once the data is blamed, the next epoch's shard is given up too,
    its re-issued copy cancelled (or, already running, recorded late), and ``a`` counted once, forgiven."""
    s = Script(n_shards=2, max_epochs=2, on_shard_failure="skip")
    first = keys(s(m.Poll()))
    bad, good = (s.state.tasks.records[k] for k in first)
    s.start(first[0], "a")
    retry = keys(s.merge(s.finish_task(first[0], "a"), accept=False, fault="non-finite"))
    s.start(first[1], "b")
    s.merge(s.finish_task(first[1], "b"))
    [retry1] = [k for k in retry + keys(s(m.Poll())) if s.state.tasks.records[k].copy_of(1, bad.shard)]
    s.start(retry1, "b")  # epoch 1's retry, held on b ...
    [bad2] = [k for k, t in s.state.tasks.updates() if t.copy_of(2, bad.shard)]
    s.start(bad2, "a")  # ... while epoch 2's copy comes back NaN from a first
    sent = keys(s.merge(s.finish_task(bad2, "a"), accept=False, fault="non-finite"))
    assert s.state.pool.record("a").rejected == 1  # a's second NaN of the same shard: counted once
    [retry2] = [k for k in sent + keys(s(m.Poll())) if s.state.tasks.records[k].copy_of(2, bad.shard)]
    if running:
        s.start(retry2, "b")
    effects = s.merge(s.finish_task(retry1, "b"), accept=False, fault="non-finite")
    assert s.state.ledger.skipped == {1: {bad.shard}, 2: {bad.shard}}
    assert [r["epoch"] for r in rows(s.state, "skipped")] == [1, 2]
    assert all("samples" in r["reason"] for r in rows(s.state, "skipped"))
    assert [r["epoch"] for r in rows(s.state, "rejected")] == [1, 2, 1]  # epoch 2: given up at its first
    assert s.state.pool.record("a").rejected == s.state.pool.record("b").rejected == 0  # the data's doing
    cancelled = [fx.keys for fx in effects if isinstance(fx, m.Cancel)]
    if running:
        assert cancelled == []  # a running copy cannot be stopped: it finishes, recorded late
        s.finish_task(retry2, "b")
        [late] = rows(s.state, "late")
        assert late["epoch"] == 2 and late["reason"] == "late: (epoch, shard) was given up (skipped) meanwhile"
    else:
        assert cancelled == [(retry2,)]
        s(m.Completed(retry2, cancelled=True))
        [row] = rows(s.state, "cancelled")
        assert row["reason"] == "cancelled: the shard was given up (skipped) for this epoch"
    assert not rows(s.state, "duplicate") and good.shard != bad.shard


def _nan_from_a(s: Script, key: str, shard: int, times: int) -> None:
    """Worker "a" sends (epoch 1, ``shard``) back NaN ``times`` times, each copy the run sends it again."""
    for _ in range(times):
        s.start(key, "a")
        sent = keys(s.merge(s.finish_task(key, "a"), accept=False, fault="non-finite"))
        copies = [k for k in sent + keys(s(m.Poll())) if s.state.tasks.records[k].copy_of(1, shard)]
        key = copies[0] if copies else key


def test_the_only_worker_sending_one_shard_back_nan_is_blamed_once_and_the_shard_fails_its_attempts():
    """A run on one worker that trains the other shards fine, with one shard whose data gives NaN: the copies
    sent again to the same worker count against the shard, not the worker again, so ``on_shard_failure``
    applies (here: skip) and the run goes on (it used to exclude its only worker and wait
    ``no_worker_timeout`` for another); a worker that sends NaN for every shard is still excluded."""
    s = Script(n_shards=4, workers=("a",), max_attempts=3, max_worker_failures=3, on_shard_failure="skip")
    first = keys(s(m.Poll()))[0]
    s.start(first, "a")
    s.merge(s.finish_task(first, "a"))  # the worker trains a shard fine
    key = next(k for k, t in s.state.tasks.records.items() if t.kind == "update")
    shard = s.state.tasks.records[key].shard
    _nan_from_a(s, key, shard, times=3)
    record = s.state.pool.record("a")
    assert record.rejected == 1 and not record.excluded and s.state.ledger.skipped == {1: {shard}}
    for _ in range(2):  # two more shards come back NaN: blamed for each, the third excludes the worker
        key = next(k for k, t in s.state.tasks.records.items() if t.kind == "update" and t.shard != shard)
        shard = s.state.tasks.records[key].shard
        s.start(key, "a")
        s.merge(s.finish_task(key, "a"), accept=False, fault="non-finite")
        s(m.Poll())
    assert record.rejected == 3 and record.excluded
    assert "no usable worker" in s.state.no_workers and "training" not in s.state.no_workers  # (it merged a shard)


def test_the_only_worker_that_has_merged_nothing_is_blamed_for_each_nan_of_the_same_copy():
    """Not the data's doing as far as anyone can tell (no second worker tried it, and this one trains
    nothing): every NaN of the same epoch's copy counts against the worker, so a worker that fails alone is
    excluded and the run waits for a good one to join (tests/test_chaos.py runs it)."""
    s = Script(n_shards=2, workers=("a",), max_attempts=4, max_worker_failures=3)
    key = keys(s(m.Poll()))[0]
    shard = s.state.tasks.records[key].shard
    _nan_from_a(s, key, shard, times=3)
    assert s.state.pool.record("a").rejected == 3 and s.state.pool.record("a").excluded


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_copy_being_merged_still_runs_so_its_overdue_sibling_neither_skips_nor_fails_the_shard(policy):
    """A result taken out of the queue for its merge (or read back) is a running copy of its shard until
    the merge is in: a sibling copy past its deadline meanwhile must not use the shard's last attempt."""
    s = Script(n_shards=4, workers=("a", "b", "c"), deadline=5.0, max_attempts=2, on_shard_failure=policy)
    first, *others = keys(s(m.Poll()))
    for key, worker in zip((first, *others), "abc", strict=True):
        s.start(key, worker)
    shard = s.state.tasks.records[first].shard
    s.clock.advance(6.0)  # every copy is past its deadline: each is re-issued once
    [copy] = [fx.key for fx in s(m.Tick()) if isinstance(fx, m.Submit) and fx.args[1] == shard]
    s.start(copy, "b")
    merging = s.finish_task(first, "a")  # the late first copy comes back: the driver merges it ...
    s.clock.advance(6.0)  # ... while the re-issued copy, on its last attempt, passes its own deadline
    during = s(m.Tick())
    assert not any(isinstance(fx, m.Fail) for fx in during)
    assert not rows(s.state, "skipped") and s.state.ledger.skipped == {}
    s.merge(merging)
    ledger = s.state.ledger
    assert ledger.merged == {1: {shard}} and ledger.remaining(1) == 3  # merged once, counted once


def test_a_copy_whose_record_is_being_read_back_still_runs_until_it_is_lost():
    s = Script(n_shards=2, deadline=5.0, max_attempts=3)
    first = keys(s(m.Poll()))[0]
    s.start(first, "a")
    shard = s.state.tasks.records[first].shard
    s.clock.advance(6.0)
    [copy] = [fx.key for fx in s(m.Tick()) if isinstance(fx, m.Submit) and fx.args[1] == shard]
    s.start(copy, "b")
    s.dask.finish(first)
    [read] = [fx for fx in s(m.Completed(first)) if isinstance(fx, m.Read)]  # Dask says done: read it back
    assert s.state.tasks.copy_running(1, shard)
    s.clock.advance(6.0)  # the copy passes its deadline while the first one's record is read
    assert [fx for fx in s(m.Tick()) if isinstance(fx, m.Submit) and fx.args[1] == shard] == []
    again = s(m.Lost(read.task, "its worker died"))  # the read failed: no copy runs any more
    assert [fx.args[1] for fx in again if isinstance(fx, m.Submit)] == [shard]


def test_a_skip_that_ends_the_epoch_while_merges_wait_for_their_commit_validates_the_committed_end():
    """The epoch ends at the head's step: a version validated before it (the head's last committed one)
    does not close it; the head is committed, then validated, then the epoch closes."""
    s = Script(
        n_shards=3,
        workers=("a", "b", "c"),
        validation=object(),
        validate_every=1,
        max_attempts=1,
        on_shard_failure="skip",
    )
    a, b, c = keys(s(m.Poll()))
    for key, worker in zip((a, b, c), "abc", strict=True):
        s.start(key, worker)
    [validate] = [fx for fx in s.merge(s.finish_task(a, "a")) if isinstance(fx, m.Submit)]  # step 1, committed
    s(m.Result(s.state.tasks.pop(validate.key), {"kind": "validation", "step": 1, "metrics": {"loss": 0.5}}))
    [merge] = [fx for fx in s.finish_task(b, "b") if isinstance(fx, m.Merge)]
    folded = Head(step=2, version="v1", version_step=1, folded=True)  # merged, its commit folded into a later one
    s(m.Merged(merge.task, merge.record, {"accepted": True, "staleness": 0, "alpha": 0.5, "new_version": 2}, folded))
    from distributed.scheduler import KilledWorker

    s.dask.finish(c)
    [read] = [fx for fx in s(m.Completed(c)) if isinstance(fx, m.Read)]
    effects = s(m.TaskFailed(read.task, KilledWorker(c, _Worker("c"), 1)))  # its one attempt: skipped, epoch ends
    assert s.state.ledger.epoch_end[1][0] == 2 and s.state.ledger.epochs == []
    assert [fx for fx in effects if not isinstance(fx, m.Emit)] == [m.Skip(1, read.task.shard, 2), m.Commit()]
    [validate] = [fx for fx in s(m.Committed(Head(step=2, version="v2", version_step=2))) if isinstance(fx, m.Submit)]
    assert validate.kind == "validation" and validate.args == ("v2", 2)
    s(m.Result(s.state.tasks.pop(validate.key), {"kind": "validation", "step": 2, "metrics": {"loss": 0.4}}))
    assert [e["loss"] for e in s.state.ledger.epochs] == [0.4] and s.state.finished()


def test_an_upload_merged_on_a_resume_has_no_time_and_leaves_deadlines_and_worker_times_alone():
    """A resumed run merges the uploads it found with no measured time (NaN): that must not make the
    median shard time NaN (deadlines would fall to their floor), nor a worker's mean time."""
    from vcdask.engine.inflight import TaskRecord

    s = Script(n_shards=4, deadline_floor=5.0)
    meta = {  # an upload's record as written with it (its task's time is added after the upload)
        "kind": "update",
        "epoch": 1,
        "shard": 0,
        "attempt": 0,
        "worker": "a",
        "train_loss": 1.0,
        "read_seconds": 0.1,
        "train_seconds": 19.0,
        "base_step": 0,
        "update": f"{RUN}/updates/1-0-0",
    }
    s(m.Resumed({}, {}, {}, (meta,)))
    rec = {"seconds": float("nan"), "upload_seconds": float("nan"), **meta}  # as recovery.recover merges it
    s.merge(s(m.Result(TaskRecord("update", 1, 0, 0, 0), rec, taken=True)))
    assert s.state.ledger.shard_seconds == [] and s.state.ledger.merged == {1: {0}}
    warm = s.state.pool.record("a")
    assert (warm.done, warm.timed, warm.seconds) == (1, 0, 0.0)
    on_a, on_b = keys(s(m.Poll()))
    s.start(on_a, "a")
    s.start(on_b, "b")
    s.merge(s.finish_task(on_b, "b", seconds=20.0))  # a measured one: 20 s
    assert s.state.ledger.shard_seconds == [20.0] and s.state.pool.record("b").mean_seconds == 20.0
    s.clock.advance(6.0)  # the copy on the warm worker "a", 6 s into a shard that takes 20: not late
    assert not emitted(s(m.Tick()), "reissue") and warm.timed_out == 0


def test_a_copy_the_hand_over_counted_started_is_timed_from_its_own_start_and_not_blamed_while_it_waits():
    """The copy sent with a hand-over's answer is counted started then, but its worker may run other work
    first (another run's task, another user's): past its deadline it was blamed on the worker, three times
    over excluded it, and a run sharing its cluster failed with no usable worker.  It is waited for as a
    queued copy until it says it began; from then on its deadline counts."""
    s = Script(n_shards=6, deadline=5.0)
    first = keys(s(m.Poll()))[0]
    s.start(first, "a")
    s.dask.finish(first)
    [nxt] = [fx.value for fx in s(m.HandOver(first, s.record(first, "a"))) if isinstance(fx, m.Reply)]
    queued = nxt[0]
    s.dask.run(queued, "a")  # Dask has it processing on a; a's thread still runs something else
    s(m.Started(queued, "a", handed=True))  # the hand-over's answer took its base
    task = s.state.tasks.records[queued]
    assert task.handed and task.started == s.clock.t
    s.clock.advance(6.0)
    assert not emitted(s(m.Tick()), "reissue")  # past the deadline, within a queued copy's patience
    s.clock.advance(60.0)
    [why] = [e["why"] for e in emitted(s(m.Tick()), "reissue") if e["shard"] == task.shard]
    assert why == "never started" and s.state.pool.record("a").timed_out == 0
    assert s.state.dispatch.failures.get((task.epoch, task.shard), 0) == 0  # nor the shard's failure
    # a copy that says it began: its deadline counts from then, and its worker answers for it
    s = Script(n_shards=6, deadline=5.0, workers=("a",))
    first = keys(s(m.Poll()))[0]
    s.start(first, "a")
    s.dask.finish(first)
    [[later]] = [fx.value for fx in s(m.HandOver(first, s.record(first, "a"))) if isinstance(fx, m.Reply)]
    s.dask.run(later, "a")
    s(m.Started(later, "a", handed=True))
    s.clock.advance(12.0)
    s(m.Started(later, "a"))  # it begins, 12 s after the hand-over
    task = s.state.tasks.records[later]
    assert task.started == s.clock.t and not task.handed
    s.clock.advance(4.0)
    assert not emitted(s(m.Tick()), "reissue")
    s.clock.advance(2.0)
    assert [e["why"] for e in emitted(s(m.Tick()), "reissue")] == ["ran past its 5.0 s deadline"]
    assert s.state.pool.record("a").timed_out == 1


def _handed_copy(s: Script, worker: str = "a") -> str:
    """A copy sent with the hand-over's answer of the task before it on ``worker``, which has not said it
    began (Dask has it processing there; the worker's thread may run other work first)."""
    first = keys(s(m.Poll()))[0]
    s.start(first, worker)
    s.dask.finish(first)
    [[key]] = [fx.value for fx in s(m.HandOver(first, s.record(first, worker))) if isinstance(fx, m.Reply)]
    s.dask.run(key, worker)
    s(m.Started(key, worker, handed=True))
    return key


def test_a_copy_only_the_hand_over_counted_started_is_a_queued_copy_everywhere_its_worker_answers():
    """Stuck workers, a preemption notice, a worker lost: a copy that has not said it began is a queued
    copy for each of them, as for its deadline (its worker is not stuck for holding it, a notice moves it
    at once, and a worker lost under it is not blamed for it)."""
    from distributed.scheduler import KilledWorker

    s = Script(n_shards=6, deadline=5.0)
    key = _handed_copy(s)
    shard = s.state.tasks.records[key].shard
    s.clock.advance(60.0)
    assert [e["why"] for e in emitted(s(m.Tick()), "reissue") if e["shard"] == shard]
    assert s.state.stuck_workers() == set()  # (busy with other work: not frozen)

    s = Script(n_shards=6, deadline=5.0)
    key = _handed_copy(s)
    s.clock.advance(3.0)
    [(moved, kept)] = [fx.value for fx in s(m.Preempt("a", window=60.0)) if isinstance(fx, m.Reply)]
    assert kept == [] and len(moved) >= 1 and s.state.tasks.records[key].overdue
    assert s.state.pool.record("a").wasted_seconds == 0.0  # (no work of it was lost with the instance)

    s = Script(n_shards=6, deadline=5.0, max_worker_failures=1)
    key = _handed_copy(s)
    task = s.state.tasks.records[key]
    s(m.TaskFailed(task, KilledWorker(key, _Worker("a"), 3)))
    assert s.state.pool.record("a").failed == 0 and s.state.pool.record("a").excluded is None
    assert s.state.dispatch.failures.get((task.epoch, task.shard), 0) == 0


def test_a_worker_the_store_refuses_is_blamed_and_its_shard_tried_elsewhere():
    """A worker without credentials of its own (it joined after the run's start was checked) is refused by the
    store: its fault, not the shard's.  It is blamed, excluded at ``max_worker_failures``, and the copy goes to
    another worker; a store that refuses every worker still gives the shard up after ``max_attempts``."""
    from vcdask.errors import StoreAccessDeniedError

    refused = StoreAccessDeniedError("opening 's3://b/vc': no credentials")
    s = Script(n_shards=2, workers=("a", "b", "c"), max_attempts=3, max_worker_failures=1)
    key = keys(s(m.Poll()))[0]
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    effects = s(m.TaskFailed(task, refused))
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert again.args[:3] == (task.epoch, task.shard, 1)
    assert s.state.tasks.records[again.key].placed != "a"  # (not back to the worker the store refused)
    record = s.state.pool.record("a")
    assert record.failed == 1 and record.excluded is not None and "refused" in record.last_fault
    assert emitted(effects, "excluded")[0]["worker"] == "a"
    assert "no credentials" in rows(s.state, "lost")[0]["reason"]
    key = again.key
    for worker in ("b", "c"):
        s.start(key, worker)
        task = s.state.tasks.records[key]
        s(m.Completed(key))
        effects = s(m.TaskFailed(task, refused))
        key = next((fx.key for fx in effects if isinstance(fx, m.Submit)), key)
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    assert "failed 3 times (last: StoreAccessDeniedError: opening 's3://b/vc': no credentials)" in fail.failure.message


def test_a_worker_without_the_runs_device_gets_no_more_shards_and_its_copy_goes_elsewhere():
    """``device="cuda"`` on a mixed fleet: a CPU worker's task raises ``DeviceUnavailableError``.  That ended the
    run (a task error under ``on_shard_failure="stop"``); the worker is now excluded at once, whatever its
    faults, and the copy re-issued elsewhere, not counted against the shard once a worker has trained one."""
    from vcdask.errors import DeviceUnavailableError

    missing = DeviceUnavailableError("device='cuda' but this worker has no CUDA device (torch 2.13.0+cpu)")
    s = Script(n_shards=2, max_attempts=1)
    first, key = keys(s(m.Poll()))
    s.start(first, "b")
    s.merge(s.finish_task(first, "b"))  # (b has the device)
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    effects = s(m.TaskFailed(task, missing))
    assert not [fx for fx in effects if isinstance(fx, m.Fail)]
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert again.args[:3] == (task.epoch, task.shard, 1) and s.state.dispatch.failures[(1, task.shard)] == 0
    assert s.state.tasks.records[again.key].placed == "b"
    record = s.state.pool.record("a")
    assert record.excluded == str(missing) and record.failed == 0 and "a" not in s.state.pool.usable()
    s.state.pool.forgive("a", "failed")  # (another fault taken back does not lift it)
    assert record.excluded == str(missing)
    assert emitted(effects, "excluded")[0]["reason"] == str(missing)
    assert "no CUDA device" in rows(s.state, "lost")[0]["reason"]
    s.start(again.key, "b")
    s.merge(s.finish_task(again.key, "b"))


def test_workers_without_the_runs_device_joining_one_after_another_give_the_shard_up_in_the_end():
    """Such losses are not attempts of the shard (with ``max_attempts=1`` a mixed fleet's first CPU worker, failing
    before the GPU worker's first task ended, gave the shard up and ended the run); while no worker has trained a
    shard, they have a bound of their own: workers without the device joining one after another (a fleet scaling
    up, replacements) kept the shard going round, the run's idle clock never running out, for good."""
    from vcdask.engine.core.failures import UNFIT_LOSSES
    from vcdask.errors import DeviceUnavailableError

    s = Script(n_shards=2, workers=("gpu", "cpu"), max_attempts=1)
    first, key = keys(s(m.Poll()))
    s.start(first, "gpu")  # (training, not done yet)
    s.start(key, "cpu")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    effects = s(m.TaskFailed(task, DeviceUnavailableError("device='cuda' but cpu has no CUDA device")))
    assert not [fx for fx in effects if isinstance(fx, m.Fail)]
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert s.state.tasks.records[again.key].placed == "gpu"

    s = Script(n_shards=1, workers=("w0",), max_attempts=1)
    [key] = keys(s(m.Poll()))
    for n in range(UNFIT_LOSSES):
        worker = f"w{n}"
        if n:
            [key] = keys(s(m.Joined(worker, 1)) + s(m.Poll()))
        s.start(key, worker)
        task = s.state.tasks.records[key]
        s(m.Completed(key))
        effects = s(m.TaskFailed(task, DeviceUnavailableError(f"device='cuda' but {worker} has no CUDA device")))
        s(m.Left(worker))
        if n < UNFIT_LOSSES - 1:
            assert not [fx for fx in effects if isinstance(fx, m.Fail)], n
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    assert f"went to {UNFIT_LOSSES} workers without the run's device, and no worker has trained" in fail.failure.message


def test_a_validation_on_a_worker_without_the_runs_device_goes_elsewhere():
    from vcdask.errors import DeviceUnavailableError

    s = Script(n_shards=2, validation=object())
    effects = s(m.Resumed({1: {0, 1}}, {1: (2, "v2")}, {(1, 0): 1, (1, 1): 1}))
    [validate] = [fx for fx in effects if isinstance(fx, m.Submit)]
    s.start(validate.key, "a")
    task = s.state.tasks.records[validate.key]
    s(m.Completed(validate.key))
    effects = s(m.TaskFailed(task, DeviceUnavailableError("device='mps' but this worker has no MPS device")))
    assert not [fx for fx in effects if isinstance(fx, m.Fail)]
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert again.kind == "validation" and again.args == ("v2", 2) and again.where == {"workers": ["b"]}
    assert s.state.pool.record("a").excluded == "device='mps' but this worker has no MPS device"
