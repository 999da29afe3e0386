"""A run without validation says so, and warns when its training loss diverged (vcdask.diagnose; issue 40)."""

from __future__ import annotations

import gc
import warnings

import pandas as pd
import pytest

import vcdask
from vcdask.demo import digits_cnn
from vcdask.diagnose import NOT_VALIDATED, SKIPS_LISTED, divergence, given_up


def _history(rows):
    cols = ["base_version", "first_loss", "accepted", "reason"]
    frame = pd.DataFrame([dict(zip(cols, r, strict=True)) for r in rows])
    if len(frame):
        frame["outcome"] = frame["accepted"].map({True: "merged", False: "rejected"})
    return frame


def _epochs(losses):
    return pd.DataFrame({"epoch": range(1, len(losses) + 1), "train_loss": losses}).set_index("epoch")


def test_divergence_from_the_initial_loss_and_from_non_finite_updates():
    start = [(0, 2.3, True, None), (0, 2.31, True, None), (1, 40.0, True, None)]  # 2 tasks from the start
    assert divergence(_history(start), _epochs([1.2, 0.8])) is None  # learned
    assert divergence(_history(start), _epochs([2.5, 6.0])) is None  # within 3x of 2.3
    message = divergence(_history(start), _epochs([504.0, 310.0]))
    assert "rose from 2.305" in message and "to 310 (epoch 2's mean)" in message and "learning rate" in message
    nan = [(0, 2.3, False, "non-finite values (NaN/inf) in ['w']")] * 3 + [(0, 2.3, True, None)]
    assert "3 updates came back non-finite" in divergence(_history(nan), _epochs([2.0]))
    # a shard given up for its NaNs: its "skipped" rows name the same failures and are not counted again
    one_shard = _history(nan[:2] + [(0, 2.3, True, None)] * 3)  # 2 rejected, 3 merged
    gave_up = {"reason": "skipped: shard 3 is given up: its updates were non-finite (NaN/inf) on 2 workers"}
    one_shard = pd.concat([one_shard, pd.DataFrame([{**gave_up, "accepted": False, "outcome": "skipped"}])])
    assert divergence(one_shard, _epochs([2.0])) is None
    assert divergence(_history([]), _epochs([])) is None


def test_the_shards_a_run_gave_up_are_named():
    rows = [{"epoch": e, "shard": 3, "outcome": o, "accepted": False} for e in (1, 2) for o in ("rejected", "skipped")]
    # a copy of shard 0 was being merged when it was given up: it counts merged, as the epoch's row says
    late = [{"epoch": 1, "shard": 0, "outcome": o, "accepted": o == "merged"} for o in ("skipped", "merged")]
    assert given_up(pd.DataFrame(rows + late)) == given_up(pd.DataFrame(rows))
    note = given_up(pd.DataFrame(rows))
    assert note.startswith("2 shard(s) given up (on_shard_failure='skip'): shard 3 of epoch 1, shard 3 of epoch 2;")
    many = pd.DataFrame(
        [{"epoch": e, "shard": 0, "outcome": "skipped", "accepted": False} for e in range(1, SKIPS_LISTED + 3)]
    )
    assert f"shard 0 of epoch {SKIPS_LISTED}; " not in given_up(many) and "and 2 more;" in given_up(many)
    assert given_up(pd.DataFrame(rows[:1])) is None and given_up(_history([])) is None
    # a resumed run: epoch 1's skip was an earlier session's (its row counts it; this history does not)
    epochs = pd.DataFrame({"epoch": [1, 2], "skipped": [1, 1]}).set_index("epoch")
    note = given_up(pd.DataFrame(rows[2:]), epochs)
    assert note.startswith(
        "2 shard(s) given up (on_shard_failure='skip'): shard 3 of epoch 2, 1 in an earlier session;"
    )
    assert given_up(_history([]), epochs).startswith("2 shard(s) given up (on_shard_failure='skip'): 2 in an earlier")


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_run_without_validation_says_so_and_warns_when_it_diverged(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    kw = {"max_epochs": 2, "n_shards": 4, "client": client, "progress": False}
    fine = vcdask.fit(digits_cnn(0), (X, y), store=tmp_path / "a", **kw)  # no warning (an error here)
    assert fine.metrics == {} and fine.notes == [NOT_VALIDATED]
    assert "not validated>" in repr(fine) and "nothing checked the model" in fine._repr_html_()
    with pytest.warns(RuntimeWarning, match=r"the training loss rose from .* the training diverged; lower") as seen:
        wild = vcdask.fit(digits_cnn(0), (X, y), lr=10, store=tmp_path / "b", **kw)
    assert [w.filename for w in seen] == [__file__]  # the user's line, not vcdask's
    assert wild.notes[0] == NOT_VALIDATED and wild.notes[1].startswith("diverged: ")
    assert repr(wild).endswith("; not validated; diverged>")
    gc.collect()  # earlier tests' unclosed sockets and loops are theirs: not reported from inside the block below
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked = vcdask.fit(digits_cnn(0), (X, y), lr=10, validation=0.1, store=tmp_path / "c", **kw)
    assert checked.notes == [] and "accuracy" in checked.metrics  # validated: the metric shows it
