"""The "probe" merge rule (issue 38): the step chosen per merge by a probe of the training loss.

Against hand-computed candidates, on a real store through the parameter server (bases kept by step,
read back by version after a restart), with the server's real probe model on real rows, and in a real fit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from spec_helpers import two_shard_spec
from test_rules import flat, w

import vcdask
from vcdask.engine.params_server import ParamsServer
from vcdask.engine.probing import ProbeModel
from vcdask.merge import Arrival, Probe, get_rule
from vcdask.params import flatten
from vcdask.updates import update_path, write_update


class Quadratic:
    """``loss(W) = sum((W - target) ** 2)``, counting its calls and the candidates it saw."""

    def __init__(self, *target):
        self.target = torch.tensor(target, dtype=torch.float64)
        self.seen: list[list[float]] = []

    def __call__(self, params):
        values = params.state_dict()["w"]
        self.seen.append(values.tolist())
        return float(((values - self.target) ** 2).sum())


def test_a_fresh_update_takes_the_step_along_its_progress_with_the_lowest_loss():
    rule, loss = Probe(momenta=[0]), Quadratic(2.0)
    server, state = flat(0.0), rule.init_state(flat(0.0))
    assert state.arrays == {}  # (no momentum, no state)
    out = rule.apply(server, flat(1.0), state, Arrival(1, 0, base=flat(0.0), loss=loss))
    # p = 1, no pull-back at staleness 0: the candidates are W_s + a for a in steps; 2 is the target
    assert loss.seen == [[0.5], [1.0], [1.5], [2.0], [3.0]]
    assert w(server) == [2.0] and out == {"alpha": None, "applied": True}
    assert state.scalars == {"step": 2.0, "pull": 1.0, "momentum": 0.0, "probes": 5}


def test_a_stale_update_chooses_its_step_then_its_pull_back():
    """W_s = 1, base 0, W_c = 0.5, staleness 1: k = 1/2, p = 0.5, W_base - W_s = -1.
    First a with b = 1: W = 1 + (0.5 a - 1) / 2 = 0.5 + a / 4 -> {0.625, 0.75, 0.875, 1, 1.25}: a = 3 for 1.45;
    then b: W = 1 + (1.5 - b) / 2 = 1.75 - b / 2 -> {1.75, 1.5, (1.25 known)}: b = 0.5."""
    rule, loss = Probe(momenta=[0]), Quadratic(1.45)
    server = flat(1.0)
    state = rule.init_state(server)
    rule.apply(server, flat(0.5), state, Arrival(1, 1, base=flat(0.0), loss=loss))
    assert loss.seen == [[0.625], [0.75], [0.875], [1.0], [1.25], [1.75], [1.5]]  # (3, 1) is not probed twice
    assert w(server) == [1.5] and state.scalars["pull"] == 0.5 and state.scalars["probes"] == 7


def test_with_one_step_and_one_pull_it_is_fedasync_and_probes_nothing():
    rule, loss = Probe(steps=[1], pulls=[1]), Quadratic(0.0)
    server, base, client = flat(4.0, -2.0), flat(1.0, 1.0), flat(3.0, 0.0)
    rule.apply(server, client, rule.init_state(server), Arrival(1, 3, base=base, loss=loss))
    fedasync = flat(4.0, -2.0)
    vcdask.merge.Staleness(alpha=0.0, a=1.0).apply(fedasync, client, None, Arrival(1, 3))
    assert loss.seen == [] and w(server) == pytest.approx(w(fedasync))


def test_a_candidate_with_a_nan_loss_is_never_chosen():
    def loss(params):
        value = params.state_dict()["w"][0].item()
        return math.nan if value > 1.2 else -value  # lower is better up to the NaNs

    rule = Probe()
    server = flat(0.0)
    rule.apply(server, flat(1.0), rule.init_state(server), Arrival(1, 0, base=flat(0.0), loss=loss))
    assert w(server) == [1.0]


def test_probed_momentum_carries_the_applied_moves():
    """momenta (0, 0.5): after the step and pull are chosen, W_s + d + mu m is probed for each mu;
    m <- d + mu m is kept in the rule's state."""
    rule = Probe(steps=[1], pulls=[1], momenta=[0.0, 0.5])
    server = flat(0.0)
    state = rule.init_state(server)
    assert sorted(state.arrays) == ["momentum"]
    loss = Quadratic(10.0)
    rule.apply(server, flat(1.0), state, Arrival(1, 0, base=flat(0.0), loss=loss))
    assert loss.seen == []  # (m is 0: every mu gives the same candidate, none is probed)
    assert w(server) == [1.0] and w(state.arrays["momentum"]) == [1.0]
    loss = Quadratic(10.0)
    rule.apply(server, flat(2.0), state, Arrival(1, 0, base=flat(1.0), loss=loss))
    assert loss.seen == [[2.0], [2.5]]  # d = 1, m = 1: mu 0 -> 2, mu 0.5 -> 2.5, nearer 10
    assert w(server) == [2.5] and w(state.arrays["momentum"]) == [1.5] and state.scalars["momentum"] == 0.5


