"""The "auto" merge rule (issue 38): the probe rule where the server can afford its probe, else the fallback.

The choice against measured times (a probe that sleeps), what each choice then merges (the chosen rule's
own result, bit for bit), ``fit``'s default by the tasks in flight, the choice kept across a restart of
the server on a real store, and a real fit with four tasks in flight.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from test_engine_core import Clock
from test_probe_rule import Quadratic, _upload
from test_rules import flat, w

import vcdask
from vcdask.engine.params_server import ParamsServer, task_seconds
from vcdask.merge import DEFAULT_RULE, ONE_IN_FLIGHT, Arrival, Auto, Nesterov, Probe, RuleState, auto, for_run, get_rule
from vcdask.params import flatten


class _ProbeClock(Clock):
    """The clock ``"auto"`` times its probe by in these tests (``vcdask.merge.auto``'s ``time.perf_counter``,
    with the ``probe_clock`` fixture): a :class:`Slow` pass moves it by exactly its seconds instead of
    sleeping, so what the rule chooses does not hang on how busy the machine is."""

    def take(self, seconds: float) -> None:
        if seconds:
            assert auto.time.perf_counter is self, "a probe that takes time needs the probe_clock fixture"
            self.advance(seconds)


CLOCK = _ProbeClock()


@pytest.fixture
def probe_clock(monkeypatch):
    monkeypatch.setattr(auto, "time", SimpleNamespace(perf_counter=CLOCK))
    return CLOCK


class Slow(Quadratic):
    """A probe that takes ``seconds`` a call over 64 rows, in proportion over fewer (``rows``), on
    :data:`CLOCK`."""

    def __init__(self, seconds, *target):
        super().__init__(*target)
        self.seconds = seconds
        self.rows: list[int | None] = []

    def __call__(self, params, rows=None):
        self.rows.append(rows)
        CLOCK.take(self.seconds * (64 if rows is None else rows) / 64)
        return super().__call__(params)


def _merge(rule, loss, seconds, server=0.0, client=1.0, base=0.0, staleness=0):
    params = flat(server)
    state = rule.init_state(params)
    arrival = Arrival(1, staleness, base=flat(base), loss=loss, seconds=seconds)
    out = rule.apply(params, flat(client), state, arrival)
    return params, state, out


def test_a_cheap_probe_is_chosen_and_then_merges_as_the_probe_rule():
    rule = Auto(probe=Probe(momenta=[0]), in_flight=4)
    loss = Slow(0.0, 2.0)
    params, state, out = _merge(rule, loss, seconds=60.0)  # a minute-long task: the probe is nothing next to it
    assert state.scalars["chosen"] == "probe" and state.scalars["task_seconds"] == 60.0
    assert 0 <= state.scalars["probe_seconds"] < 1.0 and state.scalars["probe_rows"] == 64
    assert state.scalars["busy"] == pytest.approx(4 * state.scalars["probe_seconds"] / 60.0, abs=1e-6)
    # timed over 16, 32 and 64 rows (each: a pass that reads the rows, then 3 timed) on W_s ...
    assert loss.rows[:12] == [16] * 4 + [32] * 4 + [None] * 4 and loss.seen[:12] == [[0.0]] * 12
    # ... then exactly the probe rule's candidates and result
    assert loss.seen[12:] == [[0.5], [1.0], [1.5], [2.0], [3.0]] and loss.rows[12:] == [None] * 5
    alone, alone_state, alone_out = _merge(Probe(momenta=[0]), Quadratic(2.0), seconds=None)
    assert w(params) == w(alone) == [2.0] and out == alone_out
    assert {k: state.scalars[k] for k in alone_state.scalars} == alone_state.scalars
    assert rule.requires(state) == Probe.needs
    assert rule.label(RuleState()) == "auto" and rule.label(state) == "auto: probe, 64 rows"
    # the next merge probes again, without timing
    loss.seen.clear()
    rule.apply(params, flat(2.5), state, Arrival(1, 0, base=flat(2.0), loss=loss, seconds=0.001))
    assert len(loss.seen) == 5 and state.scalars["chosen"] == "probe"


def test_a_costly_probe_probes_with_the_most_rows_that_fit(probe_clock):
    """A pass takes 100 ms over 64 rows, 25 over 16: a merge's probe (9 passes) then takes 0.225 s over
    16 rows, and 4 tasks in flight of 2 s each keep the merge thread busy 4 * 0.225 / 2 = 45% of the time,
    within the 75% budget; over 32 rows 90%: over it."""
    rule = Auto(in_flight=4)  # (Probe(): 9 passes for a stale update with momentum; 5 at this first one)
    loss = Slow(0.1, 2.0)
    params, state, _ = _merge(rule, loss, seconds=2.0)
    assert state.scalars["chosen"] == "probe" and state.scalars["probe_rows"] == 16
    assert state.scalars["busy"] == pytest.approx(0.45)
    assert loss.rows[:8] == [16] * 4 + [32] * 4  # (64 never tried)
    assert loss.rows[8:] == [16] * 5 and w(params) == [2.0]  # the probe rule's merge, on the chosen rows
    assert rule.chosen(state) == Probe(rows=16)
    loss.rows.clear()
    rule.apply(params, flat(2.5), state, Arrival(1, 0, base=flat(2.0), loss=loss, seconds=60.0))
    assert loss.rows == [16] * 7  # no timing again, the same rows (5 steps, then 2 more momenta)


def test_a_probe_that_would_keep_the_merge_thread_busy_falls_back(probe_clock):
    """A pass takes 5 ms over 16 rows, so a merge's probe (9 passes) takes 45 ms even then; 4 tasks in
    flight of 0.1 s each would keep the merge thread busy 180% of the time."""
    fallback = Nesterov(lr=0.5, momentum=0.9, delay=1)
    rule = Auto(fallback=fallback, in_flight=4)
    loss = Slow(0.02, 2.0)
    params, state, _ = _merge(rule, loss, seconds=0.1)
    # the light probe's 4 passes (its numbers recorded: the cheapest tried) would keep it over 80% busy too
    assert state.scalars["chosen"] == "nesterov" and state.scalars["probe_seconds"] == pytest.approx(4 * 0.005)
    assert state.scalars["probe_rows"] == 16 and state.scalars["busy"] == pytest.approx(0.8)
    assert not state.scalars["light"]
    assert loss.rows == [16] * 4  # the fewest rows timed once, found too costly, and no probe again
    _, no_light, _ = _merge(Auto(fallback=fallback, in_flight=4, light=None), Slow(0.02, 2.0), seconds=0.1)
    assert no_light.scalars["chosen"] == "nesterov" and no_light.scalars["probe_seconds"] == pytest.approx(9 * 0.005)
    alone, alone_state, _ = _merge(fallback, None, seconds=None)
    assert w(params) == w(alone)
    assert set(state.arrays) == set(alone_state.arrays) == {"momentum"}
    assert w(state.arrays["momentum"]) == w(alone_state.arrays["momentum"]) != [0.0]
    assert rule.requires(state) == frozenset() and rule.label(state) == "auto: nesterov"
    # the same probe with a budget that affords it
    _, state, _ = _merge(Auto(fallback=fallback, in_flight=4, budget=10.0), Slow(0.02, 2.0), seconds=0.1)
    assert state.scalars["chosen"] == "probe" and state.scalars["probe_rows"] == 64
    # a task of unknown length: no grounds for the probe
    _, state, _ = _merge(Auto(fallback=fallback, in_flight=4), Quadratic(2.0), seconds=None)
    assert state.scalars["chosen"] == "nesterov" and state.scalars["task_seconds"] is None
    assert state.scalars["probe_seconds"] is None  # (not timed)


class Stepped(Slow):
    """A probe that takes ``seconds[rows]`` a call (``rows`` None: the rule's own, 64), on :data:`CLOCK`."""

    def __call__(self, params, rows=None):
        self.rows.append(rows)
        CLOCK.take(self.seconds[rows])
        return Quadratic.__call__(self, params)


def test_where_the_full_probe_does_not_fit_the_light_one_does_with_the_most_rows_that_fit(probe_clock):
    """A pass takes 16 ms over 16 or 32 rows, 160 ms over 64.  Four 1 s tasks in flight: the full grid
    here (12 passes) would keep the merge thread 77% busy even over 16 rows; the light one (4 passes) 26%
    over 16 or 32 rows (under the 75% budget), 256% over 64."""
    full = Probe(steps=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0))  # (8 + 2 + 2 passes)
    rule = Auto(probe=full, in_flight=4)
    light = Probe(steps=(1.0, 2.0), pulls=(0.5, 1.0), momenta=(0.0, 0.9))
    assert rule.light == light and light.passes == 4 and full.passes == 12
    loss = Stepped({16: 0.016, 32: 0.016, None: 0.16}, 2.0)
    params, state, out = _merge(rule, loss, seconds=1.0, staleness=1)
    assert state.scalars["chosen"] == "probe" and state.scalars["light"] is True
    assert state.scalars["probe_rows"] == 32 and state.scalars["busy"] == pytest.approx(0.256)
    # 16 rows timed once for both grids, then 32 and 64 for the light one; then the merge, on 32 rows
    assert loss.rows[:8] == [16] * 4 + [32] * 4 and set(loss.rows[8:-3]) == {None}
    assert loss.rows[-3:] == [32] * 3  # (2 steps, 2 pulls less the one already scored; no momentum yet)
    assert rule.chosen(state) == dataclasses.replace(light, rows=32)
    assert rule.label(state) == "auto: light probe, 32 rows"
    # the merge is the light probe's, bit for bit
    alone, alone_state, alone_out = _merge(rule.chosen(state), Quadratic(2.0), None, staleness=1)
    assert w(params) == w(alone) and out == alone_out
    assert {k: state.scalars[k] for k in alone_state.scalars} == alone_state.scalars
    json.dumps(state.scalars, allow_nan=False)
    # a restarted server rebuilds the choice from the stored scalars alone
    stored = RuleState(scalars=json.loads(json.dumps(state.scalars)))
    assert Auto(probe=full, in_flight=4).chosen(stored) == rule.chosen(state)
    with pytest.raises(ValueError, match=r"chose its light probe, and this Auto has none \(light=None\)"):
        Auto(in_flight=4, light=None).chosen(stored)
    # the light probe's rows are the probe's, whatever it was given
    assert Auto(probe=Probe(rows=256), light=Probe(rows=8)).light == Probe(rows=256)


