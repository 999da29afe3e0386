"""One Dask topic subscription per client, shared by every display that follows the run on it.

``Client.subscribe_topic`` keeps one handler per topic per client: subscribing again replaces the
first handler (distributed logs "Overwriting"), ``unsubscribe_topic`` stops the topic for every
follower on that client, and it leaves the handler in ``client._event_handlers``.  So the notebook
panel and the console bar follow a run through :func:`follow`: the first follower of a (client,
topic) subscribes a fan-out that hands each event to every open follower, in the order they came; the
last to close unsubscribes the topic and takes its handler out of the client.

Handlers are called as distributed calls a topic's handler: on the client's event loop, one event at a
time; they must not block (the panel hands anything that waits to a thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Following", "follow"]

logger = logging.getLogger(__name__)

Handler = Callable[[Any], None]  # called with distributed's ``(timestamp, message)``

#: Seconds during which an unsubscribed topic's late events (sent before the scheduler saw the
#: unsubscription) are dropped quietly; then the client forgets the topic.
_GRACE = 2.0

_lock = threading.Lock()  # guards _fanouts, each fan-out's followers and the client's topic handlers
_fanouts: dict[tuple[int, str], _Fanout] = {}  # an entry holds its client: the id stays unique


def _drop(event: Any) -> None:
    """The handler of a topic just unsubscribed, until :data:`_GRACE` has passed (holds nothing)."""


class _Fanout:
    """The one handler a client has for a topic: each event goes to every open follower."""

    def __init__(self, client: Any, topic: str):
        self.client = client
        self.topic = topic
        self.followers: list[Following] = []

    def __call__(self, event: Any) -> None:
        with _lock:
            followers = list(self.followers)
        for following in followers:
            if following.closed:  # closed after the copy above
                continue
            try:
                following.handler(event)
            except Exception:
                logger.exception("a display following %s failed on an event; the others still get it", self.topic)


class Following:
    """One display's place on a run's topic; :meth:`close` leaves it (the last one out unsubscribes)."""

    def __init__(self, fanout: _Fanout, handler: Handler):
        self._fanout: _Fanout | None = fanout
        self.handler = handler

    @property
    def closed(self) -> bool:
        return self._fanout is None

    def close(self) -> None:
        """Stop getting events (again: nothing).  The last follower of the topic on its client
        unsubscribes it; the client's handler entry goes :data:`_GRACE` seconds later."""
        with _lock:
            fan, self._fanout = self._fanout, None
            if fan is None:
                return
            fan.followers = [f for f in fan.followers if f is not self]
            if fan.followers:
                return
            del _fanouts[(id(fan.client), fan.topic)]
            _unsubscribe(fan)  # under the lock: a new follow() of the topic sends its subscribe after this


def follow(client: Any, topic: str, handler: Handler) -> Following:
    """Call ``handler(event)`` for each event of ``topic`` that ``client`` receives, beside any
    other follower of that topic on ``client``.

    Parameters
    ----------
    client : distributed.Client
    topic : str
        The run's topic (:func:`vcdask.engine.events.topic`).
    handler : callable
        Called on the client's event loop with ``(timestamp, message)``; must not block.

    Returns
    -------
    Following
        Close it to stop.

    Raises
    ------
    distributed.client.ClosedClientError
        The client is closed.
    """
    with _lock:
        fan = _fanouts.get((id(client), topic))
        if fan is None:
            fan = _Fanout(client, topic)
            handlers = getattr(client, "_event_handlers", {})
            if handlers.get(topic) is _drop:  # a display just let go of it: no "Overwriting" log
                del handlers[topic]
            client.subscribe_topic(topic, fan)
            _fanouts[(id(client), topic)] = fan
        following = Following(fan, handler)
        fan.followers.append(following)
        return following


def _unsubscribe(fan: _Fanout) -> None:
    client, topic = fan.client, fan.topic
    handlers = getattr(client, "_event_handlers", None)
    if handlers is None or handlers.get(topic) is not fan:
        return  # someone else subscribed the topic on this client since: theirs now
    from distributed.client import ClosedClientError

    try:
        client.unsubscribe_topic(topic)
    except ClosedClientError:  # no more events will come
        handlers.pop(topic, None)
        return
    # distributed leaves the entry (it would keep the displays alive); events already on their way
    # still find a handler, which drops them, until the client forgets the topic
    handlers[topic] = _drop
    client.loop.add_callback(client.loop.call_later, _GRACE, _forget, handlers, topic)


def _forget(handlers: dict, topic: str) -> None:
    with _lock:
        if handlers.get(topic) is _drop:
            del handlers[topic]
