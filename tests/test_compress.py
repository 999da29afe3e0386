"""Compressed updates (vcdask.compress): codecs, error feedback, the update file, the merge, a real run."""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask import compress
from vcdask.compress import BLOCK, EncodedUpdate, check_compression, encode
from vcdask.demo import accuracy_on, digits_cnn
from vcdask.engine.params_server import ParamsServer
from vcdask.merge import VCASGD
from vcdask.params import FlatParams, Layout, flatten
from vcdask.updates import read_update, update_path, write_update


class Mixed(torch.nn.Module):
    """float32 weights, a float64 and a bfloat16 parameter, and an integer buffer (BatchNorm-style)."""

    def __init__(self, n: int = 10_000):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))
        self.d = torch.nn.Parameter(torch.zeros(300, dtype=torch.float64))
        self.h = torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))


def _pair(seed: int = 0, scale: float = 1e-2, n: int = 10_000) -> tuple[FlatParams, FlatParams]:
    g = torch.Generator().manual_seed(seed)
    model = Mixed(n)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    base = flatten(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((scale * torch.randn(p.shape, generator=g)).to(p.dtype))
        model.count += 5
    return base, flatten(model)


@pytest.fixture(autouse=True)
def _no_kept_residuals():
    compress._residuals.clear()
    yield
    compress._residuals.clear()


@pytest.mark.parametrize(("codec", "rel"), [("fp16", 1e-3), ("bf16", 1e-2), ("int8", 1e-2), ("int4", 0.2)])
def test_each_codec_decodes_close_to_w_c_and_integers_travel_as_they_are(codec, rel):
    base, w_c = _pair()
    update = encode(codec, w_c, base, "v0", run_id=f"r-{codec}")
    out = update.decode(base)
    assert out.layout == w_c.layout and set(out.arrays) == set(w_c.arrays)
    assert torch.equal(out.arrays["int64"], w_c.arrays["int64"])  # the counter, exactly
    for dtype in ("float32", "float64"):
        delta = w_c.arrays[dtype].double() - base.arrays[dtype].double()
        err = out.arrays[dtype].double() - w_c.arrays[dtype].double()
        assert err.norm() <= rel * delta.norm(), (codec, dtype)
    if codec == "int8":  # round to nearest: at most half a step of its block's scale
        delta = w_c.arrays["float32"] - base.arrays["float32"]
        step = delta[:BLOCK].abs().max() / 127
        assert (out.arrays["float32"][:BLOCK] - w_c.arrays["float32"][:BLOCK]).abs().max() <= 0.51 * step + 1e-6
    with pytest.raises(ValueError, match="layout"):
        update.decode(flatten(torch.nn.Linear(2, 2)))


def test_error_feedback_sends_what_rounding_left_out():
    """One large value sets a block's scale; the small ones round to 0 every time. Without feedback
    they never reach the server; with it, the sum of what arrives follows the sum of what was trained."""
    model = torch.nn.Linear(BLOCK, 1, bias=False)
    base = flatten(model)
    delta = torch.full((BLOCK,), 1e-3)
    delta[0] = 1.0  # int8 step 1/127 ~ 8e-3: the 1e-3 values round to 0 alone
    w_c = FlatParams(base.layout, {"float32": base.arrays["float32"] + delta})
    sent = torch.zeros(BLOCK)
    for _ in range(40):
        sent += encode("int8", w_c, base, "v", run_id="ef").decode(base).arrays["float32"] - base.arrays["float32"]
    alone = encode("int8", w_c, base, "v", run_id="no-feedback-yet").decode(base).arrays["float32"]
    assert torch.equal(alone[1:], base.arrays["float32"][1:])  # a single update drops the small values
    assert (sent - 40 * delta).abs().max() <= 1.0 / 127  # with feedback: behind by less than one step
    assert sent[1:].min() > 0.03


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_feedback_over_many_updates_of_a_layout_not_in_whole_blocks_reuses_its_memory(codec):
    """A worker's kept memory is reused from update to update (the padding to whole blocks stays
    zero): what arrives over 20 updates follows what was trained as closely as one update does."""
    base, w_c = _pair(n=1000)  # 1000 + 300 values: neither a whole number of blocks
    delta = w_c.arrays["float32"] - base.arrays["float32"]
    one = (encode(codec, w_c, base, "v", run_id="once").decode(base).arrays["float32"] - w_c.arrays["float32"]).abs()
    sent = torch.zeros_like(delta)
    for _ in range(20):
        sent += encode(codec, w_c, base, "v", run_id="many").decode(base).arrays["float32"] - base.arrays["float32"]
        (kept,) = compress._residuals["many"]
        assert set(kept.residual) == {"float32", "float64", "bfloat16"}
        assert len(kept.spare) <= len(kept.residual)  # reused, not piling up
    assert (sent - 20 * delta).abs().max() <= 1.5 * one.max()  # without feedback: up to 20x
    if codec != "bf16":  # the float32 residual's padding to whole blocks
        padding = kept.residual["float32"][1000:]
        assert padding.numel() == -1000 % BLOCK and bool((padding == 0).all())


def test_a_non_finite_update_decodes_non_finite_and_leaves_no_residual():
    base, w_c = _pair()
    w_c.arrays["float32"][5] = float("nan")
    for codec in ("int8", "int4", "fp16"):
        out = encode(codec, w_c, base, "v0", run_id="nan").decode(base)
        assert not torch.isfinite(out.arrays["float32"]).all(), codec  # the merge's check rejects it
    assert not compress._residuals.get("nan")


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4"])
def test_float_buffers_travel_as_they_are_beside_weights_that_move_far(codec, tmp_path):
    """A BatchNorm's running variance of a low-variance feature (1e-6) shared its block's scale with weights
    that moved ~1: int4 decoded it below zero (-1.5e-4), and every prediction of the model was NaN."""
    base_model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 300))
    base = flatten(base_model)
    with torch.no_grad():
        base_model[1].weight.add_(torch.randn(300, 4))
        base_model[0].running_var.copy_(torch.tensor([1e-6, 1.0, 2.0, 3.0]))
        base_model[0].running_mean.add_(0.5)
    w_c = flatten(base_model)
    assert "0.running_var" in w_c.layout.buffers
    for _ in range(3):  # (with the error feedback of the updates before)
        update = encode(codec, w_c, base, "v0", run_id=f"bn-{codec}")
        path = update_path("run", 1, 0, 0)
        write_update(vcdask.open_store(tmp_path / codec).files, path, update)
        out = read_update(vcdask.open_store(tmp_path / codec).files, path).decode(base)
        for name in ("0.running_var", "0.running_mean"):
            assert torch.equal(out[name], w_c[name]), (codec, name)  # exactly: not quantized


