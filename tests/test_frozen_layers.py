"""Fine-tuning with frozen layers: a layer the user froze, in eval mode with its parameters frozen (a batch norm, a
feature extractor), trains in eval mode on the workers, in a resumed run too, whatever the model's own mode; its
running statistics do not move.  The workers set the whole model to train mode before every task, which updated
them.  A trainable layer in eval mode (a pretrained backbone's loader leaves it so) trains in train mode."""

from __future__ import annotations

import numpy as np
import torch

import vcdask
from vcdask.steps import eval_modules, train_mode


def _frozen_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)
    )
    with torch.no_grad():  # statistics of its own, as a pretrained layer has
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    model.train()
    model[1].eval()
    model[1].requires_grad_(False)
    return model


def test_a_frozen_batch_norm_keeps_its_statistics_through_fit_resume_and_predict(cluster, tmp_path):
    from vcdask.spec import load_spec

    rng = np.random.default_rng(4)
    X = (rng.normal(size=(200, 4)) * 3 + 5).astype("float32")  # far from the frozen statistics
    y = (X[:, 0] > 5).astype("int64")
    model = _frozen_model()
    frozen = {k: v.clone() for k, v in model[1].state_dict().items()}
    head = model[4].weight.clone()
    store = tmp_path / "store"
    first = vcdask.fit(model, (X, y), max_epochs=1, n_shards=2, client=cluster[1], store=store, progress=False)
    assert load_spec(first.store, first.run_id).eval_modules == ("1",)
    more = vcdask.resume(first.run_id, store=store, client=cluster[1], max_epochs=2, progress=False)
    assert len(more.epochs) == 2 and int(more.history["accepted"].sum()) == 2
    assert load_spec(more.store, more.run_id).eval_modules == ("1",)  # (the resumed run's spec keeps them)
    for result in (first, more):
        bn = result.model[1]
        assert all(torch.equal(bn.state_dict()[k], v) for k, v in frozen.items()), bn.state_dict()
        assert not torch.equal(result.model[4].weight, head)  # the rest trained
    assert [m.training for m in model] == [True, False, True, True, True]  # the model given is left as it was
    more.model.train()
    more.model[1].eval()
    more.predict(X[:5])
    assert [m.training for m in more.model] == [True, False, True, True, True]  # and predict restores each layer

    loaded = vcdask.load(more.store, version=more.version)  # in eval mode, its batch norm still frozen: kept so
    assert eval_modules(loaded) == ("1",)
    loaded.requires_grad_(True)  # every layer trainable: trains in train mode throughout
    again = vcdask.fit(loaded, (X, y), max_epochs=1, n_shards=2, client=cluster[1], store=store, progress=False)
    assert load_spec(again.store, again.run_id).eval_modules == ()
    assert not torch.equal(again.model[1].running_mean, frozen["running_mean"])
    assert int(again.model[1].num_batches_tracked) > 0


class _Backbone(torch.nn.Module):
    """A pretrained backbone as transformers' ``from_pretrained`` makes it: in eval mode from its constructor."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.dropout = torch.nn.Dropout(0.1)
        self.eval()

    def forward(self, x):
        return self.dropout(self.norm(self.linear(x)))


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = _Backbone()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def _modes(model):
    return {name: m.training for name, m in model.named_modules() if name}


def test_a_trainable_backbone_in_eval_mode_trains_in_train_mode_and_a_frozen_one_stays_in_eval_mode():
    """The backbone's eval mode (from its constructor) was kept for the whole run, its dropout off, silently,
    because the model holding it was in train mode: fine-tuning it trained another model than torch's would."""
    model = _Classifier()
    assert eval_modules(model) == ()  # trainable: train mode, as model.train() sets it
    assert all(_modes(train_mode(model, eval_modules(model))).values())
    model = _Classifier()
    model.backbone.requires_grad_(False)  # a frozen feature extractor: stays in eval mode, all of it
    assert eval_modules(model) == ("backbone",)  # (the topmost only)
    assert _modes(train_mode(model, eval_modules(model))) == {
        "backbone": False,
        "backbone.linear": False,
        "backbone.norm": False,
        "backbone.dropout": False,
        "head": True,
    }


def test_a_frozen_batch_norm_stays_in_eval_mode_whatever_the_models_own_mode():
    """``model.eval(); model[4].train()`` kept nothing in eval mode: only a model in train mode was read."""
    model = _frozen_model()
    model.eval()
    model[4].train()
    assert eval_modules(model) == ("1",)
    assert [m.training for m in train_mode(model, eval_modules(model))] == [True, False, True, True, True]
    trainable = _frozen_model()
    trainable[1].requires_grad_(True)  # in eval mode but trainable, a parameterless dropout in eval: train mode
    trainable[3].eval()
    assert eval_modules(trainable) == ()
    still = _frozen_model()
    still[1].train()  # frozen, but in train mode: its statistics move, as torch's would
    assert eval_modules(still) == ()


def test_a_batch_norm_without_parameters_is_kept_in_eval_mode_only_where_the_user_put_it_there():
    """A layer of buffers alone (``BatchNorm1d(affine=False)``) has no parameter to freeze: it stays in eval
    mode when the user put it there under a parent in train mode, and trains in train mode in a model wholly in
    eval mode (``vcdask.load``'s, ``model.eval()`` before ``fit``) or under a backbone that put itself there.
    (The frozen-parameters rule held vacuously for it: a loaded model's batch norm never moved again.)"""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, affine=False), torch.nn.Linear(8, 2))
    assert eval_modules(model.eval()) == ()
    model.train()
    model[1].eval()
    assert eval_modules(model) == ("1",)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, affine=False)).eval()
    assert eval_modules(torch.nn.Sequential(backbone, torch.nn.Linear(8, 2)).train().requires_grad_(True)) == ()
    before = model[1].running_mean.clone()
    train_mode(model.eval(), eval_modules(model.eval()))(torch.randn(16, 4))
    assert not torch.equal(model[1].running_mean, before)  # trained in train mode: its statistics move
