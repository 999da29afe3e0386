"""The parameter server of a run (vcdask.engine.params_server.ParamsServer) on a real store."""

from __future__ import annotations

import pytest
import torch

from vcdask import open_store
from vcdask.engine.params_server import ParamsServer as ServerState
from vcdask.errors import StoreConflict
from vcdask.merge import VCASGD
from vcdask.params import flatten
from vcdask.schedules import Constant
from vcdask.updates import update_path, write_update


def _state(tmp_path, **kw):
    store = open_store(tmp_path / "s")
    store.create_branch("run-x")
    store.commit(flatten({"w": torch.zeros(4)}), {"run_id": "run-x", "step": 0, "merged": []}, branch="run-x")
    state = ServerState(store, "run-x", VCASGD(alpha=Constant(0.5)), "run-x", **kw)
    state.load()
    return store, state


def _upload(store, shard, value, base_step=0):
    path = update_path("run-x", 1, shard, 0)
    write_update(store.files, path, flatten({"w": torch.full((4,), float(value))}))
    return {"epoch": 1, "shard": shard, "attempt": 0, "base_step": base_step, "update": path}


def test_merge_commits_with_metadata_and_drops_the_upload(tmp_path):
    store, state = _state(tmp_path)
    out = state.merge(_upload(store, 0, 2.0))
    assert out == {"accepted": True, "alpha": 0.5, "new_version": 1, "staleness": 0, "version_id": state.version}
    head = store.read(branch="run-x")
    assert head.state_dict()["w"].tolist() == [1.0] * 4
    assert head.metadata == {
        "run_id": "run-x",
        "step": 1,
        "epoch": 1,
        "merged": [[1, 0, 0]],
        "alpha": 0.5,
        "merge": {"name": "vc-asgd", "alpha": 0.5},
        "progress": {"done": [], "open": [[1, 0, 0]], "skipped": []},  # what a resume needs, whatever versions are kept
    }
    assert store.files.list("run-x/updates") == []


def test_merges_with_results_queued_behind_them_share_one_commit(tmp_path):
    """``commit_every="auto"``: while more results wait (``more=True``) the commit is left to the last of
    them, up to FOLD_MAX merges in one version; every merge is in the version's ``merged`` list and its
    upload kept until then.  The default (``commit_every=1``) commits every merge, queue or not."""
    from vcdask.engine.params_server import FOLD_MAX

    store, state = _state(tmp_path / "every")
    assert state.merge(_upload(store, 0, 1.0), more=True)["version_id"] == state.version is not None
    store, state = _state(tmp_path, commit_every="auto")
    outs = [state.merge(_upload(store, shard, shard), more=True) for shard in range(3)]
    assert [o["new_version"] for o in outs] == [1, 2, 3] and all(o["version_id"] is None for o in outs)
    assert state.folded and not state.committed and len(store.files.list("run-x/updates")) == 3
    last = state.merge(_upload(store, 3, 3.0))  # nothing more queued: one commit for the four
    assert last["version_id"] == state.version and not state.folded
    assert store.read(branch="run-x").metadata["merged"] == [[1, s, 0] for s in range(4)]
    assert len(store.versions("run-x")) == 2 and store.files.list("run-x/updates") == []
    outs = [state.merge(_upload(store, 10 + i, 1.0), more=True) for i in range(FOLD_MAX + 1)]
    assert [o["version_id"] is not None for o in outs] == [False] * (FOLD_MAX - 1) + [True, False]  # bounded
    assert state.merge(_upload(store, 99, 1.0), completes=True, more=True)["version_id"] == state.version


def test_commit_whose_answer_was_lost_is_adopted_not_repeated(tmp_path):
    """The store took the commit but its answer never came back: the retry sees a conflict, finds
    its own commit at the head, and adopts it — one version, not two."""
    store, state = _state(tmp_path, commit_every=2)
    state.merge(_upload(store, 0, 2.0))
    state.merge(_upload(store, 1, 4.0))  # commit_every=2: this one commits
    before = store.versions("run-x")
    assert len(before) == 2
    state.merge(_upload(store, 2, 6.0))  # merged, not yet committed
    pending = state.uncommitted[-1]
    # What the store received from the first attempt whose answer was lost:
    landed = store.commit(
        state.params,
        {
            "run_id": "run-x",
            "step": state.step,
            "epoch": 1,
            "merged": [[1, 2, 0]],
            "alpha": 0.5,
            "merge": {"name": "vc-asgd", "alpha": 0.5},
        },
        branch="run-x",
        parent=state.version,
        message="run-x step 3",
    )
    state.commit()
    assert state.version == landed
    history = store.versions("run-x")
    assert [v.metadata["step"] for v in history] == [3, 2, 0]
    assert not store.files.exists(pending["update"])


