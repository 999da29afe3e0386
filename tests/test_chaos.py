"""The chaos suite: real worker kills, stops, bad workers and dead callers; nothing lost, nothing twice.

Seeded; every fault is real (SIGKILL/SIGSTOP of worker processes, a worker process whose user code
returns broken updates, a killed client process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import chaos_helpers
import cloudpickle
import dask
import pytest
import torch
from chaos_helpers import (
    ChaosNet,
    FaultyAdam,
    HandoverFault,
    HeldWhileFlagged,
    Killer,
    KillOnFinish,
    NaNOnWorkerZero,
    copies_in_flight,
    fit_in_thread,
    running_run,
    start_worker,
    stop_worker_mid_task,
    worker_info,
)
from distributed import Client

import vcdask
import vcdask.data
import vcdask.updates
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits_cnn
from vcdask.engine.end import read_record

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.cluster]
cloudpickle.register_pickle_by_value(chaos_helpers)  # workers cannot import the tests folder


def assert_every_shard_once(result, epochs: int, shards: int) -> None:
    accepted = result.history[result.history.accepted]
    assert sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist())) == [
        (e, s) for e in range(1, epochs + 1) for s in range(shards)
    ]
    assert accepted.new_version.tolist() == list(range(1, epochs * shards + 1))
    merged = [tuple(m[:2]) for v in result.store.versions(result.run_id) for m in v.metadata["merged"]]
    assert sorted(merged) == sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist()))


# retention=False: the checks read every (epoch, shard) back from the versions' metadata, so every version stays
FIT = dict(validation=0.1, max_epochs=8, n_shards=8, local_epochs=4, alpha=0.5, seed=7, progress=False, retention=False)


def test_a_repeated_worker_kills(digits_data, tmp_path):
    (X, y), (Xt, yt) = digits_data
    # The default merge rule, as users get it (with alpha 0.5 the final model is half the very last update,
    # and its accuracy swings with the arrival order)
    fit = {**{k: v for k, v in FIT.items() if k != "alpha"}, "max_epochs": 12}
    # LocalCluster closes a nanny whose worker is still down 15 s after a death (lost-worker-timeout): with a
    # kill every 1.5 s that retires the pool one nanny at a time.  Here every nanny keeps restarting its worker.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}),
        embedded_cluster(n_workers=3) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        thread, out = fit_in_thread(model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", **fit)
        running_run(client, min_step=3)
        # a kill every second where a shard takes 0.1-0.2 s and a forked worker restarts in 0.3 s (conftest.py;
        # a kill faster than a restarted worker's first shard would kill every copy of it, on any version).
        # Every 2 s, a fast machine finished the run after two kills
        killer = Killer(client, period=1.0, seed=1)
        killer.start()
        thread.join(240)
        killer.stop()
        assert not thread.is_alive(), f"the run did not finish; status {client.sync(client.scheduler.vcdask_runs)}"
    assert "error" not in out, out.get("error")
    assert len(killer.kills) >= 3, f"only {len(killer.kills)} kills landed"
    result = out["result"]
    assert_every_shard_once(result, 12, 8)
    # No merge lost or doubled, nothing poisoned: as accurate as a run without kills.  Until stop 27 the test
    # ran a clean run of the same settings first (20 epochs: within 2 points on validation, 3 on the test
    # images); clean runs of these settings score 0.97-0.99 on the 359 test images.
    accuracy = accuracy_on(result.model, Xt, yt)
    print(f"test_a: accuracy {accuracy:.4f} on the test images, {result.metrics['accuracy']:.4f} on validation")
    assert accuracy >= 0.94 and result.metrics["accuracy"] >= 0.94


def test_b_stopped_worker_is_reissued_and_its_late_result_recorded(digits_data, tmp_path):
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 12, "local_epochs": 12}  # shards of 0.3-1 s: easy to catch one running
    # A deadline of twice the median shard time (at least 1 s): a fixed 1 s was below a loaded machine's
    # shard time, so healthy copies were re-issued in a storm and the victim's copy was often superseded
    # by a copy elsewhere before its own deadline (its result then came back a duplicate, not late).
    res = vcdask.Resilience(deadline_factor=2.0, deadline_floor=1.0)
    with embedded_cluster(n_workers=3) as cluster, Client(cluster, set_as_default=False) as client:
        thread, out = fit_in_thread(
            model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", resilience=res, **fit
        )
        running_run(client, min_step=2)
        victim, pid = stop_worker_mid_task(client)
        # resumed once its copy is past the deadline and another copy of its shard is merged, while the run
        # goes on: a fixed 10 s outlasted a whole run on a fast machine (nothing held it up: validations
        # avoid a stuck worker), and a result that comes back after the run ended is recorded nowhere
        deadline = time.monotonic() + 60
        try:
            while not client.run_on_scheduler(chaos_helpers.superseded_on, victim):
                assert time.monotonic() < deadline and thread.is_alive(), client.run_on_scheduler(copies_in_flight)
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(300)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 12, 8)
    h = result.history
    back = h[(h.worker == victim) & h.outcome.isin(["late", "duplicate"])]
    # its result came back after SIGCONT: recorded, not merged
    assert len(back) >= 1 and not back.accepted.any(), h[h.worker == victim][["epoch", "shard", "outcome", "reason"]]
    # (No timeout charge is asserted: the stopped copy may itself be a re-issued one whose shard another
    # copy merges before its deadline; it is then superseded, not late. The charge is covered by
    # tests/test_engine_policy.py, and "no blame" by test_straggler_... below.)


def test_straggler_too_far_behind_is_reissued_without_blame(digits_data, tmp_path):
    """Under a deadline it never reaches, a frozen worker's shards are re-issued once the run has merged
    max_staleness versions past their base: no stale update is merged and nobody is charged a failure."""
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 7, "local_epochs": 12}  # 56 merges: the 30 below, and the run goes on after
    res = vcdask.Resilience(deadline=600, max_staleness=6)
    with embedded_cluster(n_workers=3) as cluster, Client(cluster, set_as_default=False) as client:
        thread, out = fit_in_thread(
            model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", resilience=res, **fit
        )
        run_id = running_run(client, min_step=2)
        victim, pid = stop_worker_mid_task(client, based=True)
        start = client.sync(client.scheduler.vcdask_status, run_id=run_id)["step"]
        deadline = time.monotonic() + 150  # 30 merges took over 60 s in a loaded CI run
        while client.sync(client.scheduler.vcdask_status, run_id=run_id)["step"] < start + 30:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        thread.join(300)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 7, 8)
    h = result.history
    assert h[h.accepted].staleness.max() <= 6
    # its result came back after SIGCONT, long after a fresh copy (re-issued at 6 behind) had been merged:
    # late, or a duplicate when the stopped copy was itself a second copy whose shard merged elsewhere first
    back = h[(h.worker == victim) & h.outcome.isin(["late", "duplicate"])]
    rows = h[h.worker == victim][["epoch", "shard", "attempt", "base_version", "outcome", "reason"]].to_string()
    assert len(back) >= 1 and not back.accepted.any(), rows
    stats = result.workers.set_index("worker").loc[victim]
    assert (stats.timed_out, stats.failed, stats.excluded) == (0, 0, None)


def test_a_frozen_worker_holds_one_copy_not_the_run(digits_data, tmp_path):
    """A worker frozen mid-task, under a deadline it never reaches and no staleness limit: it keeps the
    one copy it runs, and the shards whose home it is go to the others, so the run goes on without it.
    (Copies once followed their home there and queued behind the frozen one until they filled every
    slot: the run stopped until the deadline.)"""
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 6, "local_epochs": 8}
    res = vcdask.Resilience(deadline=600, max_staleness=None)
    with embedded_cluster(n_workers=3) as cluster, Client(cluster, set_as_default=False) as client:
        thread, out = fit_in_thread(
            model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", resilience=res, **fit
        )
        run_id = running_run(client, min_step=9)  # every worker is a home to some shards by now
        victim, pid = stop_worker_mid_task(client)
        start = client.sync(client.scheduler.vcdask_status, run_id=run_id)["step"]
        deadline, held = time.monotonic() + 150, 0
        try:
            while (status := client.sync(client.scheduler.vcdask_status, run_id=run_id))["step"] < start + 24:
                assert time.monotonic() < deadline and thread.is_alive(), status["tasks"]
                held = max(held, sum(t["worker"] == victim for t in status["tasks"]))
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(300)
    assert held == 1
    assert "error" not in out, out.get("error")
    assert_every_shard_once(out["result"], 6, 8)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["died", "froze"])
def test_a_result_its_worker_cannot_hand_over_is_read_from_the_store(signum, digits_data, tmp_path):
    """A worker dies (or freezes) holding a finished shard result the run has not read yet: the run
    reads that result from the store (a task stores it with its update) and goes on at once, instead
    of waiting for Dask to run the task again on another worker (or for the frozen one: the whole run
    waited on it, as results are read one at a time).  A copy the run does not wait for (such as Dask's
    rerun of that finished task) gives up when it asks for its base: it trains and writes nothing."""
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 3, "keep_updates": True}
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        proc, victim = chaos_helpers.start_victim(client, HandoverFault("victim", signum))
        try:
            thread, out = fit_in_thread(
                model=digits_cnn(7),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                resilience=vcdask.Resilience(deadline_floor=1.0),
                **fit,
            )
            if signum == signal.SIGKILL:  # a copy the run does not wait for gives up: trains and writes nothing
                run_id = running_run(client)
                head = client.sync(client.scheduler.vcdask_status, run_id=run_id)
                foreign = client.submit(
                    vcdask.worker.train_shard,
                    vcdask.open_store(tmp_path / "s"),
                    run_id,
                    1,
                    0,
                    99,
                    head["version"],
                    head["step"],
                    key=f"vcdask-train-{run_id}-not-a-copy",
                    workers=[next(a for a in worker_info(client) if a != victim)],
                )
                assert foreign.result(timeout=60)["kind"] == "abandoned"
                assert not vcdask.open_store(tmp_path / "s").files.exists(vcdask.updates.update_path(run_id, 1, 0, 99))
            thread.join(240)
            assert not thread.is_alive()
            # the fault did happen: the run asked the victim for a result (it did not hand it over)
            assert (
                proc.poll() == -signal.SIGKILL
                if signum == signal.SIGKILL
                else chaos_helpers.process_state(proc.pid) == "T"
            )
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(30)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 3, 8)
    handed = result.history[result.history.worker == victim]
    assert handed.accepted.iloc[0], handed  # its first result, read from the store, was merged
    assert (handed.outcome != "lost").all()
    files = vcdask.open_store(tmp_path / "s").files
    assert vcdask.updates.read_update_meta(files, handed["update"].iloc[0])["worker"] == victim


def test_a_worker_frozen_as_it_starts_a_validation_holds_no_epoch(digits_data, tmp_path):
    """The only worker freezes (SIGSTOP) as it begins the validation of the first epoch's end version,
    which the epoch waits for; a second worker joins.  The scheduler still counts the frozen one as
    connected, with the validation processing there, until Dask's worker TTL (minutes) runs out.  The
    run validates that version on the new worker and finishes every epoch long before.  (Validations
    once had no deadline: the run waited for as long as the worker stayed frozen.)"""
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 3, "validate_every": 1000}  # only the epochs' end versions are validated
    with embedded_cluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        victim = start_worker(cluster.scheduler_address, name="victim")
        helper = None
        try:
            client.wait_for_workers(1, timeout=60)
            client.run(chaos_helpers.warm_up)
            client.register_plugin(chaos_helpers.FreezeOnStart("victim", "vcdask-validate-"))
            thread, out = fit_in_thread(
                model=digits_cnn(7),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                resilience=vcdask.Resilience(deadline_floor=1.0),
                **fit,
            )
            deadline = time.monotonic() + 120
            while chaos_helpers.process_state(victim.pid) != "T":
                assert time.monotonic() < deadline and thread.is_alive(), "the victim never started a validation"
                time.sleep(0.1)
            assert thread.is_alive()  # the run waits for the first epoch's numbers
            helper = start_worker(cluster.scheduler_address, name="helper")
            thread.join(120)
            assert not thread.is_alive(), client.sync(client.scheduler.vcdask_runs)
        finally:
            for proc in (victim, helper):
                if proc is not None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait(30)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 3, 8)
    assert len(result.epochs) == 3 and result.epochs["accuracy"].notna().all(), result.epochs


def test_a_worker_killed_after_handing_its_record_over(digits_data, tmp_path):
    """A shard task hands its record to the run as it finishes (before Dask reports it done); its worker
    then dies at once.  The run has merged that update from the record it was handed, and Dask's rerun
    of the task (still wanted by the run's future) gives up without training: every shard once."""
    (X, y), _ = digits_data
    fit = {**FIT, "max_epochs": 3}
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        proc, victim = chaos_helpers.start_victim(client, KillOnFinish("victim"))
        try:
            thread, out = fit_in_thread(
                model=digits_cnn(7),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                resilience=vcdask.Resilience(deadline_floor=1.0),
                **fit,
            )
            run_id = running_run(client)
            thread.join(240)
            assert not thread.is_alive()
            handed_over = client.sync(client.scheduler.vcdask_status, run_id=run_id)["handed_over"]
            assert proc.wait(30) == -signal.SIGKILL  # the victim did finish a shard, and died
        finally:
            proc.kill()
            proc.wait(30)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 3, 8)
    assert handed_over >= 1
    mine = result.history[result.history.worker == victim]
    assert len(mine) == 1 and mine.accepted.iloc[0], mine  # its one update, handed over, was merged
    assert (result.history.outcome != "lost").all()


