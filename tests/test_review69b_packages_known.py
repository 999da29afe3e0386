"""The package check remembers what each machine answered: a second fit on the same cluster probes no machine
(one round trip to the scheduler for its roster), and a worker that joins later is probed, alone."""

from __future__ import annotations

import logging

import numpy as np
import torch
from distributed import Client, LocalCluster

import vcdask


class _Runs(logging.Handler):
    """The out-of-band functions the scheduler and the workers ran (distributed logs each by name)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "Run out-of-band function %r":
            self.names.append(record.args[0])  # type: ignore[index]

    def take(self, name: str) -> int:
        n = self.names.count(name)
        self.names.clear()
        return n


def test_a_second_fit_probes_no_machine_and_a_joining_worker_is_probed(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype("float32")
    data = (X, (X[:, 0] > 0).astype("int64"))
    logger = logging.getLogger("distributed.worker")  # (the scheduler runs its functions through the same code)
    runs, level = _Runs(), logger.level
    logger.addHandler(runs)
    logger.setLevel(logging.INFO)
    try:
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
            Client(cluster, set_as_default=False) as client,
        ):

            def fit(i: int) -> None:
                runs.names.clear()
                vcdask.fit(
                    torch.nn.Linear(4, 2), data, client=client, store=tmp_path / f"s{i}", max_epochs=1, progress=False
                )

            fit(1)
            assert runs.take("probe") >= 2  # both workers probed (the scheduler: with its roster, as its own call)
            fit(2)
            probes, rosters = runs.names.count("probe"), runs.take("roster")
            assert (probes, rosters) == (0, 1)  # no machine probed again: one round trip for the roster
            cluster.scale(3)
            client.wait_for_workers(3, timeout=60)
            fit(3)
            assert runs.take("probe") == 1  # the worker that joined, alone
    finally:
        logger.removeHandler(runs)
        logger.setLevel(level)


def test_only_answers_that_imported_both_packages_are_remembered():
    from vcdask._packages import NoAnswer, _Known

    known, good = _Known(), {"vcdask": vcdask.__version__, "torch": torch.__version__}
    known.remember("worker tcp://a:1", "Worker-1", good)
    assert known.get("worker tcp://a:1") == ("Worker-1", good)
    known.remember("worker tcp://a:1", "Worker-1", NoAnswer("no answer within 10 s"))  # asked again next time
    assert known.get("worker tcp://a:1") is None
    known.remember("worker tcp://b:1", "Worker-2", {**good, "torch": "missing: ImportError: libcudart.so.12"})
    known.remember("worker tcp://c:1", "Worker-3", RuntimeError("the probe broke"))
    assert known.get("worker tcp://b:1") is None and known.get("worker tcp://c:1") is None