def test_fits_default_rule_by_the_tasks_in_flight():
    assert for_run(DEFAULT_RULE, in_flight=1) is ONE_IN_FLIGHT
    two = for_run(DEFAULT_RULE, in_flight=2)
    assert isinstance(two, Nesterov) and two.delay == 2
    for n in (4, 8):
        auto = for_run(DEFAULT_RULE, in_flight=n)
        assert isinstance(auto, Auto) and auto.in_flight == n
        assert auto.fallback == Nesterov(lr=0.5, momentum=0.9, delay=n, bias_correction="trust")
        assert auto.probe == Probe() and auto.rows == 64
    named = get_rule("auto")  # by name: the same rule, configured by the run as the default is
    assert isinstance(named, Auto) and for_run(named, in_flight=4) == for_run(DEFAULT_RULE, in_flight=4)
    assert for_run(named, in_flight=3) == for_run(DEFAULT_RULE, in_flight=3)
    assert for_run(DEFAULT_RULE, in_flight=4).describe() == {
        "name": "auto",
        "probe": Probe().describe(),
        "fallback": {"name": "nesterov", "lr": 0.5, "momentum": 0.9, "delay": 4, "bias_correction": "trust"},
        "light": Probe(steps=(1, 2), pulls=(0.5, 1), momenta=(0, 0.9)).describe(),
        "budget": 0.75,
        "min_in_flight": 4,
        "min_rows": 16,
        "in_flight": 4,
    }
    # a fleet still starting: the tasks in flight given to the rule win over the run's count
    grown = for_run(Auto(in_flight=8), in_flight=1)
    assert isinstance(grown, Auto) and grown.in_flight == 8 and grown.fallback.delay == 8
    assert for_run(Auto(), in_flight=1) == Nesterov(lr=0.5, momentum=0.9, delay=1)
    explicit = Nesterov(lr=0.5, momentum=0.9, bias_correction="trust")  # equal to the default, but asked for
    assert isinstance(for_run(explicit, in_flight=8), Nesterov)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"budget=0: must be a number in \(0, 10\]"):
        Auto(budget=0)
    with pytest.raises(ValueError, match="min_in_flight=0: must be an integer >= 1"):
        Auto(min_in_flight=0)
    with pytest.raises(ValueError, match="min_rows=2.5: must be an integer >= 1"):
        Auto(min_rows=2.5)
    with pytest.raises(TypeError, match="fallback must be a vcdask.merge.MergeRule that needs no probe"):
        Auto(fallback=Probe())
    with pytest.raises(TypeError, match="probe must be a vcdask.merge.Probe"):
        Auto(probe=Nesterov())
    with pytest.raises(TypeError, match="light must be a vcdask.merge.Probe or None, got Nesterov"):
        Auto(light=Nesterov())
    with pytest.raises(ValueError, match="takes the tasks in flight from the run"):
        _merge(Auto(), Quadratic(1.0), seconds=1.0)
    with pytest.raises(ValueError, match="times the server's probe"):
        _merge(Auto(in_flight=4), None, seconds=1.0)