def test_an_fp16_difference_beyond_its_range_is_sent_as_its_largest_value_and_the_rest_kept():
    """A difference beyond 65504 (a buffer counting samples: +70,000) was sent as inf, and the merge turned
    the update down as non-finite, again and again, until the run excluded its healthy worker."""
    model = torch.nn.Linear(BLOCK, 1, bias=False)
    base = flatten(model)
    delta = torch.zeros(BLOCK)
    delta[:3] = torch.tensor([70_000.0, -1e6, 1.0])
    w_c = FlatParams(base.layout, {"float32": base.arrays["float32"] + delta})
    first = encode("fp16", w_c, base, "v", run_id="big").decode(base).arrays["float32"] - base.arrays["float32"]
    assert bool(torch.isfinite(first).all())
    assert first[:2].tolist() == [65504.0, -65504.0]
    assert first[2].item() == pytest.approx(1.0, rel=1e-6)  # ((w + 1) - w in float32: 1 within w's rounding)
    sent = first.clone()
    for _ in range(20):  # updates of no difference of their own: the rest follows, with the error feedback
        sent += encode("fp16", base, base, "v", run_id="big").decode(base).arrays["float32"] - base.arrays["float32"]
    assert sent[:3].tolist() == pytest.approx([70_000.0, -1e6, 1.0], rel=1e-3)