def test_integer_state_takes_the_clients_value():
    rule = Probe()
    server = flat(1.0, steps=[1])
    base = flat(1.0, steps=[1])
    rule.apply(server, flat(2.0, steps=[7]), rule.init_state(server), Arrival(1, 0, base=base, loss=Quadratic(0.0)))
    assert server.state_dict()["n"].tolist() == [7]


def test_the_default_probes_momentum_once_there_is_some():
    rule = Probe()
    server = flat(0.0)
    state = rule.init_state(server)
    counts = []
    for base in (0.0, 1.0):
        loss = Quadratic(50.0)
        rule.apply(server, flat(base + 1.0), state, Arrival(1, 0, base=flat(base), loss=loss))
        counts.append(len(loss.seen))
    assert counts == [5, 7]  # the steps; then the steps and momenta 0.5 and 0.9 (0 is the steps' best)
    assert state.scalars["momentum"] == 0.9 and state.scalars["step"] == 3.0  # the farthest, toward 50


def test_bad_options_and_a_missing_probe_are_clear_errors():
    assert isinstance(get_rule("probe"), Probe) and Probe().passes == 9 and Probe(momenta=[0]).passes == 7
    assert get_rule("probe").describe() == {
        "name": "probe",
        "steps": [0.5, 1.0, 1.5, 2.0, 3.0],
        "pulls": [0.0, 0.5, 1.0],
        "momenta": [0.0, 0.5, 0.9],
        "rows": 64,
    }
    with pytest.raises(ValueError, match=r"steps=\[\]: give a non-empty sequence"):
        Probe(steps=[])
    with pytest.raises(ValueError, match=r"pulls=\(0, -1\): -1 is outside \[0, 2\]"):
        Probe(pulls=(0, -1))
    with pytest.raises(ValueError, match=r"momenta=\[0.9, 1.0\]: 1.0 is outside \[0, 1\)"):
        Probe(momenta=[0.9, 1.0])
    with pytest.raises(ValueError, match="steps=.*nan is not a finite number"):
        Probe(steps=[1.0, float("nan")])
    with pytest.raises(ValueError, match="rows=0: must be an integer >= 1"):
        Probe(rows=0)
    with pytest.raises(ValueError, match="rows=2.5: must be an integer >= 1"):
        Probe(rows=2.5)
    with pytest.raises(ValueError, match="alpha=0.5 does not apply to merge='probe'"):
        get_rule("probe", 0.5)
    with pytest.raises(ValueError, match="needs each update's base parameters and a loss"):
        Probe().apply(flat(0.0), flat(1.0), Probe().init_state(flat(0.0)), Arrival(1, 0))


# -- through the parameter server, on a real store ---------------------------------------------------


def _server(store, loss, rule=None):
    server = ParamsServer(store, "run-p", rule or Probe(), "run-p", probe=loss, inline_bytes=1 << 20, drafts=True)
    server.load()
    return server


def _upload(store, shard, value, base_step, base_version=None):
    path = update_path("run-p", 1, shard, 0)
    write_update(store.files, path, flatten({"w": torch.full((1,), float(value))}))
    return {
        "epoch": 1,
        "shard": shard,
        "attempt": 0,
        "base_step": base_step,
        "base_version": base_version,
        "update": path,
    }


