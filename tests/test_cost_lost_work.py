"""Work lost to a worker that dies without a notice (Dask runs its copy again elsewhere) is wasted time,
counted once: scripted on a run's core, and on real workers, one SIGKILLed mid-shard."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import dask.config
import pytest
from chaos_helpers import SlowerOnceFlagged, copies_started_on, fit_in_thread, running_run, worker_info, worker_pid
from distributed import Client
from spec_helpers import core_spec

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import digits_cnn
from vcdask.engine.core import handle
from vcdask.engine.core import messages as m
from vcdask.engine.inflight import TaskRecord

PRICES = {"m.test": {"on-demand": 1.0, "spot": 0.3}}


def _run(now):
    from vcdask.engine.core import RunState

    spec = core_spec("run-lost", prices=PRICES)
    run = RunState(spec, {"a": 1, "b": 1}, SimpleNamespace(tasks={}), wall=lambda: now[0])
    run.clock = lambda: now[0]
    run.pool.clock = lambda: now[0]
    return run


def _wasted(run):
    return {r["worker"]: r["wasted_seconds"] for r in run.pool.rows()}


def test_a_copy_dask_runs_again_elsewhere_wastes_its_first_workers_time_up_to_its_leaving():
    now = [0.0]
    run = _run(now)
    run.tasks.add("k", TaskRecord("update", epoch=1, shard=0))
    handle(run, m.Started("k", "a"))
    now[0] = 7.0
    handle(run, m.Left("a"))  # killed 7 s into the shard
    now[0] = 30.0  # Dask found it a place after 23 s more: not a's work
    handle(run, m.Started("k", "b"))
    assert _wasted(run) == {"a": 7.0, "b": 0.0}
    handle(run, m.Started("k", "b"))  # its start said again (the task's own, after the hand-over's): no more
    assert _wasted(run) == {"a": 7.0, "b": 0.0}


def test_a_copy_already_counted_is_not_counted_again():
    now = [0.0]
    run = _run(now)
    run.tasks.add("k", TaskRecord("update", epoch=1, shard=0))
    handle(run, m.Started("k", "a"))
    now[0] = 5.0
    run.tasks.records["k"].overdue = True  # re-issued on a notice, or late: its 5 s counted as wasted then
    run.pool.wasted("a", 5.0)
    handle(run, m.Left("a"))
    now[0] = 9.0
    handle(run, m.Started("k", "b"))  # Dask runs the superseded copy too
    assert _wasted(run) == {"a": 5.0, "b": 0.0}
    # a copy only handed over on a (its base sent, not begun there) wasted nothing of a's
    run.tasks.add("h", TaskRecord("update", epoch=1, shard=1))
    handle(run, m.Started("h", "a", handed=True))
    handle(run, m.Started("h", "b"))
    assert _wasted(run) == {"a": 5.0, "b": 0.0}


@pytest.mark.cluster
def test_a_worker_killed_mid_shard_wastes_the_seconds_it_had_trained(digits_data, tmp_path):
    (X, y), _ = digits_data
    here = {"vcdask.cloud.instance": {"type": "m.test", "market": "spot"}, "vcdask.cloud.prices": PRICES}
    flag = tmp_path / "slow-victim"
    seen = tmp_path / "slow-victim.seen"
    with dask.config.set(here):  # the workers start with it, as cloud workers have it in their config
        with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
            victim = sorted(worker_info(client))[0]
            thread, out = fit_in_thread(
                model=digits_cnn(0),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                max_epochs=4,
                n_shards=8,
                resilience=vcdask.Resilience(deadline=60, max_staleness=None),  # no re-issue for lateness
                # once the flag is up, the victim's next batch takes 5 s: a shard is running there for certain
                train_step=SlowerOnceFlagged(victim, 0.025, str(flag), after=5.0),
                progress=False,
                retention=False,
            )
            running_run(client, min_step=2)
            flag.touch()
            deadline = time.monotonic() + 60
            while not (seen.exists() and client.run_on_scheduler(copies_started_on, victim)):
                assert time.monotonic() < deadline, "no shard running on the victim"
                time.sleep(0.01)
            began = time.monotonic()
            time.sleep(1.5)  # 1.5 s and more of its work in that shard
            os.kill(worker_pid(client, victim), signal.SIGKILL)  # reclaimed without a notice
            most = time.monotonic() - began + 5.0  # (the start it reported came before we saw it, by < 5 s)
            thread.join(300)
    assert "error" not in out, out.get("error")
    result = out["result"]
    workers = result.workers.set_index("worker")
    assert 1.5 <= workers.wasted_seconds[victim] <= most
    assert (workers.wasted_seconds.drop(victim) == 0).all()
    assert result.cost["wasted_seconds"] == pytest.approx(workers.wasted_seconds.sum())
