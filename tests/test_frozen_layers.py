"""Fine-tuning with frozen batch-norm layers: a model in train mode whose batch norm the user put in eval mode (and
froze) trains with that layer in eval mode on the workers, in a resumed run too; its running statistics do not
move.  The workers set the whole model to train mode before every task, which updated them."""

from __future__ import annotations

import numpy as np
import torch

import vcdask


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

    loaded = vcdask.load(more.store, version=more.version)  # wholly in eval mode: trains in train mode throughout
    again = vcdask.fit(loaded, (X, y), max_epochs=1, n_shards=2, client=cluster[1], store=store, progress=False)
    assert load_spec(again.store, again.run_id).eval_modules == ()
    assert not torch.equal(again.model[1].running_mean, frozen["running_mean"])
    assert int(again.model[1].num_batches_tracked) > 0
