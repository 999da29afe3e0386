"""Embeddings with sparse gradients (``torch.nn.Embedding(sparse=True)``, ``EmbeddingBag``) with an optimizer or a
clipping that cannot take them are refused before any cluster work, naming the layer and the remedy (the default
Adam failed every task on the cluster: 'Adam does not support sparse gradients'; clip_grad_norm failed with
NotImplementedError 'aten::linalg_vector_norm' on 'SparseCPU'); SGD without clipping trains."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import refusal_helpers
import torch
from refusal_helpers import refused

from vcdask.optimizers import check_inner_optimizer, resolve_optimizer


class Bag(torch.nn.Module):
    def __init__(self, kind=torch.nn.Embedding, sparse=True, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = kind(20, 4, sparse=sparse)
        self.head = torch.nn.Linear(4, 20 if tied else 1)
        if tied:  # (the weight gets dense gradients: the head's added to the embedding's)
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        return self.head(h.mean(1) if h.dim() == 3 else h)[..., :1]


@pytest.fixture(autouse=True)
def _synchronous(monkeypatch):
    """The stand-in client answers vcdask.cluster.check_sync's question (a synchronous client) and fails on any
    other attribute, as before that check came."""
    monkeypatch.setattr(refusal_helpers.NoCluster, "asynchronous", False, raising=False)


@pytest.fixture
def ids_y():
    ids = np.random.default_rng(0).integers(0, 20, size=(64, 3)).astype("int64")
    return ids, (ids % 3 == 0).mean(1, keepdims=True).astype("float32")


def _check(model, optimizer=None, clip=None):
    make = resolve_optimizer(optimizer, 1e-3)
    check_inner_optimizer(make, model, given=optimizer, lr=1e-3, clip_grad_norm=clip)


def test_the_default_adam_with_a_sparse_embedding_is_refused_before_any_cluster_work(ids_y, tmp_path):
    refused(
        Bag(),
        ids_y,
        tmp_path,
        ValueError,
        "optimizer=Adam (the default) cannot step the sparse gradients of emb (Embedding(sparse=True))",
        "RuntimeError: Adam does not support sparse gradients",
        "pass sparse=False to the embedding",
        "optimizer=torch.optim.SGD",
    )


def test_fit_refuses_clipping_sparse_gradients_before_any_cluster_work(ids_y, tmp_path):
    """``fit(clip_grad_norm=)`` reaches the check (the plan passed none: an optimizer that takes sparse gradients,
    SGD, with clipping failed every task on the cluster)."""
    refused(
        Bag(),
        ids_y,
        tmp_path,
        ValueError,
        "clip_grad_norm=1.0 cannot clip the sparse gradients of emb (Embedding(sparse=True))",
        optimizer=torch.optim.SGD,
        clip_grad_norm=1.0,
    )


@pytest.mark.parametrize(
    ("optimizer", "error"),
    [
        (torch.optim.AdamW, "Adam does not support sparse gradients"),
        (torch.optim.SparseAdam, "SparseAdam does not support dense gradients"),  # (the head's)
        (functools.partial(torch.optim.SGD, weight_decay=0.01), "add(sparse, dense) is not supported"),
    ],
    ids=["AdamW", "SparseAdam", "SGD-weight-decay"],
)
def test_optimizers_that_cannot_step_sparse_gradients_are_refused(optimizer, error):
    with pytest.raises(ValueError, match="cannot step the sparse gradients of emb") as info:
        _check(Bag(torch.nn.EmbeddingBag), optimizer)
    assert error in str(info.value) and "EmbeddingBag(sparse=True)" in str(info.value)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad, None])
def test_clipping_sparse_gradients_is_refused_with_every_optimizer(optimizer):
    with pytest.raises(ValueError) as info:
        _check(Bag(), optimizer, clip=1.0)
    message = str(info.value)
    assert message.startswith("clip_grad_norm=1.0 cannot clip the sparse gradients of emb (Embedding(sparse=True))")
    assert "NotImplementedError: Could not run 'aten::linalg_vector_norm'" in message
    assert "backends:" not in message  # (torch's list of every backend left out)
    assert "pass sparse=False to the embedding" in message and "leave clip_grad_norm unset" in message


@pytest.mark.parametrize(
    ("model", "optimizer", "clip"),
    [
        (Bag(), torch.optim.SGD, None),
        (Bag(), functools.partial(torch.optim.SGD, momentum=0.9), None),
        (Bag(), torch.optim.Adagrad, None),
        (Bag(sparse=False), None, 1.0),
        (Bag(tied=True), None, 1.0),  # (tied to a dense layer: dense gradients)
    ],
    ids=["SGD", "SGD-momentum", "Adagrad", "dense-Adam-clip", "tied-Adam-clip"],
)
def test_what_takes_sparse_gradients_is_taken(model, optimizer, clip):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _check(model, optimizer, clip)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # (the copy stepped, not the model)
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_sparse_embedding_is_not_stepped():
    model = Bag()
    model.emb.requires_grad_(False)
    _check(model)  # (Adam: the frozen embedding gets no gradient)


def test_sgd_trains_a_sparse_embedding_as_plain_torch_does(ids_y, tmp_path):
    from distributed import Client, LocalCluster

    import vcdask

    model, initial = Bag(), Bag()
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        result = vcdask.fit(
            model,
            ids_y,
            client=client,
            store=tmp_path / "store",
            max_epochs=2,
            n_shards=2,
            progress=False,
            optimizer=torch.optim.SGD,
            lr=0.1,
        )
    X, y = map(torch.as_tensor, ids_y)
    with torch.no_grad():
        assert torch.nn.functional.mse_loss(result.model(X), y) < torch.nn.functional.mse_loss(initial(X), y)
