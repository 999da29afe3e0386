"""FitResult.predict / predict_proba from several threads at once (a threaded model server): each call gives
the single-threaded answer, and the model keeps its modes and its batch norm statistics."""

from __future__ import annotations

import threading

import numpy as np
import torch

import vcdask


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(64, 2),
    )


def test_predictions_from_several_threads_match_and_leave_the_model_as_it_was(tmp_path):
    from distributed import Client, LocalCluster

    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 8)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        result = vcdask.fit(
            _model(), (X, y), client=client, store=tmp_path / "store", max_epochs=1, n_shards=1, progress=False
        )
    model = result.model
    model.train()
    model[3].eval()  # modes the caller chose, mixed: each is what it was after every prediction
    modes = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = result.predict_proba(X)
    ref_labels = result.predict(X)

    start = threading.Barrier(3)
    wrong: list[int] = []

    def serve(labels: bool) -> None:
        start.wait()
        for _ in range(60):
            if labels:
                ok = np.array_equal(result.predict(X, batch_size=32), ref_labels)
            else:
                ok = np.allclose(result.predict_proba(X, batch_size=32), ref, rtol=1e-5, atol=1e-6)
            wrong.append(0 if ok else 1)

    threads = [threading.Thread(target=serve, args=(i == 2,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(wrong) == 180 and sum(wrong) == 0  # every answer is the single-threaded one
    assert [m.training for m in model.modules()] == modes  # the caller's modes, train and eval, kept
    for name, value in model.state_dict().items():  # batch norm's running statistics untouched
        assert torch.equal(value, state[name]), name
