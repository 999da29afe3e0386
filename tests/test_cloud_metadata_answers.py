"""Odd answers of a metadata service, proxies, slow detection and notice windows, against scripted HTTP
servers on 127.0.0.1 (an answer may be any bytes: a cut-short body, a garbled status line)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import threading
import time
import urllib.request
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vcdask.cloud import PreemptionWatcher, watcher
from vcdask.cloud.metadata import AWS, GCP, Azure, provider_for


class Scripted:
    """A server on 127.0.0.1 whose ``answer(method, path, headers)`` gives ``(status, body)``, ``(status,
    body, content_length)`` or raw bytes to send as the whole answer; every request is recorded."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                outer.requests.append((self.command, self.path))
                out = outer.answer(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
                if isinstance(out, bytes):
                    self.wfile.write(out)
                    return
                status, body, *length_said = out
                self.send_response(status)
                self.send_header("Content-Length", str(length_said[0] if length_said else len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = _reply

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> Scripted:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _aws_time(seconds: float) -> bytes:
    when = datetime.fromtimestamp(time.time() + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"action": "terminate", "time": when}).encode()


def _azure_events(notice_at: float | None) -> bytes:
    events = []
    if notice_at is not None:
        not_before = email.utils.formatdate(notice_at, usegmt=True)
        events = [{"EventId": "e1", "EventType": "Preempt", "Resources": ["vm"], "NotBefore": not_before}]
    return json.dumps({"DocumentIncarnation": 1, "Events": events}).encode()


class _Scheduler:
    def __init__(self):
        self.notices: list[dict] = []

    async def vcdask_preempt(self, **kw):
        self.notices.append({**kw, "at": time.time()})
        return {}


class _Worker:
    address = "tcp://127.0.0.1:1"

    def __init__(self):
        self.scheduler = _Scheduler()


def _watch(provider, endpoint, seconds, *, halfway=None, interval=0.05, timeout=2.0):
    """Run a watcher for ``seconds`` (or until it drains), calling ``halfway()`` in the middle; the watcher
    and the notices the scheduler got."""

    async def main():
        worker = _Worker()
        w = PreemptionWatcher(provider=provider, endpoint=endpoint, interval=interval, timeout=timeout)
        w.setup(worker)
        for part in (0, 1):
            deadline = time.monotonic() + seconds / 2
            while time.monotonic() < deadline and not w._task.done():
                await asyncio.sleep(0.02)
            if part == 0 and halfway is not None:
                halfway()
        w._task.cancel()
        return w, worker.scheduler.notices

    return asyncio.run(main())


#: One odd answer each (what a service cut short, garbled or of another shape looks like), and the error
#: a poll raises on it
ODD = {
    "truncated": ((200, b"{", 50), ConnectionError, "answered badly: IncompleteRead"),
    "bad-status-line": (b"GARBAGE\r\n\r\n", ConnectionError, "answered badly: BadStatusLine"),
    "json-list": ((200, b"[]"), ValueError, r"answered b'\[\]', not an object"),
    "json-null": ((200, b"null"), ValueError, "answered b'null', not an object"),
}
AZURE_ODD = {
    "list": (b"[]", 'not an object with a list of "Events"'),
    "null-events": (b'{"Events": null}', 'not an object with a list of "Events"'),
    "string-events": (b'{"Events": ["x"]}', 'not an object with a list of "Events"'),
    "numeric-notbefore": (b'{"Events": [{"EventType": "Preempt", "Resources": ["vm"], "NotBefore": 5}]}', "NotBefore"),
}


@pytest.mark.parametrize("odd", ODD)
def test_aws_an_odd_answer_is_a_clear_error_and_the_watch_goes_on(odd):
    answer, error, says = ODD[odd]
    state = {"polls": 0, "notice": False}

    def aws(method, path, headers):
        if method == "PUT":
            return 200, b"token"
        state["polls"] += 1
        if state["polls"] == 1:
            return answer
        return (200, _aws_time(120)) if state["notice"] else (404, b"")

    with Scripted(aws) as srv:
        with pytest.raises(error, match=says):
            AWS(srv.endpoint).poll()
        state["polls"] = 0
        w, notices = _watch("aws", srv.endpoint, 3.0, halfway=lambda: state.update(notice=True))
    assert w.notice is not None and len(notices) == 1, f"the watch ended on one {odd} answer"
    assert state["polls"] >= 3


@pytest.mark.parametrize("odd", AZURE_ODD)
def test_azure_an_event_list_of_another_shape_is_a_clear_error_and_the_watch_goes_on(odd):
    body, says = AZURE_ODD[odd]
    state = {"polls": 0, "notice": None}

    def azure(method, path, headers):
        if "compute/name" in path:
            return 200, b"vm"
        state["polls"] += 1
        return (200, body) if state["polls"] == 1 else (200, _azure_events(state["notice"]))

    with Scripted(azure) as srv:
        with pytest.raises(ValueError, match=says):
            Azure(srv.endpoint).poll()
        state["polls"] = 0
        w, notices = _watch("azure", srv.endpoint, 3.0, halfway=lambda: state.update(notice=time.time() + 60))
    assert w.notice is not None and len(notices) == 1, f"the watch ended on one {odd} answer"


@pytest.mark.parametrize("odd", ["truncated", "bad-status-line"])
def test_gcp_a_cut_short_answer_is_a_connection_error_and_auto_finds_nothing_in_it(odd):
    answer, error, says = ODD[odd]
    with Scripted(lambda *_: answer) as srv:
        with pytest.raises(error, match=says):
            GCP(srv.endpoint).poll()
        for name in ("gcp", "aws", "azure"):  # (auto's probes)
            assert provider_for(name, srv.endpoint).probe() is False


def test_metadata_requests_never_go_through_a_proxy(monkeypatch):
    def imds(method, path, headers):
        return (200, b"token") if method == "PUT" else (404, b"")

    with Scripted(imds) as service, Scripted(lambda *_: (502, b"bad gateway")) as proxy:
        monkeypatch.setenv("http_proxy", proxy.endpoint)
        monkeypatch.setenv("HTTP_PROXY", proxy.endpoint)
        monkeypatch.setenv("no_proxy", "")
        monkeypatch.setenv("NO_PROXY", "")
        monkeypatch.setattr(urllib.request, "_opener", None)  # (urlopen's opener reads the proxies once, when built)
        assert AWS(service.endpoint, timeout=2).poll() is None
        assert provider_for("aws", service.endpoint).probe()
    assert proxy.requests == [] and [m for m, _ in service.requests] == ["PUT", "GET", "PUT"]


def test_auto_keeps_looking_for_a_service_slow_to_answer_at_first():
    # Azure enables Scheduled Events on the first call, which may take minutes; auto probes with 1 s
    state = {"first": True, "notice": None}

    def azure(method, path, headers):
        if "compute/name" in path:
            return 200, b"vm"
        if not path.startswith("/metadata/scheduledevents"):
            return 404, b""
        if state["first"]:
            state["first"] = False
            time.sleep(2.5)
        return 200, _azure_events(state["notice"])

    with Scripted(azure) as srv:
        w, notices = _watch("auto", srv.endpoint, 8.0, halfway=lambda: state.update(notice=time.time() + 30))
    assert isinstance(w.service, Azure) and len(notices) == 1, "auto gave up after one slow answer"


def test_auto_polls_with_the_timeout_it_was_given(monkeypatch):
    with Scripted(lambda method, *_: (200, b"token") if method == "PUT" else (404, b"")) as srv:
        w, _ = _watch("auto", srv.endpoint, 0.5, timeout=5.0)
    assert isinstance(w.service, AWS) and w.service.timeout == 5.0  # (not the probe's 1 s)


def test_auto_gives_up_with_a_warning_when_nothing_answers(monkeypatch, caplog):
    monkeypatch.setattr(watcher, "DETECT_FOR", 0.5)
    with Scripted(lambda *_: (500, b"")) as srv, caplog.at_level(logging.INFO, "vcdask.cloud.watcher"):
        w, _ = _watch("auto", srv.endpoint, 3.0)
        assert w._task.done() and w.service is None
    assert len(srv.requests) >= 6  # (three providers probed, more than once)
    (record,) = [r for r in caplog.records if "not watching" in r.getMessage()]
    assert record.levelno == logging.WARNING and "no cloud metadata service answered in 0.5 s" in record.getMessage()


def test_gcp_counts_its_30_s_from_the_last_poll_that_saw_no_notice():
    # GCP says only TRUE: the notice was posted at most one poll (and its answer) before the watcher saw it
    state = {"polls": 0, "posted": None}

    def gcp(method, path, headers):
        state["polls"] += 1
        if state["posted"] is not None:
            return 200, b"TRUE"
        if state["polls"] == 2:
            state["posted"] = time.time()  # right after this answer: the longest it can go unseen
        return 200, b"FALSE"

    with Scripted(gcp) as srv:
        w, notices = _watch("gcp", srv.endpoint, 6.0, interval=1.5)
    (notice,) = notices
    truly_left = 30.0 - (notice["at"] - state["posted"])
    assert truly_left - 0.3 <= notice["window"] <= truly_left + 0.05  # not 30 s from when it was seen


def test_aws_window_is_at_most_two_minutes_whatever_the_clocks_say():
    # a worker clock 10 minutes behind the service's: the notice's time seems 12 minutes ahead
    def aws(method, path, headers):
        return (200, b"token") if method == "PUT" else (200, _aws_time(720))

    with Scripted(aws) as srv:
        notice = AWS(srv.endpoint).poll()
    assert notice.seconds_left == AWS.max_window == 120.0
