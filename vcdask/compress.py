"""Update compression: a shard task sends its pseudo-gradient ``W_c - W_base`` in fewer bits.

``fit(..., compression="int8")`` makes each worker send, instead of its full ``W_c``, the
difference from the version it trained from, quantized:

* ``"fp16"`` / ``"bf16"``: the difference in half precision (0.5x the bytes of float32);
* ``"int8"``: blocks of :data:`BLOCK` values, each an int8 per value and one float32 scale (its
  largest magnitude / 127): ~0.25x;
* ``"int4"``: the same with 4 bits per value (levels -7..7, two per byte): ~0.13x.

What quantization leaves out is not lost: the worker keeps it (*error feedback*, per run in the
worker process) and adds it to its next update, as DiLoCo-style systems do with their compressed
outer gradients.  The merge thread adds the decoded difference to the base version (which it keeps,
or reads from the store) and merges the resulting ``W_c`` with any rule, checks included.  Integer
state (e.g. BatchNorm's counters) travels as it is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .params import FlatParams, Layout

__all__ = ["BLOCK", "COMPRESSIONS", "EncodedUpdate", "check_compression", "encode"]

#: What ``compression=`` accepts (None: full float32 ``W_c``, no compression).
COMPRESSIONS = ("fp16", "bf16", "int8", "int4")
#: Values per scale of the integer codecs.
BLOCK = 256
_LEVELS = {"int8": 127, "int4": 7}

_lock = threading.Lock()
_residuals: dict[str, list[dict[str, torch.Tensor]]] = {}  # run_id -> what earlier updates left out
_KEEP_RUNS = 4


def check_compression(value: Any) -> str | None:
    """``compression=`` checked: None or one of :data:`COMPRESSIONS`."""
    if value is None or value in COMPRESSIONS:
        return value
    raise ValueError(f"compression must be None or one of {list(COMPRESSIONS)}, got {value!r}")


@dataclass
class EncodedUpdate:
    """A compressed update as it travels: ``W_c - W_base`` encoded, integer arrays as they are.

    ``parts`` maps ``"<dtype>"`` (an integer array of ``W_c``) or ``"<dtype>.<part>"`` (a part of a
    float dtype's encoded difference) to a 1-D CPU tensor.
    """

    layout: Layout
    codec: str
    base_version: str
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def decode(self, base: FlatParams) -> FlatParams:
        """``W_c``: ``base`` (the version it was trained from) plus the decoded difference."""
        if base.layout != self.layout:
            raise ValueError(f"the update's layout does not match its base version {self.base_version!r}")
        arrays = {}
        for dtype, n in self.layout.sizes.items():
            b = base.arrays[dtype]
            if not b.is_floating_point():
                arrays[dtype] = self.parts[dtype]
                continue
            mine = {k.split(".", 1)[1]: v for k, v in self.parts.items() if k.startswith(dtype + ".")}
            delta = _decode(self.codec, mine, n)
            wide = torch.float64 if b.dtype == torch.float64 else torch.float32
            arrays[dtype] = (b.to(wide) + delta.to(wide)).to(b.dtype)
        return FlatParams(self.layout, arrays)


def encode(codec: str, w_c: FlatParams, base: FlatParams, base_version: str, run_id: str) -> EncodedUpdate:
    """Encode ``w_c - base`` with ``codec``, adding what this worker's earlier updates of ``run_id``
    left out and keeping what this one leaves out (kept only while finite)."""
    with _lock:
        kept = _residuals.get(run_id)
        residual = kept.pop() if kept else {}
    parts: dict[str, torch.Tensor] = {}
    left: dict[str, torch.Tensor] = {}
    for dtype, a in w_c.arrays.items():
        if not a.is_floating_point():
            parts[dtype] = a
            continue
        delta = a.float() - base.arrays[dtype].float()
        r = residual.get(dtype)
        if r is not None and r.shape == delta.shape:
            delta += r
        encoded = _encode(codec, delta)
        parts.update({f"{dtype}.{k}": v for k, v in encoded.items()})
        left[dtype] = delta - _decode(codec, encoded, delta.numel())
    if all(bool(torch.isfinite(r).all()) for r in left.values()):
        with _lock:
            _residuals.setdefault(run_id, []).append(left)
            for old in list(_residuals)[:-_KEEP_RUNS]:  # a long-lived cluster: forget runs long gone
                del _residuals[old]
    return EncodedUpdate(w_c.layout, codec, base_version, parts)


def _encode(codec: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    if codec == "fp16":
        return {"delta": x.to(torch.float16)}
    if codec == "bf16":
        return {"delta": x.to(torch.bfloat16)}
    levels = _LEVELS[codec]
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1) / levels  # NaN/inf stay in the scale: the update decodes non-finite
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).flatten()
    if codec == "int4":  # two values per byte: 1..15 (0 unused), low nibble first
        u = (q + 8).to(torch.uint8)
        q = (u[0::2] | (u[1::2] << 4)).view(torch.int8)
    return {"q": q, "scale": scale}


def _decode(codec: str, parts: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    if codec in ("fp16", "bf16"):
        return parts["delta"].float()
    q, scale = parts["q"], parts["scale"]
    if codec == "int4":
        u = q.view(torch.uint8)
        q = torch.stack([(u & 0x0F).to(torch.int8), (u >> 4).to(torch.int8)], dim=1).flatten() - 8
    return (q.float().view(-1, BLOCK) * scale[:, None]).flatten()[:n]