def test_c_caller_killed_run_finishes_and_attach_gets_result(digits_data, tmp_path):
    (X, y), _ = digits_data
    data = tmp_path / "digits.pt"
    torch.save((torch.from_numpy(X), torch.from_numpy(y)), data)
    store = tmp_path / "s"
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        caller = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import torch, vcdask
            from distributed import Client
            from vcdask.demo import digits_cnn
            X, y = torch.load({str(data)!r})
            vcdask.fit(digits_cnn(7), (X.numpy(), y.numpy()), client=Client({cluster.scheduler_address!r}),
                       store={str(store)!r}, validation=0.1, max_epochs=10, n_shards=8, local_epochs=4,
                       alpha=0.5, progress=False)
        """),
            ]
        )
        run_id = running_run(client, timeout=120, min_step=3)
        caller.kill()
        caller.wait(30)
        assert caller.returncode == -signal.SIGKILL
        attached = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import vcdask
            r = vcdask.attach({run_id!r}, {cluster.scheduler_address!r}).result()
            print(r.version, len(r.epochs), int(r.history.accepted.sum()), r.metrics["accuracy"])
        """),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert attached.returncode == 0, attached.stderr
    version, epochs, merges, accuracy = attached.stdout.split()
    assert (int(epochs), int(merges)) == (10, 80)
    assert version == vcdask.open_store(store).head(run_id)
    assert float(accuracy) > 0.9