def test_the_task_time_is_its_steps_at_the_workers_pace_with_its_reading_and_upload():
    record = {"steps": 10, "step_seconds": 0.2, "train_seconds": 9.0, "read_seconds": 0.5, "upload_seconds": 0.25}
    assert task_seconds(record) == pytest.approx(2.75)  # not the 9 s of a first task's warm-up
    assert task_seconds({"train_seconds": 3.0, "step_seconds": None, "steps": 1}) == 3.0
    assert task_seconds({"epoch": 1}) is None
    # a record read back from the store has no upload time (NaN): counted as unknown, not as NaN
    assert task_seconds({**record, "upload_seconds": math.nan}) == pytest.approx(2.5)
    assert task_seconds({"train_seconds": math.nan}) is None


def test_an_unknown_task_time_or_a_failing_probe_falls_back_and_the_state_stays_storable():
    for seconds in (None, math.nan, 0.0, -1.0, math.inf):
        loss = Slow(0.0, 2.0)
        _, state, _ = _merge(Auto(in_flight=4).for_run(in_flight=4), loss, seconds=seconds)
        assert state.scalars["chosen"] == "nesterov" and loss.rows == []  # never timed
        assert state.scalars["task_seconds"] is None and state.scalars["probe_rows"] is None
        json.dumps(state.scalars, allow_nan=False)  # (a version's metadata is strict JSON)

    def on_gpu_only(params, rows=None):
        raise RuntimeError("Found no NVIDIA driver on your system")

    params, state, _ = _merge(Auto(fallback=Nesterov(lr=0.5, momentum=0.9, delay=1), in_flight=4), on_gpu_only, 60.0)
    assert state.scalars["chosen"] == "nesterov" and "no NVIDIA driver" in state.scalars["probe_error"]
    assert w(params) == w(_merge(Nesterov(lr=0.5, momentum=0.9, delay=1), None, None)[0])
    json.dumps(state.scalars, allow_nan=False)


