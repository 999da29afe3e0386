"""The engine <-> UI contract: event kinds, shard states, history outcomes, topic and task keys.

Every string that crosses from the scheduler-side engine to a client (a progress bar, the
notebook panel, a test, a user's code) is defined here once and typed; nobody parses a
message back into a kind.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, MutableMapping
from typing import Any, Final, Literal, get_args

__all__ = [
    "ACTIVE_STATES",
    "EVENT_KINDS",
    "FINAL_STATES",
    "OUTCOMES",
    "PAUSE_CAUSES",
    "SHARD_STATES",
    "TASK_PREFIX",
    "TOPIC_PREFIX",
    "EventKind",
    "EventLog",
    "Outcome",
    "PauseCause",
    "ShardState",
    "client_name",
    "drop_topics",
    "final_validate_key",
    "is_train_key",
    "topic",
    "train_key",
    "validate_key",
]

logger = logging.getLogger(__name__)

#: A shard's state in one epoch, as the panel's grid shows it.
ShardState = Literal["queued", "running", "re-issued", "merged", "rejected", "skipped"]
SHARD_STATES: Final[tuple[ShardState, ...]] = get_args(ShardState)
#: States a shard copy is in while some copy of it is on its way.
ACTIVE_STATES: Final[tuple[ShardState, ...]] = ("queued", "running", "re-issued")
#: States a shard never leaves within its epoch.
FINAL_STATES: Final[tuple[ShardState, ...]] = ("merged", "skipped")

#: What the engine tells its followers (Dask topic :func:`topic`); each event is a dict with
#: ``type`` (one of these), ``run_id`` and the fields of that kind.
EventKind = Literal[
    "started",
    "shard",
    "update",
    "validation",
    "epoch",
    "lost",
    "reissue",
    "worker",
    "excluded",
    "preempted",
    "paused",
    "resumed",
    "finished",
    "failed",
]
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)

#: Why a run waits (``status()["paused_cause"]`` and the ``cause`` of paused/resumed events).
PauseCause = Literal["workers", "store"]
PAUSE_CAUSES: Final[tuple[PauseCause, ...]] = get_args(PauseCause)

#: The outcome of one shard-task copy: the ``outcome`` column of ``FitResult.history``.
#: ``reason`` holds the human-readable detail.
Outcome = Literal["merged", "rejected", "duplicate", "late", "lost", "failed", "cancelled", "skipped", "store fault"]
OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)

TOPIC_PREFIX: Final = "vcdask-run-"
TASK_PREFIX: Final = "vcdask-"
_TRAIN: Final = f"{TASK_PREFIX}train-"


def topic(run_id: str) -> str:
    """The Dask event topic of a run (``client.subscribe_topic(topic(run_id), handler)``)."""
    return f"{TOPIC_PREFIX}{run_id}"


def client_name(run_id: str) -> str:
    """The name of the Dask client a run submits its tasks through, inside the scheduler; Dask keeps that
    client's own topic (its task submissions) as ``Client-<name>-<uuid>``."""
    return f"{TASK_PREFIX}{run_id}"


def drop_topics(scheduler: Any, kept: Collection[str]) -> list[str]:
    """Drop from ``scheduler``'s event broker the topics of every run not in ``kept`` (:func:`topic`), and
    those of the runs' clients (:func:`client_name`) that have left, a kept run's too (each session of a run
    resumed again and again left one); the names dropped.

    Dask keeps a topic for as long as the scheduler runs (up to ``distributed.admin.low-level-log-length``
    events each, a long run's ~100 kB) and has no public call to drop one: this reads the broker's
    ``_topics`` mapping, and does nothing where a Dask release has none.
    """
    topics = getattr(getattr(scheduler, "_broker", None), "_topics", None)
    if not isinstance(topics, MutableMapping):
        return []
    clients = getattr(scheduler, "clients", {})
    dropped = []
    for name in list(topics):
        if not isinstance(name, str):
            continue
        ours = name.startswith(TOPIC_PREFIX) and name.removeprefix(TOPIC_PREFIX) not in kept
        ours = ours or (name.startswith(f"Client-{TASK_PREFIX}run-") and name not in clients)
        if ours and topics.pop(name, None) is not None:
            dropped.append(name)
    return dropped


def train_key(run_id: str, epoch: int, shard: int, attempt: int) -> str:
    """The Dask key of one shard-training copy: ``vcdask-train-<run>-e<epoch>-s<shard>-a<attempt>``."""
    return f"{_TRAIN}{run_id}-e{epoch}-s{shard}-a{attempt}"


def is_train_key(key: object) -> bool:
    """Whether a Dask key names a vcdask shard-training task (of any run)."""
    return str(key).startswith(_TRAIN)


def validate_key(run_id: str, step: int, retry: int = 0) -> str:
    """The Dask key of the validation of the version at ``step`` (``retry``: its re-submission)."""
    return f"{TASK_PREFIX}validate-{run_id}-v{step}" + (f"-r{retry}" if retry else "")


def final_validate_key(run_id: str, attempt: int) -> str:
    """The Dask key of the validation of a run's final version."""
    return f"{TASK_PREFIX}validate-{run_id}-final-{attempt}"


class EventLog:
    """Publishes one run's events on its Dask topic (the scheduler keeps them; clients subscribe).

    Parameters
    ----------
    scheduler : distributed.Scheduler
    run_id : str
    """

    def __init__(self, scheduler: Any, run_id: str):
        self.scheduler = scheduler
        self.run_id = run_id
        self.topic = topic(run_id)

    def emit(self, kind: EventKind, **data: Any) -> None:
        """Publish one event of ``kind``."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; valid kinds: {list(EVENT_KINDS)}")
        self.scheduler.log_event(self.topic, {"type": kind, "run_id": self.run_id, **data})