def test_a_foreign_commit_on_the_branch_is_a_conflict(tmp_path):
    store, state = _state(tmp_path, commit_every=5)
    state.merge(_upload(store, 0, 2.0))
    store.commit({"w": torch.ones(4)}, {"run_id": "someone-else", "step": 1, "merged": []}, branch="run-x")
    with pytest.raises(StoreConflict, match=r"run run-x: .*Another driver is writing this run.*vcdask\.attach"):
        state.commit()  # (the run's error says what likely happened, beside the store's own words)
    assert state.uncommitted, "nothing is dropped: the merge is still pending"


@pytest.mark.parametrize(("bad", "exc"), [(0, ValueError), ("often", ValueError), (1.5, TypeError), (True, TypeError)])
def test_commit_every_names_the_bad_value_and_what_is_allowed(bad, exc, digits_data):
    import vcdask
    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    with pytest.raises(exc, match=r"commit_every must be an integer >= 1 or 'auto', got "):
        vcdask.fit(digits_cnn(0), (X, y), commit_every=bad, progress=False)


def test_a_small_models_newest_version_is_kept_packed_with_the_head(tmp_path):
    """With ``inline_bytes`` at least the parameters' size, the head carries its committed version's
    parameters packed for a Dask message (a base then travels with the answer that gives it): equal to
    what the store holds for that version, taken at the commit (a merge not committed yet leaves it as
    it was).  Larger parameters, the default ``inline_bytes=0`` and an ended run carry none."""
    from vcdask._wire import unpack

    store, state = _state(tmp_path / "small", inline_bytes=16, commit_every=2)
    first = state.head
    assert first.payload is not None and unpack(first.payload).equal(store.read(first.version).params)
    state.merge(_upload(store, 0, 2.0))  # merged, not committed: the head's version and payload stay
    assert state.step == 1 and state.head.version == first.version and state.head.payload is first.payload
    state.merge(_upload(store, 1, 4.0))
    head = state.head
    assert head.version != first.version and head.payload is not None
    assert unpack(head.payload).equal(store.read(head.version).params)
    assert unpack(head.payload)["w"].tolist() == [2.5] * 4  # 0.5 * 1 + 0.5 * 4, after 0.5 * 0 + 0.5 * 2
    state.release()
    assert state.head.payload is None and state.head.version == head.version
    for kw in ({"inline_bytes": 15}, {}):  # 4 float32 values are 16 bytes
        store, state = _state(tmp_path / str(kw), **kw)
        state.merge(_upload(store, 0, 2.0))
        assert state.head.payload is None


def test_a_merge_goes_out_as_a_draft_and_is_committed_as_the_version_of_its_step(tmp_path):
    """With ``drafts`` (small parameters, ``commit_every=1``, no guard), a merge that does not end its
    epoch leaves its commit to the caller: the head carries the merged parameters packed (``draft``) at
    the new step while its committed version stays the last one (``version_id`` None); the caller's
    commit makes them the version of that step, and the draft its payload.  An epoch's last merge commits
    at once, and where a draft cannot be made the merge commits as before."""
    from vcdask._wire import unpack

    store, state = _state(tmp_path / "drafts", inline_bytes=16, drafts=True)
    first, n_versions = state.head, len(store.versions("run-x"))
    out = state.merge(_upload(store, 0, 2.0))
    draft = state.head
    assert out["accepted"] and out["new_version"] == 1 and out["version_id"] is None and out["drafted"]
    assert (draft.step, draft.version, draft.version_step) == (1, first.version, 0) and not state.folded
    assert draft.draft is not None and unpack(draft.draft)["w"].tolist() == [1.0] * 4
    assert len(store.versions("run-x")) == n_versions and not state.committed
    state.commit()
    head = state.head
    assert (head.step, head.version_step, head.draft) == (1, 1, None) and head.payload is draft.draft
    committed = store.read(head.version)
    assert committed.metadata["step"] == 1 and unpack(draft.draft).equal(committed.params)
    out = state.merge(_upload(store, 1, 4.0), completes=True)  # the epoch's last: committed at once
    assert out["version_id"] == state.version and state.head.draft is None and state.committed
    assert "drafted" not in out
    for kw in ({"commit_every": 2}, {"commit_every": "auto"}, {"inline_bytes": 0}, {"inline_bytes": 15}):
        store, state = _state(tmp_path / str(kw), drafts=True, **{"inline_bytes": 16, **kw})
        state.merge(_upload(store, 0, 2.0))
        assert state.head.draft is None, kw