def test_the_choice_survives_a_restart_of_the_server(tmp_path, probe_clock):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-p")
    store.commit(flatten({"w": torch.zeros(1)}), {"run_id": "run-p", "step": 0, "merged": []}, branch="run-p")
    v0 = store.read(branch="run-p").version
    rule = Auto(fallback=Nesterov(lr=0.5, momentum=0.9, delay=1), in_flight=4)

    def server(loss):
        s = ParamsServer(store, "run-p", rule, "run-p", probe=loss)
        s.load()
        return s

    first = server(Slow(0.02, 2.0))
    record = _upload(store, 0, 1.0, 0, v0)
    record.update(steps=2, step_seconds=0.05)  # 0.1 s tasks: the probe is too slow for them, even over 16 rows
    first.merge(record)
    assert first.rule_state.scalars["chosen"] == "nesterov" and first.head.rule == "auto: nesterov"
    assert first.footprint()["bases"] == 0  # no bases kept once the rule needs none
    meta = store.read(first.version).metadata
    assert meta["rule_state"]["chosen"] == "nesterov" and meta["merge"]["name"] == "auto"
    cheap = Quadratic(2.0)
    again = server(cheap)  # a probe that would be cheap now: the choice stands
    assert again.head.rule == "auto: nesterov"  # (what the run's status and panel show)
    assert again.rule_state.scalars["chosen"] == "nesterov" and set(again.rule_state.arrays) == {"momentum"}
    assert w(again.rule_state.arrays["momentum"]) == w(first.rule_state.arrays["momentum"]) != [0.0]
    record = _upload(store, 1, 3.0, 1, first.version)
    record.update(steps=2, step_seconds=60.0)
    again.merge(record)
    assert again.rule_state.scalars["chosen"] == "nesterov" and cheap.seen == []
    assert again.probe is None  # (dropped once the rule needs no probe: its model copy and rows with it)
    # a version that says "nesterov" but lost its state arrays is refused when loaded, not at a merge
    store.commit(
        flatten({"w": torch.zeros(1)}),
        {"run_id": "run-p", "step": 9, "merged": [], "merge": rule.describe(), "rule_state": {"chosen": "nesterov"}},
        branch="run-p",
    )
    with pytest.raises(ValueError, match=r"holds auto state \[\], expected \['momentum'\]"):
        server(Quadratic(2.0))


@pytest.mark.slow
def test_a_fit_with_four_tasks_in_flight_chooses_by_its_measured_times(client, digits_data, tmp_path):
    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    handle = vcdask.fit(
        digits_cnn(0),
        (X[:600], y[:600]),
        max_epochs=2,
        n_shards=4,
        tasks_per_slot=2,  # 2 workers x 1 thread x 2: four tasks in flight
        client=client,
        store=tmp_path / "s",
        progress=False,
        wait=False,
    )
    result = handle.result()
    head = result.store.read(result.version)
    assert head.metadata["merge"]["name"] == "auto" and head.metadata["merge"]["fallback"]["delay"] == 4
    state = head.metadata["rule_state"]
    busy = 4 * state["probe_seconds"] / state["task_seconds"]
    assert state["chosen"] == ("probe" if busy <= 0.75 else "nesterov")
    said = f"auto: {'light probe' if state['light'] else 'probe'}, {state['probe_rows']} rows"
    assert handle.status()["merge"] == (said if state["chosen"] == "probe" else "auto: nesterov")
    arrays = {"probe": {"momentum"}, "nesterov": {"momentum", "pending"}}[state["chosen"]]
    assert set(result.store.read_state(result.version)) == arrays
    assert len(result.history[result.history.accepted]) == 8
