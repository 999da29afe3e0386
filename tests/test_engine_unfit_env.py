"""The run's core (vcdask.engine.core) on workers whose environment cannot run the run: no module of the user's
model (``WorkerEnvironmentError``), no view of the store (``StoreNotSharedError``), a plain ``OSError`` of the
worker's environment.  Scripted events, no cluster (tests/test_worker_environment.py plays them on real workers)."""

from __future__ import annotations

import errno
import pickle

import pytest
from test_engine_core import Script, emitted, keys

from vcdask.engine.core import messages as m
from vcdask.errors import StoreAccessDeniedError, StoreNotSharedError, WorkerEnvironmentError

MODULE = WorkerEnvironmentError(
    "worker a cannot load run r's model: ModuleNotFoundError: No module named 'mymodels'; install module "
    "'mymodels' on every worker, send it with client.upload_file(...), or define the class in the script's __main__",
    process="a",
)
STORE = StoreNotSharedError(
    "worker a does not see the store at /tmp/x/store (no vcdask store at local directory '/tmp/x/store' here): a "
    "local store must be on a filesystem every worker shares; use an object store for a fleet",
    process="a",
)


def _one_merged_one_failing(error, on: str | None = "a"):
    """Two shards: the first merged from worker b, the second started on ``on`` (None: before it said it started)
    and failed with ``error``; (script, the failed task, the effects of its failure)."""
    s = Script(n_shards=2, max_attempts=1)
    first, key = keys(s(m.Poll()))
    s.start(first, "b")
    s.merge(s.finish_task(first, "b"))
    if on is not None:
        s.start(key, on)
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    return s, task, s(m.TaskFailed(task, error))


@pytest.mark.parametrize("error", [MODULE, STORE], ids=["module", "store"])
def test_a_worker_that_cannot_run_the_run_gets_no_more_shards_and_its_copy_goes_elsewhere(error):
    """Such a task's error failed the run (a module: a task error) or used up the shard's attempts on the worker
    that fails at once (a store: ``OSError``, lost); the worker is now unfit, named, and the copy goes elsewhere,
    not counted against the shard."""
    error = pickle.loads(pickle.dumps(error))  # (as it comes from the worker)
    s, task, effects = _one_merged_one_failing(error)
    assert not [fx for fx in effects if isinstance(fx, m.Fail)]
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert s.state.dispatch.failures[(1, task.shard)] == 0 and s.state.tasks.records[again.key].placed == "b"
    record = s.state.pool.record("a")
    assert record.excluded == str(error) and "a" not in s.state.pool.usable()
    assert emitted(effects, "excluded")[0]["reason"].startswith("worker a ")


def test_a_task_that_failed_before_it_said_it_started_names_its_worker_itself():
    """A task that fails while it loads the spec may fail before the run heard that it started: the worker its
    error names is the unfit one."""
    s, task, effects = _one_merged_one_failing(MODULE, on=None)
    assert task.worker is None
    assert not [fx for fx in effects if isinstance(fx, m.Fail)]
    assert s.state.pool.record("a").excluded == str(MODULE)


def test_no_worker_that_can_run_it_gives_the_shard_up_naming_why():
    from vcdask.engine.core.failures import UNFIT_LOSSES

    s = Script(n_shards=1, workers=("w0",), max_attempts=1)
    [key] = keys(s(m.Poll()))
    for n in range(UNFIT_LOSSES):
        worker = f"w{n}"
        if n:
            [key] = keys(s(m.Joined(worker, 1)) + s(m.Poll()))
        s.start(key, worker)
        task = s.state.tasks.records[key]
        s(m.Completed(key))
        effects = s(m.TaskFailed(task, WorkerEnvironmentError(f"worker {worker} cannot load run r's model")))
        s(m.Left(worker))
    [fail] = [fx for fx in effects if isinstance(fx, m.Fail)]
    assert f"went to {UNFIT_LOSSES} workers that cannot run it, and no worker has trained" in fail.failure.message
    assert "cannot load run r's model" in fail.failure.message


def test_a_plain_os_error_on_a_worker_sends_the_retry_elsewhere():
    """An ``OSError`` of the worker's environment (not the run's store) is a lost copy, as before; its retry
    now avoids that worker (it went back to the worker that had failed it at once, idle first)."""
    s = Script(n_shards=2, max_attempts=3)
    first, key = keys(s(m.Poll()))
    s.start(first, "b")
    s.merge(s.finish_task(first, "b"))
    s.start(key, "a")
    task = s.state.tasks.records[key]
    s(m.Completed(key))
    effects = s(m.TaskFailed(task, OSError(errno.EIO, "Input/output error")))
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert s.state.tasks.records[again.key].placed == "b"
    assert s.state.dispatch.failures[(1, task.shard)] == 1


def test_a_read_only_mount_is_refused_by_the_side_files_not_an_outage(tmp_path):
    """``EROFS`` (a worker's read-only mount) and ``EACCES`` writing a side file were store faults (the run paused
    as for an outage, the worker never excluded); they are access denied, as for the store's own files."""
    from vcdask.store._files import _fault

    for code in (errno.EROFS, errno.EACCES):
        err = _fault(OSError(code, "Read-only file system"), "writing 'u.safetensors'")
        assert isinstance(err, StoreAccessDeniedError), code
    assert not isinstance(_fault(OSError(errno.EIO, "I/O"), "writing"), StoreAccessDeniedError)


def test_a_worker_unfit_for_the_run_that_is_replaced_at_its_address_gets_shards_again():
    """A worker without the model's module is excluded; the user restarts it, fixed, at the same address: the new
    process got no shard for the rest of the run.  It comes back without that exclusion (its faults stay)."""
    s, _, _ = _one_merged_one_failing(MODULE)
    assert "a" not in s.state.pool.usable()
    s(m.Joined("a", 1))  # (a heartbeat's re-join of the same process: still unfit)
    assert "a" not in s.state.pool.usable()
    s(m.Left("a"))
    s(m.Joined("a", 1))
    assert "a" in s.state.pool.usable() and s.state.pool.record("a").excluded is None
