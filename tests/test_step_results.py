"""What a run with a custom step gives back: ``predict`` of a ``train_step`` trained on integer labels that are not
class ids (a count regression) gave class ids read from one output (all 1), and a custom metric's direction, read
from its name, took ``perplexity`` as higher-is-better (a target reached at the first epoch, patience keeping the
worst epoch).  The predict path and the one rule of direction are called directly; a few real fits on a threaded
cluster."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from spec_helpers import predict_spec

import vcdask
from vcdask._targets import check_target
from vcdask.engine import policy
from vcdask.engine.events import EventLog
from vcdask.engine.ledger import Ledger
from vcdask.predict import predicted, probabilities


def _step(model, batch):  # (a train_step: the fake specs below only need one)
    return model(batch[0]).sum()


def _spec(**fields):
    """The fields of a RunSpec that predict reads: a run with a train_step on integer labels."""
    return predict_spec(**{"train_step": _step, **fields})


@pytest.mark.parametrize(
    ("out_shape", "label_shape"),
    [((6, 1), ()), ((6,), ()), ((6, 3), (3,)), ((6, 1), (1,))],
    ids=["one-output", "flat-output", "multi-target", "column-labels"],
)
def test_outputs_that_are_not_class_scores_of_a_train_steps_integer_labels_are_refused(out_shape, label_shape):
    """One output against integer counts (predict said 1 for every row), several integer targets (1 for each)."""
    out = torch.randn(out_shape, generator=torch.Generator().manual_seed(0))
    spec = _spec(label_shape=label_shape)
    for read in (predicted, probabilities):
        with pytest.raises(TypeError, match="not scores per class") as caught:
            read(out, spec)
        message = str(caught.value)
        assert "train_step on integer labels" in message and "result.model" in message
        assert "float labels" in message


def test_a_train_steps_class_scores_still_give_class_ids_and_probabilities():
    generator = torch.Generator().manual_seed(0)
    out = torch.randn(6, 3, generator=generator)  # scores per class against labels (n,)
    np.testing.assert_array_equal(predicted(out, _spec()), out.argmax(1).numpy())
    np.testing.assert_allclose(probabilities(out, _spec()).sum(1), 1.0, rtol=1e-6)
    tokens = torch.randn(2, 5, 7, generator=generator)  # a language model: (n, T, V) against (n, T)
    np.testing.assert_array_equal(predicted(tokens, _spec(label_shape=(5,))), tokens.argmax(-1).numpy())


def test_a_spec_that_records_its_labels_range_needs_a_column_beyond_the_largest_id():
    """Two outputs (a count's mean and dispersion) against counts up to 9: not two classes."""
    out = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="class ids up to 9"):
        predicted(out, _spec(label_range=(0, 9)))
    np.testing.assert_array_equal(predicted(out, _spec(label_range=(0, 1))), out.argmax(1).numpy())


def test_the_default_steps_one_logit_classifier_is_unchanged():
    """Without a train_step the pre-flight checked the outputs against the labels: predict reads them as before."""
    logits = torch.tensor([[2.0], [-1.0]])
    spec = _spec(train_step=None, classification=False, loss=F.binary_cross_entropy_with_logits)
    np.testing.assert_array_equal(predicted(logits, spec), [1, 0])


def _logit_spec(label_shape=(), label_range=(0, 1)):
    return _spec(label_shape=label_shape, label_range=label_range, loss=F.binary_cross_entropy_with_logits)


def test_a_train_steps_logits_for_labels_of_0_and_1_are_read_as_the_default_steps_are():
    """A binary classifier of one logit (BCE with logits on 0/1 integers) and a multi-label one (one logit per
    label) were refused as "not scores per class": they predict class 1 where the logit is above 0, as the default
    step's one-logit classifier does, and their probabilities are the sigmoid's ([1 - p, p] for one logit)."""
    generator = torch.Generator().manual_seed(0)
    for out, labels in [(torch.randn(6, 1, generator=generator), ()), (torch.randn(6, 2, generator=generator), (2,))]:
        default = _spec(train_step=None, classification=False, loss=F.binary_cross_entropy_with_logits)
        default.label_shape = labels  # (the default step's run of one logit per label, on float labels)
        for label_range in [(0, 1), (0, 0)]:
            spec = _logit_spec(labels, label_range)
            ids = predicted(out, spec)
            assert ids.dtype == np.int64 and ids.shape == (6, *labels)
            np.testing.assert_array_equal(ids, (out > 0).long().reshape(6, *labels).numpy())
            np.testing.assert_array_equal(ids, predicted(out, default))
            np.testing.assert_allclose(probabilities(out, spec), probabilities(out, default), rtol=1e-6)
    p = torch.sigmoid(out[:, 0])  # (one logit: two columns, as scikit-learn's predict_proba)
    np.testing.assert_allclose(probabilities(out[:, :1], _logit_spec()), torch.stack([1 - p, p], 1).numpy(), 1e-6)
    np.testing.assert_allclose(probabilities(out, _logit_spec((2,))), torch.sigmoid(out).numpy(), rtol=1e-6)


