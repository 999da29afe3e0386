"""A run's progress as its versions and its record keep it (engine.progress, end.progress_of, runs.epochs_done)."""

from __future__ import annotations

import torch

import vcdask
from vcdask.engine.end import progress_of, write_record
from vcdask.engine.progress import Progress
from vcdask.params import flatten
from vcdask.runs import epochs_done


def test_an_epoch_ends_once_its_shards_are_merged_or_given_up_whichever_comes_last():
    """The race the run's loop cannot see: a shard given up while the merge of the epoch's last other shard
    runs (the loop saw neither end the epoch), in either order in the merge thread."""
    p = Progress(n_shards=2)
    p.merged(1, 0, 0, step=1)
    p.skip(1, 1, end_step=None, step=1)
    assert p == Progress(done=[[1, 1]])
    q = Progress(n_shards=2)
    q.skip(1, 1, end_step=None, step=0)
    assert q.skipped == [[1, 1]] and q.done == []
    q.merged(1, 0, 0, step=1)
    assert q == Progress(done=[[1, 1]])
    q.merged(1, 1, 3, step=2)  # a late copy of a shard of a done epoch changes nothing
    assert q == Progress(done=[[1, 1]])


def test_the_run_says_where_an_epoch_ends_and_a_shard_merged_after_its_skip_counts_merged():
    p = Progress(n_shards=3)
    p.merged(1, 0, 0, step=1)
    p.skip(1, 2, end_step=None, step=1)
    p.merged(1, 2, 1, step=2)  # a copy of the given-up shard was being merged: merged, not skipped
    assert p.open == [[1, 0, 0], [1, 2, 1]] and p.skipped == []
    p.skip(1, 1, end_step=2, step=2)
    assert p.done == [[1, 2]] and p.open == [] and p.skipped == []


def test_an_epoch_left_covered_but_open_is_ended_when_read_back():
    """What the race above left in a store before the fix: every shard merged or given up, the epoch not done.
    Nothing would end it (no merge or skip of it comes again), so a resume would never close an epoch."""
    p = Progress.read({"progress": {"done": [], "open": [[1, 0, 0], [2, 1, 0]], "skipped": [[1, 1]]}}, n_shards=2)
    p.close_covered(step=3)
    assert p.done == [[1, 3]] and p.open == [[2, 1, 0]] and p.skipped == []


def test_progress_reads_what_older_versions_wrote():
    assert Progress.read({"progress": {"done": [[1, 4]], "open": [[2, 0, 1]]}}) == Progress(
        done=[[1, 4]], open=[[2, 0, 1]]
    )
    assert Progress.read({}) == Progress()


def test_an_epoch_a_skip_ended_after_the_last_commit_counts_done_from_the_record(tmp_path):
    """``resume(max_epochs=N)`` checks N against the epochs done: one a shard given up ended after the run's
    last commit is in its record, written with every merge in that version; a record written before a later
    commit (at the same step: the skip's own commit, the run's end) is older than that version."""
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-r")
    progress = {"done": [[1, 2]], "open": [[2, 0, 0]], "skipped": []}
    store.commit(flatten(torch.nn.Linear(2, 1)), {"run_id": "run-r", "step": 3, "progress": progress}, branch="run-r")
    newest = store.versions("run-r")[0]
    assert epochs_done(store, "run-r") == 1
    later = {"done": [[1, 2], [2, 3]], "open": [], "skipped": []}
    write_record(store, "run-r", {"status": "finished", "step": 3, "progress": later, "progress_on": newest.id})
    assert epochs_done(store, "run-r") == 2
    assert progress_of(store, "run-r", newest.id, newest.metadata) == later
    older = {"status": "running", "step": 3, "progress": later, "progress_on": "AN-OLDER-VERSION"}
    write_record(store, "run-r", older)  # (a version committed after it, at the same step)
    assert epochs_done(store, "run-r") == 1
    write_record(store, "run-r", {**older, "progress_on": None})  # (merges not committed when it was written)
    assert epochs_done(store, "run-r") == 1
