"""The cloud providers' interruption notices, read from their instance metadata services.

Each provider is a small class that speaks its metadata protocol over plain HTTP (the services
live on a link-local address of the instance, and answer in milliseconds):

* **AWS** (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` for a
  session token, then ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``:
  404 until a notice, then ``{"action": "terminate" | "stop" | "hibernate", "time": "<ISO 8601>"}``,
  two minutes ahead.
* **GCP**: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: ``FALSE``,
  then ``TRUE`` about 30 s before the instance stops.
* **Azure**: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``: events
  with ``EventType: "Preempt"`` and ``NotBefore`` (at least 30 s ahead), listed to every VM of an
  availability set or scale-set placement group; only those whose ``Resources`` name this VM (its
  ``/metadata/instance/compute/name``) are its notice.  A ``POST`` of ``{"StartRequests": [{"EventId": ...}]}``
  acknowledges one (the instance may then go at once).

The endpoints are configurable (``vcdask.cloud.preemption.endpoint``), so tests run a fake service on
127.0.0.1.  Only the standard library is used: a worker needs nothing extra to watch.  Requests never go
through a proxy (``http_proxy`` and the like are ignored, as botocore and google-auth ignore them for
these services): a proxy would reach its own host's metadata service, or none.

An answer the service cuts short or garbles is a :class:`ConnectionError`, one of an unexpected shape a
:class:`ValueError`: the watcher logs either and asks again on its next poll.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar

__all__ = ["PROVIDERS", "Notice", "MetadataService", "AWS", "GCP", "Azure", "provider_for", "detect"]


@dataclass(frozen=True)
class Notice:
    """An interruption notice: the instance will be reclaimed ``seconds_left`` seconds after ``seen``."""

    provider: str
    seconds_left: float
    action: str = "terminate"
    event_id: str | None = None  # Azure: the event to acknowledge (None: an event shared with other VMs)
    seen: float = field(default_factory=time.time)
    #: Whether ``seconds_left`` counts from ``seen`` because the service said when the instance goes (AWS,
    #: Azure); False: it counts from when the notice was posted, which the service does not say (GCP), so
    #: the watcher counts it from its last poll that saw no notice.
    dated: bool = True

    def describe(self) -> str:
        return f"{self.provider} {self.action} notice: {self.seconds_left:.0f} s left"


#: The opener of every request: no proxies (the services are on the instance's link-local address).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MetadataService:
    """One provider's metadata protocol at ``endpoint`` (``http://host[:port]``, no trailing path)."""

    name: ClassVar[str] = ""
    default_endpoint: ClassVar[str] = "http://169.254.169.254"
    #: The notice window when the service does not say when the instance goes.
    default_window: ClassVar[float] = 30.0

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0):
        self.endpoint = (endpoint or self.default_endpoint).rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint={self.endpoint!r})"

    def _request(self, method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body); an HTTP error status is an answer, not an exception.

        Raises
        ------
        OSError
            The service could not be reached, or its answer was cut short or garbled (``http.client``'s
            ``IncompleteRead``, ``BadStatusLine``: not OSErrors, so turned into a ConnectionError here).
        """
        req = urllib.request.Request(self.endpoint + path, data=body, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except http.client.HTTPException as e:
            raise ConnectionError(f"{self.name} metadata service at {self.endpoint}{path} answered badly: {e!r}") from e

    #: The notice's path and the headers the service insists on (GCP, Azure: one GET each poll).
    PATH: ClassVar[str] = ""
    HEADERS: ClassVar[dict[str, str]] = {}

    def _get(self) -> bytes:
        """``GET PATH`` with ``HEADERS``: the body of a 200, else an OSError naming the status."""
        status, body = self._request("GET", self.PATH, self.HEADERS)
        if status != 200:
            raise _unexpected(self, self.PATH, status)
        return body

    def probe(self) -> bool:
        """Whether this provider's metadata service answers at ``endpoint`` (for ``provider="auto"``)."""
        try:
            self._get()
        except (OSError, ValueError):
            return False
        return True

    def poll(self) -> Notice | None:
        """The notice, if one is posted now.

        Raises
        ------
        OSError
            The service could not be reached or answered with an unexpected status.
        """
        raise NotImplementedError

    def acknowledge(self, notice: Notice) -> None:
        """Tell the provider the instance is ready to go (only Azure asks for it)."""


def _unexpected(service: MetadataService, path: str, status: int) -> OSError:
    return ConnectionError(f"{service.name} metadata service at {service.endpoint}{path} answered HTTP {status}")


def _shape(service: MetadataService, path: str, body: bytes, what: str) -> ValueError:
    return ValueError(
        f"{service.name} metadata service at {service.endpoint}{path} answered {body[:200]!r}, not {what}"
    )


class AWS(MetadataService):
    """EC2 spot instance-action through IMDSv2 (a session token first)."""

    name = "aws"
    token_ttl = 21600
    #: AWS gives two minutes: a longer window only says the worker's clock is behind the service's.
    max_window = 120.0
    TOKEN_PATH = "/latest/api/token"
    NOTICE_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0):
        super().__init__(endpoint, timeout)
        self._token: str | None = None
        self._token_expires = 0.0

    def _fresh_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_expires:
            headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)}
            status, body = self._request("PUT", self.TOKEN_PATH, headers)
            if status != 200:
                raise _unexpected(self, self.TOKEN_PATH, status)
            self._token, self._token_expires = body.decode().strip(), time.monotonic() + self.token_ttl / 2
        return self._token

    def probe(self) -> bool:
        try:
            self._fresh_token()
        except (OSError, ValueError):
            return False
        return True

    def poll(self) -> Notice | None:
        status, body = self._request("GET", self.NOTICE_PATH, {"X-aws-ec2-metadata-token": self._fresh_token()})
        if status == 401:  # the token expired early (e.g. the service restarted): once more with a new one
            self._token = None
            status, body = self._request("GET", self.NOTICE_PATH, {"X-aws-ec2-metadata-token": self._fresh_token()})
        if status == 404:
            return None
        if status != 200:
            raise _unexpected(self, self.NOTICE_PATH, status)
        doc = json.loads(body)
        if not isinstance(doc, dict) or not isinstance(doc.get("time"), str):
            raise _shape(self, self.NOTICE_PATH, body, 'an object with a "time"')
        when = datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        left = min(self.max_window, max(0.0, when.timestamp() - time.time()))  # (clamped: clock skew)
        return Notice(self.name, left, action=str(doc.get("action", "terminate")))


