"""Hostile workers: 1 of 4 sends sign-flipped or scaled updates; the robust options reject every one."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import dask.config
import pytest
import torch
from chaos_helpers import Saboteur, worker_info
from distributed import Client
from spec_helpers import two_shard_spec

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits_cnn
from vcdask.engine.guard import WARM, Guard, _norm
from vcdask.params import flatten

#: One run's test accuracy varies by about +-0.015 from run to run (asynchronous merges): 12 epochs, clean
#: 0.928-0.953 in three runs, the hostile runs screened within 0.03 of their clean run, unscreened 0.35-0.60;
#: 8 epochs, clean 0.933, screened 0.925 and 0.930, unscreened 0.60 (0.894 against a clean 0.922 with another
#: test session on the same two cores, where the hostile worker trained fewer shards).  Screened runs may
#: fall short of the clean one by NOISE; the unscreened attack must cost more than HURT.
NOISE, HURT = 0.04, 0.02
#: The rule pinned to delayed Nesterov, the one these numbers were measured with: with four tasks in flight fit's
#: default is "auto", which chooses by the moment's timing, and the probe rule it may choose damps the attack by
#: itself (unscreened, a sign-flipping worker then cost nothing: 0.914 against a clean 0.908).
FIT = dict(
    validation=0.1,
    max_epochs=8,
    n_shards=8,
    seed=3,
    progress=False,
    retention=False,
    merge=vcdask.merge.Nesterov(lr=0.5, momentum=0.9),
)
ROBUST = vcdask.Resilience(max_norm_ratio=3.0, min_cosine=0.0)


@pytest.fixture(scope="module")
def four_workers():
    # spawned, not forked (conftest.py): in one of three full runs with forked workers, the hostile worker (the
    # first of the four) trained no shard in any of this module's runs, and every test here failed; not yet
    # explained (see the stop-27 note)
    with (
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}),
        embedded_cluster(n_workers=4) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


def _accuracy(result, Xt, yt) -> float:
    return accuracy_on(vcdask.load(result.store, digits_cnn(0), branch=result.run_id), Xt, yt)


@pytest.fixture(scope="module")
def clean_accuracy(four_workers, digits_data, tmp_path_factory):
    (X, y), (Xt, yt) = digits_data
    result = vcdask.fit(digits_cnn(0), (X, y), client=four_workers, store=tmp_path_factory.mktemp("clean"), **FIT)
    return _accuracy(result, Xt, yt)


@pytest.mark.cluster
@pytest.mark.chaos
@pytest.mark.parametrize(
    "mode, resilience, reason, merge",
    [
        ("flip", ROBUST, "update direction: cosine", FIT["merge"]),
        ("scale", ROBUST, "update norm ||W_c - W_base||", FIT["merge"]),
        # the probe rule (as "auto" may choose): the screen runs against the base version, then the rule gets
        # the base's parameters (the screen once handed it the version id instead)
        ("flip", ROBUST, "update direction: cosine", "probe"),
    ],
)
def test_one_hostile_worker_of_four_is_rejected_every_time(
    mode, resilience, reason, merge, four_workers, clean_accuracy, digits_data, tmp_path
):
    (X, y), (Xt, yt) = digits_data
    hostile = sorted(worker_info(four_workers))[0]
    result = vcdask.fit(
        digits_cnn(0),
        (X, y),
        client=four_workers,
        store=tmp_path / "s",
        optimizer=functools.partial(Saboteur, lr=1e-3, hostile=hostile, mode=mode),
        resilience=resilience,
        **{**FIT, "merge": merge},
    )
    assert result.store.read(result.version).metadata["merge"]["name"] == getattr(merge, "name", merge)
    # a screened run's tasks train from the merged version, not ahead from their worker's last (maybe
    # rejected) W_c: with "delta", under load, a flipped update trained 3 of its 6 steps from its rejected
    # predecessor and looked orthogonal to the server's own step (cosine 0.001), and was merged
    assert result.settings["overlap"] == "wait"
    h = result.history
    from_hostile = h[h.worker == hostile]
    shown = ["epoch", "shard", "attempt", "staleness", "steps_ahead", "accepted", "outcome", "reason"]
    assert len(from_hostile) >= 1, h[["worker", "epoch", "shard", "accepted"]].to_string()
    assert not from_hostile.accepted.any(), from_hostile[shown].to_string()  # every bad update rejected ...
    assert from_hostile.reason.str.startswith(reason).all(), from_hostile.reason.tolist()  # ... and recorded
    honest = h[h.worker != hostile]
    assert honest.accepted.all(), honest[~honest.accepted].reason.tolist()  # no honest update turned down
    assert result.workers.set_index("worker").loc[hostile].excluded  # and the hostile worker is let go
    assert _accuracy(result, Xt, yt) >= clean_accuracy - NOISE


@pytest.mark.cluster
@pytest.mark.chaos
def test_the_probe_rejects_updates_that_wreck_the_model(four_workers, digits_data, tmp_path):
    """A broken worker whose parameters pick up heavy noise at every step: its updates' probe loss is
    many times their base's, and they are rejected; no honest update is (tolerance 2: three times the
    loss, as an honest task overfitting its shard raised it by up to 83% in a simulation)."""
    (X, y), _ = digits_data
    hostile = sorted(worker_info(four_workers))[0]
    result = vcdask.fit(
        digits_cnn(0),
        (X, y),
        client=four_workers,
        store=tmp_path / "s",
        optimizer=functools.partial(Saboteur, lr=1e-3, hostile=hostile, mode="noise"),
        resilience=vcdask.Resilience(probe_tolerance=2.0),
        **FIT,
    )
    h = result.history
    by_probe = h[h.reason.fillna("").str.startswith("probe loss")]
    assert len(by_probe) >= 1 and (by_probe.worker == hostile).all(), by_probe[["worker", "reason"]]
    assert "for its base (+" in by_probe.reason.iloc[0]
    assert "probe_tolerance=2)" in by_probe.reason.iloc[0]


@pytest.mark.cluster
@pytest.mark.chaos
def test_without_the_robust_options_the_attack_hurts(four_workers, clean_accuracy, digits_data, tmp_path):
    """The test above can fail: unscreened, the same sign-flipping worker costs accuracy.  (The tenfold
    scaled steps, unscreened, cost nothing measurable here: the outer Nesterov step absorbed them.)"""
    (X, y), (Xt, yt) = digits_data
    hostile = sorted(worker_info(four_workers))[0]
    result = vcdask.fit(
        digits_cnn(0),
        (X, y),
        client=four_workers,
        store=tmp_path / "s",
        optimizer=functools.partial(Saboteur, lr=1e-3, hostile=hostile, mode="flip"),
        **FIT,
    )
    h = result.history
    assert h[h.worker == hostile].accepted.all()
    assert _accuracy(result, Xt, yt) < clean_accuracy - HURT


# -- the screen's decisions, without a cluster ------------------------------------------------------
def _flat(*values):
    return flatten({"w": torch.tensor(values, dtype=torch.float32)})


def _warm_guard(**options):
    """A guard that has merged WARM updates of norm 1 along (1, 0, 0)."""
    guard = Guard(SimpleNamespace(resilience=vcdask.Resilience(**options)))
    for _ in range(WARM):
        guard._accept(1.0)
    return guard


def test_the_screen_rejects_a_scaled_update_and_says_by_how_much():
    guard = _warm_guard(max_norm_ratio=3.0)
    base = _flat(0, 0, 0)
    ok, problem = guard.screen("v0", base, _flat(2.5, 1, 0), steps=10, shard=0)
    assert problem is None
    _, problem = guard.screen("v0", base, _flat(30, 0, 0), steps=10, shard=0)
    assert problem[0] == "norm"
    assert problem[1].startswith(
        "update norm ||W_c - W_base|| = 30 is 30x that of the merged updates (1; max_norm_ratio=3)"
    )


def _linear(*weights):
    return flatten({"weight": torch.tensor([weights], dtype=torch.float32)})


def _two_shard_spec(tmp_path, **options):
    return two_shard_spec(tmp_path, **options)[0]


def test_the_screen_compares_an_update_with_the_servers_own_step_on_its_shard(tmp_path):
    """The reference is what the update's own shard says, not what the other shards' updates did: on
    data that differs by shard, honest updates of the two shards point opposite ways and both merge,
    while either, claimed for the other shard (as a sign-flipped update looks), is rejected."""
    guard = Guard(_two_shard_spec(tmp_path, min_cosine=0.0))
    base = _linear(0, 0, 0)
    toward = {0: _linear(0.5, 1.0, -0.5), 1: _linear(-0.5, -1.0, 0.5)}  # each shard's honest step from zero
    for shard in (0, 1, 0, 1):
        assert guard.screen("v0", base, toward[shard], steps=4, shard=shard)[1] is None
    _, problem = guard.screen("v0", base, toward[0], steps=4, shard=1)
    assert problem[0] == "direction"
    assert problem[1].startswith("update direction: cosine -")
    assert problem[1].endswith("with the server's own step on shard 1 < min_cosine=0")


def test_before_warm_up_the_norm_is_judged_against_the_servers_own_step(tmp_path):
    guard = Guard(_two_shard_spec(tmp_path, max_norm_ratio=3.0))
    base = _linear(0, 0, 0)
    own = _norm(guard._own(guard._base_facts("v0", base), base, 0))
    honest = _linear(0.5, 1.0, -0.5)  # norm 1.22: within 3x of the server's 8 steps (scaled to the task's 8)
    assert 1.22 < 3 * own and guard.screen("v0", base, honest, steps=8, shard=0)[1] is None
    _, problem = guard.screen("v0", base, _linear(50, 100, -50), steps=8, shard=0)
    assert problem[0] == "norm" and "that of the server's own step on shard 0" in problem[1]


def test_clipping_scales_a_long_pseudo_gradient_down_and_merges_it():
    guard = Guard(SimpleNamespace(resilience=vcdask.Resilience(clip_update_norm=1.0)))
    base = _flat(1, 1, 1)
    clipped, problem = guard.screen("v0", base, _flat(4, 5, 1), steps=10, shard=0)  # d = (3, 4, 0), norm 5
    assert problem is None and clipped.state_dict()["w"].tolist() == pytest.approx([1.6, 1.8, 1.0])
    short, _ = guard.screen("v0", base, _flat(1.3, 1.4, 1), steps=10, shard=0)  # norm 0.5: as it is
    assert short.state_dict()["w"].tolist() == pytest.approx([1.3, 1.4, 1.0])
    assert list(guard.norms) == pytest.approx([1.0, 0.5])  # the clipped norm counts


def test_clipping_keeps_each_dtype_in_its_own_precision():
    """A clipped update is rebuilt in each array's own dtype: a float64 coordinate the update left alone
    keeps its base value exactly (rebuilt from float32 copies, 1e8 + 1 moved by -1.0), and one it moved
    moves by exactly the clipped step; the float32 array the update left alone is the base's."""
    guard = Guard(SimpleNamespace(resilience=vcdask.Resilience(clip_update_norm=1.0)))
    base = flatten({"w": torch.tensor([1.0 + 1e-12, 1e8 + 1.0, 0.1], dtype=torch.float64), "b": torch.ones(2)})
    client = base.clone()
    client.arrays["float64"][0] += 10.0  # ||d|| = 10: clipped to 1
    clipped, problem = guard.screen("v0", base, client, steps=1, shard=0)
    assert problem is None
    assert (clipped.arrays["float64"] - base.arrays["float64"]).tolist() == [1.0, 0.0, 0.0]
    assert torch.equal(clipped.arrays["float32"], base.arrays["float32"])
    assert list(guard.norms) == [1.0]


