"""A small model's parameters in a Dask message (vcdask._wire): what the run's answer carries as a base."""

from __future__ import annotations

import pytest
import torch

from vcdask._wire import pack, unpack
from vcdask.errors import ParameterMismatchError
from vcdask.params import flatten


class _Mixed(torch.nn.Module):
    """float32 weights, an int64 counter (BatchNorm's), a bfloat16 buffer and an empty int32 one."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)
        self.register_buffer("low", torch.arange(5, dtype=torch.bfloat16) / 3)
        self.register_buffer("none", torch.zeros(0, dtype=torch.int32))


def test_packed_parameters_come_back_equal_through_a_dask_message():
    """Every dtype (bf16 and an empty array too) survives Dask's own message encoding bit for bit."""
    from distributed.protocol import dumps, loads

    model = _Mixed()
    model.bn.num_batches_tracked += 7
    flat = flatten(model)
    payload = pack(flat)
    assert all(isinstance(raw, bytes) for raw in payload["arrays"].values())
    back = unpack(loads(dumps({"params": payload}))["params"])
    assert back.equal(flat) and set(back.arrays) == {"float32", "int64", "bfloat16", "int32"}
    assert back["bn.num_batches_tracked"].item() == 7 and back["none"].numel() == 0


def test_packed_parameters_are_a_copy_and_unpacked_ones_are_writable():
    """Packing copies (the merge thread goes on changing ``W_s``); the worker loads what it unpacks into a
    model, so its tensors own writable memory that the message's bytes do not share."""
    flat = flatten(torch.nn.Linear(4, 4))
    payload = pack(flat)
    before = flat.clone()
    flat.arrays["float32"] += 1.0
    assert unpack(payload).equal(before)
    back = unpack(payload)
    back.arrays["float32"].zero_()
    assert unpack(payload).equal(before)


def test_a_payload_that_does_not_match_its_layout_is_refused():
    payload = pack(flatten(torch.nn.Linear(4, 4)))
    payload["arrays"]["float32"] = payload["arrays"]["float32"][:-4]  # one value short
    with pytest.raises(ParameterMismatchError, match="float32"):
        unpack(payload)
    payload["arrays"]["float32"] = payload["arrays"]["float32"][:-1]  # not a whole number of values
    with pytest.raises(ParameterMismatchError, match="not a whole number of float32 values"):
        unpack(payload)
