"""vcdask.fit end to end on a real LocalCluster (2 worker processes)."""

from __future__ import annotations

import gc
import itertools
import threading
import time

import pytest
import torch
from chaos_helpers import worker_info

import vcdask
from vcdask.demo import accuracy_on, digits_cnn
from vcdask.engine import policy
from vcdask.spec import load_spec
from vcdask.updates import read_update

pytestmark = pytest.mark.slow


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def test_fit_digits_reaches_accuracy(client, digits_data, tmp_path):
    (X, y), (X_test, y_test) = digits_data
    model = digits_cnn(0)
    result = vcdask.fit(
        model,
        (X, y),
        validation=0.1,
        max_epochs=20,
        n_shards=10,
        local_epochs=4,
        alpha=0.7,
        client=client,
        store=tmp_path / "store",
        progress=False,
        retention=False,  # every version stays (checked below)
    )
    # stated accuracy: >= 0.95 on the held-out test set
    assert accuracy_on(result.model, X_test, y_test) >= 0.95
    assert result.model is model
    h = result.history
    accepted = h[h.accepted]
    # one accepted update per (epoch, shard), versions 1..N in arrival order
    assert len(accepted) == 20 * 10
    assert sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist())) == [
        (e, s) for e in range(1, 21) for s in range(10)
    ]
    assert accepted.new_version.tolist() == list(range(1, 201))
    # staleness = merges between the version a task started from and its own merge
    assert (accepted.staleness == accepted.new_version - 1 - accepted.base_version).all()
    assert accepted.staleness.min() >= 0 and accepted.staleness.max() < 2 * 2 * 2 + 4
    assert (accepted.alpha == 0.7).all()
    assert set(accepted.worker) == set(worker_info(client))
    # sticky shards: a shard mostly goes back to the worker that already caches its rows
    last_worker, same, again = {}, 0, 0
    for row in accepted.itertuples():
        if row.shard in last_worker:
            again += 1
            same += row.worker == last_worker[row.shard]
        last_worker[row.shard] = row.worker
    assert same / again >= 0.6
    # epochs table: one row per epoch, with the min/max band around the mean
    e = result.epochs
    assert e.index.tolist() == list(range(1, 21))
    assert (e.accuracy_min <= e.accuracy_mean).all() and (e.accuracy_mean <= e.accuracy_max).all()
    assert e.wall_time.is_monotonic_increasing
    # every merge is a version on the run's branch; the result is the newest one
    versions = result.store.versions(result.run_id)
    assert len(versions) == 201  # initial + 200 merges
    assert versions[0].id == result.version
    assert versions[0].metadata["step"] == 200
    assert result.store.read(result.version).params.equal(vcdask.flatten(model))
    assert result.metrics["accuracy"] == pytest.approx(e.accuracy.iloc[-1])
    # nothing left in transit
    assert result.store.files.list(f"{result.run_id}/updates") == []


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.95, "epoch"])
def test_merge_arithmetic_end_to_end(client, digits_data, tmp_path, alpha):
    """Each stored version equals alpha * previous + (1 - alpha) * the client update, in arrival order."""
    (X, y), _ = digits_data
    result = vcdask.fit(
        _linear(),
        (X[:300], y[:300]),
        max_epochs=2,
        n_shards=3,
        alpha=alpha,
        client=client,
        store=tmp_path / "s",
        keep_updates=True,
        progress=False,
        retention=False,  # every version stays: each one is checked
    )
    store = result.store
    history = result.history[result.history.accepted]
    assert len(history) == 6
    by_step = {v.metadata["step"]: v.id for v in store.versions(result.run_id)}
    prev = store.read(by_step[0]).params
    for row in history.itertuples():
        expected_alpha = row.epoch / (row.epoch + 1) if alpha == "epoch" else alpha
        assert row.alpha == pytest.approx(expected_alpha)
        wc = read_update(store.files, row.update)
        got = store.read(row.version_id).params
        want = expected_alpha * prev.arrays["float32"] + (1 - expected_alpha) * wc.arrays["float32"]
        torch.testing.assert_close(got.arrays["float32"], want, rtol=1e-5, atol=1e-6)
        if alpha == 0.0:
            assert got.equal(wc)  # alpha = 0 takes the client's copy exactly
        prev = got