def test_e_bad_worker_updates_rejected(digits_data, tmp_path):
    (X, y), (Xt, yt) = digits_data
    res = vcdask.Resilience(max_update_norm=100.0, max_worker_failures=3)
    # the default merge rule (see test a: alpha 0.5 makes the final accuracy swing with the last arrivals)
    fit = {
        **{k: v for k, v in FIT.items() if k != "alpha"},
        "optimizer": FaultyAdam,
        "resilience": res,
        "max_epochs": 12,
    }
    # The bad worker is alone when the run starts, so it gets the first shards; good workers join next.
    with embedded_cluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        bad = start_worker(cluster.scheduler_address, {"VCDASK_TEST_FAULT": "cycle"})
        try:
            client.wait_for_workers(1, timeout=60)
            bad_address = next(iter(worker_info(client)))
            client.run(chaos_helpers.warm_up, workers=[bad_address])
            thread, out = fit_in_thread(model=ChaosNet(7), data=(X, y), client=client, store=tmp_path / "s", **fit)
            running_run(client)
            cluster.scale(3)  # two good workers join the bad one
            thread.join(300)
        finally:
            bad.terminate()
            bad.wait(30)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 12, 8)
    from_bad = result.history[(result.history.worker == bad_address) & ~result.history.accepted]
    reasons = from_bad.reason.tolist()
    assert len(reasons) >= 3, reasons
    assert reasons[0].startswith("non-finite values (NaN/inf) in ['net.0.weight'")
    assert reasons[1] == "layout mismatch: spare: shape [5] != expected [4]"
    assert reasons[2].startswith("update norm ||W_c - W_s|| = ") and reasons[2].endswith("> max_update_norm=100")
    workers = result.workers.set_index("worker")
    assert workers.loc[bad_address].excluded.startswith("0 failed, 0 timed out, 3 rejected")
    assert not result.history[result.history.worker == bad_address].accepted.any()
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    # no poison got in: as accurate as a clean run, within the swing of arrival order. A clean run of these
    # settings scores 0.97-0.99 on the 359 test images (until stop 26 the test ran one each time: 0.986 in
    # one CI run, where this run measured 0.941); one poisoned merge leaves NaN or a model near chance (~0.1)
    assert accuracy_on(result.model, Xt, yt) >= 0.92


