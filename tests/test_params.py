"""Model state <-> flat parameters: exact, dtype-preserving, with clear mismatch errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vcdask.errors import ParameterMismatchError
from vcdask.params import FlatParams, Layout, flatten, load_into
from vcdask.testing.store import make_model, trained_state


def test_flatten_packs_one_vector_per_dtype():
    model = trained_state(0)
    flat = flatten(model)
    assert list(flat.arrays) == ["float32", "int64"]
    n_float = sum(t.numel() for t in model.state_dict().values() if t.dtype == torch.float32)
    assert flat.arrays["float32"].shape == (n_float,)
    assert flat.arrays["int64"].tolist() == [3]
    assert flat.layout.names == list(model.state_dict())
    # offsets are contiguous per dtype, in state_dict order
    floats = [e for e in flat.layout.entries if e.dtype == "float32"]
    assert [e.offset for e in floats] == list(np.cumsum([0] + [e.size for e in floats[:-1]]))


def test_round_trip_is_exact_and_copies():
    model = trained_state(1)
    flat = flatten(model)
    target = make_model(9)
    load_into(target, flat)
    for (name, a), b in zip(model.state_dict().items(), target.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # flatten copied: changing the model later does not change the flat params
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(flat.state_dict()["0.weight"], model[0].weight)


def test_state_dict_views_share_memory():
    flat = flatten(torch.nn.Linear(3, 2))
    flat.state_dict()["bias"].fill_(7.0)
    assert flat.arrays["float32"][-2:].tolist() == [7.0, 7.0]


def test_numpy_state_and_layout_json_round_trip():
    state = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.array([1, 2], dtype=np.int32)}
    flat = flatten(state)
    assert flat.layout.sizes == {"float64": 6, "int32": 2}
    assert Layout.from_dict(flat.layout.to_dict()) == flat.layout
    assert flat.numel == 8 and flat.nbytes == 6 * 8 + 2 * 4


def test_mismatch_lists_offending_names():
    flat = flatten(trained_state(0))
    other = torch.nn.Sequential(
        torch.nn.Conv2d(1, 6, 5, padding=2),  # 0.weight has a different shape
        torch.nn.BatchNorm2d(6),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 8 * 8, 10).double(),  # 4.* have a different dtype
        torch.nn.Linear(10, 2),  # 5.* are unexpected in the model / missing from the params
    )
    with pytest.raises(ParameterMismatchError) as info:
        load_into(other, flat)
    msg = str(info.value)
    assert "missing: ['5.weight', '5.bias']" in msg
    assert "0.weight: shape [6, 1, 3, 3] != expected [6, 1, 5, 5]" in msg
    assert "4.weight: dtype float32 != expected float64" in msg
    assert isinstance(info.value, ValueError)


def test_unsupported_dtype_names_choices():
    with pytest.raises(TypeError, match=r"complex64.*supported dtypes: \['bfloat16', 'bool'"):
        flatten({"z": torch.zeros(2, dtype=torch.complex64)})


def test_not_a_module():
    with pytest.raises(TypeError, match="expected a torch.nn.Module, a state dict or FlatParams, got int"):
        flatten(3)
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got str"):
        load_into("model", {})


def test_flatparams_validates_arrays():
    layout = Layout.from_shapes([("w", (2, 2), "float32")])
    with pytest.raises(ParameterMismatchError, match=r"shape \(3,\).*expects \(4,\) float32"):
        FlatParams(layout, {"float32": torch.zeros(3)})
    with pytest.raises(ParameterMismatchError, match="dtypes"):
        FlatParams(layout, {"float64": torch.zeros(4, dtype=torch.float64)})


def test_flat_params_is_a_read_only_mapping_in_layout_order():
    from collections.abc import Mapping

    model = trained_state(2)
    flat = flatten(model)
    state = model.state_dict()
    assert isinstance(flat, Mapping)
    assert len(flat) == len(state) and list(flat) == list(state) == flat.layout.names
    assert list(flat.keys()) == list(state) and "0.weight" in flat and "nope" not in flat
    for name, tensor in flat.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    assert torch.equal(flat["0.weight"], model[0].weight.detach())
    assert flat.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        flat["nope"]
    with pytest.raises(TypeError):
        flat["0.weight"] = torch.zeros(1)  # read-only: no item assignment
    # its existing API is unchanged: equality by identity (values with .equal), hashable, state_dict views
    clone = flat.clone()
    assert flat == flat and flat != clone and flat.equal(clone) and len({flat, clone}) == 2
    flat["1.bias"].fill_(3.0)  # a view, as state_dict() gives it
    assert torch.equal(flat.state_dict()["1.bias"], torch.full_like(flat["1.bias"], 3.0))
    assert load_into(make_model(5), flat) is not None


def test_stored_version_params_by_name(tmp_path):
    """What a newcomer reaches for first: ``store.read(v).params["0.weight"]``."""
    from vcdask import open_store

    model = trained_state(3)
    store = open_store(tmp_path / "store")
    params = store.read(store.commit(model)).params
    assert torch.equal(params["0.weight"], model.state_dict()["0.weight"])
    assert list(params) == list(model.state_dict())


def test_a_tied_weight_is_named_once_as_an_alias_of_its_first_name_and_read_back_from_older_layouts():
    """``head.weight = emb.weight`` puts one tensor in the state dict under two names: the layout records
    the second as an alias (kept through its JSON form); equal tensors that are not one are no alias, and a
    layout stored before ties were recorded reads with none and still matches."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with torch.no_grad():
        model[2].weight.copy_(model[0].weight[:4])  # same values, not the same tensor
    layout = flatten(model).layout
    assert layout.names == ["0.weight", "1.weight", "2.weight", "2.bias"]
    assert layout.tied == (("1.weight", "0.weight"),)
    assert layout.to_dict()["tied"] == {"1.weight": "0.weight"}
    assert Layout.from_dict(layout.to_dict()).tied == layout.tied
    older = {k: v for k, v in layout.to_dict().items() if k != "tied"}
    assert Layout.from_dict(older).tied == () and Layout.from_dict(older) == layout
    untied = flatten(torch.nn.Linear(3, 2)).layout
    assert untied.tied == () and "tied" not in untied.to_dict()
    assert flatten({"a": torch.zeros(0), "b": torch.zeros(0)}).layout.tied == ()  # no memory: nothing shared