def test_the_server_gives_each_update_its_own_base_by_step_and_by_version_after_a_restart(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-p")
    store.commit(flatten({"w": torch.zeros(1)}), {"run_id": "run-p", "step": 0, "merged": []}, branch="run-p")
    v0 = store.read(branch="run-p").version
    with pytest.raises(ValueError, match="needs a probe of the training loss"):
        ParamsServer(store, "run-p", Probe(), "run-p")
    loss = Quadratic(2.0)
    server = _server(store, loss)
    # a fresh update from step 0: W_c = 1, so p = 1 and the step a = 2 lands on the target
    out = server.merge(_upload(store, 0, 1.0, 0, v0))
    assert out["drafted"] and w(server.params) == [2.0]
    server.commit()
    v1 = server.version
    # based on step 0 as well (staleness 1): its base is W_s at step 0 (kept by step), not W_s now
    loss.seen.clear()
    server.merge(_upload(store, 1, 0.5, 0, v0))
    # k = 1/2, p = 0.5, W_base - W_s = -2: first candidate (a = 0.5, b = 1) is 2 + (0.25 - 2) / 2
    assert loss.seen[0] == [2.0 + (0.25 - 2.0) / 2]
    server.commit()
    assert server.footprint()["bases"] == 3 * server.params.nbytes  # W_s after steps 0, 1 and 2
    # a new server (the scheduler restarted) holds only the newest: an older base is read by version ...
    again = _server(store, Quadratic(2.0))
    loss = again.probe
    again.merge(_upload(store, 2, 3.0, 1, v1))  # base W_s at step 1 = 2: p = 1, W_base - W_s = 2 - W_s
    base_at_1 = 2.0
    assert loss.seen[0] == pytest.approx([w(server.params)[0] + (0.5 * 1 + (base_at_1 - w(server.params)[0])) / 2])
    # ... and one based on a draft that was never committed has no base left: rejected with its reason
    out = again.merge(_upload(store, 3, 3.0, 1, None))
    assert not out["accepted"] and out["fault"] == "unreadable" and "never committed" in out["reason"]


def test_the_training_probe_scores_the_first_rows_of_every_shard(tmp_path):
    spec, x, y = two_shard_spec(tmp_path)
    spec.model.weight.data.normal_()  # (not the weights scored below)
    probe = ProbeModel(spec, rows=16)  # 8 rows of each of the 2 shards
    assert probe._model is None  # (the model is copied at the first probe, in the merge thread)
    weights = np.array([0.5, -1.0, 2.0], dtype="float32")
    params = flatten({"weight": torch.from_numpy(weights[None].copy())})
    before = spec.model.weight.detach().clone()
    rows = np.r_[0:8, 64:72]
    expected = float(np.mean((x[rows] @ weights - y[rows]) ** 2))
    assert probe.train_loss(params) == pytest.approx(expected, rel=1e-5)
    assert probe.calls == 1
    rows = np.r_[0:3, 64:67]  # fewer rows asked for (merge="auto" halving them): 3 of each shard
    expected = float(np.mean((x[rows] @ weights - y[rows]) ** 2))
    assert probe.train_loss(params, rows=5) == pytest.approx(expected, rel=1e-5)
    assert probe.train_loss(params) != probe.train_loss(params, rows=5)  # each count its own rows, kept
    # fewer rows than shards: the first row of as many shards, spread evenly (here: shard 0's)
    assert probe.train_loss(params, rows=1) == pytest.approx(float((x[0] @ weights - y[0]) ** 2), rel=1e-5)
    assert torch.equal(spec.model.weight.detach(), before)  # the probe has its own copy of the model


class Slow(torch.nn.Module):
    """A linear model whose forward pass takes ``seconds`` (a stand-in for a model costly to evaluate)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.seconds = seconds

    def forward(self, x):
        import time

        time.sleep(self.seconds)
        return self.linear(x)


def test_a_probe_costly_for_the_model_is_warned_of_before_any_cluster_work(tmp_path, recwarn):
    from vcdask.groups import Merging
    from vcdask.options import plan
    from vcdask.preflight import check_probe_cost
    from vcdask.steps import SupervisedStep

    step = SupervisedStep(torch.nn.functional.cross_entropy)
    batch = (torch.randn(8, 4), torch.tensor([0, 1] * 4))
    # 9 passes over 64 rows, each timed as 64 / 8 of this batch's: at least 0.1 s -> at least 7.2 s a merge
    # (a sleep never returns early; a busy machine only lengthens it)
    with pytest.warns(UserWarning, match=r"scores 9 candidates on 64 training rows .* about \d+ s a merge"):
        assert 7.2 <= check_probe_cost(Probe(), Slow(0.1), batch, step) < 20
    assert check_probe_cost(Probe(rows=8), Slow(0.1), batch, step) < 5  # fewer rows: no warning
    assert check_probe_cost(vcdask.merge.Staleness(), Slow(0.1), batch, step) is None  # no probe, no timing
    assert not [w for w in recwarn if "candidates" in str(w.message)]
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
    with pytest.warns(UserWarning, match="merge='probe' scores 9 candidates"):
        plan(Slow(0.5), (X, y), merging=Merging(rule="probe"), store=tmp_path / "s")
    # "auto" times its probe itself, at the first merge, and falls back where it is costly: no warning
    plan(Slow(0.5), (X, y), merging=Merging(rule="auto"), store=tmp_path / "t")
    assert not [w for w in recwarn if "candidates" in str(w.message)]
