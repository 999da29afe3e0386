"""Fake cloud metadata services on 127.0.0.1: AWS IMDSv2, GCP and Azure Scheduled Events.

Each answers "no notice" until :meth:`FakeMetadata.notify` and checks the protocol as the real one
does (a token for AWS, the ``Metadata-Flavor`` / ``Metadata`` header for GCP / Azure); every request
is recorded.  Azure's also serves the VM's name (``/metadata/instance/compute/name``) and lists the
events of the other VMs of its group (:attr:`FakeMetadata.group_events`), as Scheduled Events does.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AWS_TOKEN = "fake-imds-token"


class FakeMetadata:
    """One instance's metadata service speaking ``provider``'s protocol (``with`` starts and stops it)."""

    def __init__(self, provider: str):
        self.provider = provider
        self.notice_at: float | None = None  # when the instance goes (time.time())
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.acknowledged: list[str] = []
        self.event_id = "602d9444-d2cd-49c7-8624-8643e7171297"
        # Azure: this VM's name, the status its lookup answers, the VMs this VM's event names (None: this one),
        # and events for other VMs of the availability set / placement group, listed as they are
        self.vm_name = "worker-vm"
        self.vm_name_status = 200
        self.resources: list[str] | None = None
        self.group_events: list[dict] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeMetadata:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def notify(self, seconds: float) -> None:
        """Post a notice: the instance goes in ``seconds``."""
        self.notice_at = time.time() + seconds

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _, _ in self.requests if method is None or m == method]

    # -- the protocols ----------------------------------------------------------------------------
    def answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        self.requests.append((method, path, headers, body))
        return getattr(self, f"_{self.provider}")(method, path, headers, body)

    def _aws(self, method, path, headers, body):
        if method == "PUT" and path == "/latest/api/token":
            if "x-aws-ec2-metadata-token-ttl-seconds" not in headers:
                return 400, b"missing ttl"
            return 200, AWS_TOKEN.encode()
        if path.startswith("/latest/meta-data/"):
            if headers.get("x-aws-ec2-metadata-token") != AWS_TOKEN:
                return 401, b"Unauthorized"
            if path == "/latest/meta-data/spot/instance-action" and self.notice_at is not None:
                when = datetime.fromtimestamp(self.notice_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                return 200, json.dumps({"action": "terminate", "time": when}).encode()
        return 404, b"Not Found"

    def _gcp(self, method, path, headers, body):
        if not path.startswith("/computeMetadata/v1/"):
            return 404, b"Not Found"
        if headers.get("metadata-flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header."
        if path.split("?")[0] == "/computeMetadata/v1/instance/preempted":
            return 200, b"TRUE" if self.notice_at is not None else b"FALSE"
        return 404, b"Not Found"

    def _azure(self, method, path, headers, body):
        if not path.startswith(("/metadata/scheduledevents", "/metadata/instance/")):
            return 404, b"Not Found"
        if headers.get("metadata") != "true":
            return 400, b'{"error": "Bad request. Required metadata header not specified"}'
        if path.startswith("/metadata/instance/"):
            if method == "GET" and path.split("?")[0] == "/metadata/instance/compute/name" and "format=text" in path:
                return self.vm_name_status, self.vm_name.encode() if self.vm_name_status == 200 else b"error"
            return 404, b"Not Found"
        if method == "POST":
            for start in json.loads(body or b"{}").get("StartRequests", []):
                self.acknowledged.append(start["EventId"])
            return 200, b""
        events = [e for e in self.group_events if e["EventId"] not in self.acknowledged]
        if self.notice_at is not None and self.event_id not in self.acknowledged:
            events.append(
                {
                    "EventId": self.event_id,
                    "EventType": "Preempt",
                    "ResourceType": "VirtualMachine",
                    "Resources": [self.vm_name] if self.resources is None else self.resources,
                    "EventStatus": "Scheduled",
                    "NotBefore": email.utils.formatdate(self.notice_at, usegmt=True),
                    "EventSource": "Platform",
                }
            )
        return 200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, out = fake.answer(self.command, self.path, headers, body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_PUT = do_POST = _reply

            def log_message(self, *args):  # quiet
                pass

        return Handler
