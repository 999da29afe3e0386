"""The providers' metadata protocols against fake services on 127.0.0.1, and the watcher's options."""

from __future__ import annotations

import asyncio
import email.utils
import pickle
import socket
import time

import dask.config
import pytest
from fake_metadata import AWS_TOKEN, FakeMetadata

from vcdask.cloud import PreemptionWatcher
from vcdask.cloud.metadata import AWS, GCP, Azure, detect, provider_for
from vcdask.engine import policy


@pytest.mark.parametrize("provider, cls", [("aws", AWS), ("gcp", GCP), ("azure", Azure)])
def test_no_notice_then_a_notice(provider, cls):
    with FakeMetadata(provider) as fake:
        service = provider_for(provider, fake.endpoint)
        assert isinstance(service, cls)
        assert service.poll() is None
        assert service.poll() is None
        fake.notify(90)
        notice = service.poll()
    assert notice is not None and notice.provider == provider
    # AWS and Azure say when the instance goes (to the second); GCP's notice is ~30 s
    expected = 30 if provider == "gcp" else 90
    assert expected - 2 <= notice.seconds_left <= expected


def test_aws_asks_for_an_imdsv2_token_first_and_reuses_it():
    with FakeMetadata("aws") as fake:
        service = AWS(fake.endpoint)
        for _ in range(3):
            assert service.poll() is None
        fake.notify(120)
        notice = service.poll()
    assert fake.paths("PUT") == ["/latest/api/token"]  # one token for every poll
    gets = [r for r in fake.requests if r[0] == "GET"]
    assert len(gets) == 4 and all(h["x-aws-ec2-metadata-token"] == AWS_TOKEN for _, _, h, _ in gets)
    assert notice.action == "terminate" and 118 <= notice.seconds_left <= 120


def test_aws_gets_a_new_token_when_the_old_one_is_refused():
    with FakeMetadata("aws") as fake:
        service = AWS(fake.endpoint)
        assert service.poll() is None
        service._token = "expired"  # what a restarted metadata service would refuse
        assert service.poll() is None
    assert fake.paths("PUT") == ["/latest/api/token"] * 2


def test_gcp_sends_the_metadata_flavor_header():
    with FakeMetadata("gcp") as fake:
        GCP(fake.endpoint).poll()
    (_, path, headers, _), *_ = fake.requests
    assert path == "/computeMetadata/v1/instance/preempted" and headers["metadata-flavor"] == "Google"


def test_azure_preempt_event_and_its_acknowledgement():
    with FakeMetadata("azure") as fake:
        service = Azure(fake.endpoint)
        assert service.poll() is None
        fake.notify(45)
        notice = service.poll()
        assert notice.event_id == fake.event_id and 43 <= notice.seconds_left <= 45
        service.acknowledge(notice)
        assert fake.acknowledged == [fake.event_id]
        assert service.poll() is None  # an acknowledged event is no longer listed
    assert all(h["metadata"] == "true" for _, _, h, _ in fake.requests)
    assert fake.requests[-2][0] == "POST" and b'"StartRequests"' in fake.requests[-2][3]


def _preempt(event_id, resources, *, status="Scheduled", in_seconds=60.0):
    """A Scheduled Events ``Preempt`` event, as Azure lists it."""
    not_before = email.utils.formatdate(time.time() + in_seconds, usegmt=True) if status == "Scheduled" else ""
    return {
        "EventId": event_id,
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "EventStatus": status,
        "NotBefore": not_before,
        "EventSource": "Platform",
    }


