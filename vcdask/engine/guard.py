"""Robust merging: screen each pseudo-gradient against what honest workers send.

A worker may be broken or hostile and send an update that is finite and well-formed, and still
harmful: scaled up, or pointing the wrong way (a sign-flipped update).  With the ``Resilience``
options below, the merge thread looks at each update's pseudo-gradient ``d = W_c - W_base`` (what
its task changed, from the version it trained from) before the rule sees it:

* ``clip_update_norm``: ``d`` longer than this is scaled down to it (not a rejection).
* ``max_norm_ratio``: ``d`` is rejected when ``||d||`` exceeds this multiple of the reference norm.
* ``min_cosine``: ``d`` is rejected when its cosine with the reference direction is below this.
* ``probe_tolerance``: ``W_c`` is rejected when its loss on a probe of the validation set exceeds its
  base version's by more than this fraction of the base's size (``after - before > probe_tolerance *
  |before|``: a loss may be negative).  (Not the server's loss after the merge: a rule with momentum or a
  delay, like the default, applies an update's effect over later merges, so a merge's effect cannot be
  laid at one update's door; measured, honest updates were then blamed.)

``d``, its norm and its direction are those of the trainable parameters: a model's float buffers
(BatchNorm's running statistics) are left out of them, and a clipped update keeps its buffers as sent.

**The reference** is the server's own pseudo-gradient on the update's own shard (FLTrust, Cao et al. 2021,
with the shard's rows as the trusted data): the run's optimizer for :data:`REFERENCE_STEPS` steps from the
update's base on the first :data:`PROBE_ROWS` rows of its shard, computed here.  Its direction is what
``min_cosine`` compares with.  ``max_norm_ratio`` compares with the median norm of the last
:data:`NORM_WINDOW` accepted pseudo-gradients once :data:`WARM` are merged, and before that with the
reference's norm scaled by ``sqrt(task steps / REFERENCE_STEPS)``.  Nothing another worker sent shapes
the direction: a hostile update, or a pair of them, cannot pollute it, and honest updates on shards
that differ (data sorted by label, one class a shard) are compared with what their own data says, not
with the other shards' consensus.  (The consensus direction used before turned on honest workers with
such shards: their cosines with it were -0.004 to -0.12, and 28 of 30 runs failed; see
``benchmarks/robust.py``.)  The cost is :data:`REFERENCE_STEPS` optimizer steps per update on the
scheduler's CPU.  A rejection counts against the worker (``max_worker_failures``), so a hostile worker
is soon excluded.

All of this runs in the merge thread (it touches parameters), never on the event loop.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

import torch

from ..merge._base import float_buffers, zero_buffers
from .probing import PROBE_ROWS, ProbeModel

if TYPE_CHECKING:
    from ..params import FlatParams
    from ..spec import RunSpec

__all__ = ["NORM_WINDOW", "PROBE_ROWS", "REFERENCE_STEPS", "WARM", "Guard"]

#: Accepted pseudo-gradients before their median norm replaces the server's own step's as the reference norm.
WARM = 4
#: How many recent accepted norms the reference norm is the median of.
NORM_WINDOW = 16
#: The server's own steps on the first :data:`~vcdask.engine.probing.PROBE_ROWS` rows of the update's shard.
REFERENCE_STEPS = 8
#: Base versions whose probe loss and own pseudo-gradients the guard keeps.
KEPT = 8


def _deltas(base: FlatParams, params: FlatParams) -> dict[str, torch.Tensor]:
    """``params - base`` of the parameters per floating-point dtype, in at least float32: float64 stays
    float64 (a float32 copy moved a parameter of 1e8 + 1 by 1.0 once a clipped update was rebuilt from it),
    half precision is taken up to float32.

    Zero at the float buffers (BatchNorm's running statistics, :func:`~vcdask.merge._base.float_buffers`):
    they are no step, and the rules average them rather than step them.  Counted, a running variance of raw
    features (1e4) moving by 100 made the update's norm and direction: an honest update was clipped to 0.5%
    of its weights' move, and one with its weights scaled 50x passed ``max_norm_ratio=3``.
    """
    d = {dtype: _wide(params.arrays[dtype]) - _wide(a) for dtype, a in base.arrays.items() if a.is_floating_point()}
    zero_buffers(d, float_buffers(base, params))
    return d


def _wide(a: torch.Tensor) -> torch.Tensor:
    return a if a.dtype in (torch.float32, torch.float64) else a.float()


def _norm(d: dict[str, torch.Tensor]) -> float:
    """The norm of the pseudo-gradient ``d`` (one array per dtype) taken as one vector."""
    return math.hypot(*(float(a.norm()) for a in d.values()))


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The dot product of two pseudo-gradients (keyed alike) taken as one vector each."""
    return sum(float(x @ b[dtype]) for dtype, x in a.items())


class Guard:
    """The robust-merging screen of one run (the merge thread only).

    Parameters
    ----------
    spec : RunSpec
        Its ``resilience`` options; its model, loss, optimizer and validation set for the probe.
    """

    def __init__(self, spec: RunSpec):
        res = spec.resilience
        self.spec = spec
        self.clip = res.clip_update_norm
        self.max_ratio = res.max_norm_ratio
        self.min_cosine = res.min_cosine
        self.tolerance = res.probe_tolerance
        self.norms: deque[float] = deque(maxlen=NORM_WINDOW)
        self.accepted = 0
        self._probe: ProbeModel | None = None
        self._by_base: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @staticmethod
    def wanted(spec: RunSpec) -> bool:
        res = spec.resilience
        return res.rejects_updates or res.clip_update_norm is not None

    @property
    def probe(self) -> ProbeModel:
        if self._probe is None:
            self._probe = ProbeModel(self.spec)
        return self._probe

    def _base_facts(self, version: str, base: FlatParams) -> dict[Any, Any]:
        facts = self._by_base.get(version)
        if facts is None:
            facts = self._by_base[version] = {}
            while len(self._by_base) > KEPT:
                self._by_base.popitem(last=False)
        self._by_base.move_to_end(version)
        if self.tolerance is not None and "loss" not in facts:
            facts["loss"] = self.probe.loss(base)
        return facts

    def _own(self, facts: dict[Any, Any], base: FlatParams, shard: int) -> dict[str, torch.Tensor]:
        """The server's own pseudo-gradient from ``base`` on ``shard``'s first rows (per dtype, as
        :func:`_deltas`), kept per base and shard."""
        key = ("own", shard)
        if key not in facts:
            facts[key] = _deltas(base, self.probe.own_step(base, shard, REFERENCE_STEPS))
        return facts[key]

    def screen(
        self, base_version: str, base: FlatParams, client: FlatParams, steps: int, shard: int
    ) -> tuple[FlatParams, tuple[str, str] | None]:
        """``(client, None)`` to merge (clipped if need be), or ``(client, (fault, reason))`` to reject."""
        facts = self._base_facts(base_version, base)
        d = _deltas(base, client)
        norm = _norm(d)
        if self.max_ratio is not None:
            if self.accepted >= WARM:
                ref_norm, against = statistics.median(self.norms), "the merged updates"
            else:
                own = self._own(facts, base, shard)
                ref_norm = _norm(own) * math.sqrt(max(steps, 1) / REFERENCE_STEPS)
                against = f"the server's own step on shard {shard}"
            if ref_norm > 0 and norm > self.max_ratio * ref_norm:
                return client, (
                    "norm",
                    f"update norm ||W_c - W_base|| = {norm:.4g} is {norm / ref_norm:.3g}x that of {against} "
                    f"({ref_norm:.4g}; max_norm_ratio={self.max_ratio:g})",
                )
        if self.min_cosine is not None and norm > 0:
            own = self._own(facts, base, shard)
            own_norm = _norm(own)
            if own_norm > 0:
                cosine = _dot(d, own) / (norm * own_norm)
                if cosine < self.min_cosine:
                    return client, (
                        "direction",
                        f"update direction: cosine {cosine:.3f} with the server's own step on shard {shard} "
                        f"< min_cosine={self.min_cosine:g}",
                    )
        if self.tolerance is not None:
            before, after = facts["loss"], self.probe.loss(client)
            rise = after - before  # (measured against |before|: a loss may be negative, GaussianNLLLoss's is)
            if not rise <= self.tolerance * abs(before):  # (a NaN loss is worse)
                by = f"{100 * rise / abs(before):+.0f}%" if before else f"{rise:+.4g}"
                return client, (
                    "probe",
                    f"probe loss {after:.4g} against {before:.4g} for its base "
                    f"({by}; probe_tolerance={self.tolerance:g})",
                )
        if self.clip is not None and norm > self.clip:
            client = _clipped(base, client, d, self.clip / norm)
            norm = self.clip
        self._accept(norm)
        return client, None

    def _accept(self, norm: float) -> None:
        self.accepted += 1
        self.norms.append(norm)


def _clipped(base: FlatParams, client: FlatParams, d: dict[str, torch.Tensor], scale: float) -> FlatParams:
    """``client`` with each floating-point array replaced by ``base + d * scale`` (``d`` from
    :func:`_deltas`), rounded once to the array's own dtype: a coordinate the update left alone keeps
    its base value exactly.  The float buffers keep the client's values, as it sent them (``d`` is zero
    there: the merge rule averages them, it takes no step on them)."""
    from ..params import FlatParams

    spans = float_buffers(base, client)
    arrays = dict(client.arrays)
    for dtype, step in d.items():
        a = base.arrays[dtype]
        arrays[dtype] = clipped = (_wide(a) + step * scale).to(a.dtype)
        for run in spans.get(dtype, ()):
            clipped[run] = client.arrays[dtype][run]
    return FlatParams(client.layout, arrays)
