"""vcdask.load without a cluster: a location given as a path, and the mark it leaves on the model
(``model.vcdask_version``, which a later fit records as its start)."""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask.runs import start_record


@pytest.mark.parametrize("as_path", [True, False], ids=["pathlib", "str"])
def test_load_takes_a_path_like_location(tmp_path, as_path):
    store = vcdask.open_store(tmp_path / "runs store")
    v = store.commit(torch.nn.Linear(4, 3), {"epoch": 3})
    where = tmp_path / "runs store" if as_path else str(tmp_path / "runs store")
    model = vcdask.load(where, torch.nn.Linear(4, 3), version=v)
    assert model.vcdask_version == {"epoch": 3, "id": v, "tag": None, "store": store.location}
    with pytest.raises(TypeError, match=r"storage options \['region'\] apply to a location, not to an open store"):
        vcdask.load(store, torch.nn.Linear(4, 3), region="eu-west-1")


def test_metadata_named_like_the_marks_keys_never_stands_for_them(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    user = {"id": "experiment-7", "tag": "mine", "store": "elsewhere", "note": "pretrained"}
    v = store.commit(torch.nn.Linear(4, 3), user)
    store.tag("best", v)
    by_id = vcdask.load(store, torch.nn.Linear(4, 3), version=v)
    assert by_id.vcdask_version == {**user, "id": v, "tag": None, "store": store.location}
    by_tag = vcdask.load(store, torch.nn.Linear(4, 3), tag="best")
    assert by_tag.vcdask_version == {**user, "id": v, "tag": "best", "store": store.location}
    # what vcdask.fit records as the run's start (FitResult.start): the version itself
    assert start_record(by_tag, store) == {"version": v, "tag": "best", "store": store.location}
    assert store.read(start_record(by_id, store)["version"]).metadata == user