def test_azure_takes_only_the_events_that_name_this_vm():
    # Scheduled Events lists the events of every VM of the placement group to all of them, here first
    with FakeMetadata("azure") as fake:
        fake.vm_name = "vcdask-vmss_3"  # a scale-set VM: {scale-set-name}_{instance-id}, as Resources names it
        fake.group_events = [_preempt("other-vm-event", ["vcdask-vmss_1"]), _preempt("nobody", [])]
        service = Azure(fake.endpoint)
        assert service.poll() is None and service.poll() is None  # others' evictions are not this VM's notice
        fake.notify(45)
        notice = service.poll()
        assert notice.event_id == fake.event_id and 43 <= notice.seconds_left <= 45
        service.acknowledge(notice)
        assert fake.acknowledged == [fake.event_id]  # and not the other VM's
        assert service.poll() is None
        assert [e["EventId"] for e in fake.group_events] == ["other-vm-event", "nobody"]
    names = [p for p in fake.paths("GET") if p.startswith("/metadata/instance/")]
    assert names == ["/metadata/instance/compute/name?api-version=2021-02-01&format=text"]  # learnt once, kept
    assert service.vm_name == "vcdask-vmss_3"
    assert len(fake.paths("POST")) == 1


def test_azure_an_event_naming_this_vm_among_others_is_its_notice_but_not_acknowledged():
    # acknowledging lets an event proceed for all of its Resources: the other VM would lose its notice
    with FakeMetadata("azure") as fake:
        fake.resources = ["vcdask-vmss_1", fake.vm_name, "vcdask-vmss_7"]
        fake.notify(45)
        service = Azure(fake.endpoint)
        notice = service.poll()
        assert notice is not None and 43 <= notice.seconds_left <= 45 and notice.event_id is None
        service.acknowledge(notice)
    assert fake.paths("POST") == [] and fake.acknowledged == []


def test_azure_an_eviction_already_started_leaves_no_time():
    with FakeMetadata("azure") as fake:
        fake.group_events = [_preempt("started", [fake.vm_name], status="Started")]
        notice = Azure(fake.endpoint).poll()
        assert (notice.event_id, notice.seconds_left) == ("started", 0.0)
        fake.group_events = [{**_preempt("unsaid", [fake.vm_name]), "NotBefore": ""}]  # scheduled, no time given
        assert Azure(fake.endpoint).poll().seconds_left == Azure.default_window


@pytest.mark.parametrize("status", [404, 500, 200])  # 200: an empty name
def test_azure_without_this_vms_name_no_event_is_taken_and_the_name_is_asked_again(status):
    with FakeMetadata("azure") as fake:
        fake.vm_name_status = status
        if status == 200:
            fake.vm_name = ""
        fake.notify(45)
        service = Azure(fake.endpoint)
        for _ in range(2):  # never the old behaviour: any Preempt event of the group taken as this VM's
            with pytest.raises(ConnectionError, match=r"compute/name.* this VM's name is unknown, so no Scheduled"):
                service.poll()
        assert fake.paths("POST") == [] and not any(p.startswith("/metadata/sched") for p in fake.paths("GET"))
        fake.vm_name_status, fake.vm_name = 200, "worker-vm"  # the service answers again
        notice = service.poll()
    assert notice.event_id == fake.event_id and service.vm_name == "worker-vm"
    assert len([p for p in fake.paths("GET") if "compute/name" in p]) == 3


class _Scheduler:
    def __init__(self):
        self.notices: list[dict] = []

    async def vcdask_preempt(self, **kw):
        self.notices.append(kw)


def _watch_azure(fake, seconds):
    """Run a PreemptionWatcher against ``fake`` for ``seconds`` (or until it drains), then tear it down."""

    class FakeWorker:
        address = "tcp://127.0.0.1:1"
        scheduler = _Scheduler()

    async def main():
        worker = FakeWorker()
        watcher = PreemptionWatcher(provider="azure", endpoint=fake.endpoint, interval=0.05, timeout=10)
        watcher.setup(worker)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not watcher._task.done():
            await asyncio.sleep(0.05)
        await watcher.teardown(worker)
        return watcher, worker.scheduler.notices

    return asyncio.run(main())


def test_the_watcher_neither_drains_nor_acknowledges_on_another_vms_eviction():
    with FakeMetadata("azure") as fake:
        fake.group_events = [_preempt("other-vm-event", ["worker-vm-2"])]
        watcher, notices = _watch_azure(fake, 1.0)
        assert watcher.notice is None and notices == []
        assert len(fake.paths("GET")) > 3 and fake.paths("POST") == [] and fake.acknowledged == []
        fake.notify(30)  # now this VM's own, beside the other's
        watcher, notices = _watch_azure(fake, 10.0)
    assert watcher.notice.event_id == fake.event_id and len(notices) == 1 and 28 <= notices[0]["window"] <= 30
    assert fake.acknowledged == [fake.event_id]