def test_the_screen_measures_float64_updates_in_float64():
    """A step too small for float32 to see on a float64 parameter of 1e8 (its spacing there is 8) still
    counts in the norm the max_norm_ratio and min_cosine checks judge, and a half-precision step is
    measured in float32 (its squares overflow float16)."""
    guard = Guard(SimpleNamespace(resilience=vcdask.Resilience(clip_update_norm=1000.0)))
    base = flatten({"w": torch.tensor([1e8, 0.0], dtype=torch.float64), "h": torch.zeros(2, dtype=torch.float16)})
    client = base.clone()
    client.arrays["float64"][0] += 3.0
    client.arrays["float16"].copy_(torch.tensor([300.0, 400.0]))
    assert guard.screen("v0", base, client, steps=1, shard=0)[1] is None
    assert list(guard.norms) == pytest.approx([math.sqrt(3.0**2 + 300.0**2 + 400.0**2)])


def test_screens_that_reject_updates_train_each_task_from_its_merged_base():
    from vcdask.options import plan

    model = torch.nn.Linear(4, 2)
    data = (torch.rand(64, 4).numpy(), (torch.rand(64) > 0.5).long().numpy())
    for resilience, overlap in (
        (vcdask.Resilience(min_cosine=0.0), "wait"),
        (vcdask.Resilience(max_norm_ratio=3.0), "wait"),
        (vcdask.Resilience(clip_update_norm=1.0), "delta"),  # clipping rejects nothing
        (vcdask.Resilience(), "delta"),
    ):
        assert plan(model, data, resilience=resilience).overlap == overlap, resilience
    with dask.config.set({"vcdask.worker.overlap": "newest"}):  # a choice other than the default stays
        assert plan(model, data, resilience=vcdask.Resilience(min_cosine=0.0)).overlap == "newest"


