"""fit's default merge rule following a fleet that grows (issue 38).

``fit``'s default rule depends on the tasks the run keeps in flight (:func:`vcdask.merge.for_run`): one
task, each update taken as it is; 2 or 3, delayed Nesterov; 4 or more, ``"auto"``.  The count is the
cluster's when the run starts, and a spot fleet is often still starting then: its first worker is up,
the others join over minutes.  The server moves such a run (``RunSpec.merge_in_flight`` set) to the
default for the tasks in flight at each merge once it is another kind of rule, and only up: a fleet
that shrinks for a while (a preempted worker) keeps its rule and its rule's state.
"""

from __future__ import annotations

import logging
from typing import Any

from ..merge import DEFAULT_RULE, Auto, MergeRule, for_run

__all__ = ["can_grow", "grow", "grown_rule"]

logger = logging.getLogger("vcdask.engine.params_server")


def grown_rule(rule: MergeRule, chosen_for: int | None, in_flight: int | None) -> MergeRule | None:
    """fit's default for ``in_flight`` tasks, where it is another kind of rule than ``rule`` (fit's
    default for ``chosen_for`` tasks) and the fleet grew; else None (the rule stays)."""
    if chosen_for is None or in_flight is None or in_flight <= chosen_for:
        return None
    grown = for_run(DEFAULT_RULE, in_flight=int(in_flight))
    return None if type(grown) is type(rule) else grown


def can_grow(rule: MergeRule) -> bool:
    """Whether a fleet that grows can still move fit's default ``rule`` to another (not from ``"auto"``,
    the default for the most tasks in flight)."""
    return not isinstance(rule, Auto)


def grow(server: Any, in_flight: int | None) -> bool:
    """Move ``server``'s rule (:class:`~vcdask.engine.params_server.ParamsServer`: its ``rule``,
    ``follow``, ``probe`` and ``spare_probe``, the probe it keeps for a rule grown into) to fit's default for
    ``in_flight`` tasks, if the fleet grew into another kind of rule; whether it did."""
    grown = grown_rule(server.rule, server.follow, in_flight)
    if grown is None:
        return False
    logger.info(
        "run %s: %s tasks in flight, from %s: merging with %r from here on",
        server.run_id, in_flight, server.follow, grown.name,
    )  # fmt: skip
    server.rule, server.follow = grown, int(in_flight)  # type: ignore[arg-type]
    if "loss" in grown.needs and server.probe is None:
        server.probe = server.spare_probe
    if not can_grow(grown):
        server.spare_probe = None  # (no rule to grow into: the probe goes once this one needs it no more)
    return True
