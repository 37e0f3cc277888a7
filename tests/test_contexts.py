"""Rounds send what changed (deployments/contexts.py): a sequence's context reaches a model server
once, then each round carries the tokens past it; the server rebuilds the items. No Ray here."""

import asyncio
import pickle

import torch

from app.params import SamplingParams
from app.speculation.steps import Proposal, VerifyItem
from deployments.contexts import ContextMirror, ContextUnknown, SentContexts, answer, shared_prefix

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


def test_a_context_that_diverges_from_what_was_sent_builds_on_what_they_share():
    """A context drafted ahead ends in a guessed token; the next may replace it: the shared tokens stay."""
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3, 7])]))
    (d,) = sent.encode([item("a", [1, 2, 3, 9, 4])])  # the guess 7 was wrong
    assert (d.base, d.item.token_ids) == (3, [9, 4])
    assert rank.decode([d])[0].token_ids == [1, 2, 3, 9, 4]
    (d,) = sent.encode([item("a", [5, 6])])  # nothing shared: whole
    assert (d.base, d.after, d.item.token_ids) == (0, 0, [5, 6]) and rank.decode([d])[0].token_ids == [5, 6]
    assert shared_prefix(list(range(1000)), list(range(700)) + [0] * 300) == 700


def test_calls_that_arrive_out_of_order_are_asked_for_whole_never_rebuilt_wrong():
    """A cancelled call still in flight lands after a newer one: its receiver holds another version
    than the next delta was cut against, even where the tokens at the cut agree."""
    sent, rank = SentContexts(), ContextMirror()
    rank.decode(sent.encode([item("a", [1, 2, 3])]))
    ahead = sent.encode([item("a", [1, 2, 3, 7, 8])])  # drafted ahead on a guess, then cancelled
    current = sent.encode([item("a", [1, 2, 3, 9, 8])])
    rank.decode(current)
    rank.decode(ahead)  # the stale call arrives last
    (d,) = sent.encode([item("a", [1, 2, 3, 9, 8, 5])])
    (out,) = rank.decode([d])
    assert isinstance(out, ContextUnknown)  # not [1, 2, 3, 7, 8, 5]
    sent.drop("a")
    assert rank.decode(sent.encode([item("a", [1, 2, 3, 9, 8, 5])]))[0].token_ids == [1, 2, 3, 9, 8, 5]


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
    unknown.base, unknown.after = 5, 12345  # builds on a version no one holds
    out = asyncio.run(answer(rank, encoded + [unknown], submit))
    assert out[0] == [1, 2, 3] and isinstance(out[1], ValueError) and isinstance(out[2], ContextUnknown)
