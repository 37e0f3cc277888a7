"""A tensor-parallel round sends each sequence's new context tokens, not its whole context
(deployments/tp.py SentContexts on the replica, ContextMirror on every rank); no Ray here."""

import pickle

import pytest
import torch

from app.params import SamplingParams
from app.speculation.steps import Proposal, VerifyItem
from deployments.tp import ContextMirror, SentContexts

EMPTY = Proposal([], torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1))


def item(seq_id: str, ids: list[int]) -> VerifyItem:
    return VerifyItem(seq_id, list(ids), EMPTY, SamplingParams(temperature=0), seed=0)


def test_rounds_send_what_changed_and_every_rank_rebuilds_the_contexts():
    sent, ranks = SentContexts(), [ContextMirror(), ContextMirror()]
    contexts = {f"s{i}": list(range(i, i + 32_000)) for i in range(32)}
    sizes = []
    for round_ in range(3):
        items = [item(seq, ids) for seq, ids in contexts.items()]
        sent_lengths = {seq: len(ids) for seq, ids in contexts.items()}
        encoded = sent.encode(items)
        sizes.append(len(pickle.dumps(encoded)))
        for rank in ranks:  # every rank rebuilds the very items the replica verified
            assert [i.token_ids for i in rank.decode(encoded)] == [i.token_ids for i in items]
        for seq, ids in contexts.items():  # the round kept up to 5 tokens per sequence
            ids += [7] * (1 + (round_ + len(seq)) % 5)
    # the first round carries the contexts (32 x 32k ids); the next only what each round added
    assert sizes[1] < sizes[0] / 100 and sizes[2] < sizes[0] / 100
    encoded = sent.encode([item(seq, ids) for seq, ids in contexts.items()])  # the tokens past the last round's
    assert [(base, i.token_ids) for base, i in encoded] == [(sent_lengths[s], contexts[s][sent_lengths[s]:])
                                                            for s in contexts]
    assert all(len(i.token_ids) in range(1, 6) for _, i in encoded)


def test_a_context_that_does_not_extend_what_was_sent_goes_whole():
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3])]))
    (base, delta), = sent.encode([item("a", [1, 2, 9, 4])])  # last sent token changed: whole
    assert base == 0 and delta.token_ids == [1, 2, 9, 4]
    assert rank.decode([(base, delta)])[0].token_ids == [1, 2, 9, 4]
    (base, delta), = sent.encode([item("a", [1, 2, 9, 4, 5])])
    assert (base, delta.token_ids) == (4, [5])


def test_a_dropped_sequence_is_sent_whole_and_a_rank_that_lost_it_refuses_a_delta():
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3])]))
    sent.drop("a")
    rank.drop("a")
    (base, delta), = sent.encode([item("a", [1, 2, 3, 4])])
    assert base == 0 and rank.decode([(base, delta)])[0].token_ids == [1, 2, 3, 4]
    rank.drop("a")  # a rank that forgot what the replica thinks it holds: the batch fails, as a request's error
    with pytest.raises(RuntimeError, match="holds 0"):
        rank.decode(sent.encode([item("a", [1, 2, 3, 4, 5])]))
