"""Which way a metric improves, read from its name: the one rule vcdask uses for a metric's direction (targets,
early stopping, ``best_version``, ``vcdask train`` releases, plots).  :mod:`vcdask.engine.policy` gives it under
its own names too (``policy.lower_is_better``), as the docs name it.
"""

from __future__ import annotations

import re

__all__ = [
    "HIGHER_IS_BETTER",
    "LOWER_IS_BETTER",
    "LOWER_IS_BETTER_WORDS",
    "NEGATED_ERRORS",
    "NEGATED_SCORERS",
    "QUALIFIERS",
    "known_direction",
    "lower_is_better",
]

#: Name endings of the metrics that improve downwards (a ``target`` is reached when the value is at most
#: the goal): ``loss``, ``val_loss``, ``logloss``, ``mse``, ``rmse``, ``mae``, ``error``, ``val_error``,
#: ``word_error_rate``, ``perplexity``, ``kl_divergence``, ``edit_distance``, ``poisson_deviance`` ...
LOWER_IS_BETTER = (
    *("loss", "mse", "mae", "rmse", "mape", "msle", "error", "error_rate", "perplexity", "divergence"),
    *("kl_div", "deviance", "distance", "brier_score", "regret", "neg_log_likelihood", "negative_log_likelihood"),
    *("neg_loglik", "neg_elbo", "negative_elbo"),  # (a negated likelihood or ELBO is a loss)
)
#: Short names that improve downwards, as a name's last word (``val_ppl``, ``test/wer``), not as its ending
#: (``power`` does not end in ``wer``): negative log-likelihood, perplexity, word / character / translation error
#: rates, bits per character / dimension / byte, Kullback-Leibler divergence, calibration error, Frechet
#: inception distance, equal error rate, Brier score, continuous ranked probability score, mean absolute scaled error.
LOWER_IS_BETTER_WORDS = frozenset(
    ("nll", "ppl", "wer", "cer", "ter", "bpc", "bpd", "bpb", "kl", "kld", "ece", "fid", "eer", "brier", "crps", "mase")
)
#: Name endings (and last words) of metrics known to improve upwards: their direction is not a guess
#: (:func:`known_direction`); every name vcdask does not know improves upwards too, but by default.
HIGHER_IS_BETTER = (
    *("accuracy", "score", "precision", "recall", "likelihood", "elbo", "reward", "similarity", "correlation"),
    *("kappa", "specificity", "sensitivity", "auroc", "acc", "auc", "f1", "r2", "iou", "miou", "dice", "bleu"),
    *("rouge", "rougel", "chrf", "meteor", "map", "auprc", "ndcg", "mrr", "mcc", "psnr", "ssim", "snr"),
    *("top1", "top5", "fbeta", "jaccard", "hit_rate", "explained_variance"),
)
#: scikit-learn's scorers that negate a loss (``get_scorer_names()``), as a name's ending (``test_neg_log_loss``):
#: upwards.  Only these: another ``neg`` reads as its other words do (``neg_f1``, the negative class's: upwards).
NEGATED_SCORERS = frozenset(
    f"neg_{n}"
    for n in "mean_squared_error root_mean_squared_error mean_absolute_error median_absolute_error max_error "
    "mean_absolute_percentage_error mean_squared_log_error root_mean_squared_log_error log_loss brier_score "
    "mean_poisson_deviance mean_gamma_deviance negative_likelihood_ratio".split()
)
#: Errors that a leading ``neg`` / ``negative`` negates (``neg_mse``, ``negative_mae``: upwards); a negated loss
#: stays a loss (``neg_loss``, ``neg_sampling_loss``: a contrastive loss of the negative samples; downwards), and
#: so does a negated likelihood.
NEGATED_ERRORS = ("mse", "rmse", "mae", "mape", "msle", "rmsle", "error", "error_rate")
#: Trailing words that qualify a metric without changing its direction (``loss/val``, ``val_loss_epoch``,
#: ``f1_macro``, ``loss_2``: numbers too).
QUALIFIERS = frozenset("val valid validation test eval train epoch step avg mean macro micro weighted".split())


