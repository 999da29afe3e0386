"""Batches of any container a ``collate_fn`` makes reach the step on the worker's device, of their own type.

:func:`vcdask.device.to` moves (and casts) a batch; ``torch.device("meta")`` stands in for a GPU: a tensor left
behind stays on the CPU.  Each container kind also trains in a real :func:`vcdask.fit` (the pre-flight and a short
run on a one-thread in-process cluster) with a step that reads ``batch.x``.
"""

from __future__ import annotations

import dataclasses
import types
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from refusal_helpers import refused

import vcdask
from vcdask.batches import _class_ids
from vcdask.device import to

META = torch.device("meta")
CPU = torch.device("cpu")

Item = namedtuple("Item", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    y: torch.Tensor
    n: int = dataclasses.field(init=False, default=0)
    scaled: torch.Tensor | None = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        object.__setattr__(self, "n", self.n + 1)  # counts the __init__ runs
        object.__setattr__(self, "scaled", self.x * 2)


@dataclasses.dataclass(slots=True)
class SlotsBatch:
    x: torch.Tensor
    tag: str = "t"


class Encoding(UserDict):
    """Like Hugging Face's ``BatchEncoding``: a ``UserDict`` read by attribute, with state besides its items."""

    def __init__(self, data=None, note="kept"):
        super().__init__(data)
        self.note = note

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class Frozen(Mapping):
    """An immutable Mapping made from a dict."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, k):
        return self._items[k]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class Unmakeable(Frozen):
    """An immutable Mapping that cannot be made from its items."""

    def __init__(self, items, extra):
        super().__init__(items)


class Movable:
    """An object that moves itself (``.to``), as a ``BatchEncoding``, a ``PackedSequence`` or a ``TensorDict``."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device):
        return Movable(self.x.to(device), self.y.to(device))


class MovesInPlace:
    def __init__(self, x):
        self.x = x

    def to(self, device):
        self.x = self.x.to(device)


class Opaque:
    def __init__(self, x, y):
        self.x, self.y, self.name = x, y, "batch"


class Tags(list):
    pass


class MovableEncoding(Encoding):
    """A ``UserDict`` with ``.to(device)`` of its own, as a Hugging Face ``BatchFeature``: it casts nothing."""

    def to(self, device):
        return MovableEncoding({k: v.to(device) for k, v in self.items()}, note=self.note)


class DeviceBound(UserDict):
    """A mapping that keeps every value on its own device, as a ``TensorDict`` does: only its ``.to`` moves it."""

    def __init__(self, data=None, device=CPU):
        self.device = device
        super().__init__(data)

    def __setitem__(self, k, v):
        self.data[k] = v.to(self.device)

    def to(self, device):
        return DeviceBound(self.data, device)


class Units:
    """Metadata with an unrelated ``.to`` (a unit conversion, as pint's or astropy's)."""

    def __init__(self, x=None, converted=None):
        self.unit, self.x, self.converted = "m", x, converted

    def to(self, unit):
        if self.converted is None:
            raise ValueError(f"cannot convert {self.unit} to {unit}")
        return self.converted


@dataclasses.dataclass
class UnitsBatch:
    x: torch.Tensor

    def to(self, unit):
        raise TypeError(f"not a unit: {unit}")


def f64(*shape):
    return torch.zeros(*shape, dtype=torch.float64)


# --- to: what stays as it was ------------------------------------------------------------------------------------


def test_plain_containers_move_and_cast_as_before():
    batch = {"a": (f64(2), [torch.zeros(2, dtype=torch.long), "id"]), "b": None}
    out = to(batch, META, torch.float32)
    assert type(out) is dict and type(out["a"]) is tuple and type(out["a"][1]) is list
    assert out["a"][0].device == META and out["a"][0].dtype == torch.float32
    assert out["a"][1][0].device == META and out["a"][1][0].dtype == torch.long  # integers keep their dtype
    assert out["a"][1][1] == "id" and out["b"] is None
    assert batch["a"][0].device == CPU  # the caller's batch is not changed


@pytest.mark.parametrize("leaf", ["s", b"b", 3, 2.5, None, True, np.zeros(2)])
def test_leaves_are_returned_as_they_are(leaf):
    assert to(leaf, META, torch.float32) is leaf


def test_a_tensor_subclass_is_moved():
    out = to(torch.nn.Parameter(f64(2)), META, torch.float32)
    assert out.device == META and out.dtype == torch.float32


# --- to: namedtuples, tuple and list subclasses -----------------------------------------------------------------


def test_a_namedtuple_keeps_its_type_and_fields():
    out = to(Item(f64(2), torch.zeros(2, dtype=torch.long)), META, torch.float32)
    assert type(out) is Item
    assert out.x.device == META and out.x.dtype == torch.float32
    assert out.y.device == META and out.y.dtype == torch.long


def test_a_structseq_and_a_list_subclass_keep_their_types():
    out = to(torch.max(torch.zeros(2, 3), 1), META)
    assert type(out) is torch.return_types.max and out.values.device == META
    tags = to(Tags([f64(1), "a"]), META, torch.float32)
    assert type(tags) is Tags and tags[0].device == META and tags[0].dtype == torch.float32 and tags[1] == "a"


def test_a_packed_sequence_moves_itself():
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])
    out = to(packed, CPU)
    assert type(out) is torch.nn.utils.rnn.PackedSequence
    assert out.batch_sizes.device == CPU  # (its own .to keeps them on the CPU, as they must be)


