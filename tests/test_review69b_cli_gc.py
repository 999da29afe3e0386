"""``vcdask gc --branch NAME`` on a store without that branch: exit 2 at once, naming the branch (not retried as
if a run had moved it: a StoreConflict and exit 1 after seconds of retries)."""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask.cli import main


def _store(path):
    store = vcdask.open_store(path, mode="a")
    torch.manual_seed(0)
    store.commit(torch.nn.Linear(2, 1), message="start")
    return store


@pytest.mark.parametrize("dry_run", [True, False])
def test_gc_of_a_branch_the_store_lacks_is_nothing_there(tmp_path, capsys, dry_run):
    path = tmp_path / "store"
    _store(path)
    argv = ["gc", str(path), "--branch", "main", "--branch", "nope"] + (["--dry-run"] if dry_run else [])
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip() == f"vcdask gc: no branch 'nope' in {str(path)!r}; branches: ['main']"

    code = main(["gc", str(path), "--branch", "main"] + (["--dry-run"] if dry_run else []))  # one it has: collected
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and out.startswith("main: keeps 1 versions")
