"""The embedded cluster: started once per process and shared by later fits; the missing __main__ guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import vcdask
from vcdask._main_guard import _guarded
from vcdask.cli._listing import run_info
from vcdask.cluster import check_main_guard, close_embedded, embedded_client, running_embedded_client
from vcdask.engine.end import read_record
from vcdask.errors import RunNotFoundError


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


@pytest.mark.cluster
@pytest.mark.slow
def test_two_fits_share_one_embedded_cluster(tmp_path):
    X, y = _data()
    first = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store=tmp_path / "s", progress=False)
    client = embedded_client()
    address = client.scheduler.address
    assert client.status == "running"
    second = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store=tmp_path / "s", progress=False)
    assert embedded_client() is client and client.scheduler.address == address
    # both runs were driven by that scheduler's plugin
    runs = client.sync(client.scheduler.vcdask_runs)
    assert runs[first.run_id] == runs[second.run_id] == "finished"
    # never the user's default client
    from distributed.client import _get_global_client

    assert _get_global_client() is not client
    # wait=False: the cluster outlives fit's return
    handle = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store=tmp_path / "s", wait=False)
    assert handle.client is client
    assert int(handle.result().history["accepted"].sum()) == int(first.history["accepted"].sum())
    # attach without a client finds the runs of the embedded cluster (Dask's "No clients found" before)
    assert vcdask.attach(handle.run_id).client is client
    with pytest.raises(RunNotFoundError, match=r"no vcdask run 'run-nope'.*vcdask\.attach\(run_id, client_or_address"):
        vcdask.attach("run-nope")
    # closed (by hand, or at exit): the next use starts a new one; a run still going is named, and ends where it is,
    # recorded as cut off by its scheduler's shutdown (resumable), not as cancelled (over)
    live = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=500, store=tmp_path / "s", wait=False)
    with pytest.warns(RuntimeWarning, match=f"runs \\['{live.run_id}'\\] are still going.*vcdask.resume"):
        close_embedded()
    assert client.status == "closed"
    store = vcdask.open_store(tmp_path / "s", mode="r")
    record = read_record(store, live.run_id)
    assert (record["status"], record["stop_kind"]) == ("incomplete", "shutdown"), record
    assert run_info(store, live.run_id)["status"] == "incomplete (shut down)"
    # its handle says so (it raised AttributeError), and points to resume
    assert repr(live) == f"<RunHandle {live.run_id} closed>"
    said = rf"embedded cluster of run .* was closed.*vcdask\.resume\('{live.run_id}'"
    for ask in (live.status, live.done, live.result):
        with pytest.raises(RuntimeError, match=said):
            ask()
    with pytest.raises(RunNotFoundError, match="pass the scheduler it runs on"):
        vcdask.attach(live.run_id)  # (no embedded cluster up now)
    again = embedded_client()
    assert again is not client and again.status == "running" and again.scheduler.address != address
    assert embedded_client() is again


SCRIPT = """
import numpy as np
import torch
import vcdask

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (X[:, 0] > 0).astype("int64")
{call}
"""
FIT = (
    'result = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store="store", progress=False)\n'
    'print("merges", int(result.history["accepted"].sum()))'
)


def _script(tmp_path, call):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(call=call))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180, cwd=tmp_path)


def test_a_script_without_the_main_guard_is_refused_before_any_worker_starts(tmp_path):
    proc = _script(tmp_path, FIT)
    assert proc.returncode != 0
    assert "MainGuardError" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr and "Safe importing of main module" in proc.stderr
    assert f"{tmp_path / 'train.py'} (line 8)" in proc.stderr
    assert "Nanny failed to start" not in proc.stderr and proc.stderr.count("Traceback") == 1
    _assert_no_run_left(tmp_path / "store")  # the data was not staged for a cluster that would not start


def _assert_no_run_left(location):
    """Neither a branch nor a folder of a run that never started: nothing of it in the store."""
    store = vcdask.open_store(str(location))
    assert [b for b in store.branches() if b.startswith("run-")] == []
    assert store.files.list("") == [] and not list(location.glob("**/run-*"))


@pytest.mark.cluster
def test_a_run_whose_cluster_fails_to_start_leaves_nothing_in_the_store(tmp_path):
    """In-memory data staged while the embedded cluster starts (a branch, the data, the initial version) is
    deleted again when the cluster fails to start: here its workers do, on a worker preload of the user's
    Dask config that raises."""
    import dask.config

    broken = tmp_path / "broken_preload.py"
    broken.write_text("raise RuntimeError('this preload is broken')\n")
    close_embedded()  # (an embedded cluster started by an earlier test would be reused)
    X, y = _data()
    with dask.config.set({"distributed.worker.preload": [str(broken)]}):
        with pytest.raises(Exception, match="this preload is broken|failed to start"):
            vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store=tmp_path / "store", progress=False)
    assert running_embedded_client() is None  # nothing of the failed start left running
    _assert_no_run_left(tmp_path / "store")


@pytest.mark.cluster
@pytest.mark.slow
def test_a_script_with_the_main_guard_trains(tmp_path):
    proc = _script(tmp_path, 'if __name__ == "__main__":\n' + textwrap.indent(FIT, "    "))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["merges", "4"]  # 2 workers, 2 shards each


def test_guard_detection_reads_the_script(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(
        textwrap.dedent(
            """\
            import vcdask
            vcdask.fit(m, d)
            def main():
                vcdask.fit(m, d)
            if __name__ == "__main__":
                main()
            if "__main__" == __name__:
                x = 1
                main()
            if __name__ != "__main__":
                main()
            if __name__ == "__main__" and len(d) > 0:
                main()
            if __name__ in {"__main__", "__mp_main__"}:
                main()
            """
        )
    )
    assert [_guarded(str(path), line) for line in range(1, 16)] == [
        False, False, False, False, False, True, False, True, True, False, False, False, True, False, True,
    ]  # fmt: skip
    assert _guarded(str(tmp_path / "missing.py"), 1)  # unreadable: nothing claimed
    check_main_guard()  # under pytest: __main__'s top level is guarded (or not in the stack)
    check_main_guard(stacklevel=10_000)  # a stack shallower than stacklevel: no ValueError
