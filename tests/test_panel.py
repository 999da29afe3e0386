"""The notebook panel, in a real Jupyter kernel (nbclient), fed by the run's events; displays side by side."""

from __future__ import annotations

import json
import time

import nbformat
import numpy as np
import pytest
import torch

import vcdask
from vcdask.panel import PanelState

SETUP = """\
import json, threading, time
import vcdask
from distributed import Client, LocalCluster
from vcdask.demo import digits, digits_cnn
(X, y), _ = digits()
"""

FIT = """\
result = vcdask.fit(digits_cnn(0), (X, y), validation=0.1, max_epochs=3, n_shards=6, alpha=0.5, store="store",
                    seed=0)
"""

CHECK_FIT = """\
p = result.panel
print(json.dumps({"progress": p.progress.value, "max": p.progress.max, "points": len(p.source.data["epoch"]),
                  "workers": [r["worker"] for r in p.state.worker_rows()], "events": p.state.events,
                  "grid": {e: p.state.grid(e) for e in p.state.grid_epochs()}, "epochs": len(result.epochs),
                  "result_workers": sorted(result.workers.worker), "header": p.header.value}))
"""

REATTACH = """\
client = Client(LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None))
out = {}
t = threading.Thread(target=lambda: out.update(r=vcdask.fit(digits_cnn(1), (X, y), client=client, validation=0.1,
                     max_epochs=4, n_shards=6, alpha=0.5, store="store", seed=1, progress=False)))
t.start()
while True:  # a notebook re-attaching to a run that is already running
    runs = client.sync(client.scheduler.vcdask_runs) if client.run_on_scheduler(
        lambda dask_scheduler: "vcdask" in dask_scheduler.plugins) else {}
    if runs:
        break
    time.sleep(0.05)
(run_id,) = runs
panel = vcdask.attach(run_id, client).panel()
t.join()
deadline = time.monotonic() + 30
while not panel._closed and time.monotonic() < deadline:  # it lets go when the run's "finished" event arrives
    time.sleep(0.1)
print(json.dumps({"progress": panel.progress.value, "epochs": len(out["r"].epochs), "closed": panel._closed,
                  "points": len(panel.source.data["epoch"]),
                  "merged": all(s == "merged" for e in panel.state.grid_epochs() for s in panel.state.grid(e))}))
client.close()
"""


def _run(tmp_path, cells: list[str]) -> list[dict]:
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    return [o for c in nb.cells for o in c.get("outputs", [])]


def _printed(outputs: list[dict]) -> list[dict]:
    return [
        json.loads(line)
        for o in outputs
        if o.get("output_type") == "stream"
        for line in o["text"].splitlines()
        if line.startswith("{")
    ]


@pytest.mark.slow
@pytest.mark.cluster
def test_panel_in_a_kernel_after_fit(tmp_path):
    outputs = _run(tmp_path, [SETUP, FIT, CHECK_FIT, "result", "result.plot()"])
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 2  # the live panel during fit, and the plot
    (state,) = _printed(outputs)
    assert state["progress"] == state["max"] == state["epochs"] == 3
    assert state["points"] == 3  # the metric plot: one point per epoch
    assert sorted(state["workers"]) == state["result_workers"] and len(state["workers"]) == 2
    assert state["events"] > 0  # fed by the run's events, not only by snapshots
    assert state["grid"] and all(s == "merged" for row in state["grid"].values() for s in row)
    assert all(len(row) == 6 for row in state["grid"].values())
    assert "finished" in state["header"] and "alpha" in state["header"]
    html = next(o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {}))
    assert "vcdask.FitResult" in html and "accuracy" in html and "store" in html


@pytest.mark.slow
@pytest.mark.cluster
def test_panel_reattached_to_a_running_run_keeps_updating(tmp_path):
    (state,) = _printed(_run(tmp_path, [SETUP, REATTACH]))
    assert state["closed"] and state["merged"]
    assert state["progress"] == state["epochs"] == state["points"] == 4


def test_an_ended_runs_grid_shows_the_copies_it_cancelled_as_not_run():
    """A run that stops (a target, stop(), cancel()) cancels the copies still out, and no event says so: its
    final grid showed them running."""
    st = PanelState("r")
    snapshot = {"epochs": [], "workers": [], "metric": "accuracy"}
    shards = [[1, 0, "merged"], [1, 1, "running"], [1, 2, "re-issued"], [1, 3, "skipped"]]
    st.apply_snapshot({**snapshot, "status": {"n_shards": 4, "status": "running"}, "shards": shards})
    assert st.grid(1) == ["merged", "running", "re-issued", "skipped"]
    st.apply_snapshot({**snapshot, "status": {"n_shards": 4, "status": "finished"}, "shards": shards})
    assert st.grid(1) == ["merged", "queued", "queued", "skipped"]