def test_bad_robust_options_raise_clear_errors_before_cluster_work(digits_data, tmp_path):
    for name in ("clip_update_norm", "max_norm_ratio", "probe_tolerance"):
        with pytest.raises(ValueError, match=f"{name} must be a positive number, got 0"):
            vcdask.Resilience(**{name: 0})
    with pytest.raises(ValueError, match=r"min_cosine must be a number in \[-1, 1\), got 1.5"):
        vcdask.Resilience(min_cosine=1.5)
    (X, y), _ = digits_data
    with pytest.raises(ValueError, match=r"Resilience\(probe_tolerance=...\) screens updates on a probe of the valid"):
        vcdask.fit(digits_cnn(0), (X, y), resilience=vcdask.Resilience(probe_tolerance=1.0), store=tmp_path / "s")
    assert not (tmp_path / "s").exists()


def _probed_guard(base_loss: float, client_loss: float, tolerance: float = 2.0):
    """A guard whose probe gives the base ``base_loss`` and the update ``client_loss``; the two versions."""
    base, client = flatten(torch.nn.Linear(2, 1)), flatten(torch.nn.Linear(2, 1))
    losses = {id(base): base_loss, id(client): client_loss}
    guard = Guard(SimpleNamespace(resilience=vcdask.Resilience(probe_tolerance=tolerance)))
    guard._probe = SimpleNamespace(loss=lambda params: losses[id(params)])
    return guard, base, client


def test_the_probe_judges_a_negative_loss_by_how_much_it_rose():
    """A loss may be negative (GaussianNLLLoss's is): an update that lowers it merges, and one that raises
    it by more than the tolerance's share of its size is rejected, the rise named with its sign."""
    for lower in (-1.10, -5.0):
        guard, base, client = _probed_guard(-1.0, lower)
        assert guard.screen("v0", base, client, steps=4, shard=0)[1] is None
    guard, base, client = _probed_guard(-1.0, 0.5)  # +1.5: within 2.0 x |-1.0|
    assert guard.screen("v0", base, client, steps=4, shard=0)[1] is None
    guard, base, client = _probed_guard(-1.0, 1.5)  # +2.5
    problem = guard.screen("v0", base, client, steps=4, shard=0)[1]
    assert problem == ("probe", "probe loss 1.5 against -1 for its base (+250%; probe_tolerance=2)")
    guard, base, client = _probed_guard(2.0, 7.0)  # a positive loss, as before: +250%
    assert guard.screen("v0", base, client, steps=4, shard=0)[1][1].endswith("(+250%; probe_tolerance=2)")