def test_int8_and_int4_files_are_a_quarter_and_an_eighth_of_float32(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    base, w_c = _pair(n=1_000_000)
    sizes = {None: write_update(store.files, "r/updates/raw.safetensors", w_c)}
    for codec in ("fp16", "int8", "int4"):
        path = f"r/updates/{codec}.safetensors"
        sizes[codec] = write_update(store.files, path, encode(codec, w_c, base, "v0", run_id="bytes"))
        back = read_update(store.files, path)
        assert isinstance(back, EncodedUpdate) and back.codec == codec and back.base_version == "v0"
        assert all(torch.equal(back.parts[k], v) for k, v in encode(codec, w_c, base, "v0", "x").parts.items())
    assert isinstance(read_update(store.files, "r/updates/raw.safetensors"), FlatParams)
    assert sizes["fp16"] <= 0.51 * sizes[None]
    assert sizes["int8"] <= 0.27 * sizes[None]
    assert sizes["int4"] <= 0.14 * sizes[None]


def test_the_merge_decodes_against_the_base_version_kept_or_read(tmp_path):
    """A compressed update based on an older version merges as its W_c would (within rounding), whether
    the server still holds that base or reads it from the store."""
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run")
    base, w_c = _pair()
    v0 = store.commit(base, {"run_id": "run", "step": 0, "epoch": 0, "merged": []}, branch="run")
    server = ParamsServer(store, "run", VCASGD(alpha=0.5), "run")
    server.load()
    records = []
    for shard in range(3):  # three updates, all trained from v0
        path = update_path("run", 1, shard, 0)
        write_update(store.files, path, encode("int8", w_c, base, v0, run_id=f"w{shard}"))
        records.append({"epoch": 1, "shard": shard, "attempt": 0, "base_step": 0, "update": path, "n_samples": 1})
    want = base.arrays["float32"].clone()
    for record in records:
        assert server.merge(record)["accepted"]
        want = 0.5 * want + 0.5 * w_c.arrays["float32"]
        assert v0 in server._bases and server.version in server._bases  # read once, then kept with each commit
    assert torch.allclose(server.params.arrays["float32"], want, atol=1e-3)
    assert torch.equal(server.params.arrays["int64"], w_c.arrays["int64"])
    path = update_path("run", 1, 9, 0)
    write_update(store.files, path, encode("int8", w_c, base, "NOSUCHVERSION0000000", run_id="w9"))
    out = server.merge({"epoch": 1, "shard": 9, "attempt": 0, "base_step": 3, "update": path, "n_samples": 1})
    assert not out["accepted"] and out["reason"].startswith("unreadable update")


def test_bad_compression_is_named_before_any_cluster_work(digits_data):
    (X, y), _ = digits_data
    assert check_compression(None) is None and check_compression("int4") == "int4"
    with pytest.raises(
        ValueError, match=r"compression must be None or one of \['fp16', 'bf16', 'int8', 'int4'\], got 'int9'"
    ):
        vcdask.fit(digits_cnn(0), (X, y), compression="int9", progress=False)


@pytest.mark.cluster
def test_fit_with_int8_updates_trains_as_well_with_a_quarter_of_the_bytes(client, digits_data, tmp_path):
    (X, y), (Xt, yt) = digits_data
    fit = dict(validation=0.1, max_epochs=6, n_shards=6, local_epochs=4, seed=3, client=client, progress=False)
    full = vcdask.fit(digits_cnn(3), (X, y), store=tmp_path / "full", **fit)
    small = vcdask.fit(digits_cnn(3), (X, y), store=tmp_path / "int8", compression="int8", **fit)
    h = small.history
    merged = h[h.accepted]
    assert len(merged) == 6 * 6 and not merged.duplicated(["epoch", "shard"]).any()  # every update decoded and merged
    # A copy past its deadline under load may come back late; nothing is ever refused as undecodable.
    assert set(h[~h.accepted].outcome) <= {"late", "duplicate", "lost", "cancelled"}, h[~h.accepted].reason.tolist()
    assert not h.reason.fillna("").str.startswith("unreadable").any()
    ratio = small.history.nbytes.median() / full.history.nbytes.median()
    assert ratio <= 0.3, ratio
    assert (
        accuracy_on(small.model, Xt, yt) >= accuracy_on(full.model, Xt, yt) - 0.05
    )  # async runs differ by a few points


class TiedLM(torch.nn.Module):
    """A head tied to its embedding: one tensor the state dict holds under two names, the second one's
    values at an offset that is no whole number of blocks (its blocks mix other values than the first's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(300, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 300, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4"])
def test_a_tied_weight_decodes_to_one_value_under_both_names_update_after_update(codec, tmp_path):
    """Each name's copy of a tied weight is quantized in its own blocks, with its own residual: the decoded
    W_c (and so every merged version) takes the first name's values for both, through the update file too."""
    store = vcdask.open_store(tmp_path / "s")
    model = TiedLM()
    base = flatten(model)
    assert base.layout.tied == (("head.weight", "emb.weight"),)
    g = torch.Generator().manual_seed(1)
    for step in range(4):  # a worker's updates of one run, with error feedback
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=g))
        w_c = flatten(model)
        path = f"r/updates/{step}.safetensors"
        write_update(store.files, path, encode(codec, w_c, base, "v0", run_id="tied"))
        out = read_update(store.files, path).decode(base)
        assert torch.equal(out["emb.weight"], out["head.weight"]), step
        assert not torch.equal(out["emb.weight"], base["emb.weight"])  # (it did move)
        err = (out["emb.weight"] - w_c["emb.weight"]).abs().max()
        assert err <= 0.2 * (w_c["emb.weight"] - base["emb.weight"]).abs().max()  # the first name's decoding


def test_an_update_whose_layout_names_no_ties_takes_its_base_versions():
    """An update written before layouts recorded ties (a leftover of a run resumed by this vcdask) is made
    consistent by its base version's layout."""
    model = TiedLM()
    base = flatten(model)
    with torch.no_grad():
        model.emb.weight.add_(1e-2)
    update = encode("int8", flatten(model), base, "v0", run_id="old")
    update.layout = Layout.from_dict({k: v for k, v in update.layout.to_dict().items() if k != "tied"})
    assert update.layout.tied == ()
    out = update.decode(base)
    assert torch.equal(out["emb.weight"], out["head.weight"])
