"""The plain objects beside a store's repository (run records, specs, updates, rule states): a reader
sees an object whole, the old one or the new one, never a part of it, as an object store's PUT gives.

A local file written in place is first truncated: a resume reading a live run's record while its epoch
closed got ``Expecting value: line 1 column 1`` (CI, stop 70).
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from vcdask import open_store
from vcdask.store._state import state_folder, sweep_states
from vcdask.updates import delete_run_updates, list_updates


def test_a_reader_never_sees_a_record_half_written(tmp_path):
    files = open_store(tmp_path / "s").files
    records = [json.dumps({"n": n, "rows": ["x" * 64] * 20_000}).encode() for n in range(2)]  # 1.4 MB each
    files.put("run/record.json", records[0])
    stop, seen, bad = threading.Event(), set(), []

    def read() -> None:
        while not stop.is_set():
            data = files.get("run/record.json")
            try:
                seen.add(json.loads(data)["n"])
            except ValueError:
                bad.append(len(data))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(60):
            files.put("run/record.json", records[i % 2])
    finally:
        stop.set()
        reader.join()
    assert not bad, f"read {len(bad)} partial records, of sizes {sorted(set(bad))[:5]}"
    assert seen  # (the reader did read)
    assert files.list("run") == ["run/record.json"]  # no temporary file left behind
    assert sorted(os.listdir(tmp_path / "s" / "runs" / "run")) == ["record.json"]


def test_a_write_that_fails_leaves_the_old_object_and_no_temporary_file(tmp_path):
    files = open_store(tmp_path / "s").files
    files.put("run/spec", b"old")
    with pytest.raises(TypeError):
        files.put_parts("run/spec", [b"new, in ", "a str, which a file cannot take", b" parts"])  # type: ignore[list-item]
    assert files.get("run/spec") == b"old"
    assert os.listdir(tmp_path / "s" / "runs" / "run") == ["spec"]
    assert files.put_parts("run/spec", [b"new ", memoryview(b"parts")]) == 9
    assert files.get("run/spec") == b"new parts"


def test_what_a_killed_writer_left_is_not_listed_and_is_swept(tmp_path):
    """A worker killed while it wrote its update leaves a temporary file: it is no update (the server
    never sees it), and the run's end or the next collection of rule states takes it away."""
    store = open_store(tmp_path / "s")
    files = store.files
    files.put("r1/updates/e1-s0-a0.safetensors", b"an update")
    folder = tmp_path / "s" / "runs" / "r1" / "updates"
    (folder / ".e1-s1-a0.safetensors.0123456789ab.part").write_bytes(b"half an upd")
    assert list_updates(files, "r1") == ["r1/updates/e1-s0-a0.safetensors"]
    delete_run_updates(files, "r1")
    assert os.listdir(folder) == []

    files.put(f"{state_folder('main')}/kept", b"state")
    states = tmp_path / "s" / "runs" / state_folder("main")
    (states / ".other.0123456789ab.part").write_bytes(b"sta")
    assert files.list(state_folder("main")) == [f"{state_folder('main')}/kept"]
    assert len(files.list(state_folder("main"), parts=True)) == 2
    assert sweep_states(files, "main", None) == 2
    assert files.list(state_folder("main"), parts=True) == []


def test_a_read_only_store_refuses_a_write_before_touching_the_disk(tmp_path):
    open_store(tmp_path / "s").files.put("run/x", b"1")
    files = open_store(tmp_path / "s", mode="r").files
    with pytest.raises(PermissionError, match="mode='r'"):
        files.put_parts("run/x", [b"2"])
    assert files.get("run/x") == b"1"
    assert os.listdir(tmp_path / "s" / "runs" / "run") == ["x"]


def test_a_record_cut_short_by_an_older_crash_is_left_out_with_a_warning(tmp_path, caplog):
    from vcdask.engine.end import read_record, record_path, write_record

    store = open_store(tmp_path / "s")
    write_record(store, "r1", {"status": "running", "step": 3})
    assert read_record(store, "r1") == {"status": "running", "step": 3}
    with open(tmp_path / "s" / "runs" / record_path("r1"), "r+b") as f:
        f.truncate(10)  # what a vcdask that wrote it in place left when killed
    with caplog.at_level("WARNING", logger="vcdask"):
        assert read_record(store, "r1") is None
    assert "run r1: its record" in caplog.text and "does not read" in caplog.text


def test_a_side_file_behind_a_link_is_written_through_and_keeps_its_permissions(tmp_path):
    """As a file written in place: a link stays a link (its target gets the bytes, on another filesystem too:
    the temporary file goes beside the target), and a file made private stays private."""
    files = open_store(tmp_path / "s").files
    files.put("run/spec", b"old")
    elsewhere = tmp_path / "elsewhere" / "spec"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"old")
    link = tmp_path / "s" / "runs" / "run" / "linked"
    link.symlink_to(elsewhere)
    files.put("run/linked", b"new")
    assert link.is_symlink() and elsewhere.read_bytes() == b"new" and files.get("run/linked") == b"new"
    assert os.listdir(elsewhere.parent) == ["spec"]
    private = tmp_path / "s" / "runs" / "run" / "spec"
    private.chmod(0o600)
    files.put("run/spec", b"new")
    assert private.stat().st_mode & 0o777 == 0o600 and files.get("run/spec") == b"new"
