"""Prefix-cache isolation: a sequence borrows only KV cached under its own cache_salt (None: shared),
so time to first token tells a client nothing of another's prompts; output is the same either way."""

import torch

from app.engine import Engine
from app.model.kv import PREFIX_BLOCK, block_keys
from app.params import SamplingParams
from app.model.runner import ModelRunner, SeqInput
from conftest import blend, kv_store, put_ids

ATOL = 1e-4


def ids_of(seed: int, n: int) -> list[int]:
    return torch.randint(2, 98, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_sequence_borrows_only_under_its_own_salt(target_model, tokenizer):
    runner = ModelRunner(target_model, tokenizer)
    prompt = ids_of(1, 2 * PREFIX_BLOCK + 5)
    runner.forward([SeqInput("alice-1", prompt + [7], salt="alice")])
    runner.release("alice-1")  # finished: a prefix donor, for alice's sequences only
    logits = {}
    for seq, salt in (("bob", "bob"), ("shared", None), ("alice-2", "alice")):
        batch = runner.open([SeqInput(seq, prompt + [9], 2, salt)])
        logits[seq] = batch.logits[0]
        batch.close([len(prompt) + 1])
        hit = runner.cache.prefix_hit_tokens
        assert (batch.recomputed, hit) == ((2, len(prompt) - 1) if salt == "alice" else (len(prompt) + 1, 0)), seq
    torch.testing.assert_close(logits["bob"], logits["alice-2"], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits["shared"], logits["alice-2"], atol=ATOL, rtol=0)


def test_the_index_confirms_the_salt():
    """A salted key that collided with another scope's would still not lend it: the salt is checked."""
    store = kv_store(16)
    ids = list(range(2 * PREFIX_BLOCK))
    put_ids(store, "a", ids, "s")
    assert store.borrow(ids, len(ids)) is None and store.borrow(ids, len(ids), "t") is None
    assert len(store.borrow(ids, len(ids), "s")) == len(ids)
    for _, key in block_keys(ids):
        store._index[key] = "a"  # the unsalted chain points at a salted donor
    assert store.borrow(ids, len(ids)) is None


def test_engine_requests_share_prefixes_only_with_the_same_salt(target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"

    def run(salts: list[str | None]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, cache_salt=s) for s in salts]
        return [r.token_ids for r in engine.generate([prompt] * len(salts), params)]

    first = run(["alice", "bob"])  # at once, with the same prompt: no prefill shared across salts
    assert engine.target.cache.prefix_hit_tokens == 0
    assert run([None]) == [first[0]] and engine.target.cache.prefix_hit_tokens == 0
    assert run(["bob"]) == [first[0]]  # bob's earlier sequence is a donor for bob
    assert engine.target.cache.prefix_hit_tokens >= len(prompt) - 1
    assert first[1] == first[0]