def test_only_worker_excluded_then_a_good_one_joins(digits_data, tmp_path):
    """The run's only worker is excluded (its updates are all rejected).  The shards it would be sent
    again wait for a usable worker instead (before, Dask took ``workers=[]`` as no restriction, sent them
    to the excluded worker, and a shard used up its attempts there); the run pauses, and finishes on a
    worker that joins later, every shard merged once."""
    (X, y), _ = digits_data
    res = vcdask.Resilience(max_worker_failures=3, no_worker_timeout=120)
    fit = {**FIT, "max_epochs": 2, "n_shards": 4, "optimizer": NaNOnWorkerZero, "resilience": res}
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        thread, out = fit_in_thread(model=ChaosNet(7), data=(X, y), client=client, store=tmp_path / "s", **fit)
        run_id = running_run(client)
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            if _status(client, run_id)["paused_cause"] == "workers":
                break
            time.sleep(0.1)
        assert "error" not in out, out.get("error")
        assert _status(client, run_id)["paused_cause"] == "workers"
        cluster.scale(2)  # a good worker (named 1) joins
        thread.join(120)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 2, 4)
    workers = result.workers.set_index("worker")
    bad = next(a for a in workers.index if a not in set(result.history[result.history.accepted].worker))
    assert workers.loc[bad].excluded.startswith("0 failed, 0 timed out, 3 rejected")
    from_bad = result.history[result.history.worker == bad]
    assert not from_bad.accepted.any()
    # sent nothing once excluded: its 3 rejections, and at most the one copy queued there at the time
    assert 3 <= len(from_bad) <= 4, from_bad[["epoch", "shard", "attempt", "reason"]]


