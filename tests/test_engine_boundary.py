"""The boundary between a run's loop and its merge thread (engine.lane) and the base handshake
(engine.handshake), without a cluster: a real store, a real merge thread, asyncio on this thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from vcdask import open_store
from vcdask.engine import handshake
from vcdask.engine.committing import Head
from vcdask.engine.handshake import Handshake
from vcdask.engine.lane import MergeLane
from vcdask.engine.params_server import ParamsServer
from vcdask.merge import VCASGD
from vcdask.params import flatten
from vcdask.schedules import Constant
from vcdask.updates import update_path, write_update


def _server(tmp_path, **kw) -> ParamsServer:
    store = open_store(tmp_path / "s")
    store.create_branch("run-x")
    store.commit(flatten({"w": torch.zeros(4)}), {"run_id": "run-x", "step": 0, "merged": []}, branch="run-x")
    return ParamsServer(store, "run-x", VCASGD(alpha=Constant(0.5)), "run-x", **kw)


def _upload(server: ParamsServer, shard: int, value: float) -> dict:
    path = update_path("run-x", 1, shard, 0)
    write_update(server.store.files, path, flatten({"w": torch.full((4,), float(value))}))
    return {"epoch": 1, "shard": shard, "attempt": 0, "base_step": 0, "update": path}


def test_every_call_runs_in_the_lanes_thread_in_order_and_the_loop_sees_one_head(tmp_path):
    server = _server(tmp_path, commit_every="auto")
    lane = MergeLane(server, "vcdask-merge-test")
    threads: list[str] = []

    async def scenario() -> list[Head]:
        await lane.load()
        heads = [lane.head]
        for shard in range(3):
            out = await lane.merge(
                _upload(server, shard, shard), completes=False, max_staleness=None, more=True, in_use_step=0
            )
            assert out["accepted"] and out["version_id"] is None  # folded: more results are queued
            threads.append(await lane.call(lambda: threading.current_thread().name))
            heads.append(lane.head)
        await lane.commit()
        heads.append(lane.head)
        await lane.collect(final=True, in_use_step=3)
        return heads

    heads = asyncio.run(scenario())
    lane.shutdown()
    assert set(threads) == {threads[0]} and threads[0].startswith("vcdask-merge-test")
    assert threading.current_thread().name not in threads
    assert [h.step for h in heads] == [0, 1, 2, 3, 3] and [h.version_step for h in heads] == [0, 0, 0, 0, 3]
    assert [h.folded for h in heads] == [False, True, True, True, False]  # published with the head, as one value
    assert heads[-1].committed and heads[-1].version == server.store.head("run-x")
    assert server.in_use_step == 3  # given with the call, set in the merge thread


def test_a_store_request_under_way_is_published_with_the_head(tmp_path):
    server = _server(tmp_path)
    server.load()
    seen = []
    server._through_outages(lambda: seen.append(server.head.waiting), "reading something")
    assert seen[0][0] == "reading something" and server.head.waiting is None and server.stalled() is None


def test_a_task_may_have_its_base_once_the_results_before_it_are_settled():
    hs = Handshake()
    committed, merged_only = Head(step=2, version="v2", version_step=2), Head(step=3, version="v2", version_step=2)
    hs.arrived, hs.settled = 3, 2
    assert not hs.through(committed, 1, hs.arrived)  # one result to merge yet
    hs.settled = 3
    assert hs.through(committed, 1, 3) and not hs.through(merged_only, 1, 3)  # merged, not committed yet
    assert hs.through(merged_only, 5, 3)  # commit_every > 1: merged is enough
    drafted = Head(step=3, version="v2", version_step=2, draft={"bytes": b""})
    hs.settled = 2
    assert hs.through(drafted, 1, 3)  # the next result's merge, being committed: its draft goes out


def test_settled_through_wakes_on_each_settled_result_and_gives_up_at_its_timeout_or_the_runs_end():
    async def scenario() -> tuple[bool, bool, bool]:
        hs, head, done = Handshake(), Head(step=1, version="v1", version_step=1), asyncio.Event()
        hs.arrived = 1

        async def settle_later() -> None:
            await asyncio.sleep(0.05)
            hs.settled = 1
            hs.note_settled()

        settling = asyncio.ensure_future(settle_later())
        woke = await hs.settled_through(lambda: head, 1, 1, timeout=5.0, done=done)
        await settling
        hs.arrived = 2
        timed_out = await hs.settled_through(lambda: head, 1, 2, timeout=0.05, done=done)
        done.set()
        ended = await hs.settled_through(lambda: head, 1, 2, timeout=5.0, done=done)
        return woke, timed_out, ended

    assert asyncio.run(scenario()) == (True, False, False)


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: where it would wait for its next timer with nothing else to do,
    its clock jumps there.  Timers fire in order at their exact times, however busy the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        real = self._selector  # type: ignore[attr-defined]
        loop = self

        class Jump:
            def __getattr__(self, name):
                return getattr(real, name)

            def select(self, timeout=None):
                events = real.select(0)
                if not events and timeout:
                    loop.now += timeout
                return events

        self._selector = Jump()  # type: ignore[attr-defined]

    def time(self) -> float:
        return self.now


def test_a_task_behind_a_queue_of_merges_waits_its_turn_while_they_go_on(monkeypatch):
    """The timeout bounds each step of the merge path: results settled one every 0.06 s with a timeout of
    0.1 s keep a task waiting for the fifth (0.3 s), a merge path that stops after the second lets the
    task go on 0.1 s later, and ``most`` bounds the whole wait.  On a virtual clock (the handshake's
    too): a loaded machine that wakes the loop late cannot turn a merge in time into a timeout."""

    async def scenario(stop_after: int, most: float | None = None) -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(handshake, "time", SimpleNamespace(monotonic=loop.time))
        hs, done = Handshake(), asyncio.Event()
        head = Head(step=0, version="v0", version_step=0)
        hs.arrived = 5

        async def merge_one_by_one() -> None:
            nonlocal head
            for n in range(1, stop_after + 1):
                await asyncio.sleep(0.06)
                head = Head(step=n, version=f"v{n}", version_step=n)
                hs.settled = n
                hs.note_settled()

        merging = asyncio.ensure_future(merge_one_by_one())
        t0 = loop.time()
        through = await hs.settled_through(lambda: head, 1, 5, timeout=0.1, done=done, most=most)
        waited = loop.time() - t0
        await merging
        return through, waited

    def run(*args, **kwargs) -> tuple[bool, float]:
        with asyncio.Runner(loop_factory=_VirtualClockLoop) as runner:
            return runner.run(scenario(*args, **kwargs))

    # past its timeout three times over: the merges went on
    assert run(stop_after=5) == (True, pytest.approx(0.30))
    # the merge path stopped at 0.12 s: given up 0.1 s later
    assert run(stop_after=2) == (False, pytest.approx(0.22))
    # the merges go on, but the whole wait is bounded by ``most``
    assert run(stop_after=5, most=0.2) == (False, pytest.approx(0.20))


@pytest.mark.parametrize("attribute", ["folded", "paused", "waiting"])
def test_what_the_merge_thread_publishes_is_not_a_plain_attribute_of_the_server(tmp_path, attribute):
    """The loop reads the merge thread's status through ``head`` only (one immutable value)."""
    server = _server(tmp_path)
    assert attribute not in vars(server) and hasattr(server.head, attribute)


