"""Rounds send what changed: a sequence's context goes to a model server once, then each round
sends only the tokens past what that server already holds.

A round's items (VerifyItems to tensor-parallel ranks, ProposeItems to the draft pool) each carry
their sequence's whole context; at 32 sequences of 32k tokens that is about a million ids a round,
pickled and read by every receiver. The sender keeps, per sequence, the last context it sent and
that message's version (`SentContexts`); the receiver keeps the contexts with their versions
(`ContextMirror`) and rebuilds each item from the tokens it shares with the version it was cut
against (a context drafted ahead ends in guessed tokens the next one may not share). A receiver
that does not hold that version (a draft replica the call was routed to for the first time, an
entry it let go, calls that arrived out of order) says so per item (`ContextUnknown`), and the
sender sends that item again, whole. No Ray here.
"""

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass, replace


@dataclass
class Delta:
    """An item whose token_ids are only its context past `base` tokens: the first `base` tokens of the
    context the sender sent as version `after` (0: none, the item is whole); this one is `version`."""

    base: int
    after: int
    version: int
    item: object  # a ProposeItem or VerifyItem with the context's tail as its token_ids

    @property
    def seq_id(self) -> str:  # what the draft pool's router reads to find the sequence's home
        return self.item.seq_id


class ContextUnknown(Exception):
    """This receiver does not hold the context an item builds on: send it whole."""


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share. Contexts differ near their ends (a token guessed while
    drafting ahead), so the whole common length is tried first; else a binary search, each probe a
    list comparison (C speed), not a Python loop over the tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SentContexts:
    """What a sender has sent of each sequence's context: the last context sent and its version. A
    version names one message, so a receiver rebuilds only from exactly the context a delta was cut
    against: calls that arrive out of order (a cancelled call still in flight) find a version they
    do not hold and ask for the item whole, never rebuild from the wrong tokens."""

    def __init__(self):
        self._sent: dict[str, tuple[list[int], int]] = {}
        self._versions = itertools.count(1)

    def encode(self, items: list) -> list[Delta]:
        out = []
        for item in items:
            ids = item.token_ids
            before, after = self._sent.get(item.seq_id, ([], 0))
            base = shared_prefix(before, ids) if after else 0
            version = next(self._versions)
            out.append(Delta(base, after if base else 0, version, replace(item, token_ids=ids[base:])))
            self._sent[item.seq_id] = (list(ids), version)
        return out

    def drop(self, seq_id: str) -> None:
        self._sent.pop(seq_id, None)


class ContextMirror:
    """Each sequence's context as a receiver has it, with the version it came as, for at most
    `max_sequences` sequences (the least recently used go first: a sender whose sequences were never
    released must not grow it forever)."""

    def __init__(self, max_sequences: int = 1 << 16):
        self._contexts: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        self.max_sequences = max_sequences

    def decode(self, encoded: list[Delta]) -> list:
        """The items rebuilt, each with a list of its own, or a ContextUnknown for each this mirror
        cannot rebuild (it does not hold the version the delta was cut against)."""
        out = []
        for d in encoded:
            seq = d.item.seq_id
            known, version = self._contexts.get(seq, ([], 0))
            if d.base and (version != d.after or d.base > len(known)):
                self._contexts.pop(seq, None)
                out.append(ContextUnknown(f"sequence {seq}: a delta on version {d.after}, held {version}"))
                continue
            known = known[: d.base] + d.item.token_ids
            self._contexts[seq] = (known, d.version)
            self._contexts.move_to_end(seq)
            out.append(replace(d.item, token_ids=list(known)))
        while len(self._contexts) > self.max_sequences:
            self._contexts.popitem(last=False)
        return out

    def drop(self, seq_id: str) -> None:
        self._contexts.pop(seq_id, None)


async def answer(mirror: ContextMirror, encoded: list[Delta], submit) -> list:
    """A receiver's results for one call, in order: each item rebuilt and passed to `submit` (an async
    call), a ContextUnknown for each it cannot rebuild; an item that fails fails alone."""

    async def one(item):
        if isinstance(item, ContextUnknown):
            return item
        return await submit(item)

    return await asyncio.gather(*(one(item) for item in mirror.decode(encoded)), return_exceptions=True)
