"""The run's tasks in flight (vcdask.engine.inflight): results handed over by their tasks still count."""

from __future__ import annotations

from vcdask.engine.inflight import InFlight, TaskRecord


class _Completed:
    """What InFlight reads of distributed.as_completed: count() and has_ready()."""

    def __init__(self, pending: int, ready: int):
        self.pending, self.ready = pending, ready

    def count(self) -> int:
        return self.pending + self.ready

    def has_ready(self) -> bool:
        return self.ready > 0


def test_a_handed_over_copy_counts_as_running_until_merged():
    """A copy whose record was handed over is out of the tasks in flight, but its shard is not without a
    copy: re-issuing it (or skipping it once its attempts are spent) would waste or lose that result."""
    tasks = InFlight(scheduler=None)
    assert not tasks.copy_running(1, 2)
    late = TaskRecord("update", 1, 2, attempt=0, overdue=True)
    tasks.handed.append((late, {"epoch": 1, "shard": 2}))
    assert tasks.copy_running(1, 2)  # even an overdue copy's result in hand will be merged
    assert not tasks.copy_running(1, 3) and not tasks.copy_running(2, 2)
    tasks.handed.clear()
    assert not tasks.copy_running(1, 2)


def test_a_handed_over_validation_is_not_submitted_again():
    tasks = InFlight(scheduler=None)
    tasks.handed.append((TaskRecord("validation", step=7), {"kind": "validation", "step": 7}))
    assert tasks.validating(7) and not tasks.validating(8)


def test_results_waiting_leaves_out_late_reports_of_handed_over_tasks():
    tasks = InFlight(scheduler=None)
    assert not tasks.results_waiting()  # no client yet
    tasks.completed = _Completed(pending=0, ready=1)
    assert tasks.results_waiting()  # a finished future nobody handed over
    tasks.stale = {"k"}
    assert not tasks.results_waiting()  # the one ready future is Dask's late report of a hand-over
    tasks.completed = _Completed(pending=1, ready=1)
    assert tasks.results_waiting()  # one of the two is a real result (which one is ready is not known)
    tasks.completed = _Completed(pending=0, ready=0)
    tasks.handed.append((TaskRecord("update", 1, 0), {}))
    assert tasks.results_waiting()


class _Task:
    def __init__(self, state: str, on: str | None = None):
        self.state = state
        self.processing_on = None if on is None else type("W", (), {"address": on})()


class _Scheduler:
    def __init__(self, tasks: dict[str, _Task]):
        self.tasks = tasks


def test_held_counts_a_copy_where_it_was_placed_until_dask_assigns_it():
    """The run's own submit reaches the scheduler a message later: a copy sent this turn is not in
    Dask's task table yet, and two copies sent in one turn to the one free worker both found it free
    (the second then queued behind the first there: behind a frozen worker, for its whole deadline)."""
    scheduler = _Scheduler({})
    tasks = InFlight(scheduler=scheduler)
    tasks.records = {
        "running": TaskRecord("update", 1, 0, placed="a"),
        "moved": TaskRecord("update", 1, 1, placed="a"),
        "sent": TaskRecord("update", 1, 2, placed="b"),
        "loose": TaskRecord("update", 1, 3, placed=None),
        "done": TaskRecord("update", 1, 4, placed="c"),
        "check": TaskRecord("validation", step=3, placed="c"),
    }
    scheduler.tasks = {
        "running": _Task("processing", on="a"),
        "moved": _Task("processing", on="b"),  # Dask moved it (placement is loose): where it runs counts
        "loose": _Task("queued"),
        "done": _Task("memory"),  # finished, its result not read yet: it holds no worker
        "check": _Task("processing", on="c"),  # validations are not shard copies
    }
    assert tasks.held() == {"a": 1, "b": 2}  # "sent" is not known to Dask yet: counted where it was placed
    scheduler.tasks["sent"] = _Task("processing", on="c")
    assert tasks.held() == {"a": 1, "b": 1, "c": 1}


def test_dask_starts_no_copy_placed_on_workers_that_all_left_and_the_table_says_it_is_stranded():
    """On a real scheduler (worker threads, no processes): a task placed loosely on a worker
    (``allow_other_workers=True``, the sticky placement of a shard copy) waits as ``no-worker`` once that
    worker and every other left, and stays there when a new worker joins.  ``TaskTable.stranded`` names
    it, and only while no worker its placement names is connected.  (If a Dask release starts such tasks on
    the new worker, the first assertion fails: the run's workaround is then no longer needed.)"""
    import time

    from distributed import Client, Event, LocalCluster

    def hold(name: str) -> None:
        Event(name).wait(30)

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        [first] = client.scheduler_info()["workers"]
        busy = client.submit(hold, "vcdask-test-hold", pure=False)  # the worker's one thread
        copy = client.submit(sum, [1, 2], workers=[first], allow_other_workers=True, key="copy")
        scheduler, table = cluster.scheduler, InFlight(scheduler=cluster.scheduler)
        deadline = time.monotonic() + 10
        while table.processing_on("copy") != first:
            assert time.monotonic() < deadline, table.state("copy")
            time.sleep(0.05)
        cluster.scale(0)
        while scheduler.workers or table.state("copy") != "no-worker":
            assert time.monotonic() < deadline + 10, (list(scheduler.workers), table.state("copy"))
            time.sleep(0.05)
        Event("vcdask-test-hold", client=client).set()  # (the old worker's thread lets it close)
        cluster.scale(1)
        client.wait_for_workers(1, timeout=30)
        time.sleep(0.5)
        assert table.state("copy") == "no-worker"  # Dask left it there: the new worker is not one it names
        assert table.stranded("copy", set(scheduler.workers))
        assert not table.stranded("copy", {first, *scheduler.workers})  # one it names is connected
        del busy, copy