# --- to: mappings ------------------------------------------------------------------------------------------------


def test_an_ordered_dict_and_a_defaultdict_keep_their_types():
    out = to(OrderedDict(x=f64(2), y=torch.zeros(2)), META, torch.float32)
    assert type(out) is OrderedDict and list(out) == ["x", "y"]
    assert out["x"].device == META and out["x"].dtype == torch.float32
    d = defaultdict(list, x=f64(2))
    moved = to(d, META)
    assert type(moved) is defaultdict and moved.default_factory is list and moved["x"].device == META


def test_a_user_dict_keeps_its_type_state_and_attribute_access():
    enc = Encoding({"x": f64(2), "mask": torch.ones(2, dtype=torch.long)}, note="mine")
    out = to(enc, META, torch.float32)
    assert type(out) is Encoding and out.note == "mine"
    assert out.x.device == META and out.x.dtype == torch.float32 and out.mask.dtype == torch.long
    assert enc.x.device == CPU  # a copy: the caller's batch is not changed


def test_an_immutable_mapping_is_made_again_or_becomes_a_dict():
    out = to(Frozen({"x": f64(2)}), META, torch.float32)
    assert type(out) is Frozen and out["x"].device == META and out["x"].dtype == torch.float32
    proxy = to(types.MappingProxyType({"x": f64(1)}), META)
    assert type(proxy) is types.MappingProxyType and proxy["x"].device == META
    fallback = to(Unmakeable({"x": f64(1)}, None), META)
    assert type(fallback) is dict and fallback["x"].device == META  # (as torch's pin_memory falls back)


# --- to: dataclasses ---------------------------------------------------------------------------------------------


def test_a_dataclass_is_moved_and_cast():
    batch = Batch(f64(2), torch.zeros(2, dtype=torch.long))
    out = to(batch, META, torch.float32)
    assert type(out) is Batch and out is not batch
    assert out.x.device == META and out.x.dtype == torch.float32
    assert out.y.device == META and out.y.dtype == torch.long
    assert batch.x.device == CPU


def test_a_frozen_dataclass_is_moved_without_running_its_init_again():
    batch = FrozenBatch(f64(2), torch.zeros(2))
    out = to(batch, META, torch.float32)
    assert type(out) is FrozenBatch and out.n == 1  # __post_init__ ran once, for the caller
    assert out.x.device == META and out.scaled.device == META  # an init=False field is moved too
    assert out.scaled.dtype == torch.float32
    assert batch.x.device == CPU and batch.scaled.device == CPU


def test_a_slots_dataclass_is_moved():
    out = to(SlotsBatch(f64(2)), META, torch.float32)
    assert type(out) is SlotsBatch and out.x.device == META and out.tag == "t"


def test_a_dataclass_class_is_a_leaf():
    assert to({"kind": Batch}, META)["kind"] is Batch


# --- to: objects that move themselves, and those that cannot be moved --------------------------------------------


def test_an_object_with_its_own_to_moves_itself():
    out = to({"b": Movable(torch.zeros(2), torch.zeros(2))}, META)
    assert type(out["b"]) is Movable and out["b"].x.device == META
    in_place = MovesInPlace(torch.zeros(2))
    assert to(in_place, META) is in_place and in_place.x.device == META