@pytest.mark.parametrize("label_range", [(0, 3), (-1, 1), None], ids=["counts", "signs", "unrecorded"])
def test_one_output_per_label_beyond_0_and_1_is_still_refused(label_range):
    """A count regression (one output against counts up to 3) is no classifier of logits."""
    for shape, labels in [((6, 1), ()), ((6,), ()), ((6, 2), (2,))]:
        out = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        for read in (predicted, probabilities):
            with pytest.raises(TypeError, match="not scores per class"):
                read(out, _logit_spec(labels, label_range))


def _counts(n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    X = generator.normal(size=(n, 5)).astype("float32")
    return X, generator.poisson(np.exp(0.5 * X[:, 0] + 1.0))


def _poisson_step_of_two(model, batch):
    x, y = batch
    out = model(x)
    return F.poisson_nll_loss(out[:, 0], y.float(), log_input=True) + out[:, 1].pow(2).mean()


def _poisson_step(model, batch):
    x, y = batch
    return F.poisson_nll_loss(model(x).squeeze(-1), y.float(), log_input=True)


def test_predict_of_a_count_regression_on_integer_labels_says_to_call_the_model(threaded_client, tmp_path):
    """The reviewer's run: predict gave [1 1 1 ...] and predict_proba [[1.], ...]."""
    X, counts = _counts()
    torch.manual_seed(0)
    result = vcdask.fit(
        torch.nn.Linear(5, 1),
        (X, counts),
        train_step=_poisson_step,
        client=threaded_client,
        store=tmp_path / "s",
        max_epochs=1,
        progress=False,
    )
    with pytest.raises(TypeError, match="not scores per class"):
        result.predict(X[:4])
    with pytest.raises(TypeError, match="not scores per class"):
        result.predict_proba(X[:4])
    # two outputs (a mean and a dispersion) against counts up to their largest: the spec's label range says so
    two = vcdask.fit(
        torch.nn.Linear(5, 2),
        (X, counts),
        train_step=_poisson_step_of_two,
        client=threaded_client,
        store=tmp_path / "two",
        max_epochs=1,
        progress=False,
    )
    with pytest.raises(TypeError, match=f"class ids up to {counts.max()}"):
        two.predict(X[:4])
    # the remedy the message gives: float labels, and predict returns the model's outputs
    result = vcdask.fit(
        torch.nn.Linear(5, 1),
        (X, counts.astype("float32")),
        train_step=_poisson_step,
        client=threaded_client,
        store=tmp_path / "t",
        max_epochs=1,
        progress=False,
    )
    with torch.no_grad():
        expected = result.model(torch.as_tensor(X[:4])).numpy()
    np.testing.assert_allclose(result.predict(X[:4]), expected, rtol=1e-6)


def _bce_step(model, batch):
    x, y = batch
    return F.binary_cross_entropy_with_logits(model(x).reshape(y.shape), y.float())


@pytest.mark.parametrize("outputs", [1, 2], ids=["one-logit", "multi-label"])
def test_predict_of_a_train_steps_classifier_of_logits_on_0_1_labels(threaded_client, tmp_path, outputs):
    """The reviewer's runs: refused with TypeError (before: accuracy 0.965 and 0.963)."""
    X = np.random.default_rng(0).normal(size=(256, 5)).astype("float32")
    y = (X[:, :2] > 0).astype("int64") if outputs == 2 else (X[:, 0] > 0).astype("int64")
    torch.manual_seed(0)
    common = {"client": threaded_client, "store": tmp_path / "s", "max_epochs": 3, "lr": 0.1, "progress": False}
    result = vcdask.fit(torch.nn.Linear(5, outputs), (X, y), train_step=_bce_step, **common)
    ids, proba = result.predict(X), result.predict_proba(X)
    assert ids.shape == y.shape and ids.dtype == np.int64 and (ids == y).mean() > 0.9
    assert proba.shape == (256, 2)  # (one logit: P(0), P(1); two labels: P(1) of each)
    if outputs == 1:
        np.testing.assert_allclose(proba.sum(1), 1.0, rtol=1e-6)
        np.testing.assert_array_equal(ids, (proba[:, 1] > 0.5).astype("int64"))
    else:
        np.testing.assert_array_equal(ids, (proba > 0.5).astype("int64"))


@pytest.mark.parametrize(
    ("name", "lower"),
    [
        ("perplexity", True),
        ("val_perplexity", True),
        ("ppl", True),
        ("val/ppl", True),
        ("valPPL", True),
        ("nll", True),
        ("test_wer", True),
        ("cer", True),
        ("bpc", True),
        ("kl", True),
        ("kl_div", True),
        ("kl_divergence", True),
        ("word_error_rate", True),
        ("edit_distance", True),
        ("loss/val", True),
        ("val_loss_epoch", True),
        ("loss_2", True),
        ("MeanSquaredError", True),
        ("neg_log_likelihood", True),
        ("brier_score", True),
        ("power", False),  # "wer" is a word, not an ending
        ("answer_match", False),
        ("neg_mean_squared_error", False),  # scikit-learn's scorers: negated, to maximise
        ("log_likelihood", False),
        ("f1_macro", False),
        ("bleu", False),
    ],
)
def test_the_common_lower_is_better_names_improve_downwards(name, lower):
    assert policy.lower_is_better(name) is lower
    assert policy.known_direction(name) or name in ("power", "answer_match")
    assert policy.improved(name, 0.4, 0.5) is lower and policy.reached(name, 0.5, 0.4) is lower


@pytest.mark.parametrize(
    ("name", "lower"),
    [
        *((n, False) for n in ("neg_f1", "neg_precision", "neg_recall", "neg_accuracy", "neg_auc", "negative_recall")),
        ("neg_loss", True),  # a contrastive loss on negative samples
        ("neg_sampling_loss", True),
        ("negative_log_likelihood", True),  # a negated likelihood is a loss
        ("NegLogLikelihood", True),
        ("neg_elbo", True),
        *((n, False) for n in sorted(policy.NEGATED_SCORERS)),  # scikit-learn's, to maximise
        ("test_neg_mean_squared_error", False),  # (as cross_validate reports it)
        ("train_neg_log_loss", False),
        # an error negated by its user, short: upwards (as at 9b6c936); a loss negated stays a loss
        *((n, False) for n in ("neg_mse", "neg_rmse", "neg_mae", "negative_mse", "Negative_MSE", "val_neg_mse")),
        ("neg_error_rate", False),
        ("negative_loss", True),
        ("neg_loglik", True),
    ],
)
def test_neg_turns_round_only_scikit_learns_negated_losses(name, lower):
    """``neg`` flipped every known name: ``neg_f1`` (the negative class's F1) improved downwards, so
    target={"neg_f1": 0.95} was reached at 0.949, and ``neg_loss`` upwards."""
    assert policy.lower_is_better(name) is lower and policy.known_direction(name)
    assert policy.reached(name, 0.95, 0.949) is lower


def test_negated_scorers_are_scikit_learns():
    metrics = pytest.importorskip("sklearn.metrics")
    assert {n for n in metrics.get_scorer_names() if n.startswith("neg_")} <= policy.NEGATED_SCORERS


@pytest.mark.parametrize("name", ["mAP", "val_mAP", "mAP50", "mIoU", "val_mIoU", "rougeL", "rouge1", "F1Score"])
def test_camel_case_names_of_known_metrics_are_known(name, recwarn):
    """Split at camelCase only, ``mAP`` was ``m``, ``ap`` and ``mIoU`` ``m``, ``io``, ``u``: a target was warned of."""
    assert policy.known_direction(name) and not policy.lower_is_better(name)
    check_target({name: 0.5}, [name], {})
    assert not recwarn.list


def test_patience_on_perplexity_keeps_its_lowest_epoch():
    """The reviewer's run: perplexity 8.5, 6.2, 4.2 stopped at epoch 2 with epoch 1 as the best."""
    events = EventLog(types.SimpleNamespace(log_event=lambda *_: None), "r")
    ledger = Ledger(1, 6, validated=True, target={"perplexity": 2.0}, events=events, patience=1, monitor="perplexity")
    stop = None
    for epoch, value in enumerate([8.5, 6.2, 4.2, 2.9, 3.1], start=1):
        ledger.record(epoch, 0, 0, "merged", accepted=True, train_loss=1.0, new_version=epoch)
        ledger.note_merged(epoch, 0, seconds=1.0, step=epoch)
        ledger.validate(epoch, {"perplexity": value})
        stop = ledger.close_epochs()
        if stop is not None:
            break
    assert epoch == 5 and stop.startswith("early stopping: perplexity has not improved for 1 epochs")
    assert ledger.best["epoch"] == 4 and ledger.best["value"] == 2.9


def test_a_target_on_a_name_of_unknown_direction_is_warned_of():
    with pytest.warns(UserWarning, match="cannot tell from the name 'my_metric' which way it improves") as record:
        assert check_target({"my_metric": 2.0}, ["my_metric"], {}) == {"my_metric": 2.0}
    message = str(record[0].message)
    assert "is reached once my_metric is at least 2" in message and "'my_metric_loss'" in message


@pytest.mark.parametrize("name", ["perplexity", "accuracy", "val_f1", "top1_error", "loss"])
def test_a_target_on_a_name_of_known_direction_is_not_warned_of(name, recwarn):
    check_target({name: 0.5}, [name], {})
    check_target({"my_metric": 0.5})  # (Stopping's check of the form alone: the pre-flight warns, once)
    assert not recwarn.list


def _digits_like(n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    X = np.random.default_rng(0).normal(size=(n, 6)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0).astype("int64")


def _ce_step(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _perplexity_step(model, batch):
    loss = F.cross_entropy(model(batch[0]), batch[1])
    return {"perplexity": torch.exp(loss), "spread": loss * 0 + 1.0}


def test_a_perplexity_target_is_not_reached_at_a_higher_perplexity(threaded_client, tmp_path):
    """target={"perplexity": 1e-6} was "reached" at the first epoch (perplexity about 3 >= 1e-6)."""
    result = vcdask.fit(
        torch.nn.Linear(6, 3),
        _digits_like(),
        train_step=_ce_step,
        eval_step=_perplexity_step,
        target={"perplexity": 1e-6},
        validation=0.25,
        client=threaded_client,
        store=tmp_path / "s",
        max_epochs=2,
        progress=False,
    )
    assert list(result.epochs.index) == [1, 2] and not (result.stop_reason or "").startswith("target")


def test_a_target_on_an_eval_steps_name_of_unknown_direction_is_said_at_the_fit_call(threaded_client, tmp_path):
    with pytest.warns(UserWarning, match="cannot tell from the name 'spread'") as record:
        vcdask.fit(
            torch.nn.Linear(6, 3),
            _digits_like(),
            train_step=_ce_step,
            eval_step=_perplexity_step,
            target={"spread": 5.0},
            validation=0.25,
            client=threaded_client,
            store=tmp_path / "s",
            max_epochs=1,
            progress=False,
        )
    assert record[0].filename == __file__


def test_a_monitor_of_unknown_direction_is_warned_of_once_named_or_followed_by_patience(tmp_path, recwarn):
    """``monitor=`` (or the default one that ``patience`` follows) keeps its highest value when its name does not
    say which way it improves; a monitor that is also the target's is warned of once, by the target."""
    from vcdask.options import plan

    def _plan(name, **stopping):
        common = {"train_step": _ce_step, "eval_step": _perplexity_step, "validation": 0.25}
        model, data = torch.nn.Linear(6, 3), _digits_like()
        return plan(model, data, store=tmp_path / name, stopping=vcdask.Stopping(**stopping), **common)

    with pytest.warns(UserWarning, match=r"monitor='spread' \(early stopping and best_version\)"):
        _plan("a", monitor="spread")
    with pytest.warns(UserWarning, match="cannot tell from the name 'spread'") as record:
        _plan("b", monitor="spread", target={"spread": 5.0})
    assert len(record) == 1
    recwarn.clear()
    _plan("c", monitor="perplexity", patience=2)
    _plan("d")  # (the default monitor, perplexity here, followed by nothing but best_version)
    assert not [w for w in recwarn if "cannot tell" in str(w.message)]