def test_the_next_queued_update_is_read_ahead_and_merged_ones_are_deleted_off_the_merge_path(tmp_path):
    server = _server(tmp_path)
    server.load()
    first, second, third = (_upload(server, shard, value) for shard, value in ((0, 2.0), (1, 4.0), (2, 8.0)))
    files = server.store.files
    server.merge(first, ahead=second["update"])
    server.side.drain()  # the side thread read the second update and deleted the first (merged and committed)
    assert not files.exists(first["update"])
    files.delete(second["update"])  # gone from the store: only the read ahead still has it
    second["base_step"] = 1
    out = server.merge(second, ahead="run-x/updates/never-written.safetensors")  # a read ahead that fails
    assert out["accepted"], out
    assert torch.equal(server.params.arrays["float32"], torch.full((4,), 2.5))  # 0 -> 1.0 -> 2.5 (alpha 0.5)
    third["base_step"] = 2
    assert server.merge(third)["accepted"]  # the failed read ahead named another update: this one is read now
    assert torch.equal(server.params.arrays["float32"], torch.full((4,), 5.25))
    server.side.drain()
    assert not any(files.exists(r["update"]) for r in (first, third))
    server.release()  # lets the side thread go
    assert server.side.closed


def test_an_update_whose_read_ahead_failed_is_read_again_through_outages(tmp_path):
    server = _server(tmp_path)
    server.load()
    late = update_path("run-x", 1, 1, 0)
    first = _upload(server, 0, 2.0)
    server.merge(first, ahead=late)  # its read ahead fails: not written yet
    server.side.drain()
    second = _upload(server, 1, 6.0)  # written now, under the name read ahead
    second["base_step"] = 1
    assert server.merge(second)["accepted"]
    assert torch.equal(server.params.arrays["float32"], torch.full((4,), 3.5))  # read again, not the failed read
