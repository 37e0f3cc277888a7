"""Rounds send what changed: a sequence's context goes to a model server once, then each round
sends only the tokens past what that server already holds.

A round's items (VerifyItems to tensor-parallel ranks, ProposeItems to the draft pool) each carry
their sequence's whole context; at 32 sequences of 32k tokens that is about a million ids a round,
pickled and read by every receiver. The sender keeps, per sequence, the length and last token it
sent (`SentContexts`); the receiver keeps the contexts (`ContextMirror`) and rebuilds each item.
A context only grows (committed tokens never roll back; a retried request has a new id), so one
that does not extend what was sent goes whole. A receiver that does not hold what an item builds
on (a draft replica the call was routed to for the first time, an entry it let go) says so per
item (`ContextUnknown`), and the sender sends that item again, whole. No Ray here.
"""

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, replace


@dataclass
class Delta:
    """An item whose token_ids are only its context past `base` tokens; `last` is token base - 1."""

    base: int
    last: int | None
    item: object  # a ProposeItem or VerifyItem with the context's tail as its token_ids

    @property
    def seq_id(self) -> str:  # what the draft pool's router reads to find the sequence's home
        return self.item.seq_id


class ContextUnknown(Exception):
    """This receiver does not hold the context an item builds on: send it whole."""


class SentContexts:
    """What a sender has sent of each sequence's context: (length, last token)."""

    def __init__(self):
        self._sent: dict[str, tuple[int, int]] = {}

    def encode(self, items: list) -> list[Delta]:
        out = []
        for item in items:
            ids = item.token_ids
            n, last = self._sent.get(item.seq_id, (0, None))
            base = n if 0 < n <= len(ids) and ids[n - 1] == last else 0
            out.append(Delta(base, ids[base - 1] if base else None, replace(item, token_ids=ids[base:])))
            if ids:
                self._sent[item.seq_id] = (len(ids), ids[-1])
        return out

    def drop(self, seq_id: str) -> None:
        self._sent.pop(seq_id, None)


class ContextMirror:
    """Each sequence's context as a receiver has it, for at most `max_sequences` sequences (the least
    recently used go first: a sender whose sequences were never released must not grow it forever)."""

    def __init__(self, max_sequences: int = 1 << 16):
        self._contexts: OrderedDict[str, list[int]] = OrderedDict()
        self.max_sequences = max_sequences

    def decode(self, encoded: list[Delta]) -> list:
        """The items rebuilt, each with a list of its own (the mirror's grows on), or a ContextUnknown
        for each this mirror cannot rebuild."""
        out = []
        for d in encoded:
            seq = d.item.seq_id
            known = self._contexts.get(seq, [])
            if d.base > len(known) or (d.base and known[d.base - 1] != d.last):
                self._contexts.pop(seq, None)
                out.append(ContextUnknown(f"sequence {seq}: sent past {d.base} context tokens, held {len(known)}"))
                continue
            if d.base == len(known):
                known.extend(d.item.token_ids)  # the usual round: only the new tokens are copied
            else:
                known = known[: d.base] + d.item.token_ids
            self._contexts[seq] = known
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
