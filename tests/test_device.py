"""The hot path is device-correct: sampling, drafting and verification create every tensor next to the
model's logits, and only CPU tensors and plain ids leave a server. Checked without a GPU by marking
the logits as living on another device (tests/device_guard.py): mixing it with a CPU tensor raises."""

import pytest
import torch

from app.speculation.logits import LogitRules
from app.params import SamplingParams
from app.speculation.sampling import process_logits, rejection_sample, sample, uniform
from app.speculation.drafting import _draft_step, _guess, propose
from app.speculation.steps import Proposal, ProposeItem, VerifyItem, _verdicts, sampling_tensors
from tests.device_guard import (
    MixedDeviceError,
    guard,
    is_on_accelerator,
    on_accelerator,
)

V = 50


def params(temperature: float, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=temperature, **kw)


CONTROLS = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={3: 2.0},
                min_tokens=2, min_p=0.05, logprobs=2)


def logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_guard_catches_what_a_gpu_would_refuse():
    x = on_accelerator(logits(4))
    with guard(), pytest.raises(MixedDeviceError):
        x / torch.tensor([1.0, 2.0, 3.0, 4.0]).unsqueeze(-1)  # the sampled-draft defect: a CPU temperature
    with guard():
        assert x.device.type == "meta" and is_on_accelerator(x / torch.tensor(2.0))  # CPU scalars are fine


def test_sampling_and_rejection_run_on_the_logits_device():
    p_logits, b, k = logits(2, 4), 2, 3
    def args(dev) -> dict:
        return {"draft_tokens": dev(torch.tensor([[3, 4, 5], [6, 7, 0]])),
                "q_ids": dev(torch.tensor([[[3], [4], [5]], [[6], [7], [0]]])), "q_probs": dev(torch.ones(b, k, 1)),
                "num_draft": dev(torch.tensor([3, 2])), "greedy": dev(torch.tensor([False, True])),
                "seeds": dev(torch.tensor([1, 2])), "start_pos": dev(torch.tensor([10, 20]))}

    t, tk, tp = torch.tensor([0.8, 0.0]).repeat_interleave(4), torch.zeros(8, dtype=torch.long), torch.full((8,), 0.9)
    expected = rejection_sample(process_logits(p_logits.view(-1, V), t, tk, tp).view(b, 4, V), **args(lambda x: x))
    with guard():
        dev = on_accelerator
        p = process_logits(dev(p_logits.view(-1, V)), dev(t), dev(tk), dev(tp)).view(b, 4, V)
        accepted, tokens = rejection_sample(p, **args(dev))
        assert is_on_accelerator(accepted) and is_on_accelerator(tokens)
        drawn = sample(p[:, 0], uniform(dev(torch.tensor([1, 2])), dev(torch.tensor([5, 6])), 1))
        assert is_on_accelerator(drawn)
    assert torch.equal(accepted.as_subclass(torch.Tensor), expected[0])
    assert torch.equal(tokens.as_subclass(torch.Tensor), expected[1])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_step_and_its_guess_on_the_device(temperature):
    items = [ProposeItem(str(i), [1, 2, 3], 3, params(temperature, top_p=0.9), seed=i) for i in range(3)]
    with guard():
        lg, positions = on_accelerator(logits(3)), on_accelerator(torch.tensor([3, 3, 3]))
        # what a proposal uploads once for all its steps, on the device too
        sampling = None if temperature == 0 else sampling_tensors([it.sampling for it in items], lg.device)
        seeds = on_accelerator(torch.tensor([it.seed for it in items]))
        assert sampling is None or all(is_on_accelerator(t) for t in sampling)
        tokens, q_ids, q_probs = _draft_step(lg, items, positions, 8, sampling, seeds)
        assert all(is_on_accelerator(t) for t in (tokens, q_ids, q_probs))
        assert is_on_accelerator(_guess(lg, items, positions, sampling, seeds))


class FakeBatch:
    """A runner batch whose logits live on the (marked) device."""

    def __init__(self, seqs):
        self.logits = [on_accelerator(logits(s.num_logits, seed=i)) for i, s in enumerate(seqs)]
        self.closed = None

    def extend(self, tokens):
        assert is_on_accelerator(tokens)  # drafted tokens stay on the device between steps: no sync
        return on_accelerator(logits(len(tokens), seed=len(tokens)))

    def close(self, keep, extended=None):
        assert all(type(t) is int for row in extended or [] for t in row)  # their values, read once at the end
        self.closed = keep


class FakeRunner:
    vocab_size = V
    grammars = None  # requests here have no grammar

    def open(self, seqs):
        self.batch = FakeBatch(seqs)
        return self.batch

    def prefill(self, seqs, budget=None):
        return 0  # no cache to fill


@pytest.mark.parametrize("with_rules", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_proposals_leave_the_draft_as_cpu_tensors(temperature, with_rules):
    """A proposal is pickled to target replicas that may have no GPU: nothing in it may be on the draft's."""
    sampling = params(temperature, **(CONTROLS if with_rules else {}))
    rules = LogitRules.of(sampling, 2, frozenset({0}))
    items = [ProposeItem(str(i), [1, 2, 3 + i], 3, sampling, seed=i, guess=True, rules=rules) for i in range(2)]
    with guard():
        out = propose(FakeRunner(), items, top_n=8)
    for proposal in out:
        assert len(proposal.tokens) == 3 and all(type(t) is int for t in proposal.tokens)
        assert type(proposal.guess) is int
        assert not is_on_accelerator(proposal.q_ids) and not is_on_accelerator(proposal.q_probs)


@pytest.mark.parametrize("controls", [{}, CONTROLS, dict(CONTROLS, logprobs_mode="processed")],
                         ids=["plain", "rules-logprobs", "processed-logprobs"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verification_stays_on_the_target_device(temperature, controls):
    proposal = Proposal([4, 5], torch.tensor([[4, 9], [5, 8]]), torch.tensor([[0.7, 0.3], [0.6, 0.4]]))
    sampling = params(temperature, **controls)
    rules = LogitRules.of(sampling, 2, frozenset({0}))
    items = [VerifyItem(str(i), [1, 2, 3], proposal, sampling, seed=i, rules=rules) for i in range(3)]
    runner = FakeRunner()
    with guard():
        batch = runner.open([type("S", (), {"num_logits": 3})() for _ in items])
        verdicts = _verdicts(batch, items, runner, [])
    if controls:
        assert all(len(vd.logprobs) == len(vd.tokens) for vd in verdicts)
    for vd in verdicts:
        assert 1 <= len(vd.tokens) <= 3 and all(type(t) is int for t in vd.tokens) and type(vd.accepted) is int
    assert batch.closed == [3 + vd.accepted for vd in verdicts]
