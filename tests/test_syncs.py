"""Host syncs per round, counted on CPU (app/model/syncs.py): a verify round reads the device once (its
verdicts' token ids), a proposal once per draft call (its tokens), never once per sequence or step."""

import pytest
import torch

from app.params import SamplingParams
from app.model.runner import Execution, ModelRunner
from app.speculation.steps import Proposal, ProposeItem, VerifyItem, verify
from app.speculation.drafting import propose
from app.model.syncs import SyncCounter
from conftest import blend

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(10, 90)), [42] * 12]


def sampling(greedy: bool) -> SamplingParams:
    return SamplingParams(temperature=0 if greedy else 0.8, top_p=1.0 if greedy else 0.9, max_tokens=16)


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.arange(4)
    with SyncCounter() as syncs:
        x.tolist(), x[0].item(), bool(x.any()), x.cpu(), int(x[1]), float(x[2])
        if x.sum() > 2:
            pass
    assert syncs.by_call == {"tolist": 1, "item": 1, "__bool__": 2, "cpu": 1, "__int__": 1, "__float__": 1}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_round_reads_the_device_once(target_model, tokenizer, greedy):
    target = ModelRunner(target_model, tokenizer)
    draft = ModelRunner(blend(target_model, 7, 0.9), tokenizer)
    params = sampling(greedy)
    asks = [ProposeItem(f"s{i}", p, 4, params, seed=i, guess=True) for i, p in enumerate(PROMPTS)]
    propose(draft, asks)  # prompts cached: the counted calls below are a steady round's
    verify(target, [VerifyItem(a.seq_id, a.token_ids, Proposal.empty(), params, a.seed) for a in asks])
    with SyncCounter() as draft_syncs:
        proposals = propose(draft, asks)
    with SyncCounter() as target_syncs:
        verdicts = verify(target, [VerifyItem(a.seq_id, a.token_ids, p, params, a.seed)
                                   for a, p in zip(asks, proposals)])
    assert all(len(p.tokens) == 4 for p in proposals) and all(v.tokens for v in verdicts)
    # the target: one transfer for the whole batch (every row's accepted ids), whatever its size
    assert target_syncs.count == 1, target_syncs.by_call
    # the draft: five steps (four tokens and the guess) and no read between them; its proposal's
    # tokens, q ids and q probabilities come back once each at the end
    assert draft_syncs.by_call == {"cpu": 3, "tolist": 1}, draft_syncs.by_call
    # asked for its runner-ups too (a greedy sequence that branches): they ride with the tokens
    with SyncCounter() as branching:
        propose(draft, [ProposeItem(a.seq_id, a.token_ids, 4, params, a.seed, guess=True, runner_ups=2) for a in asks])
    assert branching.by_call == draft_syncs.by_call, branching.by_call


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_round_uploads_a_bounded_number_of_times_whatever_the_batch(target_model, tokenizer, greedy):
    """Host-to-device copies (from pageable memory each synchronises a GPU's stream): a forward's
    indices go in one copy, a proposal's per-call values once for all its steps, a verify's proposals
    in one copy per kind; before, a draft step made B+3 copies and a sampled verify 3 per sequence."""
    counts = []
    for prompts in (PROMPTS[:2], PROMPTS):
        target = ModelRunner(target_model, tokenizer)
        draft = ModelRunner(blend(target_model, 7, 0.9), tokenizer)
        params = sampling(greedy)
        asks = [ProposeItem(f"s{i}", p, 4, params, seed=i, guess=True) for i, p in enumerate(prompts)]
        propose(draft, asks)
        verify(target, [VerifyItem(a.seq_id, a.token_ids, Proposal.empty(), params, a.seed) for a in asks])
        with SyncCounter() as draft_syncs:
            proposals = propose(draft, asks)
        with SyncCounter() as target_syncs:
            verify(target, [VerifyItem(a.seq_id, a.token_ids, p, params, a.seed) for a, p in zip(asks, proposals)])
        counts.append((draft_syncs.upload_count, target_syncs.upload_count))
    steps = 5  # four draft tokens and the guess
    # the draft: one per step's forward, and once per proposal its positions and seeds (and, sampled,
    # its sampling parameters); the target: one for its forward (and, sampled, the sampling
    # parameters, the proposals' q ids, their q probabilities, and its columns)
    assert counts == [(steps + 1, 1)] * 2 if greedy else counts == [(steps + 2, 5)] * 2, counts


def test_the_counter_sees_uploads_the_engine_asks_for():
    ids = [1, 2, 3]
    with SyncCounter(upload_callers=(__name__,)) as syncs:
        torch.tensor(ids, device="cpu"), torch.tensor(ids), torch.zeros(3).to("cpu"), torch.zeros(3).to(torch.float64)
    assert syncs.uploads == {"tensor": 1, "to": 1} and syncs.count == 0


@pytest.mark.parametrize("attention", ["per_sequence", "varlen"])
def test_a_forward_over_borrowed_prefixes_uploads_once_on_the_gpu_paths(attention, target_model, tokenizer):
    """The GPU's attention paths: tables in two runs (a prefix borrowed by reference, then their own
    blocks) are gathered, and their indices travel in the forward's one copy; before, each such
    span made a copy of its own (a stream sync per fragmented sequence per forward)."""
    from app.model.runner import SeqInput

    runner = ModelRunner(target_model, tokenizer, Execution(attention=attention))
    runner.compact_tables = False  # as on a GPU: tables stay in their runs (the CPU moves them into one)
    donor = list(range(3, 60))
    runner.forward([SeqInput("donor", donor, 1)])
    borrowers = [SeqInput(f"b{i}", donor + [70 + i] * (3 + i), 1) for i in range(3)]
    runner.forward(borrowers)
    steps = [SeqInput(s.seq_id, s.token_ids + [5], 1) for s in borrowers]
    with SyncCounter() as syncs:
        runner.forward(steps)
    assert all(len(runner.cache.get(s.seq_id).runs(len(s.token_ids))) > 1 for s in steps)  # gathered
    assert syncs.upload_count == 1, syncs.uploads