def test_an_unexpected_answer_is_an_oserror_naming_the_service():
    with FakeMetadata("gcp") as fake:
        service = GCP(fake.endpoint)
        service.PATH = "/computeMetadata/v1/instance/nothing-here"
        with pytest.raises(ConnectionError, match=r"gcp metadata service at http://127.0.0.1:\d+/.* answered HTTP 404"):
            service.poll()


@pytest.mark.parametrize("provider, cls", [("aws", AWS), ("gcp", GCP), ("azure", Azure)])
def test_auto_detects_the_provider_that_answers(provider, cls):
    with FakeMetadata(provider) as fake:  # (a generous timeout: the fake serves from this busy process)
        assert isinstance(detect(fake.endpoint, timeout=10), cls)


def test_auto_finds_nothing_off_the_clouds():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert detect(f"http://127.0.0.1:{port}", timeout=0.5) is None


def test_bad_watcher_options_raise_clear_errors():
    with pytest.raises(
        ValueError, match=r"unknown cloud provider 'ibm'; valid providers: \['aws', 'gcp', 'azure', 'auto'\]"
    ):
        PreemptionWatcher(provider="ibm")
    with pytest.raises(ValueError, match=r"endpoint must be an http:// or https:// URL .*got '169.254.169.254'"):
        PreemptionWatcher(endpoint="169.254.169.254")
    for bad in (0, -5, float("nan"), "5", True):
        with pytest.raises(ValueError, match=r"interval must be a positive number of seconds, got"):
            PreemptionWatcher(interval=bad)
    with pytest.raises(ValueError, match="unknown cloud provider 'amazon'"):
        provider_for("amazon")


def test_the_watcher_reads_unset_options_from_dask_config_on_the_worker():
    class FakeWorker:
        address = "tcp://127.0.0.1:1"

    async def main():
        watcher = PreemptionWatcher()
        with dask.config.set(
            {
                "vcdask.cloud.preemption.provider": "gcp",
                "vcdask.cloud.preemption.endpoint": "http://127.0.0.1:9",
                "vcdask.cloud.preemption.interval": 0.5,
            }
        ):
            watcher.setup(FakeWorker())
        watcher._task.cancel()
        return watcher

    watcher = asyncio.run(main())
    assert (watcher.provider, watcher.endpoint, watcher.interval) == ("gcp", "http://127.0.0.1:9", 0.5)
    explicit = PreemptionWatcher(provider="aws", interval=2)
    with dask.config.set({"vcdask.cloud.preemption.provider": "gcp"}):
        assert explicit.provider == "aws"
    with dask.config.set({"vcdask.cloud.preemption.provider": "oracle"}), pytest.raises(ValueError, match="'oracle'"):
        PreemptionWatcher().setup(FakeWorker())


def test_the_watcher_pickles_its_settings_not_its_state():
    watcher = PreemptionWatcher(provider="azure", endpoint="http://127.0.0.1:1", interval=1)
    watcher.service = Azure("http://127.0.0.1:1")
    copy = pickle.loads(pickle.dumps(watcher))
    assert (copy.provider, copy.endpoint, copy.interval) == ("azure", "http://127.0.0.1:1", 1.0)
    assert copy.service is None and copy.notice is None


def test_a_running_shard_is_let_finish_only_if_it_fits_the_notice():
    # remaining * NOTICE_SAFETY + NOTICE_MARGIN <= window
    assert policy.fits_notice(expected=10, elapsed=4, window=120)
    assert policy.fits_notice(expected=10, elapsed=0, window=policy.NOTICE_MARGIN + 15)
    assert not policy.fits_notice(expected=10, elapsed=0, window=policy.NOTICE_MARGIN + 14.9)
    assert policy.fits_notice(expected=10, elapsed=30, window=policy.NOTICE_MARGIN)  # overdue: nothing left
    assert not policy.fits_notice(expected=1, elapsed=0, window=2)  # a short notice leaves no margin