def test_panel_state_folds_events_idempotently():
    st = PanelState("r")
    st.apply_snapshot(
        {
            "status": {"n_shards": 2, "max_epochs": 2, "status": "running", "merge": "auto"},
            "epochs": [],
            "workers": [],
            "shards": [[1, 0, "running"]],
            "metric": "accuracy",
        }
    )
    events = [
        {"type": "shard", "epoch": 1, "shard": 1, "state": "queued"},
        {
            "type": "update",
            "epoch": 1,
            "shard": 0,
            "accepted": True,
            "new_version": 1,
            "alpha": 0.5,
            "staleness": 0,
            "version": "V1",
            "merge": "auto: probe, 16 rows",  # (what the rule merges with now: "auto" has chosen)
            "worker": "w1",
            "worker_row": {
                "worker": "w1",
                "done": 1,
                "failed": 0,
                "timed_out": 0,
                "rejected": 0,
                "mean_seconds": 0.1,
                "preempted": False,
                "excluded": None,
            },
        },
        {"type": "shard", "epoch": 1, "shard": 0, "state": "merged"},
        {
            "type": "lost",
            "epoch": 1,
            "shard": 1,
            "worker": "w2",
            "why": "KilledWorker",
            "worker_row": {
                "worker": "w2",
                "done": 0,
                "failed": 1,
                "timed_out": 0,
                "rejected": 0,
                "mean_seconds": float("nan"),
                "preempted": False,
                "excluded": None,
            },
        },
        {
            "type": "epoch",
            "run_id": "r",
            "epoch": 1,
            "wall_time": 1.5,
            "accuracy": 0.5,
            "accuracy_min": 0.4,
            "accuracy_max": 0.6,
            "version": 2,
        },
    ]
    for event in events + events:  # twice: folding again changes nothing
        st.apply(event)
    assert st.grid(1) == ["merged", "queued"]
    assert st.epochs_done == 1
    assert st.metric_series() == {"epoch": [1], "time": [1.5], "value": [0.5], "lo": [0.4], "hi": [0.6]}
    assert [(r["worker"], r["state"]) for r in st.worker_rows()] == [("w1", "active"), ("w2", "lost")]
    assert st.status["step"] == 1 and st.status["alpha"] == 0.5
    assert any("w2 lost" in n for n in st.notes)
    from vcdask.panel import _header_html

    assert st.status["merge"] == "auto: probe, 16 rows" and "merge auto: probe, 16 rows" in _header_html(st)


@pytest.mark.parametrize(
    "cause, shown, note",
    [
        ("store", "store unavailable: 503 Slow Down", "store back after 12 s"),
        ("workers", "no usable worker (connected: 0)", "workers back after 12 s"),
    ],
)
def test_panel_state_shows_why_a_run_is_paused(cause, shown, note):
    st = PanelState("r")
    why = "503 Slow Down" if cause == "store" else "no usable worker (connected: 0)"
    st.apply({"type": "paused", "cause": cause, "why": why})
    assert st.paused == shown
    st.apply({"type": "resumed", "cause": cause, "after": 12.0})
    assert st.paused is None
    assert any(note in n for n in st.notes), st.notes


def test_panel_header_shows_the_cost_so_far_with_a_price_table():
    from vcdask.panel import _header_html

    st = PanelState("r")
    assert "cost" not in _header_html(st)  # no price table: nothing to say
    st.apply_status({"status": "running", "cost": {"total": 1.234, "on_demand": 4.1, "saving": 0.7}})
    assert "cost $1.23 (70% below on-demand)" in _header_html(st)


def test_panel_state_notes_a_shard_given_up_and_why():
    """A skip (``on_shard_failure="skip"``) is noted, as lost workers and re-issues are: the run goes on
    without that shard's work, and a client of a remote scheduler sees no log of it."""
    st = PanelState("r")
    st.apply({"type": "shard", "epoch": 1, "shard": 2, "state": "merged"})
    assert st.notes == []
    why = "shard 2 of epoch 1 failed 3 times (last: non-finite values (NaN/inf) in ['weight'])"
    st.apply({"type": "shard", "epoch": 1, "shard": 2, "state": "skipped", "why": why})
    st.apply({"type": "shard", "epoch": 2, "shard": 0, "state": "skipped"})  # (an older scheduler's event)
    assert st.notes == [f"skipped: {why}", "skipped: shard 0 of epoch 2 failed"]
    assert st.shards[(1, 2)] == "skipped"


