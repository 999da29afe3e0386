"""How a worker's next shard meets the merge of its last one: the delta rule and the hand-overs still out."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from vcdask import overlap
from vcdask.errors import ParameterMismatchError
from vcdask.params import flatten


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, steps: int, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 4, generator=g)).pow(2).mean().backward()
        opt.step()


def test_the_delta_rule_moves_the_local_steps_onto_the_merged_version():
    """A task that trained on from its own W_c ends as merged + (what it learned since W_c)."""
    model = _net()
    _train(model, 3, seed=1)
    own = flatten(model)  # W_c, handed over
    _train(model, 2, seed=2)  # the next task's first steps, before the merged version came
    learned = {d: flatten(model).arrays[d] - own.arrays[d] for d in own.arrays}
    server = _net()
    _train(server, 5, seed=3)  # the server's version, holding W_c among others
    merged = flatten(server)
    overlap.correct(model, merged, own)
    after = flatten(model)
    torch.testing.assert_close(after.arrays["float32"], merged.arrays["float32"] + learned["float32"])
    assert torch.equal(after.arrays["int64"], merged.arrays["int64"] + learned["int64"])  # BatchNorm's counter
    assert merged.arrays["float32"].data_ptr() != after.arrays["float32"].data_ptr()
    assert torch.equal(merged.arrays["float32"], flatten(server).arrays["float32"])  # the base is left as it was
    _train(model, 1, seed=4)  # the optimizer's parameters were corrected in place: training goes on from there


def test_with_nothing_learned_meanwhile_the_task_holds_the_merged_version_exactly():
    model = _net()
    own = flatten(model)
    server = _net()
    _train(server, 4, seed=5)
    merged = flatten(server)
    overlap.correct(model, merged, own)
    assert flatten(model).equal(merged)  # bit for bit (what a learning rate of 0 relies on: early stopping)


class _Tied(torch.nn.Module):
    """A language model's head tied to its embedding: one tensor under two names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_a_tied_weight_is_corrected_once():
    model = _Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    own = flatten(model)

    def step() -> None:
        opt.zero_grad()
        model(torch.arange(6)).logsumexp(-1).mean().backward()
        opt.step()

    step()
    learned = model.emb.weight.detach() - own["emb.weight"]
    merged = own.clone()
    merged.arrays["float32"] += 0.5  # the server moved every weight
    overlap.correct(model, merged, own)
    assert model.head.weight is model.emb.weight  # still tied
    torch.testing.assert_close(model.emb.weight.detach(), merged["emb.weight"] + learned)
    step()  # training goes on from there


def test_a_boolean_buffer_takes_the_merged_value():
    model = torch.nn.Linear(2, 1)
    model.register_buffer("mask", torch.tensor([True, False]))
    own = flatten(model)
    merged_model = torch.nn.Linear(2, 1)
    merged_model.register_buffer("mask", torch.tensor([False, True]))
    overlap.correct(model, flatten(merged_model), own)
    assert model.mask.tolist() == [False, True]


def test_a_base_of_another_model_is_refused_naming_it():
    model = _net()
    with pytest.raises(ParameterMismatchError, match="the merged version does not fit"):
        overlap.correct(model, flatten(torch.nn.Linear(4, 2)), flatten(model))
    with pytest.raises(ParameterMismatchError, match="own W_c does not fit"):
        overlap.correct(model, flatten(model), flatten(torch.nn.Linear(4, 2)))


def test_check_overlap_names_the_value_and_the_choices():
    assert overlap.check_overlap("delta") == "delta"
    with pytest.raises(ValueError, match=r"overlap must be one of \['delta', 'wait', 'newest'\], got 'eager'"):
        overlap.check_overlap("eager")


def _pending(run_id: str, answer: concurrent.futures.Future | None = None) -> overlap.Pending:
    return overlap.Pending(run_id, answer or concurrent.futures.Future(), flatten(torch.nn.Linear(2, 1)))