def _kill_pool(client, workers: list) -> None:
    """SIGKILL every worker process (no nannies: they stay dead) and wait until the scheduler saw them go."""
    for proc in workers:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30
    while worker_info(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker_info(client)


def _status(client, run_id: str) -> dict:
    return client.sync(client.scheduler.vcdask_status, run_id=run_id)


def test_whole_pool_lost_then_replaced(digits_data, tmp_path):
    """Every worker dies mid-run: the run waits (paused, no re-issue storm), then finishes on new workers."""
    (X, y), _ = digits_data
    res = vcdask.Resilience(deadline_floor=1.0, no_worker_timeout=120)
    fit = {**FIT, "max_epochs": 4}
    with embedded_cluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        pool = [start_worker(cluster.scheduler_address, name=f"first-{i}") for i in range(2)]
        replacements = []
        try:
            client.wait_for_workers(2, timeout=60)
            thread, out = fit_in_thread(
                model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", resilience=res, **fit
            )
            run_id = running_run(client, timeout=120, min_step=3)
            first = set(worker_info(client))
            _kill_pool(client, pool)
            deadline = time.monotonic() + 30
            while not (_status(client, run_id)["paused"] or "").startswith("no usable worker"):
                assert time.monotonic() < deadline, _status(client, run_id)
                time.sleep(0.1)
            queued = len(_status(client, run_id)["tasks"])
            time.sleep(8)  # well past the "never started" limit of a 1 s deadline: nothing to re-issue to
            waiting = _status(client, run_id)
            assert waiting["status"] == "running" and waiting["paused"].startswith("no usable worker")
            assert len(waiting["tasks"]) == queued, waiting["tasks"]
            replacements = [start_worker(cluster.scheduler_address, name=f"second-{i}") for i in range(2)]
            thread.join(300)
            assert not thread.is_alive(), _status(client, run_id)
        finally:
            for proc in pool + replacements:
                proc.kill()
                proc.wait(30)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 4, 8)
    merged_on = set(result.history[result.history.accepted].worker)
    assert merged_on & first and merged_on - first  # merges from both pools
    assert result.workers.excluded.isna().all()


def test_whole_pool_lost_past_no_worker_timeout(digits_data, tmp_path):
    (X, y), _ = digits_data
    res = vcdask.Resilience(no_worker_timeout=3)
    with embedded_cluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        pool = [start_worker(cluster.scheduler_address, name=f"only-{i}") for i in range(2)]
        try:
            client.wait_for_workers(2, timeout=60)
            thread, out = fit_in_thread(
                model=digits_cnn(7),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                resilience=res,
                **{**FIT, "max_epochs": 50},
            )
            run_id = running_run(client, timeout=120, min_step=2)
            _kill_pool(client, pool)
            thread.join(60)
            assert not thread.is_alive(), _status(client, run_id)
        finally:
            for proc in pool:
                proc.kill()
                proc.wait(30)
    error = out.get("error")
    assert isinstance(error, vcdask.RunFailedError), out
    assert "NoWorkersError: run " in str(error)
    assert "no usable worker for 3 s (no_worker_timeout; connected workers: none)" in str(error)
    assert "task (epoch" not in str(error)  # the run's verdict, not dressed up as a task's failure
    store = vcdask.open_store(tmp_path / "s")
    head = store.head(run_id)
    assert store.read(head).version == head  # the store stays readable at its last commit


def test_preemption_notice_moves_work_without_failures(digits_data, tmp_path):
    (X, y), _ = digits_data
    # the victim's task is held mid-shard while the notice goes out (twice, under the full suite's load, the
    # busy worker finished its task between being seen busy and the notice, and had nothing left to move)
    flag, seen = tmp_path / "hold", tmp_path / "seen"
    step = HeldWhileFlagged(str(flag), str(seen), delay=0.01)
    with embedded_cluster(n_workers=3) as cluster, Client(cluster, set_as_default=False) as client:
        thread, out = fit_in_thread(
            model=digits_cnn(7), data=(X, y), client=client, store=tmp_path / "s", train_step=step, **FIT
        )
        running_run(client, min_step=2)
        flag.touch()
        victim = _held_worker(client, seen)
        moved = vcdask.preempt(client, victim)
        flag.unlink()
        thread.join(300)
        assert victim not in worker_info(client)  # retired
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert_every_shard_once(result, 8, 8)
    assert list(moved.values())[0]  # its queued shards were re-issued
    stats = result.workers.set_index("worker").loc[victim]
    assert stats.preempted and stats.failed == 0 and stats.excluded is None


