"""notebooks/*.ipynb run top to bottom in a fresh kernel, as a reader would run them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
EXPECTED = {"alpha-schedules", "char-lm", "fault-tolerance", "object-storage", "quickstart"}
#: Values that replace a notebook's ``parameters``-tagged cell in the test (papermill's convention): the
#: notebook runs every cell as a reader would, on a smaller run.  char-lm: its quality against torch is
#: checked by tests/test_examples.py on the same example code; here 1 epoch instead of 3 (about 50 s less),
#: on the first quarter of the training text (every cell after the parameters runs on ``X, Y`` as loaded).
#: The others: fewer epochs, still past every point their cells wait for (fault-tolerance kills a worker
#: after epoch 3 and gives a notice after epoch 5; object-storage kills its job once it has 10 versions,
#: about an epoch, and the resumed run has two more to go).  Their cells run the same code at any epoch
#: count; a run's cost here is mostly its fixed start (kernel, cluster, job process), ~1 s an epoch beyond.
PARAMETERS = {
    "char-lm": "EPOCHS, SHARDS = 1, 8\nX, Y = X[: len(X) // 4], Y[: len(Y) // 4]",
    "alpha-schedules": "EPOCHS = 2",
    "object-storage": "EPOCHS, JOB_EPOCHS, KILLED_AFTER, MORE_EPOCHS = 2, 3, 1, 1",
    "fault-tolerance": "EPOCHS, SHARDS = 7, 10",
    "quickstart": "EPOCHS = 5",
}


def test_every_notebook_is_collected_and_saved_clean():
    """The notebooks exist, name the python3 kernel, and are saved without outputs."""
    assert {p.stem for p in NOTEBOOKS} == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3", path.name
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code, path.name
        dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
        assert not dirty, f"{path.name}: code cells {dirty} were saved with outputs"


def _this_python_kernel():
    """A KernelManager for the python3 kernel that runs this interpreter (the venv's), whatever kernelspecs
    the machine has installed elsewhere (a user-level python3 spec would otherwise win)."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = super().get_kernel_spec(kernel_name)
            spec.argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return spec

    return KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())


def _shut_down(client, km, grace: float = 5.0, wait: float = 60.0) -> list[str]:
    """Shut the kernel down, as a reader closing the notebook does: nbclient leaves a kernel it was given
    running (and with it what the notebook started, such as fit's embedded cluster) for the rest of the
    session.  The kernel is asked to exit, with Jupyter's ``grace`` (jupyter_client's, Jupyter Server's and
    nbclient's ``shutdown_wait_time``, 5 s) before it is terminated; the processes it started that are still
    running ``wait`` seconds later (killed), by command line and pid.

    ipykernel answers the request by terminating its child processes (the multiprocessing forkserver and
    resource tracker, and the worker processes forked from the forkserver) and polls until none is left; it
    does not reap them, so their zombies keep it polling ~29 s (ipykernel 7.4), and a longer grace only waits
    for that.  Within 5 s its children are gone or, once the kernel is gone, see their pipes close and exit."""
    import psutil

    kernel = psutil.Process(km.provisioner.process.pid) if km.has_kernel else None
    started = kernel.children(recursive=True) if kernel is not None else []
    if client.kc is not None:
        client.kc.stop_channels()
    km.shutdown_wait_time = grace
    km.shutdown_kernel(now=False)
    _, alive = psutil.wait_procs(started, timeout=wait)
    left = []
    for p in alive:  # (not left to the rest of the session, whatever the test says)
        try:
            left.append(f"{' '.join(p.cmdline()[:3])} ({p.pid})")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    """Execute every cell in a fresh python3 kernel, working directory tmp_path (where the runs put their
    stores); a cell that raises fails the test with its traceback."""
    nb = nbformat.read(path, as_version=4)
    if path.stem in PARAMETERS:
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: one cell must be tagged 'parameters'"
        nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(PARAMETERS[path.stem]))
    km = _this_python_kernel()
    client = nbclient.NotebookClient(
        nb, km=km, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        left = _shut_down(client, km)
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    assert not left, f"{path.name}: processes still running after its kernel was shut down: {left}"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code"), "a code cell did not run"
    assert any(tmp_path.iterdir()), "the notebook wrote nothing to its working directory"
