"""Merge rules against hand-computed arrays; rule state versioned with the parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vcdask
from vcdask.engine.params_server import ParamsServer as ServerState
from vcdask.merge import (
    VCASGD,
    Arrival,
    Auto,
    Nesterov,
    Probe,
    RuleState,
    Staleness,
    Sync,
    UnknownMergeRuleError,
    get_rule,
)
from vcdask.params import flatten
from vcdask.updates import update_path, write_update


def flat(*values, steps=None):
    d = {"w": torch.tensor(values, dtype=torch.float64)}
    if steps is not None:
        d["n"] = torch.tensor(steps, dtype=torch.int64)
    return flatten(d)


def w(params):
    return params.state_dict()["w"].tolist()


def test_vc_asgd_constant_and_epoch_schedule():
    server, state = flat(0.0, 0.0), None
    rule = VCASGD(alpha=0.5)
    out = rule.apply(server, flat(2.0, 4.0), rule.init_state(server), Arrival(epoch=1))
    assert w(server) == [1.0, 2.0] and out == {"alpha": 0.5, "applied": True}
    rule = VCASGD()  # alpha_e = e / (e + 1): epoch 3 -> 0.75
    rule.apply(server, flat(5.0, 6.0), state, Arrival(epoch=3))
    assert w(server) == [0.75 * 1 + 0.25 * 5, 0.75 * 2 + 0.25 * 6]


@pytest.mark.parametrize(
    "function,staleness,expected_weight",
    [
        ("polynomial", 0, 0.5),  # s = 1
        ("polynomial", 3, 0.5 * 4**-0.5),  # s = (3 + 1) ** -0.5 = 0.5
        ("hinge", 2, 0.5),  # t <= b: s = 1
        ("hinge", 6, 0.5 / (0.5 * 4 + 1)),  # s = 1 / (a (t - b) + 1) = 1/3
    ],
)
def test_staleness_weights(function, staleness, expected_weight):
    rule = Staleness(alpha=0.5, function=function, a=0.5, b=2)
    server = flat(0.0)
    out = rule.apply(server, flat(3.0), rule.init_state(server), Arrival(epoch=1, staleness=staleness))
    assert w(server) == pytest.approx([3.0 * expected_weight])
    assert out["alpha"] == pytest.approx(1 - expected_weight)


def test_nesterov_momentum_over_three_arrivals():
    rule = Nesterov(lr=0.7, momentum=0.9, delay=1, bias_correction=False)
    server = flat(1.0)
    state = rule.init_state(server)
    expected = []
    # by hand: g = W_s - W_c;  m = 0.9 m + g;  W_s -= 0.7 (g + 0.9 m)
    ws, m = 1.0, 0.0
    for wc in (0.0, 0.5, 0.2):
        g = ws - wc
        m = 0.9 * m + g
        ws = ws - 0.7 * (g + 0.9 * m)
        expected.append((ws, m))
        rule.apply(server, flat(wc), state, Arrival(epoch=1))
        assert w(server) == pytest.approx([ws], abs=1e-12)
        assert state.arrays["momentum"].state_dict()["w"].tolist() == pytest.approx([m], abs=1e-12)
    assert [round(e[0], 6) for e in expected] == [-0.33, 0.2069, 0.158033]
    # the same as PyTorch's SGD(nesterov=True) fed the pseudo-gradients
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for wc in (0.0, 0.5, 0.2):
        p.grad = p.detach() - wc
        opt.step()
    assert p.item() == pytest.approx(w(server)[0], abs=1e-12)


def test_sync_averages_by_samples_once_the_target_is_reached():
    rule = Sync(target_samples=30)
    server = flat(0.0, steps=[5])
    state = rule.init_state(server)
    out = rule.apply(server, flat(1.0, steps=[7]), state, Arrival(epoch=1, n_samples=10))
    assert out["applied"] is False and w(server) == [0.0] and state.scalars == {"samples": 10, "updates": 1}
    out = rule.apply(server, flat(4.0, steps=[9]), state, Arrival(epoch=1, n_samples=20))
    assert out["applied"] is True
    assert w(server) == [(10 * 1.0 + 20 * 4.0) / 30]  # 3.0
    assert server.state_dict()["n"].tolist() == [9]  # integer state: the client's value
    assert state.scalars == {"samples": 0, "updates": 0}
    assert state.arrays["moved"].state_dict()["w"].tolist() == [0.0]


@pytest.mark.parametrize(
    "aggregate, expected",
    [
        ("median", [2.0, -2.0]),  # of 1, 100, 2, -50, 6 (and of their negatives)
        ("trimmed-mean", [3.0, -3.0]),  # trim 0.2 of 5: drop the top and the bottom value, mean of 1, 2, 6
        ("mean", [(1 + 100 + 2 - 50 + 6) / 5, -(1 + 100 + 2 - 50 + 6) / 5]),
    ],
)
def test_sync_robust_aggregates_shrug_off_an_outlier(aggregate, expected):
    rule = Sync(target_samples=5, aggregate=aggregate)
    server = flat(0.0, 0.0, steps=[5])
    state = rule.init_state(server)
    for i, v in enumerate([1.0, 100.0, 2.0, -50.0, 6.0]):
        out = rule.apply(server, flat(v, -v, steps=[i]), state, Arrival(epoch=1, n_samples=1))
        assert out["applied"] is (i == 4)
        assert w(server) == ([0.0, 0.0] if i < 4 else pytest.approx(expected))
    assert server.state_dict()["n"].tolist() == [4]  # integer state: the last client's value
    assert state.scalars == {"samples": 0, "updates": 0} and set(state.arrays) <= {"moved"}


def test_sync_median_of_an_even_round_is_the_mean_of_the_middle_two():
    rule = Sync(target_samples=4, aggregate="median")
    server = flat(0.0)
    state = rule.init_state(server)
    for v in (1.0, 10.0, 2.0, 3.0):
        rule.apply(server, flat(v), state, Arrival(epoch=1, n_samples=1))
    assert w(server) == [2.5]


@pytest.mark.parametrize("aggregate", ["median", "trimmed-mean"])
def test_sync_robust_aggregates_keep_float64(aggregate):
    """Four clients sending the same float64 parameters give exactly them (they were sorted in float32)."""
    values = (1.0 + 1e-12, 2.0 + 3e-12, 0.1)
    rule = Sync(target_samples=4, aggregate=aggregate)  # (a mean of 2 or 4 equal values is exact)
    server = flat(0.0, 0.0, 0.0)
    state = rule.init_state(server)
    for _ in range(4):
        rule.apply(server, flat(*values), state, Arrival(epoch=1, n_samples=1))
    assert w(server) == list(values)


def _half(dtype, value, steps):
    return flatten(
        {
            "a": torch.full((2,), value, dtype=torch.float32),
            "h": torch.full((3,), value, dtype=dtype),
            "n": torch.tensor([steps]),
        }
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sync_mean_sums_half_precision_in_float32(dtype):
    """60 shards of 1000 rows of w ~ 1.5: the round's sum (~90,000) overflowed float16 to inf; it is kept in
    float32 and rounded to the parameters' dtype once, when the round closes."""
    rule = Sync(target_samples=60_000)
    server = _half(dtype, 1.5, 0)
    state = rule.init_state(server)
    sent = [torch.tensor(1.5 + i * 0.001, dtype=dtype) for i in range(60)]
    for i, v in enumerate(sent):
        out = rule.apply(server, _half(dtype, float(v), i), state, Arrival(epoch=1, n_samples=1000))
    mean = sum(float(v) for v in sent) / 60
    assert out["applied"] is True
    assert server["h"].dtype == dtype and server["h"].tolist() == [float(torch.tensor(mean, dtype=dtype))] * 3
    assert server["a"].tolist() == pytest.approx([mean] * 2, abs=1e-6) and server["n"].tolist() == [59]
    assert state.arrays["moved"]["h"].tolist() == [0.0] * 3  # ready for the next round
    assert {a.dtype for a in state.arrays["moved"].arrays.values()} == {torch.float32, torch.int64}


