"""Rounds send what changed (deployments/contexts.py): a sequence's context reaches a model server
once, then each round carries the tokens past it; the server rebuilds the items. No Ray here."""

import asyncio
import pickle

import torch

from app.params import SamplingParams
from app.speculation.steps import Proposal, VerifyItem
from deployments.contexts import ContextMirror, ContextUnknown, SentContexts, answer

EMPTY = Proposal([], torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1))


def item(seq_id: str, ids: list[int]) -> VerifyItem:
    return VerifyItem(seq_id, list(ids), EMPTY, SamplingParams(temperature=0), seed=0)


def test_rounds_send_what_changed_and_every_receiver_rebuilds_the_items():
    sent, ranks = SentContexts(), [ContextMirror(), ContextMirror()]
    contexts = {f"s{i}": list(range(i, i + 32_000)) for i in range(32)}
    sizes = []
    for round_ in range(3):
        items = [item(seq, ids) for seq, ids in contexts.items()]
        sent_lengths = {seq: len(ids) for seq, ids in contexts.items()}
        encoded = sent.encode(items)
        sizes.append(len(pickle.dumps(encoded)))
        for rank in ranks:  # every receiver rebuilds the very items the sender had
            assert [i.token_ids for i in rank.decode(encoded)] == [i.token_ids for i in items]
        for seq, ids in contexts.items():  # the round kept 1 to 5 tokens per sequence
            ids += [7] * (1 + (round_ + len(seq)) % 5)
    # the first round carries the contexts (32 x 32k ids, 3.1 MB); the next only what each round added
    assert sizes[1] < sizes[0] / 100 and sizes[2] < sizes[0] / 100
    encoded = sent.encode([item(seq, ids) for seq, ids in contexts.items()])
    assert [(d.base, d.item.token_ids) for d in encoded] == [(sent_lengths[s], contexts[s][sent_lengths[s]:])
                                                             for s in contexts]
    assert all(len(d.item.token_ids) in range(1, 6) for d in encoded)


def test_a_rebuilt_item_owns_its_list():
    sent, rank = SentContexts(), ContextMirror()
    first = rank.decode(sent.encode([item("a", [1, 2, 3])]))[0]
    rank.decode(sent.encode([item("a", [1, 2, 3, 4])]))
    assert first.token_ids == [1, 2, 3]  # the mirror grew; the item handed out before did not


def test_a_context_that_does_not_extend_what_was_sent_goes_whole():
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3])]))
    (d,) = sent.encode([item("a", [1, 2, 9, 4])])  # the last sent token changed: whole
    assert d.base == 0 and d.item.token_ids == [1, 2, 9, 4]
    assert rank.decode([d])[0].token_ids == [1, 2, 9, 4]
    (d,) = sent.encode([item("a", [1, 2, 9, 4, 5])])
    assert (d.base, d.last, d.item.token_ids) == (4, 4, [5])


def test_a_receiver_without_the_context_says_so_per_item_and_the_item_goes_whole_again():
    sent, rank, other = SentContexts(), ContextMirror(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3]), item("b", [5])]))
    encoded = sent.encode([item("a", [1, 2, 3, 4]), item("b", [5, 6])])
    out = other.decode(encoded)  # routed to a receiver that never saw them
    assert all(isinstance(o, ContextUnknown) for o in out)
    sent.drop("a")
    (d,) = sent.encode([item("a", [1, 2, 3, 4])])
    assert d.base == 0 and other.decode([d])[0].token_ids == [1, 2, 3, 4]
    assert other.decode([sent.encode([item("a", [1, 2, 3, 4, 5])])[0]])[0].token_ids == [1, 2, 3, 4, 5]
    diverged = ContextMirror()  # holds as many tokens, but not the ones the sender built on
    diverged.decode([SentContexts().encode([item("a", [1, 2, 3, 9])])[0]])
    assert isinstance(diverged.decode([sent.encode([item("a", [1, 2, 3, 4, 5, 6])])[0]])[0], ContextUnknown)


def test_the_mirror_keeps_at_most_its_bound_of_sequences():
    sent, rank = SentContexts(), ContextMirror(max_sequences=2)
    for seq in "abc":
        rank.decode(sent.encode([item(seq, [1, 2])]))
    out = rank.decode(sent.encode([item(s, [1, 2, 3]) for s in "abc"]))
    assert isinstance(out[0], ContextUnknown) and [o.token_ids for o in out[1:]] == [[1, 2, 3], [1, 2, 3]]


def test_answer_submits_what_it_rebuilds_and_fails_items_alone():
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1])]))

    async def submit(it):
        if it.seq_id == "bad":
            raise ValueError("bad")
        return it.token_ids

    encoded = sent.encode([item("a", [1, 2, 3]), item("bad", [3])])
    unknown = SentContexts().encode([item("z", [9])])[0]
    unknown.base, unknown.last = 5, 1  # builds on what no one holds
    out = asyncio.run(answer(rank, encoded + [unknown], submit))
    assert out[0] == [1, 2, 3] and isinstance(out[1], ValueError) and isinstance(out[2], ContextUnknown)