def test_an_object_holding_tensors_that_cannot_be_moved_is_refused_by_name():
    with pytest.raises(TypeError, match=r"test_batch_containers\.Opaque with tensors in its attributes \(x, y\)") as e:
        to([Opaque(torch.zeros(2), torch.zeros(2))], META)
    assert "return a tuple, dict, namedtuple, dataclass or SimpleNamespace" in str(e.value)
    assert ".to(device)" in str(e.value)


def test_an_object_without_tensors_is_left_as_it_is():
    obj = Opaque(1, [2])
    assert to((obj,), META)[0] is obj


def test_an_object_whose_tensors_need_no_move_nor_cast_is_left_as_it_is():
    on_cpu = Opaque(torch.zeros(2), [torch.zeros(2, dtype=torch.long)])
    assert to((on_cpu,), CPU, torch.float32)[0] is on_cpu  # (a collate_fn's own class trains on a CPU worker)
    assert to(on_cpu, CPU) is on_cpu
    on_meta = Opaque(torch.zeros(2, device=META), {"m": torch.zeros(2, dtype=torch.long, device=META)})
    assert to([on_meta], META, torch.float32)[0] is on_meta


def test_an_object_whose_tensors_need_a_cast_is_refused():
    with pytest.raises(TypeError, match=r"Opaque with tensors in its attributes \(x\)") as e:
        to(Opaque(f64(2), torch.zeros(2, dtype=torch.long)), CPU, torch.float32)
    assert "or cast to torch.float32" in str(e.value)


# --- to: objects with a .to of their own and a dtype; a .to of another kind --------------------------------------


def test_a_mapping_with_its_own_to_is_moved_and_cast():
    enc = MovableEncoding({"x": f64(2), "mask": torch.ones(2, dtype=torch.long)}, note="mine")
    out = to(enc, META, torch.float32)
    assert type(out) is MovableEncoding and out.note == "mine"
    assert out.x.device == META and out.x.dtype == torch.float32
    assert out.mask.device == META and out.mask.dtype == torch.long
    assert to(MovableEncoding({"x": torch.zeros(2)}), META, torch.float64).x.dtype == torch.float64


def test_a_mapping_that_keeps_its_values_on_its_device_moves_itself_first():
    out = to(DeviceBound({"x": f64(2), "ids": torch.zeros(2, dtype=torch.long)}), META, torch.float32)
    assert type(out) is DeviceBound and out.device == META
    assert out["x"].device == META and out["x"].dtype == torch.float32 and out["ids"].device == META


def test_a_packed_sequence_is_cast_and_other_objects_keep_their_dtypes():
    packed = torch.nn.utils.rnn.pack_sequence([f64(3), f64(2)])
    out = to(packed, META, torch.float32)
    assert type(out) is torch.nn.utils.rnn.PackedSequence
    assert out.data.device == META and out.data.dtype == torch.float32 and out.batch_sizes.device == CPU
    ids = torch.nn.utils.rnn.pack_sequence([torch.ones(3, dtype=torch.long), torch.ones(2, dtype=torch.long)])
    assert to(ids, META, torch.float32).data.dtype == torch.long
    own = to(Movable(f64(2), f64(2)), META, torch.float32)  # (its own .to casts nothing; vcdask cannot rebuild it)
    assert own.x.device == META and own.x.dtype == torch.float64


def test_an_object_with_an_unrelated_to_is_handled_as_one_without_it():
    meta = Units()
    assert to((f64(2), meta), META, torch.float32)[1] is meta
    with pytest.raises(TypeError, match=r"Units with tensors in its attributes \(x\)") as e:
        to(Units(torch.zeros(2)), META)
    assert "its own .to(device) raised ValueError: cannot convert m to meta" in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(TypeError, match=r"its own .to\(device\) returned a builtins.float"):
        to(Units(torch.zeros(2), converted=2.5), META)  # (a conversion that returned a magnitude)
    assert to(Units(converted=2.5), META).unit == "m"
    out = to(UnitsBatch(f64(2)), META, torch.float32)  # a dataclass: moved as one
    assert type(out) is UnitsBatch and out.x.device == META and out.x.dtype == torch.float32


def test_a_to_that_runs_out_of_memory_is_not_taken_for_another_kind_of_to():
    class Big(Movable):
        def to(self, device):
            raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        to(Big(torch.zeros(2), torch.zeros(2)), META)


# --- _class_ids keeps the batch's type ---------------------------------------------------------------------------


CLASSIFIER = types.SimpleNamespace(classification=True)


def test_class_ids_keep_a_namedtuple():
    out = _class_ids(Item(torch.zeros(2), torch.zeros(2, dtype=torch.int32)), CLASSIFIER)
    assert type(out) is Item and out.y.dtype == torch.int64