def lower_is_better(name: str) -> bool:
    """Whether metric ``name`` improves downwards; the one rule vcdask uses for a metric's direction (targets,
    early stopping, ``best_version``, releases, plots).

    The name is read as words (split at anything but letters and digits; and again at camelCase, ``valPPL``), less
    trailing qualifiers (:data:`QUALIFIERS`: ``val``, ``epoch``, numbers ...); downwards when they end in one of
    :data:`LOWER_IS_BETTER` (``loss``, ``rmse``, ``error``, ``perplexity`` ...) or the last word (also without its
    number: ``mAP50``) is one of :data:`LOWER_IS_BETTER_WORDS` (``nll``, ``ppl`` ...), unless they end in one of
    :data:`NEGATED_SCORERS` (``neg_mean_squared_error``: upwards); downwards if either reading says so.

    An argument list at the end of the name is not part of its ending: a :func:`functools.partial` is named
    by its function and arguments (:func:`vcdask.metrics.metric_name`), and ``"scaled_error(scale=1.0)"`` or
    ``"l1_loss(reduction='mean')"`` improve downwards as their functions do.

    Examples
    --------
    >>> lower_is_better("val_loss"), lower_is_better("scaled_error(scale=1.0)"), lower_is_better("topk(k=3)")
    (True, True, False)
    >>> lower_is_better("val/ppl"), lower_is_better("power"), lower_is_better("neg_mean_squared_error")
    (True, False, False)
    >>> lower_is_better("neg_f1"), lower_is_better("neg_sampling_loss"), known_direction("val_mAP")
    (False, True, True)
    >>> lower_is_better("neg_mse"), lower_is_better("negative_rmse"), lower_is_better("neg_loglik")
    (False, False, True)
    """
    return _direction(name)[0]


def known_direction(name: str) -> bool:
    """Whether :func:`lower_is_better` knows metric ``name``'s direction from its name, rather than taking it as
    improving upwards for want of a known ending (``"loss"``, ``"accuracy"``, ``"f1_macro"``: known;
    ``"my_metric"``: not)."""
    return _direction(name)[1]


def _direction(name: str) -> tuple[bool, bool]:
    """``(lower is better, known)`` for metric ``name`` (:func:`lower_is_better`): read as written and split at
    camelCase (``"mAP"``: ``map``; ``m``, ``ap``); downwards if either reading says so, known if either tells it."""
    name = _function_name(name)
    reads = [_read(_words(n)) for n in (name, re.sub("(?<=[a-z0-9])(?=[A-Z])", "_", name))]
    return any(r[0] for r in reads), any(r[1] for r in reads)


def _read(words: list[str]) -> tuple[bool, bool]:
    """``(lower is better, known)`` for a metric name of ``words`` (lower case)."""
    while len(words) > 1 and (words[-1] in QUALIFIERS or words[-1].isdigit()):
        words = words[:-1]
    joined = "_".join(words)
    if any(joined == n or joined.endswith("_" + n) for n in NEGATED_SCORERS):
        return False, True
    lead = next((i for i, w in enumerate(words) if w not in QUALIFIERS), len(words))  # (val_neg_mse)
    if len(words) > lead + 1 and words[lead] in ("neg", "negative") and joined.endswith(NEGATED_ERRORS):
        return False, True  # (neg_mse, negative_rmse: an error negated, as scikit-learn's scorers negate theirs)
    lasts = {words[-1], words[-1].rstrip("0123456789")} if words else set()  # (``mAP50``: map50, map)
    lower = joined.endswith(LOWER_IS_BETTER) or bool(lasts & LOWER_IS_BETTER_WORDS)
    return lower, lower or joined.endswith(HIGHER_IS_BETTER) or bool(lasts & {"ap", *HIGHER_IS_BETTER})


def _words(name: str) -> list[str]:
    """``name``'s words, lower case: split at anything but a letter or digit (``"val/PPL"``: ``["val", "ppl"]``)."""
    return [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w]


def _function_name(name: str) -> str:
    """``name`` without an argument list at its end: ``"scaled_error(scale=1.0)"`` -> ``"scaled_error"``
    (from its first ``(``: a partial's arguments may hold parentheses, a function's name never does)."""
    if name.endswith(")") and "(" in name:
        return name[: name.index("(")].rstrip()
    return name