def _start_in_thread(**kwargs):
    out = {}

    def target():
        try:
            out["result"] = vcdask.fit(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def _wait_for_run(client, min_step=1, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.sync(client.scheduler.vcdask_runs) if _has_plugin(client) else {}
        running = [r for r, s in runs.items() if s == "running"]
        if running:
            status = client.sync(client.scheduler.vcdask_status, run_id=running[-1])
            if status["step"] >= min_step:
                return running[-1], status
        time.sleep(0.05)
    raise TimeoutError("no run started")


def _has_plugin(client):
    return client.run_on_scheduler(lambda dask_scheduler: "vcdask" in dask_scheduler.plugins)


@pytest.mark.parametrize(
    ("overlap", "next_base"),
    [("delta", True), ("delta", False), ("wait", True), ("wait", False)],
    ids=["delta-base-brought-by-the-hand-over", "delta-base-asked-for", "wait-base-brought", "wait-base-asked-for"],
)
def test_a_workers_next_task_trains_from_its_own_last_update(overlap, next_base, client, digits_data, tmp_path):
    """A worker gets its next shard as soon as its result is back, before that result is merged.  With
    ``vcdask.worker.overlap="delta"`` (the default) the task trains from the worker's own update at once
    and moves onto the merged version when it comes (:mod:`vcdask.overlap`); with ``"wait"`` it waits
    for the merge before it trains (or the hand-over waits for it, and its answer brings the next task's
    base: ``vcdask.worker.next-base``).  Either way its update's base holds its worker's last update:
    before the wait, every task trained from the version just before it (half the work lost with
    ``alpha=0``)."""
    import dask

    (X, y), _ = digits_data
    client.run(_set_worker_config, {"vcdask.worker.next-base": next_base})
    try:
        with dask.config.set({"vcdask.worker.overlap": overlap}):
            result = vcdask.fit(
                digits_cnn(0),
                (X, y),
                max_epochs=4,
                n_shards=6,
                local_epochs=2,
                tasks_per_slot=1,
                client=client,
                store=tmp_path / "s",
                progress=False,
            )
    finally:
        client.run(_set_worker_config, {"vcdask.worker.next-base": True})
    h = result.history[result.history.accepted].sort_values("time")
    if overlap == "delta":  # some tasks trained ahead (a merge takes a few of digits' 10 ms steps)
        assert (h.steps_ahead > 0).any() and (h.steps_ahead >= 0).all(), h.steps_ahead
    else:
        assert (h.steps_ahead == 0).all(), h.steps_ahead
    pairs = [
        (int(a.new_version), int(b.base_version))
        for _, rows in h.groupby("worker")
        for a, b in itertools.pairwise(rows.itertuples())
    ]
    assert len(pairs) >= 10, pairs
    fresh = sum(base >= own for own, base in pairs)
    # before the wait: none; with it, nearly all (bounded by a shard's time, so a CI run under load misses some)
    assert fresh >= 0.5 * len(pairs), pairs
    # the history says what the wait cost, never more than its bound: part of the read time of a task that
    # asked (a base brought by the hand-over was waited for before the task began)
    assert (h.wait_seconds >= 0).all() and h.wait_seconds.max() < policy.BASE_WAIT_MAX + 1.0, h.wait_seconds
    if not next_base and overlap == "wait":
        assert (h.wait_seconds <= h.read_seconds).all(), h[["wait_seconds", "read_seconds"]]


def test_default_shards_are_two_per_worker_thread(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    threads = sum(client.nthreads().values())
    result = vcdask.fit(_linear(), (X, y), max_epochs=2, client=client, store=tmp_path / "s", progress=False)
    h = result.history[result.history.accepted]
    assert sorted(set(h.shard)) == list(range(2 * threads)) and len(h) == 2 * 2 * threads
    # optimizer_state="auto" is decided with the shards: the run's spec holds the choice, not "auto"
    steps = -(-(len(X) // (2 * threads)) // 32)
    expected = "worker" if steps >= 10 else "fresh"
    spec = load_spec(result.store, result.run_id)
    assert spec.optimizer_state == expected
    # ... and the result says what the run decided: the rule fit's default is for these tasks in flight
    rule = vcdask.merge.for_run(vcdask.merge.DEFAULT_RULE, in_flight=threads)
    assert result.settings == {
        "merge": rule.name,
        "optimizer_state": expected,
        "n_shards": 2 * threads,
        "local_steps": steps,
        "overlap": spec.overlap,
    }
    summary = result._repr_html_()
    assert "trained with" in summary and f"{2 * threads} shards of {steps} local steps" in summary


def test_default_shards_shorten_long_tasks(client, digits_data, tmp_path):
    from vcdask.data import TASK_STEPS

    (X, y), _ = digits_data
    threads = sum(client.nthreads().values())
    # batches of 8: 180 a pass, so 8 shards per thread still leave tasks of 11 steps
    result = vcdask.fit(
        _linear(), (X, y), max_epochs=1, batch_size=8, client=client, store=tmp_path / "s", progress=False
    )
    h = result.history[result.history.accepted]
    assert sorted(h.shard) == list(range(8 * threads))  # every shard merged once
    assert result.settings["n_shards"] == 8 * threads
    assert result.settings["local_steps"] == -(-(len(X) // (8 * threads)) // 8) >= TASK_STEPS


def test_local_steps_of_a_task_are_counted_on_the_smallest_shard():
    from vcdask.data import Shards

    shards = Shards(1000, 3)  # 334, 333 and 333 rows
    assert shards.local_steps(32) == 11 and shards.local_steps(32, local_epochs=2) == 22
    assert Shards(64, 2).local_steps(32) == 1 and Shards(65, 2).local_steps(32) == 1


def test_default_shard_count_bounds():
    from vcdask.data import Shards

    assert Shards.default(1000, 2).n_shards == 4
    # more shards per thread while a task still trains 8 batches: 4095 rows are 128 batches of 32
    assert [Shards.default(4095, t).n_shards for t in (2, 3, 4, 8, 16)] == [16, 15, 16, 16, 32]
    assert Shards.default(4095, 2).local_steps(32) == 8 and Shards.default(4095, 3).local_steps(32) == 9
    assert Shards.default(4095, 2, batch_size=64).n_shards == 8  # 64 batches: 4 shards per thread
    assert Shards.default(1438, 4).n_shards == 8  # 45 batches: 2 per thread, tasks of 6 steps
    assert Shards.default(10**6, 8).n_shards == 64  # at most 8 per thread
    assert Shards.default(4095, 1).n_shards == 2  # one thread: its tasks run one after another
    assert Shards.default(1000, 0).n_shards == 2  # at least 2 (a cluster whose workers are still coming)
    assert Shards.default(1000, 1).n_shards == 2
    assert Shards.default(3, 8).n_shards == 3  # never more shards than samples
    assert Shards.default(1, 8).n_shards == 1


def test_duplicate_result_is_merged_once(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    thread, out = _start_in_thread(
        model=_linear(),
        data=(X, y),
        max_epochs=6,
        n_shards=4,
        local_epochs=3,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    run_id, _ = _wait_for_run(client, min_step=1)
    client.sync(client.scheduler.vcdask_reissue, run_id=run_id, epoch=1, shard=0)  # a second copy
    thread.join(120)
    assert "error" not in out, out.get("error")
    h = out["result"].history
    rows = h[(h.epoch == 1) & (h.shard == 0)]
    assert len(rows) == 2
    assert rows.accepted.sum() == 1
    # the second copy either ran and was discarded, or was still queued and was cancelled: never merged
    assert rows[~rows.accepted].reason.iloc[0].startswith(("duplicate", "cancelled: superseded"))
    accepted = h[h.accepted]
    assert len(accepted) == 6 * 4
    assert not accepted.duplicated(["epoch", "shard"]).any()


def test_scheduler_answers_while_merging_5m_params(client, digits_data, tmp_path):
    """Merges of a 5M-parameter model run off the event loop: the scheduler keeps answering fast."""
    (X, y), _ = digits_data

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(64, 10)
            self.table = torch.nn.Parameter(torch.zeros(5_000_000))  # 20 MB merged on every update

        def forward(self, x):
            return self.head(x.flatten(1)) + 0.0 * self.table[:1]

    # The scheduler lives in this (pytest) process, which after most of the suite holds a large heap; a full
    # collection of it stops every thread, the event loop's too, and is not what this test is about. So the
    # heap so far is frozen out of collection (a scheduler process of its own has none of it), and every
    # collection during the pings is timed, to tell one apart from a merge on the loop if a ping is slow.
    pauses = _GcPauses()
    gc.freeze()
    gc.callbacks.append(pauses)
    try:
        thread, out = _start_in_thread(
            model=Big(), data=(X, y), max_epochs=3, n_shards=6, client=client, store=tmp_path / "s", progress=False
        )
        run_id, start = _wait_for_run(client, min_step=1)
        latencies = []
        while thread.is_alive() and len(latencies) < 400:
            t = time.perf_counter()
            client.sync(client.scheduler.identity)
            latencies.append(time.perf_counter() - t)
            time.sleep(0.01)
        thread.join(300)
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()
    assert "error" not in out, out.get("error")
    merges_during = out["result"].history.accepted.sum() - start["step"]
    assert merges_during >= 5, "the pings must overlap real merges"
    assert len(latencies) >= 20
    # a merge on the loop would hold every ping it overlaps (at least 5); a busy 2-core machine may
    # hold one now and then
    slow = sorted(t for t in latencies if t > 0.1)
    assert len(slow) <= max(1, len(latencies) // 50), (
        f"{len(slow)} of {len(latencies)} pings over 100 ms: {slow}; {pauses}"
    )
    assert max(latencies) < 0.5, f"scheduler took {max(latencies) * 1e3:.0f} ms to answer; {pauses}"


class _GcPauses:
    """A ``gc.callbacks`` entry timing each collection of this process."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __repr__(self):
        longest = max(self.pauses, key=lambda p: p[1], default=(None, 0.0))
        return (
            f"{len(self.pauses)} garbage collections in this process meanwhile, the longest "
            f"{longest[1] * 1e3:.0f} ms (generation {longest[0]})"
        )


def _set_worker_config(values):
    import dask.config

    dask.config.set(values)


def _count_started_messages(dask_scheduler):
    """Keep the task keys of the ``vcdask_started`` messages (the handler) and of the starts a request
    for a base says (the plugin's ``handle_started``, called by ``handle_base``)."""
    plugin = dask_scheduler.plugins["vcdask"]
    for name, calls in (("messages", dask_scheduler.handlers), ("starts", None)):
        inner = calls["vcdask_started"] if calls is not None else plugin.handle_started
        keys: list = []

        def counted(*args, _inner=inner, _keys=keys, **kwargs):
            _keys.append(kwargs.get("key"))
            return _inner(*args, **kwargs)

        setattr(dask_scheduler, f"vcdask_test_{name}", (keys, inner))
        if calls is not None:
            calls["vcdask_started"] = counted
        else:
            plugin.handle_started = counted


def _uncount_started_messages(dask_scheduler):
    dask_scheduler.handlers["vcdask_started"] = dask_scheduler.vcdask_test_messages[1]
    del dask_scheduler.plugins["vcdask"].handle_started  # the class's method again
    return [list(dask_scheduler.vcdask_test_messages[0]), list(dask_scheduler.vcdask_test_starts[0])]


@pytest.mark.parametrize("overlap", ["wait", "delta"])
def test_a_warm_task_says_it_started_with_its_request_for_a_base(overlap, client, digits_data, tmp_path):
    """A shard task on a worker that has the run's spec and the shard's rows at hand sends one message
    before it trains, not two (its request for a base, which says it started; or, when the hand-over before
    it brought its base, a word that it began, which waits for no answer: it may have waited behind other
    work there); a cold one sends both.  With ``overlap="delta"`` a task trains before its base comes, so
    that one message says it started (a worker its shard kills is charged to it).  Either way every shard
    is merged once, none re-issued for want of a start, and every task says it started once."""
    import dask

    from vcdask.handle import ensure_plugin

    (X, y), _ = digits_data
    ensure_plugin(client)  # (its handlers are there from now on)
    client.run_on_scheduler(_count_started_messages)
    try:
        with dask.config.set({"vcdask.worker.overlap": overlap}):
            result = vcdask.fit(
                digits_cnn(0), (X, y), max_epochs=3, n_shards=4, client=client, store=tmp_path / "s", progress=False
            )
    finally:
        messages, starts = client.run_on_scheduler(_uncount_started_messages)
    h = result.history
    assert (h.outcome == "merged").all(), h[["epoch", "shard", "outcome", "reason"]]
    messages = [k for k in messages if str(k).startswith("vcdask-train-")]
    starts = [k for k in starts if str(k).startswith("vcdask-train-")]
    # 12 shard tasks on 2 workers: a worker is cold for its first task of each shard only (its rows)
    if overlap != "wait":  # each says it started: before training from its worker's own update, or as a cold task
        assert len(messages) >= len(h) - 2 and len(set(messages)) == len(messages), (messages, len(h))
        # (the answer that brings its base may say so first: the run keeps the first, plugin.handle_started)
        assert len(set(messages) | set(starts)) == len(h), (messages, starts, len(h))
        return
    # every task says it started once: in its own message (cold, or its base came with the hand-over
    # before it), or in its request for a base (warm)
    assert len(set(messages + starts)) == len(messages + starts) == len(h), (messages, starts, len(h))


def _count_base_messages(dask_scheduler):
    """Keep the keys of the ``vcdask_base`` requests, and of the copies whose base a hand-over's answer brought."""
    asked: list = []
    brought: list = []
    ask, finish = dask_scheduler.handlers["vcdask_base"], dask_scheduler.handlers["vcdask_finished"]

    async def asking(*args, **kwargs):
        asked.append(kwargs.get("key"))
        return await ask(*args, **kwargs)

    async def finishing(*args, **kwargs):
        answer = await finish(*args, **kwargs)
        if answer and answer.get("next"):
            brought.append(answer["next"]["key"])
        return answer

    dask_scheduler.vcdask_test_bases = (asked, brought, ask, finish)
    dask_scheduler.handlers.update(vcdask_base=asking, vcdask_finished=finishing)


def _uncount_base_messages(dask_scheduler):
    asked, brought, ask, finish = dask_scheduler.vcdask_test_bases
    dask_scheduler.handlers.update(vcdask_base=ask, vcdask_finished=finish)
    return list(asked), list(brought)


@pytest.mark.parametrize("next_base", [True, False], ids=["brought-by-the-hand-over", "asked-for"])
def test_a_warm_worker_gets_its_next_base_with_the_hand_over(next_base, client, digits_data, tmp_path):
    """With ``vcdask.worker.next-base`` the answer to a shard task's hand-over brings the base of the copy
    sent to its worker next, and that copy asks for nothing: one message per task, not two (what the copy
    trains from: :func:`test_a_workers_next_task_trains_from_its_own_last_update`).  Either way every
    shard is merged once."""
    from vcdask.handle import ensure_plugin

    (X, y), _ = digits_data
    ensure_plugin(client)
    client.run(_set_worker_config, {"vcdask.worker.next-base": next_base})
    client.run_on_scheduler(_count_base_messages)
    try:
        result = vcdask.fit(
            digits_cnn(0), (X, y), max_epochs=4, n_shards=4, client=client, store=tmp_path / "s", progress=False
        )
    finally:
        asked, brought = client.run_on_scheduler(_uncount_base_messages)
        client.run(_set_worker_config, {"vcdask.worker.next-base": True})
    h = result.history
    assert (h.outcome == "merged").all(), h[["epoch", "shard", "outcome", "reason"]]
    asked = [k for k in asked if str(k).startswith("vcdask-train-")]
    if next_base:
        # 16 copies on 2 workers: after each worker's first epoch most of its copies are on warm shards
        assert len(brought) >= len(h) // 3, (brought, asked)
        assert len(set(asked) | set(brought)) == len(h) > len(asked), (asked, brought)
    else:
        assert brought == [] and len(asked) == len(h), (asked, brought)


def _count_store_reads(dask_worker):
    """Keep the key of the task behind each read of a version from the store on this worker."""
    from vcdask.store._icechunk import IcechunkParamStore

    reads: list = []
    read = IcechunkParamStore.read

    def counting(self, *args, **kwargs):
        try:
            reads.append(str(dask_worker.get_current_task()))
        except Exception:  # noqa: BLE001 - (not in a task: a shard task's base fetched in a thread, overlap="delta")
            reads.append("vcdask-train-base" if threading.current_thread().name.startswith("vcdask-base") else None)
        return read(self, *args, **kwargs)

    IcechunkParamStore.read = counting
    dask_worker.vcdask_test_reads = (reads, read)


def _uncount_store_reads(dask_worker):
    from vcdask.store._icechunk import IcechunkParamStore

    kept = getattr(dask_worker, "vcdask_test_reads", None)  # (None: a worker started since)
    if kept is None:
        return None
    reads, read = kept
    IcechunkParamStore.read = read
    return list(reads)


def _set_scheduler_config(values, dask_scheduler=None):
    """Set ``values`` where the scheduler runs; return what they were."""
    import dask.config

    before = {k: dask.config.get(k) for k in values}
    dask.config.set(values)
    return before


@pytest.mark.parametrize("inline", [1 << 20, 0], ids=["with-the-answer", "from-the-store"])
def test_a_small_models_base_comes_with_the_answer_that_gives_it(inline, client, digits_data, tmp_path):
    """With ``vcdask.worker.inline-base-bytes`` above the model's size (the default: 1 MiB; digits' CNN is
    150 kB) every answer that gives a shard task its base also brings that version's parameters, and no
    shard task reads a version from the store; with 0 they read their bases from the store, as before.
    Either way every shard is merged once."""
    (X, y), _ = digits_data
    before = client.run_on_scheduler(_set_scheduler_config, {"vcdask.worker.inline-base-bytes": inline})
    client.run(_count_store_reads)
    try:
        result = vcdask.fit(
            digits_cnn(0), (X, y), max_epochs=3, n_shards=4, client=client, store=tmp_path / "s", progress=False
        )
    finally:
        reads = client.run(_uncount_store_reads)
        client.run_on_scheduler(_set_scheduler_config, before)
    h = result.history
    assert (h.outcome == "merged").all() and len(h) == 12, h[["epoch", "shard", "outcome", "reason"]]
    by_training = [k for keys in reads.values() for k in keys or () if str(k).startswith("vcdask-train-")]
    if inline:
        assert by_training == [], reads
    else:  # (a worker reads each version once: two copies based on one version share the read)
        assert len(by_training) >= len(h) // 2, reads


def _keep_base_answers(dask_scheduler):
    """Keep (key, version, step, params) of every base the run gives: asked for, or brought by a
    hand-over's answer."""
    given: list = []
    ask, finish = dask_scheduler.handlers["vcdask_base"], dask_scheduler.handlers["vcdask_finished"]

    def keep(key, base):
        given.append((key, base["version"], base["step"], base.get("params")))

    async def asking(*args, **kwargs):
        answer = await ask(*args, **kwargs)
        if answer and "step" in answer:
            keep(kwargs.get("key"), answer)
        return answer

    async def finishing(*args, **kwargs):
        answer = await finish(*args, **kwargs)
        if answer and answer.get("next"):
            keep(answer["next"]["key"], answer["next"])
        return answer

    dask_scheduler.vcdask_test_given = (given, ask, finish)
    dask_scheduler.handlers.update(vcdask_base=asking, vcdask_finished=finishing)


def _forget_base_answers(dask_scheduler):
    given, ask, finish = dask_scheduler.vcdask_test_given
    dask_scheduler.handlers.update(vcdask_base=ask, vcdask_finished=finish)
    return list(given)


@pytest.mark.parametrize("early", [True, False], ids=["before-the-commit", "once-committed"])
def test_a_small_models_base_goes_out_while_it_is_committed(early, client, digits_data, tmp_path):
    """With ``vcdask.worker.base-before-commit`` a task waiting for a merge gets its parameters as soon as
    they are merged, while the merge thread commits them: such a base has no version id yet, only its
    step, and that step becomes a version of its own.  Off, every base is a committed version.  Either
    way every shard is merged once, each merge committed in a version of its own step."""
    from vcdask._wire import unpack
    from vcdask.handle import ensure_plugin

    (X, y), _ = digits_data
    ensure_plugin(client)
    before = client.run_on_scheduler(_set_scheduler_config, {"vcdask.worker.base-before-commit": early})
    client.run_on_scheduler(_keep_base_answers)
    try:
        result = vcdask.fit(
            digits_cnn(0),
            (X, y),
            max_epochs=4,
            n_shards=4,
            client=client,
            store=tmp_path / "s",
            progress=False,
            retention=False,  # (every version kept, to be counted)
        )
    finally:
        given = client.run_on_scheduler(_forget_base_answers)
        client.run_on_scheduler(_set_scheduler_config, before)
    h = result.history
    assert (h.outcome == "merged").all() and len(h) == 16, h[["epoch", "shard", "outcome", "reason"]]
    store = vcdask.open_store(tmp_path / "s")
    versions = {v.metadata["step"]: v.id for v in store.versions(result.run_id)}
    assert sorted(versions) == list(range(17)), sorted(versions)  # every merge its own version
    drafts = [step for _, version, step, _ in given if version is None]
    if early:  # (a worker handing its update over waits for that merge: its next base is then a draft)
        assert drafts, given
    else:
        assert drafts == [] and given, given
    rows = h.set_index(["epoch", "shard", "attempt"]).base_version
    for key, version, step, params in given:
        # a base is the version of its step, committed or being committed: its parameters came along
        assert version in (None, versions[step]) and params is not None, (key, version, step)
        assert unpack(params).equal(store.read(versions[step]).params), (key, step)
        # and the copy trained from it (the history's base_version is that step)
        epoch, shard, attempt = (int(part[1:]) for part in str(key).rsplit("-", 3)[1:])
        assert rows[(epoch, shard, attempt)] == step, (key, step)


@pytest.mark.parametrize("hand_over", [True, False], ids=["handed-over", "through-dask"])
def test_results_handed_over_by_their_tasks_or_read_through_dask(hand_over, client, digits_data, tmp_path):
    """A task hands its record to the run as it finishes (``vcdask.worker.hand-over``); with that off the
    run reads every result through Dask.  Either way every shard is merged once."""
    (X, y), _ = digits_data
    client.run(_set_worker_config, {"vcdask.worker.hand-over": hand_over})
    try:
        result = vcdask.fit(
            digits_cnn(0), (X, y), max_epochs=3, n_shards=6, client=client, store=tmp_path / "s", progress=False
        )
    finally:
        client.run(_set_worker_config, {"vcdask.worker.hand-over": True})
    h = result.history
    assert sorted(map(tuple, h[h.accepted][["epoch", "shard"]].values.tolist())) == [
        (e, s) for e in range(1, 4) for s in range(6)
    ]
    assert (h.outcome == "merged").all(), h[["epoch", "shard", "outcome", "reason"]]
    run_id = result.run_id
    handed = client.sync(client.scheduler.vcdask_status, run_id=run_id)["handed_over"]
    # shard tasks and validations: most come handed over (Dask's own report can come first), none without it
    assert handed >= len(h) // 2 if hand_over else handed == 0, handed


@pytest.mark.cluster
def test_one_worker_with_the_default_rule_is_a_sequence_of_local_runs(digits_data, tmp_path):
    """One task in flight: the default rule takes each update as the new W_s, bit for bit (one worker's
    run is plain torch's loop over its shards, no outer step on top of the inner optimizer's own), and
    records it as the staleness rule with alpha 0."""
    from distributed import Client

    from vcdask.cluster import embedded_cluster
    from vcdask.merge import ONE_IN_FLIGHT

    (X, y), _ = digits_data
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.fit(
            _linear(),
            (X[:300], y[:300]),
            max_epochs=2,
            n_shards=3,
            client=client,
            store=tmp_path / "s",
            keep_updates=True,
            progress=False,
            retention=False,
        )
    store = result.store
    history = result.history[result.history.accepted]
    assert len(history) == 6 and set(history.staleness) == {0}
    assert (history.alpha == 0.0).all()
    for row in history.itertuples():
        got = store.read(row.version_id)
        assert got.params.equal(read_update(store.files, row.update))
        assert got.metadata["merge"] == ONE_IN_FLIGHT.describe() == {**got.metadata["merge"], "name": "staleness"}


@pytest.mark.cluster
def test_a_run_schedule_follows_the_runs_order_of_shards(digits_data, tmp_path):
    """``lr_schedules.OverRun`` is indexed by the run's global count of local steps: a rate of 0 from the
    middle of epoch 2 on leaves the last three versions where the sixth merge put them (one task in flight:
    each update is the new W_s), while a per-task schedule could not tell the tasks of an epoch apart."""
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    (X, y), _ = digits_data
    # 4 shards of 100 rows, batches of 50: 2 steps a shard, 16 in the run; from step 10 on, no step moves
    schedule = vcdask.lr_schedules.OverRun(lambda step, _total: 0.0 if step >= 10 else 1.0)
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.fit(
            _linear(),
            (X[:400], y[:400]),
            max_epochs=2,
            n_shards=4,
            batch_size=50,
            lr_schedule=schedule,
            client=client,
            store=tmp_path / "s",
            progress=False,
            retention=False,
        )
    history = result.history[result.history.accepted].sort_values("new_version")
    params = [result.store.read(v).params for v in history.version_id]
    assert len(params) == 8
    assert not params[3].equal(params[4])  # the 5th task (steps 8-9) trained
    assert params[4].equal(params[5]) and params[5].equal(params[6]) and params[6].equal(params[7])