def test_class_ids_keep_plain_and_subclassed_sequences():
    x, y = torch.zeros(2), torch.zeros(2, dtype=torch.int8)
    assert type(_class_ids((x, y), CLASSIFIER)) is tuple
    assert type(_class_ids([x, y], CLASSIFIER)) is list
    tags = _class_ids(Tags([x, y]), CLASSIFIER)
    assert type(tags) is Tags and tags[1].dtype == torch.int64 and tags[0] is x
    assert _class_ids(Item(x, y), types.SimpleNamespace(classification=False)).y.dtype == torch.int8


# --- a real fit per container kind -------------------------------------------------------------------------------

N, D = 48, 8


class Rows(torch.utils.data.Dataset):
    """``(x, label)`` items, or namedtuple ones; ``x`` in ``dtype``."""

    def __init__(self, dtype=torch.float32, named=False):
        g = np.random.default_rng(0)
        self.X = torch.as_tensor(g.normal(size=(N, D)), dtype=dtype)
        self.y = torch.as_tensor(g.integers(0, 3, size=N))
        self.named = named

    def __len__(self):
        return N

    def __getitem__(self, i):
        return Item(self.X[i], self.y[i]) if self.named else (self.X[i], self.y[i])


def _collated(kind):
    def collate(items):
        x, y = torch.utils.data.default_collate(items)
        return kind(x, y)

    return collate


COLLATES = {
    "namedtuple": None,
    "user_dict": _collated(lambda x, y: Encoding({"x": x, "y": y})),
    "dataclass": _collated(Batch),
    "frozen_dataclass": _collated(FrozenBatch),
    "own_to": _collated(Movable),
    "mapping_own_to": _collated(lambda x, y: MovableEncoding({"x": x, "y": y})),
    "plain_object": _collated(Opaque),
    "simple_namespace": _collated(lambda x, y: types.SimpleNamespace(x=x, y=y)),
}


def _step(model, batch):
    assert batch.x.dtype == torch.float32, batch.x.dtype  # cast to the model's dtype (the data is float64)
    return F.cross_entropy(model(batch.x), batch.y)


@pytest.mark.parametrize("kind", list(COLLATES))
def test_each_container_kind_trains_read_by_attribute(kind, tmp_path, threaded_client):
    torch.manual_seed(0)
    # (an object's own .to casts nothing; a plain object is kept only when nothing in it must move or be cast)
    dtype = torch.float32 if kind in ("own_to", "plain_object") else torch.float64
    data = Rows(dtype, named=kind == "namedtuple")
    result = vcdask.fit(
        torch.nn.Linear(D, 3),
        data,
        collate_fn=COLLATES[kind],
        train_step=_step,
        client=threaded_client,
        store=tmp_path / "store",
        max_epochs=1,
        n_shards=2,
        batch_size=16,
        progress=False,
    )
    merged = result.history[result.history.outcome == "merged"]
    assert len(merged) == 2, result.history


def test_namedtuple_items_train_with_the_default_step(tmp_path, threaded_client):
    torch.manual_seed(0)
    result = vcdask.fit(
        torch.nn.Linear(D, 3),
        Rows(torch.float64, named=True),
        loss=torch.nn.CrossEntropyLoss(),
        client=threaded_client,
        store=tmp_path / "store",
        max_epochs=1,
        n_shards=2,
        batch_size=16,
        progress=False,
    )
    assert len(result.history[result.history.outcome == "merged"]) == 2, result.history


def test_a_batch_that_cannot_be_moved_is_refused_before_the_run(tmp_path):
    refused(
        torch.nn.Linear(D, 3),
        Rows(torch.float64),  # (its x must be cast to the model's float32)
        tmp_path,
        TypeError,
        "test_batch_containers.Opaque with tensors in its attributes (x)",
        "or cast to torch.float32",
        "return a tuple, dict, namedtuple, dataclass or SimpleNamespace of tensors from collate_fn",
        collate_fn=_collated(Opaque),
        train_step=_step,
        max_epochs=1,
    )


def test_a_simple_namespace_is_moved_and_cast():
    batch = types.SimpleNamespace(x=f64(2), ids=["a"])
    out = to(batch, META, torch.float32)
    assert type(out) is types.SimpleNamespace and out.x.device == META and out.x.dtype == torch.float32
    assert out.ids == ["a"] and batch.x.device == CPU