def test_panel_state_notes_a_failure_without_an_error_text():
    st = PanelState("r")
    st.apply({"type": "failed", "error": ""})  # an empty error has no last line to show
    assert st.status["status"] == "error" and st.ended
    assert st.notes == ["run failed"]
    st.apply({"type": "failed", "error": None})
    st.apply({"type": "failed", "error": "Traceback (most recent call last):\n  ...\nValueError: bad shard\n"})
    assert st.notes == ["run failed", "run failed", "run failed: ValueError: bad shard"]


# -- displays of a run on one client, beside each other (distributed keeps one handler per topic per client) --


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _short_run(client, tmp_path, *, max_epochs: int, step_seconds: float = 0.0, wait: bool = False):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(160, 8)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 2))

    def slow(epoch, step):  # each local step takes a while: the run lasts long enough to watch
        import time

        time.sleep(step_seconds)
        return 1.0

    kw = dict(max_epochs=max_epochs, n_shards=4, validation=0.25, client=client, progress=False, seed=0)
    return vcdask.fit(model, (X, y), store=tmp_path / "store", lr_schedule=slow, wait=wait, **kw)


def test_two_panels_and_a_bar_of_one_run_on_one_client_all_follow_it(client, tmp_path):
    from vcdask import _topics
    from vcdask.engine.events import topic
    from vcdask.panel import RunPanel
    from vcdask.progress import ConsoleProgress

    handle = _short_run(client, tmp_path, max_epochs=4, step_seconds=0.03)
    name = topic(handle.run_id)
    first = RunPanel(handle, display=False)
    second = RunPanel(handle, display=False)  # (a re-run cell)
    bar = ConsoleProgress(handle)  # (handle.wait(progress=True) after handle.panel())
    assert _until(lambda: min(first.state.events, second.state.events, bar.state.events) > 0), (
        first.state.events,
        second.state.events,
        bar.state.events,
    )
    bar.close()  # closing one display leaves the others live
    seen = first.state.events, second.state.events
    assert _until(lambda: first.state.events > seen[0] and second.state.events > seen[1])
    assert not first._closed and not second._closed
    second.close()
    seen = first.state.events, second.state.events
    # the last panel lets go when the run's "finished" event arrives, and draws the run's end
    assert _until(lambda: first._closed and first.progress.bar_style == "success")
    assert first.state.events > seen[0]
    assert second.state.events - seen[1] <= 1  # (an event already being handed out as it closed)
    assert first.state.status["status"] == "finished"
    assert first.progress.value == first.progress.max == 4
    assert (id(client), name) not in _topics._fanouts
    # distributed's unsubscribe_topic leaves the handler (and the displays it holds) in the client
    assert _until(lambda: name not in client._event_handlers, timeout=_topics._GRACE + 5), client._event_handlers


def test_a_panel_of_an_ended_run_shows_its_end_and_follows_nothing(client, tmp_path):
    from vcdask import _topics
    from vcdask.engine.events import topic
    from vcdask.panel import RunPanel

    result = _short_run(client, tmp_path, max_epochs=2, wait=True)
    panel = RunPanel(vcdask.attach(result.run_id, client), display=False)
    assert panel._closed  # no "finished" event will come to close it
    assert panel.state.status["status"] == "finished" and panel.state.ended
    assert panel.progress.value == panel.progress.max == 2 and panel.progress.bar_style == "success"
    assert len(panel.source.data["epoch"]) == 2 and "finished" in panel.header.value
    assert (id(client), topic(result.run_id)) not in _topics._fanouts
    assert _until(lambda: topic(result.run_id) not in client._event_handlers, timeout=10), client._event_handlers


def test_the_console_bar_in_a_log_is_redrawn_when_what_it_shows_changes(client, tmp_path, capsys):
    """Where stderr is no terminal (a scheduled job's log), each redraw is a line of the log: the bar was
    redrawn at every look at the run, twice a second, the same but for the clock."""
    from vcdask.progress import ConsoleProgress

    result = _short_run(client, tmp_path, max_epochs=2, wait=True)
    handle = vcdask.attach(result.run_id, client)
    capsys.readouterr()
    bar = ConsoleProgress(handle)  # (pytest's captured stderr is no terminal)
    status = handle.status()
    for _ in range(20):
        bar.update(status)
    written = capsys.readouterr().err
    bar.close()
    assert 1 <= written.count(result.run_id) <= 2, written  # the bar's first line, the epochs' redraw
