"""fit's default merge rule follows a fleet that grows (issue 38; vcdask.engine.following).

The default depends on the tasks in flight: one, each update taken as it is; 2 or 3, delayed Nesterov; 4 or
more, "auto".  A run that starts while its fleet is still starting moves up to the default for the tasks in
flight at a merge, and never back down; a resumed run keeps the rule it had grown into.  Real stores, the
real parameter server; the probe is a quadratic that takes a little time (test_auto_rule.Slow).
"""

from __future__ import annotations

import pytest
import torch
from test_auto_rule import Slow
from test_probe_rule import _upload

import vcdask
from vcdask.engine.following import can_grow, grown_rule
from vcdask.engine.params_server import ParamsServer
from vcdask.merge import DEFAULT_RULE, ONE_IN_FLIGHT, Auto, Nesterov, for_run
from vcdask.params import flatten


def _store(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-p")
    store.commit(flatten({"w": torch.zeros(1)}), {"run_id": "run-p", "step": 0, "merged": []}, branch="run-p")
    return store


def _server(store, follow=1, rule=ONE_IN_FLIGHT, probe=None):
    server = ParamsServer(store, "run-p", rule, "run-p", probe=probe or Slow(0.0, 2.0), follow=follow)
    server.load()
    return server


def _merge(server, shard, value, in_flight):
    record = _upload(server.store, shard, value, server.step, server.version)
    record.update(steps=2, step_seconds=30.0, in_flight=in_flight)  # a minute-long task: any probe is cheap
    assert server.merge(record)["accepted"]
    return server.store.read(server.version).metadata


def test_the_default_rule_moves_up_with_the_tasks_in_flight_and_never_back(tmp_path):
    server = _server(_store(tmp_path))
    meta = _merge(server, 0, 1.0, in_flight=1)
    assert meta["merge"]["name"] == "staleness" and meta["merge_in_flight"] == 1 and server.head.rule == "staleness"
    meta = _merge(server, 1, 1.5, in_flight=3)  # two workers joined: delayed Nesterov, its window the three
    assert meta["merge"] == {**Nesterov(lr=0.5, momentum=0.9, delay=3, bias_correction="trust").describe()}
    assert meta["merge_in_flight"] == 3 and set(server.rule_state.arrays) == {"momentum", "pending"}
    meta = _merge(server, 2, 1.8, in_flight=2)  # one left again (preempted): the rule and its state stay
    assert meta["merge"]["name"] == "nesterov" and meta["merge_in_flight"] == 3
    meta = _merge(server, 3, 2.0, in_flight=8)  # the fleet is up: "auto", which times the probe and chooses
    assert meta["merge"]["name"] == "auto" and meta["merge"]["in_flight"] == 8 and meta["merge_in_flight"] == 8
    assert meta["rule_state"]["chosen"] == "probe" and server.head.rule == "auto: probe, 64 rows"
    meta = _merge(server, 4, 2.1, in_flight=1)  # the fleet shrinks: still "auto", never back down
    assert meta["merge"]["name"] == "auto" and meta["rule_state"]["chosen"] == "probe"
    # a restarted server (the run's spec still says what it started with) resumes with the rule grown into
    again = _server(server.store)
    assert isinstance(again.rule, Auto) and again.follow == 8 and again.head.rule == "auto: probe, 64 rows"
    assert set(again.rule_state.arrays) == {"momentum"} and again.rule_state.scalars["chosen"] == "probe"
    assert _merge(again, 5, 2.0, in_flight=8)["merge"]["name"] == "auto"


def test_the_status_names_the_grown_rule_even_when_the_update_that_grew_it_is_rejected(tmp_path):
    server = _server(_store(tmp_path))
    _merge(server, 0, 1.0, in_flight=1)
    record = _upload(server.store, 1, 1.5, 0, server.version)  # one merge stale
    record.update(steps=2, step_seconds=30.0, in_flight=3)
    out = server.merge(record, max_staleness=0)
    assert not out["accepted"] and server.rule.name == "nesterov" and server.head.rule == "nesterov"


def test_a_rule_the_user_chose_stays_whatever_the_fleet(tmp_path):
    server = _server(_store(tmp_path), follow=None, rule=Nesterov(lr=0.5, momentum=0.9, delay=2))
    for shard, in_flight in enumerate((2, 8, 16)):
        meta = _merge(server, shard, 1.0 + shard, in_flight)
        assert meta["merge"]["name"] == "nesterov" and meta["merge"]["delay"] == 2 and "merge_in_flight" not in meta


def test_which_rule_a_grown_fleet_gets():
    one, few = for_run(DEFAULT_RULE, in_flight=1), for_run(DEFAULT_RULE, in_flight=2)
    assert grown_rule(one, 1, None) is None and grown_rule(one, 1, 1) is None  # nothing known, or no growth
    assert grown_rule(one, 1, 2) == few and grown_rule(few, 2, 3) is None  # (same kind: the delay stays)
    assert grown_rule(few, 2, 4) == for_run(DEFAULT_RULE, in_flight=4) and grown_rule(few, None, 8) is None
    assert can_grow(one) and can_grow(few) and not can_grow(for_run(DEFAULT_RULE, in_flight=4))


@pytest.mark.slow
def test_a_fit_started_on_one_worker_moves_to_the_default_of_the_grown_cluster(digits_data, tmp_path):
    """A real LocalCluster of one worker; two more join once the run has merged (a spot fleet still
    starting): its merges move from one task in flight's rule to delayed Nesterov over the tasks it has."""
    import time

    from chaos_helpers import HeldWhileFlagged
    from distributed import Client, LocalCluster

    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    flag = tmp_path / "hold"
    step = HeldWhileFlagged(str(flag), str(tmp_path / "seen"), delay=0.01)  # 10 ms a batch
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1") as cluster:
        with Client(cluster) as client:
            handle = vcdask.fit(
                digits_cnn(0),
                (X[:800], y[:800]),
                max_epochs=12,
                n_shards=4,
                train_step=step,
                client=client,
                store=tmp_path / "s",
                retention=False,  # (every version kept: the test reads each merge's rule)
                resilience=vcdask.Resilience(deadline=120),  # (the held task outlasts slow worker starts)
                progress=False,
                wait=False,
            )
            deadline = time.monotonic() + 60
            while handle.status()["step"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            flag.touch()  # the first worker's task waits mid-shard until the new ones are up (however slow)
            cluster.scale(3)
            client.wait_for_workers(3, timeout=60)
            flag.unlink()
            result = handle.result()
    history = result.history
    assert history["accepted"].all() and len(history) == 48
    merged = [v.metadata for v in result.store.versions(result.run_id) if "merge" in v.metadata]
    rules = [(m["step"], m["merge"]["name"], m["merge_in_flight"]) for m in sorted(merged, key=lambda m: m["step"])]
    assert rules[0] == (1, "staleness", 1) and len(rules) == 48  # the first merge: one worker, one task in flight
    names = [name for _, name, _ in rules]
    grown = names.index("nesterov")  # then delayed Nesterov, for good, over the tasks in flight it grew to
    assert set(names[:grown]) == {"staleness"} and set(names[grown:]) == {"nesterov"}, rules
    head = result.store.read(result.version).metadata
    assert head["merge_in_flight"] == head["merge"]["delay"] >= 2


def test_a_draft_based_update_merges_right_after_the_rule_grows_into_one_that_needs_its_base(tmp_path):
    """Small models' tasks may start from a merge's draft, before its version exists (``base_version``
    None): a rule that needs each update's base (the probe, in "auto") finds it among the server's recent
    states, which a run that may grow into one keeps from the start."""
    store = _store(tmp_path)
    server = ParamsServer(
        store, "run-p", ONE_IN_FLIGHT, "run-p", probe=Slow(0.0, 2.0), follow=1, inline_bytes=1 << 20, drafts=True
    )
    server.load()
    record = _upload(store, 0, 1.0, 0, server.version)
    record.update(steps=2, step_seconds=30.0, in_flight=1)
    assert server.merge(record)["drafted"]  # a task may start from these parameters before their commit
    drafted_step = server.step
    server.commit()
    record = _upload(store, 1, 1.5, drafted_step, None)  # trained from the draft: no version id known to it
    record.update(steps=2, step_seconds=30.0, in_flight=8)
    out = server.merge(record)
    assert out["accepted"], out
    assert server.rule.name == "auto" and server.rule_state.scalars["chosen"] == "probe"
