"""Branch and tag names: only characters every storage keeps verbatim in a ref's key, and a collection that
refuses to run while the storage holds a ref Icechunk does not list (whose version it would delete)."""

from __future__ import annotations

import os

import icechunk
import pytest
import torch

from vcdask import Retention, open_store
from vcdask.errors import StoreError
from vcdask.runs import new_run_id

# Icechunk's local storage stores these percent-encoded (and S3 turns "\\" into "/"): such a tag was missing
# from store.tags() and a collection deleted its version; such a branch made every listing of the store fail.
REFUSED = ["é✓", "modèle", "a\\b", "a#b", "a%20b", "a?b", "*", "~x", "a|b", "[x]", "a^b", "`x`", '"q"', "<a>", "{a}"]
ALLOWED = [" ", ".", "..", "a b", "v1.0", "a:b", "a+b=c@d,e_f-g", "tag.x", "ref.json", "A", "x" * 200]


def _store(kind: str, tmp_path, s3_server=None):
    if kind == "local":
        return open_store(tmp_path / "s")
    if kind == "memory":
        return open_store(f"memory://names-{os.urandom(4).hex()}")
    return open_store(f"s3://{s3_server.new_bucket()}/runs", **s3_server.options())


def _versions(store, n: int) -> list[str]:
    model, out = torch.nn.Linear(3, 2), []
    for i in range(n):
        with torch.no_grad():
            model.weight.fill_(i)
        out.append(store.commit(model, {"i": i}))
    return out


@pytest.mark.parametrize("name", [*REFUSED, "x" * 201, "", "a/b", "tab\there"])
def test_a_name_of_other_characters_is_refused_naming_the_rule(tmp_path, name):
    store = open_store(tmp_path / "s")
    v = store.commit({"w": torch.zeros(3)})
    rule = r"name must be 1 to 200 characters: ASCII letters, digits, space and \. _ \+ : = @ , - "
    for what, make in (("tag", store.tag), ("branch", store.create_branch)):
        with pytest.raises(ValueError, match=f"a {what} {rule}") as info:
            make(name, v)
        assert repr(name[:40]) in str(info.value)
    assert store.tags() == {} and list(store.branches()) == ["main"]
    assert sorted(os.listdir(tmp_path / "s" / "refs")) == ["branch.main"]  # nothing written


def test_the_rule_names_the_characters_a_name_may_not_have(tmp_path):
    store = open_store(tmp_path / "s")
    with pytest.raises(
        ValueError, match=r"\(those every storage keeps verbatim in the tag's key\), got 'modèle #1' \(not '#', 'è'\)$"
    ):
        store.tag("modèle #1", store.commit({"w": torch.zeros(3)}))


@pytest.mark.parametrize("kind", ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_every_allowed_name_round_trips_and_keeps_its_version(tmp_path, request, kind):
    store = _store(kind, tmp_path, request.getfixturevalue("s3") if kind == "s3" else None)
    vs = _versions(store, 4)
    run_id = new_run_id()  # what vcdask names a run's branch
    for name in [*ALLOWED, run_id]:
        store.tag(name, vs[1])
        store.create_branch(name, vs[2])
        store.commit({"w": torch.ones(3)}, {"on": name}, branch=name)
    assert store.tags() == {name: vs[1] for name in sorted([*ALLOWED, run_id])}
    assert set(store.branches()) == {"main", *ALLOWED, run_id}
    if kind == "local":  # each ref under a key of its own name, verbatim
        keys = set(os.listdir(tmp_path / "s" / "refs"))
        assert {f"tag.{n}" for n in ALLOWED} | {f"branch.{n}" for n in ALLOWED} <= keys
    report = store.gc(Retention(keep_last=1, keep_epochs=False, grace=0))  # pins named after each branch too
    assert vs[0] in report.removed["main"] and vs[1] not in report.removed["main"]
    fresh = open_store(store.location, mode="r", **({} if kind != "s3" else request.getfixturevalue("s3").options()))
    for name in [*ALLOWED, run_id]:
        assert fresh.read(tag=name).metadata == {"i": 1}
        assert fresh.read(branch=name).metadata == {"on": name}


def _icechunk_repo(store, s3_server=None) -> icechunk.Repository:
    """The store's repository opened with Icechunk itself (which takes any name)."""
    if s3_server is None:
        return icechunk.Repository.open(icechunk.local_filesystem_storage(store.location))
    bucket = store.location[len("s3://") :].split("/")[0]
    return icechunk.Repository.open(s3_server.icechunk_storage(bucket, "runs"))


@pytest.mark.parametrize(
    ("kind", "name", "shown"),
    [
        ("local", "modèle", r"tag 'modèle' \(key refs/tag\.mod%C3%A8le\)"),
        ("local", "a%20b", r"tag 'a%20b' \(key refs/tag\.a%2520b\)"),
        pytest.param("s3", "win\\best", r"tag 'win/best' \(key refs/tag\.win/best\)", marks=pytest.mark.s3),
    ],
)
def test_a_collection_refuses_while_a_tag_is_not_listed(tmp_path, request, kind, name, shown):
    """A tag made with Icechunk (or an earlier release) whose name its storage does not keep verbatim: Icechunk's
    listing leaves it out, and a collection deleted the version it keeps."""
    s3 = request.getfixturevalue("s3") if kind == "s3" else None
    store = _store(kind, tmp_path, s3)
    vs = _versions(store, 5)
    repo = _icechunk_repo(store, s3)
    repo.create_tag(name, vs[1])
    assert name not in store.tags()
    retention = Retention(keep_last=1, keep_epochs=False, grace=0)
    for dry_run in (True, False):
        with pytest.raises(StoreError, match=f"collecting old versions in .*: refused, nothing was deleted: .*{shown}"):
            store.gc(retention, dry_run=dry_run)
    assert [v.id for v in store.versions()] == vs[::-1]
    assert store.read(vs[1]).metadata == {"i": 1}
    # the remedy the message gives: a new name for the version, the old tag deleted with Icechunk
    store.tag("kept", vs[1])
    repo.delete_tag(name)
    report = store.gc(retention)
    assert sorted(report.removed["main"]) == sorted([vs[0], *vs[2:4]])
    assert open_store(store.location, mode="r", **(s3.options() if s3 else {})).read(tag="kept").metadata == {"i": 1}


@pytest.mark.s3
def test_a_collection_refuses_while_a_branch_is_not_listed(tmp_path, s3):
    """S3 keeps a branch named with a backslash under a key split at it: Icechunk lists another name."""
    store = _store("s3", tmp_path, s3)
    vs = _versions(store, 4)
    _icechunk_repo(store, s3).create_branch("a\\b", vs[1])
    with pytest.raises(StoreError, match=r"branch 'a/b' \(key refs/branch\.a/b\)"):
        store.gc(Retention(keep_last=1, keep_epochs=False, grace=0))
    assert [v.id for v in store.versions()] == vs[::-1]
