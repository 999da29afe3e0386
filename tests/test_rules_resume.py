"""A run resumed from its store continues bit for bit as if it had never stopped, under the default rule.

The rule state is read from a safetensors object where each array lies behind the others (behind an int64
counter's 8 bytes, say): a view of it is aligned to its element size only, and ``torch.dot``'s float32
sum, which the default rule's bound (``bias_correction="trust"``) takes, depends on its operands'
alignment.  The one-array, three-value state of ``test_rules.py``'s restart test never showed it.
"""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask.engine.params_server import ParamsServer
from vcdask.merge import Nesterov
from vcdask.params import flatten
from vcdask.updates import update_path, write_update


def _model(seed: int) -> dict[str, torch.Tensor]:
    """A few thousand float32 values in several entries, with an int64 counter and BatchNorm's buffers."""
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(24, 3, 5, 5, generator=g),
        "conv.bias": torch.randn(24, generator=g),
        "bn.running_mean": torch.randn(24, generator=g),
        "bn.running_var": torch.rand(24, generator=g) + 0.5,
        "bn.num_batches_tracked": torch.tensor(3),
        "fc.weight": torch.randn(10, 301, generator=g),
        "fc.bias": torch.randn(10, generator=g),
    }


def _start(path, rule, seed):
    store = vcdask.open_store(path)
    if "run" not in store.branches():
        store.create_branch("run")
        store.commit(flatten(_model(seed)), {"run_id": "run", "step": 0, "merged": []}, branch="run")
    server = ParamsServer(store, "run", rule, "run")
    server.load()
    return store, server


def _merge(store, server, i, seed):
    g = torch.Generator().manual_seed(1000 * seed + i)
    client = {
        k: v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1  # large: the bound cuts
        for k, v in server.params.state_dict().items()
    }
    path = update_path("run", 1, i, 0)
    write_update(store.files, path, flatten(client))
    record = {"epoch": 1, "shard": i, "attempt": 0, "base_step": server.step, "update": path, "n_samples": 10}
    assert server.merge(record)["accepted"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("delay", "stop_at"), [(4, 2), (4, 3), (4, 6), (4, 7), (1, 2), (1, 5)])
def test_the_default_rule_resumed_mid_window_continues_bit_for_bit(tmp_path, delay, stop_at, seed):
    rule = Nesterov(lr=0.5, momentum=0.9, delay=delay)  # bias_correction="trust", the default
    store_a, a = _start(tmp_path / "a", rule, seed)
    store_b, b = _start(tmp_path / "b", rule, seed)
    for i in range(10):
        if i == stop_at:
            store_b, b = _start(tmp_path / "b", rule, seed)  # the scheduler died; vcdask.resume loads the branch
        _merge(store_a, a, i, seed)
        _merge(store_b, b, i, seed)
        assert a.rule_state.scalars == b.rule_state.scalars, f"after arrival {i}"
        assert a.params.equal(b.params), f"after arrival {i}"
    for name, flat in a.rule_state.arrays.items():
        assert flat.equal(b.rule_state.arrays[name]), name


def test_the_loaded_state_is_in_memory_of_its_own(tmp_path):
    """Each array of a resumed state is a copy in fresh memory, aligned as PyTorch aligns what it allocates
    (64 bytes), as the uninterrupted run's arrays are: not a view of the object's buffer, aligned to its
    element size only (which would also keep the buffer, the whole state once more, for as long as any of
    its arrays lives)."""
    rule = Nesterov(lr=0.5, momentum=0.9, delay=4)
    store, server = _start(tmp_path, rule, seed=0)
    for i in range(6):
        _merge(store, server, i, seed=0)
    _, resumed = _start(tmp_path, rule, seed=0)
    arrays = [a for flat in resumed.rule_state.arrays.values() for a in flat.arrays.values()]
    assert len(arrays) == 4  # momentum and pending, float32 and int64 each
    assert [a.data_ptr() % 64 for a in arrays] == [0] * 4
