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
state (e.g. BatchNorm's counters) travels as it is, and so do float buffers (BatchNorm's running
statistics; :attr:`~vcdask.params.Layout.buffers`), which are few: quantized in a block beside weights
that move far more, a small running variance decoded below zero, and the model predicted NaN.  A
difference beyond float16's range is sent as the largest float16 of its sign (``"fp16"``), the rest
kept as error feedback: it was sent as ``inf``, and the merge turned the update down as non-finite.
A tensor the model holds under two names (a head tied to its embedding) is encoded once per name, each
copy in its own blocks; the decoded ``W_c`` takes the first name's values for both, so the merged
versions hold one value for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .params import FlatParams, Layout, all_finite

__all__ = ["BLOCK", "COMPRESSIONS", "EncodedUpdate", "check_compression", "encode", "forget"]

#: What ``compression=`` accepts (None: full float32 ``W_c``, no compression).
COMPRESSIONS = ("fp16", "bf16", "int8", "int4")
#: Values per scale of the integer codecs.
BLOCK = 256
_LEVELS = {"int8": 127, "int4": 7}

_lock = threading.Lock()
_residuals: dict[str, list[_Kept]] = {}  # run_id -> what earlier updates left out, and memory to reuse
_KEEP_RUNS = 4


@dataclass
class _Kept:
    """What one worker thread's update of a run leaves for the next: what quantization left out, per
    dtype (float32, padded to whole blocks for the integer codecs), and a float32 buffer of that size per
    dtype to reuse, twice the parameters' float32 size in all.

    Reusing them spares each encode the fresh pages of new parameter-sized buffers: encoding 5M values
    to bf16 took 31-40 ms with new buffers at every step, 13-15 ms now (``benchmarks/compression.py --speed``).
    """

    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    spare: list[torch.Tensor] = field(default_factory=list)

    def buffer(self, size: int) -> torch.Tensor:
        """A float32 buffer of ``size`` values: a spare one, else new."""
        for i, t in enumerate(self.spare):
            if t.numel() == size:
                return self.spare.pop(i)
        return torch.empty(size, dtype=torch.float32)


def forget(run_id: str) -> int:
    """Drop what run ``run_id``'s updates left out (the run ended); how many threads' residuals there were."""
    with _lock:
        return len(_residuals.pop(run_id, ()))


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
            if b.dtype == torch.float32:  # (adding a half-precision tensor to a float32 one is 6x slower)
                arrays[dtype] = delta.float().add_(b)
            else:
                wide = torch.float64 if b.dtype == torch.float64 else torch.float32
                arrays[dtype] = (b.to(wide) + delta.to(wide)).to(b.dtype)
            if "buffers" in mine:  # (none in an earlier vcdask's updates: it quantized them with the rest)
                arrays[dtype][_buffer_positions(self.layout, dtype)] = mine["buffers"].to(b.dtype)
        return _copy_tied(FlatParams(self.layout, arrays), self.layout.tied or base.layout.tied)


def _buffer_positions(layout: Layout, dtype: str) -> torch.Tensor | None:
    """Where the float buffers of ``dtype`` (:attr:`~vcdask.params.Layout.buffers`) sit in its flat vector;
    None when it holds none."""
    spans = [
        torch.arange(e.offset, e.offset + e.size)
        for e in layout.entries
        if e.dtype == dtype and e.name in layout.buffers and e.size
    ]
    return torch.cat(spans) if spans else None


def _copy_tied(params: FlatParams, tied: tuple[tuple[str, str], ...]) -> FlatParams:
    """``params`` with each alias of a tied tensor (``(alias, first)`` pairs, :attr:`Layout.tied`) set to
    its first name's values, in place: quantized in different blocks, the decoded copies differ.

    The update's own layout names the ties (its worker packed it from the model); an update written
    before layouts recorded them takes its base version's, where that was."""
    for alias, first in tied:
        if alias in params and first in params:
            params[alias].copy_(params[first])
    return params