def test_sync_half_precision_sum_saved_in_the_parameters_dtype_is_taken_up_to_float32():
    """A sum (of ``n_i W_c_i``) saved before it was kept in float32 (laid out as the parameters) resumes, exactly."""
    rule = Sync(target_samples=2)
    server = _half(torch.float16, 0.0, 0)
    old = _half(torch.float16, 2.0, 0)  # one update of w = 2 (a = 2 in float32 too), 1 row
    state = RuleState(arrays={"sum": old}, scalars={"samples": 1, "updates": 1})
    assert rule.apply(server, _half(torch.float16, 4.0, 1), state, Arrival(epoch=1, n_samples=1))["applied"]
    assert server["h"].tolist() == [3.0] * 3 and server["a"].tolist() == [3.0] * 2
    assert set(state.arrays) == {"moved"}
    assert state.arrays["moved"].layout == rule.init_state(server).arrays["moved"].layout


@pytest.mark.parametrize("aggregate", ["mean", "trimmed-mean", "median"])
def test_sync_leaves_what_no_update_moved_exactly_as_it_was_round_after_round(aggregate):
    """A frozen layer or a constant buffer comes back from every update as it went out: the round combines
    what each update moved, so it stays bit for bit, where the average of its copies (7 shards of 38 or 39
    rows) was a few ulps off it and drifted further each round."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(10_000, generator=g)
    frozen = flatten({"backbone": w0[:5000].clone(), "head": w0[5000:].clone()})
    rows = [39, 39, 39, 39, 38, 38, 38]
    rule = Sync(target_samples=sum(rows), aggregate=aggregate)
    server = frozen.clone()
    state = rule.init_state(server)
    for _ in range(10):
        for n in rows:
            w_c = server.clone()
            w_c["head"].add_(1e-2 * torch.randn(5000, generator=g))
            out = rule.apply(server, w_c, state, Arrival(epoch=1, n_samples=n))
        assert out["applied"] is True
    assert torch.equal(server["backbone"], frozen["backbone"])
    assert (server["head"] - frozen["head"]).abs().max() > 1e-3  # (the trained part did move)


def test_sync_round_moves_w_s_by_the_sample_weighted_mean_of_what_the_updates_moved():
    """W_s = (1, -2); updates (3, -2) of 10 rows and (0, 4) of 30: W_s + (10 (2, 0) + 30 (-1, 6)) / 40."""
    rule = Sync(target_samples=40)
    server = flat(1.0, -2.0)
    state = rule.init_state(server)
    rule.apply(server, flat(3.0, -2.0), state, Arrival(epoch=1, n_samples=10))
    assert w(server) == [1.0, -2.0] and state.arrays["moved"]["w"].tolist() == [20.0, 0.0]
    rule.apply(server, flat(0.0, 4.0), state, Arrival(epoch=1, n_samples=30))
    assert w(server) == [1.0 + (20 - 30) / 40, -2.0 + 180 / 40]  # 0.75, 2.5


def test_sync_sum_of_client_weights_saved_by_an_earlier_vcdask_is_taken_over_mid_round():
    """An earlier vcdask saved the round's sum of ``n_i W_c_i`` as ``"sum"``: a resumed run accepts it
    (ParamsServer's check asks ``state_arrays``) and finishes the round as it would have."""
    rule = Sync(target_samples=40)
    server = flat(1.0, -2.0)
    old = RuleState(arrays={"sum": flat(10 * 3.0, 10 * -2.0)}, scalars={"samples": 10, "updates": 1})
    assert rule.state_arrays(server, old) == {"sum"}
    assert rule.state_arrays(server, rule.init_state(server)) == {"moved"}
    rule.apply(server, flat(0.0, 4.0), old, Arrival(epoch=1, n_samples=30))
    assert w(server) == [(10 * 3.0 + 30 * 0.0) / 40, (10 * -2.0 + 30 * 4.0) / 40]
    assert set(old.arrays) == {"moved"} and old.arrays["moved"]["w"].tolist() == [0.0, 0.0]


def test_sync_bad_aggregate_options():
    with pytest.raises(
        ValueError, match=r"unknown aggregate 'mode'; valid aggregates: \['mean', 'median', 'trimmed-mean'\]"
    ):
        Sync(aggregate="mode")
    with pytest.raises(ValueError, match=r"trim must be a number in \[0, 0.5\), got 0.5"):
        Sync(aggregate="trimmed-mean", trim=0.5)


def test_integer_state_takes_the_clients_value_in_every_rule():
    for rule in (VCASGD(alpha=0.9), Staleness(), Nesterov(delay=1), Nesterov(delay=3)):
        server = flat(1.0, steps=[1])
        rule.apply(server, flat(1.0, steps=[42]), rule.init_state(server), Arrival(epoch=1))
        assert server.state_dict()["n"].tolist() == [42]


def test_registry_and_bad_options():
    assert isinstance(get_rule("nesterov"), Nesterov)
    assert get_rule("vc-asgd", 0.7).describe() == {"name": "vc-asgd", "alpha": 0.7}
    assert get_rule("sync", samples_per_epoch=123).target_samples == 123
    with pytest.raises(UnknownMergeRuleError, match="'nesterov'.*'staleness'.*'sync'.*'vc-asgd'"):
        get_rule("fedavg")
    with pytest.raises(ValueError, match="alpha=0.5 does not apply to merge='nesterov'"):
        get_rule("nesterov", 0.5)
    with pytest.raises(ValueError, match="lr=-1"):
        Nesterov(lr=-1)
    with pytest.raises(ValueError, match="momentum=1.0"):
        Nesterov(momentum=1.0)
    with pytest.raises(ValueError, match="function='cubic'"):
        Staleness(function="cubic")
    with pytest.raises(TypeError, match="merge must be"):
        get_rule(3)
    with pytest.raises(ValueError, match="delay=0"):
        Nesterov(delay=0)
    assert Nesterov().for_run(in_flight=6).delay == 6 and Nesterov(delay=2).for_run(in_flight=6).delay == 2


def _upload(store, run, epoch, shard, value, base_step):
    path = update_path(run, epoch, shard, 0)
    write_update(store.files, path, flatten({"w": torch.full((3,), float(value))}))
    return {"epoch": epoch, "shard": shard, "attempt": 0, "base_step": base_step, "update": path, "n_samples": 10}


def test_momentum_state_survives_a_restart(tmp_path):
    """Two merges, the server dies, a new ServerState resumes from the store: the third merge gives
    exactly what an uninterrupted server gives."""

    def start(store_path, run):
        store = vcdask.open_store(store_path)
        if run not in store.branches():
            store.create_branch(run)
            store.commit(flatten({"w": torch.ones(3)}), {"run_id": run, "step": 0, "merged": []}, branch=run)
        state = ServerState(store, run, Nesterov(lr=0.7, momentum=0.9, delay=1), run)
        state.load()
        return store, state

    store, a = start(tmp_path / "a", "run-a")
    store_b, b = start(tmp_path / "b", "run-b")
    for i, value in enumerate((0.0, 0.5)):
        a.merge(_upload(store, "run-a", 1, i, value, i))
        b.merge(_upload(store_b, "run-b", 1, i, value, i))
    saved = store_b.read_state(b.version)
    assert saved["momentum"].state_dict()["w"].tolist() == b.rule_state.arrays["momentum"].state_dict()["w"].tolist()
    assert store_b.read(b.version).metadata["merge"] == {
        "name": "nesterov",
        "lr": 0.7,
        "momentum": 0.9,
        "delay": 1,
        "bias_correction": "trust",
    }
    # the bias correction resumes too, with its switch to the bounded one (these steps are large)
    assert store_b.read(b.version).metadata["rule_state"] == {"steps": 2, "bounded": 1}
    del b  # the server dies; a new one resumes from the branch
    _, b2 = start(tmp_path / "b", "run-b")
    assert b2.step == 2
    assert torch.equal(
        b2.rule_state.arrays["momentum"].arrays["float32"], a.rule_state.arrays["momentum"].arrays["float32"]
    )
    a.merge(_upload(store, "run-a", 1, 2, 0.2, 2))
    b2.merge(_upload(store_b, "run-b", 1, 2, 0.2, 2))
    assert torch.equal(a.params.arrays["float32"], b2.params.arrays["float32"])
    # a new run started from this version gets a fresh outer optimizer
    store_b.create_branch("run-c", b2.version)
    c = ServerState(store_b, "run-c", Nesterov(delay=1), "run-c")
    c.load()
    assert not c.rule_state.arrays["momentum"].arrays["float32"].any()


def test_sync_buffer_survives_a_restart(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-s")
    store.commit(flatten({"w": torch.zeros(3)}), {"run_id": "run-s", "step": 0, "merged": []}, branch="run-s")
    s1 = ServerState(store, "run-s", Sync(target_samples=20), "run-s")
    s1.load()
    s1.merge(_upload(store, "run-s", 1, 0, 1.0, 0))  # collected, W_s unchanged; buffer committed
    assert store.read(s1.version).metadata["rule_state"] == {"samples": 10, "updates": 1}
    s2 = ServerState(store, "run-s", Sync(target_samples=20), "run-s")
    s2.load()
    s2.merge(_upload(store, "run-s", 1, 1, 3.0, 1))
    assert s2.params.state_dict()["w"].tolist() == [2.0, 2.0, 2.0]


def test_sync_float32_sum_of_half_precision_survives_a_restart(tmp_path):
    """The sum of a half-precision model, kept in float32 (laid out unlike the parameters), is stored and
    resumed as it is."""
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-h")
    store.commit(_half(torch.float16, 0.0, 0), {"run_id": "run-h", "step": 0, "merged": []}, branch="run-h")

    def upload(shard, value):
        path = update_path("run-h", 1, shard, 0)
        write_update(store.files, path, _half(torch.float16, value, shard))
        return {"epoch": 1, "shard": shard, "attempt": 0, "base_step": shard, "update": path, "n_samples": 5000}

    s1 = ServerState(store, "run-h", Sync(target_samples=20_000), "run-h")
    s1.load()
    for shard, value in enumerate((10.0, 12.0, 14.0)):  # a float16 sum would reach 180,000: inf
        s1.merge(upload(shard, value))
    saved = store.read_state(s1.version)["moved"]
    assert saved.layout == s1.rule_state.arrays["moved"].layout and saved["h"].dtype == torch.float32
    assert saved["h"].tolist() == [180_000.0] * 3  # 5000 (10 + 12 + 14) - 15000 * 0
    s2 = ServerState(store, "run-h", Sync(target_samples=20_000), "run-h")
    s2.load()
    s2.merge(upload(3, 16.0))
    assert s2.params["h"].dtype == torch.float16 and s2.params["h"].tolist() == [13.0] * 3
    assert s2.params["a"].tolist() == [13.0] * 2


def test_sync_median_round_survives_a_restart(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-m")
    store.commit(flatten({"w": torch.zeros(3)}), {"run_id": "run-m", "step": 0, "merged": []}, branch="run-m")
    rule = Sync(target_samples=30, aggregate="median")
    s1 = ServerState(store, "run-m", rule, "run-m")
    s1.load()
    s1.merge(_upload(store, "run-m", 1, 0, 1.0, 0))
    s1.merge(_upload(store, "run-m", 1, 1, 9.0, 1))  # two of the round's three updates, committed
    s2 = ServerState(store, "run-m", rule, "run-m")
    s2.load()
    assert sorted(s2.rule_state.arrays) == ["u0", "u1"]
    s2.merge(_upload(store, "run-m", 1, 2, 2.0, 2))
    assert s2.params.state_dict()["w"].tolist() == [2.0, 2.0, 2.0]  # median of 1, 9, 2


def test_fit_rejects_bad_merge_options_before_cluster_work(digits_data, tmp_path):
    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    with pytest.raises(UnknownMergeRuleError, match="fedavg.*choose one of"):
        vcdask.fit(digits_cnn(0), (X, y), merge="fedavg", store=tmp_path / "s")
    with pytest.raises(ValueError, match="does not apply to merge='sync'"):
        vcdask.fit(digits_cnn(0), (X, y), merge="sync", alpha=0.5, store=tmp_path / "s")
    assert not (tmp_path / "s").exists()  # nothing was written: the errors came first


@pytest.mark.slow
@pytest.mark.parametrize("merge", ["nesterov", "sync", Staleness(alpha=0.5), "probe"])
def test_fit_with_each_rule(merge, client, digits_data, tmp_path):
    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    result = vcdask.fit(
        digits_cnn(0),
        (X[:600], y[:600]),
        validation=0.2,
        max_epochs=3,
        n_shards=4,
        merge=merge,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    accepted = result.history[result.history.accepted]
    assert len(accepted) == 12 and len(result.epochs) == 3
    head = result.store.read(result.version)
    name = merge if isinstance(merge, str) else merge.name
    assert head.metadata["merge"]["name"] == name
    if name == "nesterov":  # delay: the 2 tasks in flight (2 workers x 1 thread x tasks_per_slot 1)
        assert head.metadata["merge"]["delay"] == 2
        assert set(result.store.read_state(result.version)) == {"momentum", "pending"}
    if name == "sync":  # one merge per epoch's samples: W_s changes only at the end of each epoch
        assert head.metadata["rule_state"] == {"samples": 0, "updates": 0}
    if name == "probe":  # the last merge's choice, by the server's probe of the training rows (5 to 9 passes)
        chosen = head.metadata["rule_state"]
        assert chosen["step"] in (0.5, 1.0, 1.5, 2.0, 3.0) and chosen["probes"] in (5, 6, 7, 8, 9)
        assert chosen["momentum"] in (0.0, 0.5, 0.9) and set(result.store.read_state(result.version)) == {"momentum"}
    assert result.metrics["accuracy"] > 0.15  # better than chance (0.1) after 3 short epochs


def test_delayed_nesterov_window_equals_one_step_on_the_mean():
    """N arrivals from the same base make one Nesterov step on their mean pseudo-gradient, spread out."""
    rule = Nesterov(lr=0.7, momentum=0.9, delay=2, bias_correction=False)
    server = flat(1.0)
    state = rule.init_state(server)
    rule.apply(server, flat(0.0), state, Arrival(epoch=1))  # g1 = 1: W = 1 - 0.35 = 0.65, momentum waits
    assert w(server) == pytest.approx([0.65]) and state.scalars == {"arrivals": 1, "steps": 0}
    rule.apply(server, flat(0.45), state, Arrival(epoch=1))  # g2 = 0.65 - 0.45 = 0.2
    # W = 0.65 - 0.35 * 0.2 = 0.58; m = mean(1, 0.2) = 0.6; W -= 0.7 * 0.9 * 0.6 = 0.378 -> 0.202
    assert w(server) == pytest.approx([0.202])
    assert state.arrays["momentum"].state_dict()["w"].tolist() == pytest.approx([0.6])
    assert state.scalars == {"arrivals": 0, "steps": 1} and state.arrays["pending"].state_dict()["w"].tolist() == [0.0]


@pytest.mark.parametrize("delay", [1, 3])
def test_nesterov_bias_correction_moves_at_the_steady_pace_from_the_start(delay):
    """A constant pseudo-gradient g: with the correction every momentum step moves W_s by
    lr * g * (1 + momentum / (1 - momentum)) per window, the steady pace, from the first window on;
    without it the first window moves lr * g * (1 + momentum) and the pace builds up."""
    lr, mom, g = 0.5, 0.8, 0.01
    steady = lr * g * (1 + mom / (1 - mom))
    moved = {}
    for corrected in (True, False):
        rule = Nesterov(lr=lr, momentum=mom, delay=delay, bias_correction=corrected)
        server = flat(0.0)
        state = rule.init_state(server)
        steps = []
        for _window in range(4):
            before = w(server)[0]
            for _ in range(delay):
                rule.apply(server, flat(w(server)[0] - g), state, Arrival(epoch=1))
            steps.append(before - w(server)[0])
        moved[corrected] = steps
        assert state.scalars["steps"] == 4
    assert moved[True] == pytest.approx([steady] * 4)
    assert moved[False][0] == pytest.approx(lr * g * (1 + mom))
    assert moved[False][0] < moved[False][1] < moved[False][2] < moved[False][3] < steady


def test_nesterov_state_saved_before_the_step_count_is_not_corrected_again():
    """A momentum buffer already built up (a state saved before vcdask counted momentum steps) is not
    divided by 1 - momentum: the step is the uncorrected one."""
    a = Nesterov(lr=0.5, momentum=0.8, delay=1)
    b = Nesterov(lr=0.5, momentum=0.8, delay=1, bias_correction=False)
    results = []
    for rule in (a, b):
        server = flat(1.0)
        state = rule.init_state(server)
        state.arrays["momentum"].arrays["float64"].fill_(0.3)  # built up, and no count saved with it
        state.scalars.pop("steps")
        rule.apply(server, flat(0.9), state, Arrival(epoch=1))
        results.append(w(server)[0])
    assert results[0] == pytest.approx(results[1])


def _windows(delay, *gs, start=(100.0, 0.0), lr=0.5, mom=0.8, correction="agreement"):
    """Momentum windows of ``Nesterov(bias_correction=correction)``, each of ``delay`` arrivals with
    pseudo-gradient ``g``: how far each window moved W_s, and the momentum after the last."""
    rule = Nesterov(lr=lr, momentum=mom, delay=delay, bias_correction=correction)
    server = flat(*start)
    state = rule.init_state(server)
    moved = []
    for g in gs:
        before = torch.tensor(w(server), dtype=torch.float64)
        for _ in range(delay):
            client = torch.tensor(w(server), dtype=torch.float64) - torch.tensor(g, dtype=torch.float64)
            rule.apply(server, flat(*client.tolist()), state, Arrival(epoch=1))
        moved.append((before - torch.tensor(w(server), dtype=torch.float64)).tolist())
    return moved, state.arrays["momentum"].state_dict()["w"].tolist()


@pytest.mark.parametrize("delay", [1, 2])
def test_nesterov_agreement_correction_follows_the_pseudo_gradients(delay):
    """``bias_correction="agreement"`` far from its bound: the first momentum step takes Adam's full
    correction; a later one the full correction where the window's pseudo-gradient points along the
    momentum, none where it points back, and the correction times the cosine in between."""
    lr, mom, g = 0.5, 0.8, [0.01, 0.0]
    first, _ = _windows(delay, g)
    assert first[0] == pytest.approx([lr * 0.01 * (1 + mom / (1 - mom)), 0.0])  # the steady pace at once

    same, m = _windows(delay, g, g)  # agrees: the full correction, 1 / (1 - mom**2)
    assert m == pytest.approx([0.01 * (1 + mom), 0.0])
    assert same[1] == pytest.approx([lr * 0.01 + lr * mom * 0.01 * (1 + mom) / (1 - mom**2), 0.0])

    back, m = _windows(delay, g, [-0.01, 0.0])  # points back: momentum not amplified
    assert m == pytest.approx([0.01 * (mom - 1), 0.0])
    assert back[1] == pytest.approx([-lr * 0.01 + lr * mom * 0.01 * (mom - 1), 0.0])

    across, m = _windows(delay, g, [0.01, 0.01])  # at 45 degrees: the correction times cos = 1 / sqrt(2)
    gain = 1 + (1 / (1 - mom**2) - 1) / 2**0.5
    assert across[1] == pytest.approx([lr * 0.01 + lr * mom * gain * m[0], lr * 0.01 + lr * mom * gain * m[1]])


@pytest.mark.parametrize("delay", [1, 2])
def test_nesterov_agreement_correction_never_steps_past_half_the_parameters_norm(delay):
    """A pseudo-gradient half the size of the parameters: the corrected momentum step is cut to half
    the server's norm (gain 1.875 of Adam's 5); one too small to reach it is not cut at all."""
    lr, mom = 0.5, 0.8
    moved, _ = _windows(delay, [0.5, 0.0], start=(1.0, 0.0))
    # delayed, the arrivals' own shares first move W_s to 1 - lr * 0.5 = 0.75, and the momentum step is
    # 0.5 * 0.75; with a step per arrival, both come at once, from |W_s| = 1
    assert moved[0] == pytest.approx([lr * 0.5 + 0.5 * (0.75 if delay > 1 else 1.0), 0.0])
    small, _ = _windows(delay, [0.01, 0.0], start=(1.0, 0.0))  # 0.02 < 0.5 * 0.995
    assert small[0] == pytest.approx([lr * 0.01 * (1 + mom / (1 - mom)), 0.0])
    # never below the uncorrected step, however large the pseudo-gradient
    huge, _ = _windows(delay, [50.0, 0.0], start=(1.0, 0.0))
    assert huge[0] == pytest.approx([lr * 50 * (1 + mom), 0.0])


@pytest.mark.parametrize("delay", [1, 2])
def test_nesterov_trust_correction_weighs_agreement_by_how_much_the_bound_cut(delay):
    """``bias_correction="trust"``: while every momentum step stays within half the parameters' norm,
    Adam's full correction, even where the next window points back; once the bound cuts a correction,
    later ones are scaled by the agreement as far as it cut: fully when it cut the correction to
    nothing (``"agreement"``), by the share it took otherwise."""
    g, back = [0.01, 0.0], [-0.01, 0.0]

    def flat_moves(*gs, **kw):
        moved, m = _windows(delay, *gs, **kw)
        return [x for step in moved for x in step] + m

    small = flat_moves(g, back, correction="trust")
    assert small == pytest.approx(flat_moves(g, back, correction=True))  # far from the bound: exactly Adam's
    # where "agreement" would not have amplified the step back
    assert small != pytest.approx(flat_moves(g, back, correction="agreement"))
    # a first pseudo-gradient far beyond the bound: cut to no correction at all, then "agreement"
    huge = [[50.0, 0.0], [-30.0, 10.0], [20.0, 20.0]]
    assert flat_moves(*huge, start=(1.0, 0.0), correction="trust") == pytest.approx(
        flat_moves(*huge, start=(1.0, 0.0), correction="agreement")
    )
    # cut part of the way, then a second window pointing straight back, well within its bound: its
    # correction loses the share of the first one the bound took (cosine -1 takes all of it under
    # "agreement")
    lr, mom, g1, g2, start = 0.5, 0.8, 3.0, -0.01, (0.0, 10.0)
    moved, m = _windows(delay, [g1, 0.0], [g2, 0.0], start=start, correction="trust")
    at_close = math.hypot(start[0] - (lr * g1 if delay > 1 else 0.0), start[1])  # |W_s| as window 1 closes
    first = 0.5 * at_close / (lr * mom * g1)  # the bound on the first step's gain, below Adam's 5
    assert 1.0 < first < 5.0
    assert moved[0][0] == pytest.approx(lr * g1 + lr * mom * first * g1)
    share = (5.0 - first) / 4.0
    second = 1 + (1 / (1 - mom**2) - 1) * (1 - share)
    assert m == pytest.approx([mom * g1 + g2, 0.0])
    assert moved[1][0] == pytest.approx(lr * g2 + lr * mom * second * m[0])


def test_nesterov_bias_correction_must_be_a_known_choice():
    with pytest.raises(ValueError, match=r"bias_correction='adam': must be True, False, 'agreement' or 'trust'"):
        Nesterov(bias_correction="adam")
    assert Nesterov(bias_correction="agreement").describe()["bias_correction"] == "agreement"


@pytest.mark.parametrize("correction", ["trust", "agreement"])
def test_nesterov_correction_once_below_float32_resolution_is_the_plain_step(correction):
    """Past the momentum step where ``1 / (1 - momentum**t)`` is within float32's resolution of 1 (158 for
    0.9) the bounded corrections make exactly the uncorrected step (and skip their passes over the
    arrays); before it they still correct."""
    torch.manual_seed(0)
    start = {"w": torch.randn(1000), "m": torch.randn(1000) * 0.01}
    pseudo = [start["m"] + torch.randn(1000) * 0.001 for _ in range(2)]  # along the momentum: corrected

    def window(bias_correction, steps):
        rule = Nesterov(lr=0.5, momentum=0.9, delay=2, bias_correction=bias_correction)
        server = flatten({"w": start["w"].clone()})
        state = rule.init_state(server)
        state.arrays["momentum"].arrays["float32"].copy_(start["m"])
        state.scalars["steps"] = steps
        for g in pseudo:
            rule.apply(server, flatten({"w": server.state_dict()["w"] - g}), state, Arrival(epoch=1))
        return server.state_dict()["w"]

    assert torch.equal(window(correction, 158), window(False, 158))
    assert not torch.equal(window(correction, 20), window(False, 20))


def test_the_default_rule_with_one_task_in_flight_takes_each_fresh_update_and_averages_stale_ones():
    from vcdask.merge import DEFAULT_RULE, ONE_IN_FLIGHT, for_run

    assert for_run(DEFAULT_RULE, in_flight=1) is ONE_IN_FLIGHT
    assert for_run(DEFAULT_RULE, in_flight=3) == Nesterov(lr=0.5, momentum=0.9, bias_correction="trust", delay=3)
    chosen = Nesterov(lr=0.5, momentum=0.9, bias_correction="trust")  # equal to the default, but given: kept
    assert for_run(chosen, in_flight=1) == Nesterov(lr=0.5, momentum=0.9, bias_correction="trust", delay=1)
    server, client = flatten({"w": torch.randn(5)}), flatten({"w": torch.randn(5)})
    state = ONE_IN_FLIGHT.init_state(server)
    fresh = server.clone()
    ONE_IN_FLIGHT.apply(fresh, client, state, Arrival(1, staleness=0))
    assert fresh.equal(client)  # bit for bit: the worker's own run goes on as plain torch's would
    stale = server.clone()
    ONE_IN_FLIGHT.apply(stale, client, state, Arrival(1, staleness=1))  # a joined worker, a re-issued copy
    torch.testing.assert_close(stale.arrays["float32"], (server.arrays["float32"] + client.arrays["float32"]) / 2)


# -- float buffers (BatchNorm's running statistics): averaged by every rule, never extrapolated ----------------

_BUFFERS = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()


def _parameters_only(params):
    """``params`` without its buffers: what the rule merges for a model that has none."""
    return flatten({n: t.clone() for n, t in params.items() if n not in params.layout.buffers})


def _trend(server, n=7):
    """Updates whose parameters drift one way (momentum builds up) and whose running variance falls toward
    zero, staying positive: a step past the trend takes it below zero."""
    g = torch.Generator().manual_seed(1)
    updates = []
    for i, var in enumerate((0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05)[:n]):
        c = server.clone()
        for name in c:
            if name not in c.layout.buffers:
                c[name].add_(0.3 * (i + 1) + 0.05 * torch.randn(c[name].shape, generator=g, dtype=torch.float64))
        c["1.running_var"].fill_(var)
        c["1.running_mean"].fill_(0.2 * (i + 1))
        c["1.num_batches_tracked"].fill_(10 * (i + 1))
        updates.append(c)
    return updates


class _Loss:
    """The probe's loss: distance of the parameters (never the buffers) to a target far along their drift."""

    def __init__(self, server):
        self.target = {n: t + 5.0 for n, t in server.items() if n not in server.layout.buffers}

    def __call__(self, params, rows=None):
        return float(sum(((params[n] - t) ** 2).sum() for n, t in self.target.items()))


def _auto(seconds):
    """``fit``'s default for 4 tasks in flight, each task taking ``seconds``."""
    return Auto().for_run(in_flight=4), seconds


@pytest.mark.parametrize(
    "make, exact",
    [
        (lambda: (Nesterov(lr=0.5, momentum=0.9, delay=1, bias_correction=False), None), True),
        (lambda: (Nesterov(lr=0.5, momentum=0.9, delay=3, bias_correction=True), None), True),
        (lambda: (Nesterov(lr=0.5, momentum=0.9, delay=1), None), False),  # "trust": its bound is on |W_s|
        (lambda: (Nesterov(lr=0.5, momentum=0.9, delay=2), None), False),
        (lambda: (Probe(), None), True),
        (lambda: _auto(1e6), True),  # the probe is affordable: "auto" probes
        (lambda: _auto(1e-9), False),  # it is not: delayed Nesterov
    ],
    ids=[
        "nesterov",
        "nesterov-delayed-corrected",
        "nesterov-trust",
        "nesterov-delayed-trust",
        "probe",
        "auto-probe",
        "auto-nesterov",
    ],
)
def test_float_buffers_are_averaged_and_parameters_take_the_rules_full_step(make, exact):
    """BatchNorm's running variance, falling toward zero in every update, stays what a convex average of the
    updates makes it (1 / (staleness + 1) of each; the buffers get no momentum), never below zero: momentum
    took it there, and eval-mode outputs were NaN.  The parameters get exactly what the rule gives a model
    without buffers."""
    model = _bn_model()
    server = flatten(model)
    assert server.layout.buffers == _BUFFERS
    rule, seconds = make()
    alone = _parameters_only(server)
    state, state_alone = rule.init_state(server), rule.init_state(alone)
    loss = _Loss(server)
    history, history_alone = [server.clone()], [alone.clone()]
    var, mean = 1.0, 0.0
    for i, (client, staleness) in enumerate(zip(_trend(server), (0, 1, 0, 2, 1, 0, 3), strict=True)):
        base = history[max(0, len(history) - 1 - staleness)]
        base_alone = history_alone[max(0, len(history_alone) - 1 - staleness)]
        arrival = Arrival(1, staleness, base=base, loss=loss, seconds=seconds)
        rule.apply(server, client, state, arrival)
        arrival_alone = Arrival(1, staleness, base=base_alone, loss=loss, seconds=seconds)
        rule.apply(alone, _parameters_only(client), state_alone, arrival_alone)
        history.append(server.clone())
        history_alone.append(alone.clone())
        weight = 1 / (staleness + 1)
        var, mean = var + weight * (client["1.running_var"][0].item() - var), mean + weight * (0.2 * (i + 1) - mean)
        assert (server["1.running_var"] >= 0).all()
        assert server["1.running_var"].tolist() == pytest.approx([var] * 4, abs=1e-12)
        assert server["1.running_mean"].tolist() == pytest.approx([mean] * 4, abs=1e-12)
        assert server["1.num_batches_tracked"].item() == 10 * (i + 1)  # integer state: the client's, as before
        for name in alone:
            if exact:
                assert torch.equal(server[name], alone[name]), name
            else:  # (|W_s| summed in another order: the last bits of the correction's bound)
                torch.testing.assert_close(server[name], alone[name], rtol=1e-12, atol=1e-12)
        for key in ("momentum", "pending"):  # no momentum on the buffers
            if key in state.arrays:
                assert not state.arrays[key]["1.running_var"].any() and not state.arrays[key]["1.running_mean"].any()
    if isinstance(rule, Auto):  # (each of the rules it chooses between: both cases are covered)
        assert state.scalars["chosen"] == ("probe" if seconds > 1 else "nesterov")


def test_momentum_saved_on_the_buffers_by_an_earlier_vcdask_is_dropped():
    """A rule state saved before the buffers were told apart holds momentum on them: it is not applied."""
    server = flatten(_bn_model())
    client = _trend(server, 1)[0]
    for rule in (Nesterov(lr=0.5, momentum=0.9, delay=1), Nesterov(lr=0.5, momentum=0.9, delay=2)):
        for arrivals in range(rule.delay):
            ws, state = server.clone(), rule.init_state(server)
            state.arrays["momentum"]["1.running_var"].fill_(5.0)  # would take 0.5 * 0.9 * 5 off the variance
            if "pending" in state.arrays:
                state.arrays["pending"]["1.running_var"].fill_(5.0)
                state.scalars["arrivals"] = arrivals
            rule.apply(ws, client, state, Arrival(1, 0))
            assert ws["1.running_var"].tolist() == [0.8] * 4
            if arrivals == rule.delay - 1:  # the window closed: the momentum moved, not on the buffers
                assert not state.arrays["momentum"]["1.running_var"].any()


def test_buffers_are_stored_with_the_layout_and_an_old_stores_layout_still_merges_them(tmp_path):
    """The buffers travel with the layout (store, updates) and survive a restart; a layout stored by an
    earlier vcdask (no ``buffers``) reads as before, and the update's own layout tells the rule."""
    from vcdask.params import FlatParams, Layout

    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-bn")
    model = _bn_model()
    store.commit(model, {"run_id": "run-bn", "step": 0, "merged": []}, branch="run-bn")
    head = store.read(branch="run-bn")
    assert head.params.layout.buffers == _BUFFERS
    described = head.params.layout.to_dict()
    assert described["buffers"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert "buffers" not in flatten(torch.nn.Linear(2, 1)).layout.to_dict()  # (as before, without buffers)
    old = Layout.from_dict({k: v for k, v in described.items() if k != "buffers"})
    assert old == head.params.layout and old.buffers == frozenset()

    def start():
        state = ServerState(store, "run-bn", Nesterov(lr=0.5, momentum=0.9, delay=1), "run-bn")
        state.load()
        return state

    updates = _trend(flatten(model), 3)
    server = start()
    for i, client in enumerate(updates):
        if i == 2:  # the server dies; a new one resumes from the branch
            server = start()
            assert server.params.layout.buffers == _BUFFERS
        path = update_path("run-bn", 1, i, 0)
        write_update(store.files, path, client)
        record = {"epoch": 1, "shard": i, "attempt": 0, "base_step": i, "update": path, "n_samples": 10}
        assert server.merge(record)["accepted"]
        assert server.params["1.running_var"].tolist() == client["1.running_var"].tolist()  # fresh: the client's
    # a server whose layout came from an old store: the update's layout names the buffers
    ws = FlatParams(old, {d: a.clone() for d, a in head.params.arrays.items()})
    rule = Nesterov(lr=0.5, momentum=0.9, delay=1)
    state = rule.init_state(ws)
    for client in updates:
        rule.apply(ws, client, state, Arrival(1, 0))
        assert ws["1.running_var"].tolist() == client["1.running_var"].tolist()


def test_fit_with_batchnorm_and_the_default_rule_keeps_the_running_variance_valid(client, tmp_path):
    """The reviewer's run: BatchNorm under fit's default rule (delayed Nesterov on 2 tasks in flight).  The
    outer momentum took running_var below zero: validation loss NaN, in every version stored."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 4)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    r = vcdask.fit(model, (X, y), validation=0.2, max_epochs=2, client=client, store=tmp_path / "s", progress=False)
    assert r.store.read(r.version).metadata["merge"]["name"] == "nesterov"
    assert np.isfinite(r.epochs["loss"]).all() and len(r.epochs) == 2
    assert (r.model[1].running_var >= 0).all()
    versions = r.store.versions(r.run_id)
    assert len(versions) >= 3
    for v in versions:
        params = r.store.read(v.id).params
        assert (params["1.running_var"] >= 0).all() and torch.isfinite(params["1.running_var"]).all(), v.id


def test_the_trust_bound_is_the_parameters_norm_whatever_the_buffers_hold():
    """The default rule bounds its momentum correction by |W_s| of the parameters.  It was the whole
    vector's norm less the buffers', in float32: a BatchNorm on raw features (running variances of 1e8
    and more) left nothing of it, switched the correction off for the run, and the parameters moved by
    what the buffers held."""
    from vcdask.merge._base import Arrival

    def run(var):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
        with torch.no_grad():
            model[0].running_var.fill_(var)
        server = flatten(model)
        rule = Nesterov(lr=0.5, momentum=0.9, bias_correction="trust", delay=1)
        state = rule.init_state(server)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):  # fresh updates of the parameters alone
            client = torch.nn.Sequential(torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
            client.load_state_dict(server.state_dict())
            with torch.no_grad():
                for p in client.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            rule.apply(server, flatten(client), state, Arrival(epoch=1, staleness=0))
        return state.scalars.get("bounded", 0.0), server["1.weight"].clone()

    (small, w_small), (large, w_large) = run(1.0), run(3e9)
    assert small == large < 1.0
    assert torch.equal(w_small, w_large)