def _held_worker(client, seen, timeout: float = 60) -> str:
    """A worker whose training task waits at a batch (``HeldWhileFlagged`` wrote its pid to ``seen``)."""
    pids = {pid: address for address, pid in client.run(os.getpid).items()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = {int(line) for line in seen.read_text().split()} if seen.exists() else set()
        if held & set(pids):
            return pids[min(held & set(pids))]
        time.sleep(0.02)
    raise TimeoutError("no training task was held")


def test_g_bad_resilience_options_fail_before_cluster_work(tmp_path):
    with pytest.raises(ValueError, match="deadline must be a positive number, got 0"):
        vcdask.Resilience(deadline=0)
    with pytest.raises(ValueError, match="deadline must be a positive number, got -5"):
        vcdask.Resilience(deadline=-5)
    with pytest.raises(ValueError, match=r"max_staleness must be an integer >= 0, 'auto' or None \(no limit\), got -1"):
        vcdask.Resilience(max_staleness=-1)
    with pytest.raises(ValueError, match=r"max_staleness must be .*, got 'Auto'"):
        vcdask.Resilience(max_staleness="Auto")
    with pytest.raises(
        ValueError, match=r"unknown on_shard_failure policy 'retry'; valid policies: \['stop', 'skip'\]"
    ):
        vcdask.Resilience(on_shard_failure="retry")
    with pytest.raises(TypeError, match="resilience must be a vcdask.Resilience, got dict"):
        vcdask.fit(
            torch.nn.Linear(64, 10),
            (torch.zeros(10, 64), torch.zeros(10, dtype=torch.long)),
            resilience={"deadline": 1},
            store=tmp_path / "s",
            progress=False,
        )
    assert not (tmp_path / "s").exists()


def test_staleness_limit_auto_default():
    from vcdask.engine.policy import staleness_limit

    assert vcdask.Resilience().max_staleness == "auto"
    assert staleness_limit("auto", n_shards=8, in_flight=6) == 24  # four times the tasks in flight
    assert staleness_limit("auto", n_shards=50, in_flight=4) == 100  # two epochs' worth of shards
    assert staleness_limit(3, n_shards=50, in_flight=4) == 3
    assert staleness_limit(None, n_shards=50, in_flight=4) is None


def _uploaded_not_committed(store, run_id: str) -> bool:
    # the uploads first, then the versions: an upload committed in between counts as committed (the other
    # order took it for uncommitted, and the kill that followed could find nothing uncommitted)
    uploads = []
    for path in store.files.list(f"{run_id}/updates"):
        try:
            meta = vcdask.updates.read_update_meta(store.files, path)
        except Exception:  # noqa: BLE001 - an upload still being written, or deleted meanwhile
            continue
        if meta:
            uploads.append((meta["epoch"], meta["shard"]))
    committed = {(e, sh) for v in store.versions(run_id) for e, sh, _ in v.metadata["merged"]}
    return any(u not in committed for u in uploads)


def test_d_scheduler_killed_then_resumed_on_a_new_cluster(digits_data, tmp_path):
    """Kill the scheduler (with its workers) mid-run; resume on a new cluster from the store."""
    (X, y), _ = digits_data
    data = tmp_path / "digits.pt"
    torch.save((torch.from_numpy(X), torch.from_numpy(y)), data)
    store_path = tmp_path / "s"
    # The first cluster lives in its own process group: killing it kills scheduler, nannies and workers.
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import torch, vcdask
        from vcdask.demo import digits_cnn
        X, y = torch.load({str(data)!r})
        vcdask.fit(digits_cnn(7), (X.numpy(), y.numpy()), store={str(store_path)!r}, validation=0.1,
                   max_epochs=8, n_shards=8, local_epochs=4, alpha=0.5, commit_every=6, progress=False,
                   retention=False)
    """),
        ],
        start_new_session=True,
    )
    store = vcdask.open_store(store_path)
    deadline = time.monotonic() + 120
    run_id = None
    while time.monotonic() < deadline:
        runs = [b for b in store.branches() if b.startswith("run-")]
        # kill between two commits, once an upload exists that no committed version merged (and epoch 1 is
        # in the run's record: what it measured must outlive the kill)
        if (
            runs
            and len(store.versions(runs[0])) >= 3
            and (read_record(store, runs[0]) or {}).get("epochs")
            and _uploaded_not_committed(store, runs[0])
        ):
            run_id = runs[0]
            break
        time.sleep(0.02)
    assert run_id is not None, "the first run never got going"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    time.sleep(0.5)  # let the killed processes' last writes settle
    store = vcdask.open_store(store_path)
    committed = {(e, s) for v in store.versions(run_id) for e, s, _ in v.metadata["merged"]}
    uploaded = {}
    for path in store.files.list(f"{run_id}/updates"):
        meta = vcdask.updates.read_update_meta(store.files, path)
        if meta and (meta["epoch"], meta["shard"]) not in committed:
            uploaded[(meta["epoch"], meta["shard"])] = meta["attempt"]
    assert len(committed) < 8 * 8, "the run finished before the kill"
    assert uploaded, "nothing was uploaded-but-uncommitted at the kill"
    closed = {r["epoch"]: r for r in read_record(store, run_id)["epochs"]}  # (as the killed session wrote them)

    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.resume(run_id, store=store_path, client=client, progress=False)
    versions = store.versions(run_id)
    merged = [(e, s, a) for v in versions for e, s, a in v.metadata["merged"]]
    pairs = [(e, s) for e, s, _ in merged]
    assert len(pairs) == len(set(pairs)), "an (epoch, shard) was merged twice"
    assert sorted(pairs) == [(e, s) for e in range(1, 9) for s in range(8)]
    for (e, s), attempt in uploaded.items():  # uploads nobody had committed were merged, not retrained
        assert (e, s, attempt) in merged
    steps = [v.metadata["step"] for v in reversed(versions)]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert result.version == versions[0].id
    assert result.epochs.index.tolist() == list(range(1, 9))
    for epoch, row in closed.items():  # the epochs closed before the kill keep what they measured
        assert result.epochs.loc[epoch, "train_loss"] == row["train_loss"] and row["wall_time"] > 0
    assert result.metrics["accuracy"] > 0.85
    assert store.files.list(f"{run_id}/updates") == []


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_shard_that_keeps_killing_workers(policy, digits_data, tmp_path):
    (X, y), (Xv, yv) = digits_data
    X = X.copy()
    poisoned = 3
    start, stop = vcdask.data.Shards(len(X), 6).bounds(poisoned)
    X[start:stop] = 999.0  # every worker that trains this shard dies
    res = vcdask.Resilience(max_attempts=2, on_shard_failure=policy)
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),
        embedded_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):

        def run():
            return vcdask.fit(
                chaos_helpers.PoisonNet(),
                (X, y),
                validation=(Xv, yv),
                max_epochs=2,
                n_shards=6,
                shuffle=False,
                tasks_per_slot=1,
                resilience=res,
                client=client,
                store=tmp_path / "s",
                progress=False,
            )

        if policy == "stop":
            with pytest.raises(
                vcdask.RunFailedError, match=rf"shard {poisoned} of epoch 1 failed 2 times .*on_shard_failure='stop'"
            ):
                run()
            return
        result = run()
    h = result.history
    accepted = h[h.accepted]
    assert sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist())) == [
        (e, s) for e in (1, 2) for s in range(6) if s != poisoned
    ]
    skipped = h[h.reason.fillna("").str.startswith("skipped")]
    assert sorted(skipped.epoch) == [1, 2] and set(skipped.shard) == {poisoned}
    assert result.epochs.skipped.tolist() == [1, 1]
    lost = h[h.reason.fillna("").str.startswith("lost: KilledWorker")]
    # 2 attempts x 2 epochs, each killed the worker it ran on: 4 charged to workers.  A copy that was only
    # queued on a dying worker (while the other restarted) is lost too, but charged to neither the worker
    # nor the shard, and runs again (under the full suite's load epoch 2's shard once ran a third copy)
    assert result.workers["failed"].sum() == 4
    assert len(lost[lost.shard == poisoned]) >= 4


@pytest.mark.s3
def test_f_object_store_faults(s3, client, digits_data):
    """An S3 proxy on loopback answers 503s, stalls and resets, and loses one commit's answer after the write."""
    from vcdask.testing.faulty_proxy import FaultyProxy

    (X, y), _ = digits_data
    with FaultyProxy(s3.endpoint_url, seed=3) as proxy:
        location = f"s3://{s3.new_bucket()}/runs"
        options = {"endpoint_url": proxy.endpoint_url, "access_key_id": "testing", "secret_access_key": "testing"}
        store = vcdask.open_store(location, **options)
        # the shared cluster's workers have no AWS credentials of their own: hand them this store's
        vcdask.store.share_credentials(client, store)
        thread, out = fit_in_thread(
            model=digits_cnn(7),
            data=(X[:600], y[:600]),
            client=client,
            store=store,
            validation=0.2,
            max_epochs=4,
            n_shards=4,
            local_epochs=2,
            alpha=0.5,
            progress=False,
        )
        running_run(client, min_step=1, timeout=120)
        proxy.set_faults(p_503=0.10, p_reset=0.03, p_stall=0.03, stall_seconds=0.5)
        proxy.lose_next_ref_answer()
        thread.join(300)
        proxy.set_faults()  # the checks below read through the proxy, now well-behaved
        counts = dict(proxy.faults.counts)
        assert "error" not in out, out.get("error")
        result = out["result"]
        assert_every_shard_once(result, 4, 4)
    assert counts["503"] > 0 and counts["reset"] > 0 and counts["stall"] > 0
    assert counts["lost_answer"] == 1
    store = vcdask.open_store(
        location, endpoint_url=s3.endpoint_url, access_key_id="testing", secret_access_key="testing"
    )
    versions = store.versions(result.run_id)
    steps = [v.metadata["step"] for v in reversed(versions)]
    assert steps == list(range(len(steps))), "a version is missing or duplicated"
    for info in versions:  # none torn: every version reads back whole and finite
        params = store.read(info.id).params
        assert all(torch.isfinite(a).all() for a in params.arrays.values() if a.is_floating_point())


def _fit_behind_proxy(proxy, s3, client, digits_data, max_epochs: int, outage_timeout: float, **fit):
    """A run whose store (S3 on loopback, max_tries=2) is reached through ``proxy``; returns
    (location, thread, out, run_id) once it has merged two updates."""
    (X, y), _ = digits_data
    location = f"s3://{s3.new_bucket()}/runs"
    options = {"endpoint_url": proxy.endpoint_url, "access_key_id": "testing", "secret_access_key": "testing"}
    store = vcdask.open_store(location, max_tries=2, **options)
    vcdask.store.share_credentials(client, store)  # the shared cluster's workers have no AWS credentials
    thread, out = fit_in_thread(
        model=digits_cnn(7),
        data=(X[:600], y[:600]),
        client=client,
        store=store,
        validation=0.2,
        max_epochs=max_epochs,
        n_shards=4,
        local_epochs=2,
        alpha=0.5,
        progress=False,
        resilience=vcdask.Resilience(store_outage_timeout=outage_timeout),
        **fit,
    )
    return location, thread, out, running_run(client, min_step=2, timeout=120)


@pytest.mark.s3
def test_f_store_outage_longer_than_retries_pauses_then_continues(s3, client, digits_data, tmp_path):
    """Every request to the store fails for several seconds, far past the store's own retries: the run
    pauses (says so), no worker is blamed, and it continues when the store is back — no merge lost."""
    from vcdask.testing.faulty_proxy import FaultyProxy

    # Shards of ~1 s (0.1 s a batch), and one held mid-training until the store is down: a task meets the
    # outage for certain.  (Unheld, every task could upload before the outage, leaving it to the merge
    # thread alone: CI saw that once.)
    flag, seen = tmp_path / "hold", tmp_path / "seen"
    step = chaos_helpers.HeldWhileFlagged(str(flag), str(seen), delay=0.1)
    with FaultyProxy(s3.endpoint_url, seed=4) as proxy:
        _, thread, out, run_id = _fit_behind_proxy(
            proxy, s3, client, digits_data, max_epochs=3, outage_timeout=120, train_step=step
        )
        flag.touch()
        held_by = time.monotonic() + 60
        while not seen.exists():
            assert time.monotonic() < held_by, "no shard task was held mid-training within 60 s"
            time.sleep(0.05)
        proxy.set_faults(p_503=1.0)  # the store is down, far longer than the storage clients retry
        flag.unlink()  # the held task finishes into the outage
        # down until the run has said it paused (its store's retries were spent) and 5 s more; 45 s at most
        seen_paused, paused_at = False, None
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and (paused_at is None or time.monotonic() < paused_at + 5):
            status = vcdask.attach(run_id, client=client).status()
            if status["paused"] and not seen_paused:
                seen_paused, paused_at = True, time.monotonic()
            time.sleep(0.5)
        down = proxy.faults.counts["503"]
        proxy.set_faults()  # back
        thread.join(300)
        assert "error" not in out, out.get("error")
        result = out["result"]
        assert_every_shard_once(result, 3, 4)
    assert down > 0 and seen_paused
    faults = result.history[result.history.outcome == "store fault"]
    assert len(faults) > 0, result.history.to_string()
    assert faults.reason.str.startswith("store fault").all()
    assert not any(w["excluded"] for w in result.workers.to_dict("records"))
    assert result.workers.failed.sum() == 0


@pytest.mark.s3
def test_f_store_outage_past_the_outage_timeout_fails_clearly(s3, client, digits_data):
    """An outage longer than ``store_outage_timeout`` ends the run with an error that says so; the store
    stays readable at its last commit."""
    from vcdask.testing.faulty_proxy import FaultyProxy

    with FaultyProxy(s3.endpoint_url, seed=5) as proxy:
        location, thread, out, run_id = _fit_behind_proxy(
            proxy, s3, client, digits_data, max_epochs=20, outage_timeout=3
        )
        proxy.set_faults(p_503=1.0)
        thread.join(300)
        proxy.set_faults()
    assert "store_outage_timeout" in str(out.get("error")), out
    store = vcdask.open_store(
        location, endpoint_url=s3.endpoint_url, access_key_id="testing", secret_access_key="testing"
    )
    last = store.read(branch=run_id)  # readable at its last commit, whole and finite
    assert last.metadata["step"] >= 1
    assert all(torch.isfinite(a).all() for a in last.params.arrays.values() if a.is_floating_point())