class GCP(MetadataService):
    """Compute Engine ``instance/preempted`` (spot and preemptible VMs: about 30 s of notice)."""

    name = "gcp"
    default_endpoint = "http://metadata.google.internal"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def poll(self) -> Notice | None:
        body = self._get()
        if body.strip().upper() != b"TRUE":
            return None
        return Notice(self.name, self.default_window, action="preempt", dated=False)


class Azure(MetadataService):
    """Azure Scheduled Events: this VM's ``Preempt`` event (Spot VMs, at least 30 s ahead), acknowledged when ready.

    Scheduled Events lists the events of every VM in the availability set or scale-set placement group
    to all of them; an event's ``Resources`` names the VMs it affects.  So the service first learns this
    VM's name from the instance metadata (``GET /metadata/instance/compute/name?...&format=text``: a
    scale-set VM is ``{scale-set-name}_{instance-id}``, as ``Resources`` names it) and keeps it, then acts
    only on ``Preempt`` events whose ``Resources`` include that name.  An event with no ``Resources``
    names no VM, and is not this VM's.

    While the name is unknown (the lookup failed or answered nothing), :meth:`poll` raises
    :class:`ConnectionError` saying so, acting on no event, and asks again on the next poll.  It does not
    fall back to draining on any ``Preempt`` event: in a group of VMs that would retire every worker of
    the group when one of them is evicted, and acknowledge the others' events, cutting their notice
    short.  A notice missed this way costs one worker lost without a drain, which a run survives (its
    shards are re-issued); the watcher logs the failure.

    An event that names other VMs too is not acknowledged: acknowledging lets it proceed for all of its
    ``Resources``, so it goes at its ``NotBefore``.  An event already ``Started`` (``NotBefore`` blank)
    leaves no time: its notice has 0 s left.
    """

    name = "azure"
    PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}
    VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0):
        super().__init__(endpoint, timeout)
        self.vm_name: str | None = None  # learnt on the first poll that can, then kept

    def _this_vm(self) -> str:
        if self.vm_name is None:
            status, body = self._request("GET", self.VM_NAME_PATH, self.HEADERS)
            name = body.decode(errors="replace").strip() if status == 200 else ""
            if not name:
                answer = f"HTTP {status}" if status != 200 else "an empty name"
                raise ConnectionError(
                    f"{self.name} metadata service at {self.endpoint}{self.VM_NAME_PATH} answered {answer}: "
                    "this VM's name is unknown, so no Scheduled Event is taken as its notice"
                )
            self.vm_name = name
        return self.vm_name

    def poll(self) -> Notice | None:
        vm = self._this_vm()
        body = self._get()
        doc = json.loads(body)
        events = doc.get("Events", []) if isinstance(doc, dict) else None
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise _shape(self, self.PATH, body, 'an object with a list of "Events"')
        for event in events:
            resources = event.get("Resources")
            if event.get("EventType") != "Preempt" or not isinstance(resources, list) or vm not in resources:
                continue
            not_before = event.get("NotBefore") or ""
            if not isinstance(not_before, str):
                raise _shape(self, self.PATH, body, "events with an RFC 1123 NotBefore")
            if not_before:
                left = max(0.0, email.utils.parsedate_to_datetime(not_before).timestamp() - time.time())
            elif event.get("EventStatus") == "Started":  # the eviction is under way
                left = 0.0
            else:
                left = self.default_window
            sole = all(r == vm for r in resources)  # acknowledging would let it proceed for every VM it names
            return Notice(self.name, left, action="preempt", event_id=event.get("EventId") if sole else None)
        return None

    def acknowledge(self, notice: Notice) -> None:
        """Approve the notice's event (``StartRequests``); none for an event that also names other VMs."""
        if notice.event_id is None:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        status, _ = self._request("POST", self.PATH, {**self.HEADERS, "Content-Type": "application/json"}, body)
        if status not in (200, 201, 202, 204):
            raise _unexpected(self, self.PATH, status)


#: The providers ``PreemptionWatcher(provider=...)`` knows, by name.
PROVIDERS: dict[str, type[MetadataService]] = {"aws": AWS, "gcp": GCP, "azure": Azure}


def provider_for(provider: str, endpoint: str | None = None, timeout: float = 2.0) -> MetadataService:
    """The metadata service of ``provider`` (one of :data:`PROVIDERS`).

    Raises
    ------
    ValueError
        An unknown provider name.
    """
    cls = PROVIDERS.get(provider)
    if cls is None:
        raise ValueError(f"unknown cloud provider {provider!r}; valid providers: {[*PROVIDERS, 'auto']}")
    return cls(endpoint, timeout)


def detect(endpoint: str | None = None, timeout: float = 1.0) -> MetadataService | None:
    """The provider whose metadata service answers (at ``endpoint``, or at each one's own address), or None
    off the clouds (GCP first: its header check is the strictest; then AWS's token; then Azure)."""
    for name in ("gcp", "aws", "azure"):
        service = provider_for(name, endpoint, timeout)
        if service.probe():
            return service
    return None