def test_hand_overs_still_out_are_taken_oldest_first_once_each_per_run():
    first, second, other = _pending("run-a"), _pending("run-a"), _pending("run-b")
    for p in (first, second, other):
        overlap.put(p)
    assert overlap.take("run-a") is first and overlap.take("run-a") is second and overlap.take("run-a") is None
    assert overlap.take("run-b") is other and overlap.take("run-never") is None


def test_a_worker_keeps_the_hand_overs_of_the_runs_it_trained_for_last_not_first():
    """Past its bound of runs a worker forgets the run it used longest ago, not the one that started first
    (a long run beside short ones kept losing its hand-overs)."""
    long_run = [_pending("run-long") for _ in range(5)]
    overlap.put(long_run[0])
    for i, short in enumerate(("s1", "s2", "s3", "s4")):
        overlap.put(_pending(short))
        overlap.put(long_run[i + 1])  # the long run goes on between them
    assert overlap.take("run-long") is long_run[0]
    assert overlap.take("s1") is None  # the run used longest ago
    for run in ("s2", "s3", "s4", "run-long"):
        overlap.forget(run)


def test_a_pending_base_is_fetched_in_a_thread_and_never_waited_for_between_steps():
    answer: concurrent.futures.Future = concurrent.futures.Future()
    pending = _pending("run-c", answer)
    params = flatten(torch.nn.Linear(2, 1))
    pending.resolve(lambda p: overlap.Base(p.answer.result(), params))
    assert not pending.ready()  # the answer is not there: training goes on
    answer.set_result({"version": "v7", "step": 7})
    base = pending.result()
    assert pending.ready() and base.answer == {"version": "v7", "step": 7} and base.params is params


@pytest.mark.gpu
def test_the_delta_rule_on_cuda_takes_a_pinned_cpu_base():
    """As a CUDA worker does it: W_c kept on the GPU, the merged version in pinned CPU memory."""
    device = torch.device("cuda")
    model = _net().to(device)
    own = flatten(model, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # what the next task learned before the merge came
    learned = flatten(model).arrays["float32"] - own.arrays["float32"].cpu()
    server = _net()
    _train(server, 3, seed=3)
    merged = flatten(server)
    pinned = type(merged)(merged.layout, {d: a.pin_memory() for d, a in merged.arrays.items()})
    overlap.correct(model, pinned, own)
    after = flatten(model)  # (packed on the CPU)
    torch.testing.assert_close(after.arrays["float32"], merged.arrays["float32"] + learned)
    assert torch.equal(after.arrays["int64"], merged.arrays["int64"])
    assert all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.gpu
def test_adam_state_kept_on_cuda_is_checked_without_mixing_devices():
    from vcdask import inner

    model = torch.nn.Linear(3, 1).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3, device="cuda")).sum().backward()
    opt.step()
    devices = {t.device.type for state in opt.state.values() for t in state.values()}
    assert devices == {"cpu", "cuda"}  # step on the CPU, the moments on the GPU: what crashed every run
    assert inner._finite_state(opt)


def test_a_delta_task_trains_at_most_half_its_steps_before_its_merged_base():
    assert overlap.most_ahead(40) == int(overlap.MAX_AHEAD * 40) and overlap.most_ahead(2) == 1
    assert overlap.most_ahead(1) == 1  # a one-step task may take its step (then it waits at its end)


def test_a_merge_that_took_the_update_as_it_was_leaves_the_training_untouched():
    """One task in flight: the merged version is W_c itself, and the task's steps since are kept bit for bit
    (``merged + (model - own)`` would round them, at a moment that depends on when the base arrived)."""
    model = _net()
    _train(model, 3, seed=1)
    own = flatten(model)
    with torch.no_grad():  # far from W_c, where (model - own) + own is not model in float32
        for p in model.parameters():
            p.mul_(37.0).add_(0.1)
    before = flatten(model)
    rounded = (before.arrays["float32"] - own.arrays["float32"]) + own.arrays["float32"]
    assert not torch.equal(rounded, before.arrays["float32"])  # (what the correction would have done)
    overlap.correct(model, own.clone(), own)
    assert flatten(model).equal(before)
