"""Error feedback covers decode's rounding to a float16 or bfloat16 model's own dtype.

The decoded ``W_c`` is ``base + delta`` rounded to the parameters' dtype, an ulp of which is far more than
float32's; a residual that kept only the quantization error let the server's total drift from the worker's
like a random walk (2.8e-2 after 200 int4 updates of float16 parameters, 7e-7 for float32 ones).
"""

from __future__ import annotations

import pytest
import torch

from vcdask import compress
from vcdask.compress import encode
from vcdask.params import FlatParams, flatten


@pytest.fixture(autouse=True)
def _no_kept_residuals():
    compress._residuals.clear()
    yield
    compress._residuals.clear()


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_what_the_server_got_is_what_the_worker_trained_less_one_residual(dtype, codec):
    """200 updates, each trained from the version the last one made (``alpha = 0``): the sum of the decoded
    differences is the sum of the trained ones less what the worker still holds, and the gap does not grow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(60, 66), torch.nn.BatchNorm1d(66)).to(dtype)  # not whole blocks
    w = flatten(model)
    name = str(dtype).removeprefix("torch.")
    values = w.arrays[name]
    trained = torch.zeros(values.numel(), dtype=torch.float64)
    got = torch.zeros_like(trained)
    for _ in range(200):
        step = 0.01 * torch.randn(values.numel(), dtype=torch.float64)
        w_c = FlatParams(w.layout, {**w.arrays, name: (w.arrays[name].double() + step).to(dtype)})
        decoded = encode(codec, w_c, w, "v", run_id="half").decode(w)
        trained += w_c.arrays[name].double() - w.arrays[name].double()
        got += decoded.arrays[name].double() - w.arrays[name].double()
        w = decoded  # the next task starts from what the server made of this one
    (kept,) = compress._residuals["half"]
    residual = kept.residual[name][: values.numel()].double()
    assert float((trained - got - residual).abs().max()) < 1e-6  # without the rounding fed back: 2e-5 to 6e-2
    # (the buffers travel as they are: nothing of them is kept)
    buffers = [e for e in w.layout.entries if e.name in w.layout.buffers and e.dtype == name]
    spans = [torch.arange(e.offset, e.offset + e.size) for e in buffers]
    assert not residual[torch.cat(spans)].any()


def test_float32_models_keep_the_quantization_error_alone():
    """A float32 model's decode adds in float32, which its residual has: it is what quantization left out."""
    torch.manual_seed(0)
    base = flatten({"w": torch.randn(1000)})
    w_c = flatten({"w": base["w"] + 0.01 * torch.randn(1000)})
    update = encode("int8", w_c, base, "v", run_id="f32")
    (kept,) = compress._residuals["f32"]
    sent = compress._decode("int8", {k.split(".", 1)[1]: v for k, v in update.parts.items()}, 1000)
    left_out = (w_c.arrays["float32"] - base.arrays["float32"]) - sent
    assert torch.allclose(kept.residual["float32"][:1000], left_out, rtol=0, atol=1e-8)


@pytest.mark.parametrize("codec", ["int4", "fp16"])
def test_the_rounding_fed_back_slice_by_slice_is_what_the_whole_decode_leaves_out(codec):
    """The feedback decodes a slice at a time (its memory: three float32 slices, not three float32 copies of
    the parameters): across slices, and a last one that is not whole blocks, each value gets what decoding all
    of them at once and rounding to bfloat16 leaves out."""
    torch.manual_seed(0)
    n = 2 * compress.FEEDBACK_SLICE + 3 * compress.BLOCK + 7
    base = flatten({"w": torch.randn(n).to(torch.bfloat16)})
    w_c = flatten({"w": (base["w"].float() + 0.01 * torch.randn(n)).to(torch.bfloat16)})
    update = encode(codec, w_c, base, "v", run_id="sliced")
    (kept,) = compress._residuals["sliced"]
    b = base.arrays["bfloat16"].float()
    sent = compress._decode(codec, {k.split(".", 1)[1]: v for k, v in update.parts.items()}, n).float()
    applied = (b + sent).to(torch.bfloat16).float() - b
    assert torch.equal(applied, update.decode(base).arrays["bfloat16"].float() - b)  # (what the server merges)
    left_out = (w_c.arrays["bfloat16"].float() - b) - applied
    assert torch.allclose(kept.residual["bfloat16"][:n], left_out, rtol=0, atol=1e-7)
