"""Cost accounting: worker time at known prices, with a scripted preemption on real workers."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import dask.config
import pytest
from chaos_helpers import SlowerOnceFlagged, SlowOn, copies_started_on, fit_in_thread, running_run, worker_info
from distributed import Client
from spec_helpers import core_spec

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.cost import check_prices, summarize
from vcdask.demo import digits_cnn
from vcdask.engine.events import topic
from vcdask.engine.pool import WorkerPool

PRICES = {"m.test": {"on-demand": 1.0, "spot": 0.3}, "g.big": {"on-demand": 4.0, "spot": 1.0}}


def test_the_cost_of_known_worker_time_at_known_prices():
    rows = [
        {"worker": "a", "instance": "m.test", "market": "spot", "alive_seconds": 3600.0, "wasted_seconds": 60.0},
        {"worker": "b", "instance": "m.test", "market": "on-demand", "alive_seconds": 1800.0, "wasted_seconds": 0.0},
        {"worker": "c", "instance": "g.big", "market": "spot", "alive_seconds": 7200.0, "wasted_seconds": 30.0},
        {"worker": "d", "instance": "x.unknown", "market": "spot", "alive_seconds": 50.0, "wasted_seconds": 0.0},
    ]
    cost = summarize(rows, PRICES, merges=10)
    assert cost["total"] == pytest.approx(0.3 + 0.5 + 2.0)
    assert cost["on_demand"] == pytest.approx(1.0 + 0.5 + 8.0)
    assert cost["saving"] == pytest.approx(1 - 2.8 / 9.5)
    assert cost["per_merge"] == pytest.approx(0.28)
    assert cost["wasted_seconds"] == 90.0 and cost["unpriced"] == ["d"]
    assert [r["cost"] for r in rows[:3]] == pytest.approx([0.3, 0.5, 2.0]) and math.isnan(rows[3]["cost"])


def test_a_pool_counts_alive_and_wasted_seconds_on_its_clock():
    now = [0.0]
    pool = WorkerPool(vcdask.Resilience(), 1, {"a": 1}, clock=lambda: now[0])
    now[0] = 10.0
    pool.joined("b", 1)
    now[0] = 25.0
    pool.wasted("b", 4.0)
    pool.left("b")
    now[0] = 40.0
    pool.joined("b", 1)  # back (a restarted process at the same address)
    now[0] = 50.0
    rows = {r["worker"]: r for r in pool.rows()}
    assert rows["a"]["alive_seconds"] == 50.0
    assert rows["b"]["alive_seconds"] == 15.0 + 10.0 and rows["b"]["wasted_seconds"] == 4.0
    pool.stop_clocks()  # the run ended: its workers, still connected, no longer count
    now[0] = 500.0
    assert [r["alive_seconds"] for r in pool.rows()] == [50.0, 25.0]


def test_bad_price_tables_are_refused_with_the_valid_markets():
    assert check_prices(None) == {} and check_prices(PRICES) == PRICES
    with pytest.raises(
        ValueError, match=r"prices\['m'\] must give 'on-demand' .*valid markets: \['spot', 'on-demand'\]"
    ):
        check_prices({"m": {"spot": 0.1}})
    with pytest.raises(ValueError, match=r"prices\['m'\]\['spot'\] must be a number >= 0 \(\$ per hour\), got -1"):
        check_prices({"m": {"on-demand": 1, "spot": -1}})
    with pytest.raises(ValueError, match="prices must map instance types"):
        check_prices(["m"])


@pytest.mark.cluster
def test_fit_reports_what_its_spot_workers_cost_and_what_a_preemption_wasted(digits_data, tmp_path):
    (X, y), _ = digits_data
    here = {"vcdask.cloud.instance": {"type": "m.test", "market": "spot"}, "vcdask.cloud.prices": PRICES}
    flag = tmp_path / "slow-victim"
    seen = tmp_path / "slow-victim.seen"
    with dask.config.set(here):  # the workers start with it, as cloud workers have it in their config
        with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
            victim = sorted(worker_info(client))[0]
            thread, out = fit_in_thread(
                model=digits_cnn(0),
                data=(X, y),
                client=client,
                store=tmp_path / "s",
                max_epochs=5,
                n_shards=8,
                # its shards take ~1 s; once the flag is up, its next batch takes 5 s: a shard is running
                # there at the notice for certain (between two shards the victim holds none for a moment,
                # and on a fast machine a shard seen running had ended by the time the notice came)
                train_step=SlowerOnceFlagged(victim, 0.025, str(flag), after=5.0),
                progress=False,
                retention=False,
            )
            run_id = running_run(client, min_step=3)
            flag.touch()
            deadline = time.monotonic() + 60
            while not (seen.exists() and client.run_on_scheduler(copies_started_on, victim)):
                assert time.monotonic() < deadline, "no shard running on the victim"
                time.sleep(0.01)
            moved = vcdask.preempt(client, victim, window=0)  # reclaimed now: its running shard is lost
            thread.join(300)
            notices = [e for _, e in client.get_events(topic(run_id)) if e["type"] == "preempted"]
            # the run's status after its end: its cost stopped with it, the workers still connected or not
            ended = client.sync(client.scheduler.vcdask_status, run_id=run_id)["cost"]
            time.sleep(0.5)
            later = client.sync(client.scheduler.vcdask_status, run_id=run_id)["cost"]
    assert "error" not in out, out.get("error")
    result = out["result"]
    workers = result.workers.set_index("worker")
    assert (workers.instance == "m.test").all() and (workers.market == "spot").all()
    alive = workers.alive_seconds
    assert alive[victim] < alive.drop(victim).min()  # it stopped counting when it left
    cost = result.cost
    assert later == ended and ended["total"] == pytest.approx(cost["total"], rel=1e-12)
    assert cost["total"] == pytest.approx(alive.sum() / 3600 * 0.3, rel=1e-12)
    assert cost["on_demand"] == pytest.approx(alive.sum() / 3600 * 1.0, rel=1e-12)
    assert cost["saving"] == pytest.approx(0.7, rel=1e-12)
    assert cost["per_merge"] == pytest.approx(cost["total"] / result.history.accepted.sum(), rel=1e-12)
    assert workers.cost.to_numpy() == pytest.approx((alive / 3600 * 0.3).to_numpy(), rel=1e-12)
    # the shard running on the victim was re-issued: its seconds so far are its waste, and only waste
    assert list(moved.values())[0] and notices[0]["reissued"] >= 1
    assert (
        workers.wasted_seconds[victim] == pytest.approx(notices[0]["wasted_seconds"])
        and notices[0]["wasted_seconds"] > 0
    )
    assert cost["wasted_seconds"] == pytest.approx(workers.wasted_seconds.sum())
    assert (workers.wasted_seconds.drop(victim) == 0).all()


@pytest.mark.cluster
def test_a_worker_that_joins_says_its_instance_before_any_shard(digits_data, tmp_path):
    """A spot worker reclaimed before its first shard was unpriced (its billed time left out): a worker that
    joins while a run counts its cost is asked its instance at once."""
    (X, y), _ = digits_data
    here = {"vcdask.cloud.instance": {"type": "m.test", "market": "spot"}, "vcdask.cloud.prices": PRICES}
    with dask.config.set(here):  # (the workers start with it, the one added later too)
        with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
            (first,) = worker_info(client)
            handle = vcdask.fit(
                digits_cnn(0),
                (X, y),
                client=client,
                store=tmp_path / "s",
                max_epochs=1,
                n_shards=1,
                train_step=SlowOn(first, 0.1),
                progress=False,
                wait=False,
            )  # fmt: skip  (its one shard runs on the first worker for ~5 s: none is left for the second)
            running_run(client)
            cluster.scale(2)
            result = handle.result()
    workers = result.workers.set_index("worker")
    (joined,) = set(workers.index) - {first}
    assert workers.loc[joined, "done"] == 0 and workers.loc[joined, "instance"] == "m.test"
    assert workers.loc[joined, "market"] == "spot" and workers.loc[joined, "cost"] > 0
    assert not result.cost["unpriced"]


def test_a_resumed_runs_cost_per_merge_counts_the_merges_since_it_was_resumed():
    """A resumed run's workers are counted from the resume on, so its cost per merge divides by the merges
    made since then (its history's accepted rows), not by every merge on its branch (its head's step)."""

    from vcdask.engine import views
    from vcdask.engine.committing import Head
    from vcdask.engine.core import RunState

    spec = core_spec("run-resumed", prices=PRICES)
    now = [0.0]
    run = RunState(spec, {"a": 1}, SimpleNamespace(tasks={}), wall=lambda: now[0])
    run.pool.identify("a", "m.test", "spot")
    run.head = Head(step=20, version="v20", version_step=20)  # 16 merges before the resume, 4 since
    for shard in range(4):
        run.ledger.record(2, shard, 1, "merged", accepted=True, staleness=0)
    run.ledger.record(2, 0, 2, "rejected")
    now[0] = 3600.0  # an hour of its worker since the resume
    cost = views.result_dict(run)["cost"]
    assert cost["total"] == pytest.approx(0.3) and cost["per_merge"] == pytest.approx(0.3 / 4)


def test_unpriced_workers_are_said_not_priced_at_zero():
    from vcdask.panel import _cost_html

    # a spot worker that joined and left before its first shard never said its instance: not $0.00
    rows = [{"worker": "a", "instance": None, "market": None, "alive_seconds": 600.0, "wasted_seconds": 0.0}]
    cost = summarize(rows, PRICES, merges=4)
    assert cost["total"] == 0.0 and cost["unpriced"] == ["a"]
    assert math.isnan(cost["per_merge"]) and math.isnan(cost["saving"])  # not known, rather than $0 a merge
    live = {"total": cost["total"], "on_demand": cost["on_demand"], "saving": cost["saving"]}  # (the status's)
    (html,) = _cost_html(live, rows)
    assert "$0.00" not in html and html == "cost unknown (1 worker unpriced)"
    priced = {"worker": "b", "instance": "m.test", "market": "spot", "alive_seconds": 3600.0, "wasted_seconds": 0.0}
    cost = summarize([*rows, priced], PRICES, merges=4)
    assert cost["per_merge"] == pytest.approx(0.3 / 4)
    (html,) = _cost_html({"total": cost["total"], "saving": cost["saving"]}, [*rows, priced])
    assert html == "cost $0.30 (70% below on-demand) (1 worker unpriced)"
    (html,) = _cost_html({"total": 0.3, "saving": 0.7}, [priced])
    assert html == "cost $0.30 (70% below on-demand)"