def encode(codec: str, w_c: FlatParams, base: FlatParams, base_version: str, run_id: str) -> EncodedUpdate:
    """Encode ``w_c - base`` with ``codec``, adding what this worker's earlier updates of ``run_id``
    left out and keeping what this one leaves out (kept only while finite)."""
    with _lock:
        stack = _residuals.get(run_id)
        kept = stack.pop() if stack else _Kept()
    parts: dict[str, torch.Tensor] = {}
    left = _Kept()
    for dtype, a in w_c.arrays.items():
        if not a.is_floating_point():
            parts[dtype] = a
            continue
        n = a.numel()
        size = n + (-n % BLOCK if codec in _LEVELS else 0)  # whole blocks: the padding is zeros
        r = kept.residual.pop(dtype, None)
        if r is not None and r.numel() != size:
            r = None
        work = kept.buffer(size)
        wide = torch.float64 if a.dtype == torch.float64 else torch.float32
        torch.sub(a.to(wide), base.arrays[dtype].to(wide), out=work[:n])
        work[n:] = 0
        if r is not None:
            work.add_(r)
        # the last residual, now added, is the integer codecs' scratch, then the next update's work buffer
        scratch = r
        if scratch is None and codec in _LEVELS:
            scratch = kept.buffer(size)
        raw = _buffer_positions(w_c.layout, dtype)
        if raw is not None:  # sent as they are, outside the blocks (their difference left out: nothing kept)
            parts[f"{dtype}.buffers"] = a[raw].clone()
            work[raw] = 0
        encoded = _encode(codec, work, n, scratch)
        if a.dtype in (torch.float16, torch.bfloat16):
            _feed_back_rounding(codec, encoded, work, base.arrays[dtype])
        parts.update({f"{dtype}.{k}": v for k, v in encoded.items()})
        left.residual[dtype] = work  # now what this update left out
        if scratch is not None:
            left.spare.append(scratch)
    if all(all_finite(r) for r in left.residual.values()):
        with _lock:
            _residuals[run_id] = _residuals.pop(run_id, [])  # (the run used last, last)
            _residuals[run_id].append(left)
            for old in list(_residuals)[:-_KEEP_RUNS]:  # a long-lived cluster: forget runs long gone
                del _residuals[old]
    return EncodedUpdate(w_c.layout, codec, base_version, parts)


#: Values the rounding feedback (:func:`_feed_back_rounding`) works on at once, whole blocks: its memory is
#: three float32 slices of this size, not three copies of the parameters (+27% peak for a 50M bfloat16 model).
FEEDBACK_SLICE = BLOCK * 4096


def _feed_back_rounding(codec: str, encoded: dict[str, torch.Tensor], work: torch.Tensor, base: torch.Tensor) -> None:
    """Add to ``work`` (what quantization left out) what decode's rounding to ``base``'s half-precision
    dtype leaves out: the decoded ``W_c`` is ``base + delta`` rounded to that dtype (:meth:`EncodedUpdate.decode`),
    computed here as it does it, :data:`FEEDBACK_SLICE` values at a time.  Without it, float16 and bfloat16
    models' totals drifted from their workers' like a random walk: by 2.8e-2 after 200 int4 updates (float32:
    7e-7), as if there were no feedback."""
    n = base.numel()
    for i in range(0, n, FEEDBACK_SLICE):
        j = min(i + FEEDBACK_SLICE, n)
        sent = _decode(codec, _slice_of(codec, encoded, i, j), j - i).to(torch.float32)
        b = base[i:j].to(torch.float32)
        applied = (b + sent).to(base.dtype).to(torch.float32).sub_(b)
        work[i:j].add_(sent.sub_(applied))


def _slice_of(codec: str, parts: dict[str, torch.Tensor], i: int, j: int) -> dict[str, torch.Tensor]:
    """The parts that encode values ``i`` to ``j`` (``i`` at a block's start): :func:`_decode` of them is
    those values."""
    if codec in ("fp16", "bf16"):
        return {"delta": parts["delta"][i:j]}
    first, end = i // BLOCK, -(-j // BLOCK)
    per_byte = 2 if codec == "int4" else 1
    return {"q": parts["q"][first * BLOCK // per_byte : end * BLOCK // per_byte], "scale": parts["scale"][first:end]}


def _encode(codec: str, x: torch.Tensor, n: int, scratch: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The parts that encode ``x[:n]``; ``x`` is left holding what they leave out (its padding to whole
    blocks stays zero).  ``scratch``: a float32 buffer of ``x``'s size, needed by the integer codecs."""
    if codec in ("fp16", "bf16"):
        half = x[:n].to(torch.float16 if codec == "fp16" else torch.bfloat16)
        if codec == "fp16" and not bool(half.isfinite().all()):
            over = half.isinf() & x[:n].isfinite()  # beyond float16's range (a non-finite one stays so)
            half[over] = torch.finfo(torch.float16).max * x[:n][over].sign().to(torch.float16)
        x[:n].sub_(half)
        return {"delta": half}
    assert scratch is not None
    levels = _LEVELS[codec]
    blocks = x.view(-1, BLOCK)
    # NaN and inf stay in the scale: the update decodes non-finite, and the merge rejects it
    scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    steps = torch.div(blocks, safe[:, None], out=scratch.view(-1, BLOCK)).round_().clamp_(-levels, levels)
    q = steps.to(torch.int8).flatten()
    blocks.addcmul_(steps, scale[:, None], value=-1)  # what the decoded q * scale leaves out
    if codec == "int4":  # two values per byte: 1..15 (0 unused), low nibble first
        u = (q + 8).to(torch.uint8)
        q = (u[0::2] | (u[1::2] << 4)).view(torch.int8)
    return {"q": q, "scale": scale}


def _decode(codec: str, parts: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    if codec in ("fp16", "bf16"):
        return parts["delta"]
    q, scale = parts["q"], parts["scale"]
    if codec == "int4":
        u = q.view(torch.uint8)
        q = torch.stack([(u & 0x0F).to(torch.int8), (u >> 4).to(torch.int8)], dim=1).flatten() - 8
    return q.float().view(-1, BLOCK).mul_(scale[:, None]).flatten()[:n]
