"""ModelRunner: prefix reuse, rollback, ragged batches and eviction give a fresh forward's logits."""

import pytest
import torch

from app.model.kv import OutOfBlocks
from conftest import kv_store, put_ids
from app.model.runner import Execution, ModelRunner, SeqInput

ATOL = 1e-4


@pytest.fixture(params=["ragged", "per_sequence", "padded", "flex", "varlen"])
def target_runner(request, target_model, tokenizer):
    """Every forward layout: packed rows (the default: on a CPU, every span through the paged kernel),
    packed rows with one SDPA call per sequence, packed rows with FlexAttention over the pool (a small
    pool here: the CPU runs FlexAttention's reference code), packed rows with sequences' contexts
    gathered for one varlen call per layer (a GPU's FlashAttention; here the reference of its
    contract), and padded batches (models ragged attention cannot serve exactly, e.g. sliding windows)."""
    if request.param == "flex":
        return ModelRunner(target_model, tokenizer, Execution(attention="flex"), max_cache_bytes=4 << 20)
    if request.param in ("per_sequence", "varlen"):
        return ModelRunner(target_model, tokenizer, Execution(attention=request.param))
    runner = ModelRunner(target_model, tokenizer)
    runner.ragged = request.param == "ragged"
    return runner


def fresh_logits(model, ids: list[int], n: int) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -n:].float()


def random_ids(seed: int, n: int, vocab: int = 98) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_ragged_batch_matches_fresh_forward(target_runner, target_model):
    seqs = [SeqInput("a", random_ids(0, 23), 3), SeqInput("b", random_ids(1, 5), 1), SeqInput("c", random_ids(2, 11), 5)]
    for s, logits in zip(seqs, target_runner.forward(seqs)):
        torch.testing.assert_close(logits, fresh_logits(target_model, s.token_ids, s.num_logits), atol=ATOL, rtol=0)


def test_prefix_reuse_computes_only_the_rest(target_runner, target_model):
    ids = random_ids(3, 30)
    target_runner.forward([SeqInput("a", ids[:20])])
    batch = target_runner.open([SeqInput("a", ids, 2)])
    assert batch.recomputed == 10  # the 20 cached positions are reused
    torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, ids, 2), atol=ATOL, rtol=0)
    batch.close([len(ids)])
    assert target_runner.cache.get("a").token_ids == ids


def test_a_new_sequence_prefills_only_past_the_prefix_it_will_borrow(target_model, tokenizer):
    """A request's branch (a new sequence id over its context) starts where the borrowable prefix ends:
    the store says how far without borrowing, and prefill() then computes nothing it would borrow."""
    runner = ModelRunner(target_model, tokenizer, max_forward_tokens=16)
    ids = random_ids(4, 70)
    runner.prefill([SeqInput("a", ids, 1)])
    runner.forward([SeqInput("a", ids, 1)])
    assert runner.cache.prefix_len(ids + [5, 6]) == 70 and runner.cache.prefix_len(random_ids(5, 70)) == 0
    assert runner.cache.prefix_len(ids[:10]) == 0  # under one block: never borrowed
    assert runner.prefill([SeqInput("a#b0", ids + [5, 6], 1)]) == 0  # no chunk forward: it borrows 70
    batch = runner.open([SeqInput("a#b0", ids + [5, 6], 1)])
    assert batch.recomputed == 2
    torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, ids + [5, 6], 1), atol=ATOL, rtol=0)


def test_rollback_after_divergence(target_runner, target_model):
    ids = random_ids(4, 25)
    target_runner.forward([SeqInput("a", ids)])
    diverged = ids[:18] + random_ids(5, 4)  # positions 18.. were "rejected"
    batch = target_runner.open([SeqInput("a", diverged, 4)])
    assert batch.recomputed == 4
    torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, diverged, 4), atol=ATOL, rtol=0)
    batch.close([20])  # keep only 20 positions
    assert target_runner.cache.get("a").token_ids == diverged[:20]
    entry = target_runner.cache.get("a")
    assert target_runner.cache.read(entry, 0)[0].shape[1] == 20 and entry.capacity >= 20  # a length change


def test_extend_decodes_like_a_fresh_forward(target_runner, target_model):
    a, b = random_ids(6, 9), random_ids(7, 3)
    batch = target_runner.open([SeqInput("a", a), SeqInput("b", b)])
    for step in range(3):
        logits = batch.extend([10 + step, 20 + step])
        a, b = a + [10 + step], b + [20 + step]
        torch.testing.assert_close(logits[0], fresh_logits(target_model, a, 1)[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], fresh_logits(target_model, b, 1)[0], atol=ATOL, rtol=0)
    batch.close([len(a) - 1, len(b)])
    assert target_runner.cache.get("a").token_ids == a[:-1]


def test_eviction_under_tiny_budget_keeps_logits(target_model, tokenizer):
    """A budget that holds one batch's sequences but not every sequence: each batch evicts the least
    recently used others, which are recomputed when they come back, and every logit stays exact."""
    big = ModelRunner(target_model, tokenizer)
    budget = 10 * big.kv_block_bytes()  # ten blocks; a pair of these sequences takes at most eight
    tiny = ModelRunner(target_model, tokenizer, max_cache_bytes=budget)
    seqs = [random_ids(10 + i, 30) for i in range(4)]
    for round_, pair in enumerate([(0, 1), (2, 3), (0, 2), (1, 3), (0, 1)]):
        for i in pair:
            seqs[i] = seqs[i] + random_ids(100 + round_, 2)
        batch = [SeqInput(str(i), seqs[i], 2) for i in pair]
        for x, y in zip(big.forward(batch), tiny.forward(batch)):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
        assert tiny.cache.nbytes <= budget
    assert tiny.cache.evictions > 0


def test_a_batch_larger_than_the_budget_fails_and_gives_every_block_back(target_model, tokenizer):
    runner = ModelRunner(target_model, tokenizer, max_cache_bytes=4 * ModelRunner(target_model, tokenizer).kv_block_bytes())
    runner.forward([SeqInput("a", random_ids(1, 20))])
    runner.release("a")  # a donor: its blocks are shared by the borrower below
    with pytest.raises(OutOfBlocks):
        runner.forward([SeqInput("b", random_ids(1, 20) + random_ids(2, 30)), SeqInput("c", random_ids(3, 30))])
    # what the failed forward took is back: only the stored sequences hold blocks
    store = runner.cache
    assert store.nbytes == sum(store.entry_bytes(store.get(s)) for s in list(store._entries))


def test_release_retires_the_cache_and_its_room_goes_first(target_model, tokenizer):
    runner = ModelRunner(target_model, tokenizer)
    runner.forward([SeqInput("a", random_ids(8, 40)), SeqInput("b", random_ids(9, 40))])
    runner.release("a")
    assert "a" not in runner.cache and len(runner.cache) == 1  # not live: only a prefix donor
    one = runner.cache.entry_bytes(runner.cache.get("b"))
    runner.cache.max_bytes = 2 * one  # room for two: the next sequence must evict one
    runner.forward([SeqInput("c", random_ids(10, 40))])
    assert runner.cache.evictions == 1 and runner.cache.get("b") is not None  # the retired one went, not b
    runner.cache.drop("b")
    runner.cache.drop("c")
    assert runner.cache.nbytes == 0 and len(runner.cache) == 0


def test_new_sequence_reuses_another_sequences_prefix_exactly(target_runner, target_model):
    system = random_ids(11, 37)  # a shared system prompt: two whole blocks and a bit
    a, b = system + random_ids(12, 6), system + random_ids(13, 9)
    target_runner.forward([SeqInput("a", a)])
    target_runner.release("a")  # finished: its KV stays a donor
    batch = target_runner.open([SeqInput("b", b, 3)])
    assert batch.recomputed == len(b) - len(system)  # the exact common prefix, not just whole blocks
    assert target_runner.cache.prefix_hit_tokens == len(system)
    torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, b, 3), atol=ATOL, rtol=0)
    batch.close([len(b)])
    # the donor's cache was copied, never written: a second borrower still sees a's tokens exactly
    c = a[:40] + random_ids(14, 4)
    (logits,) = target_runner.forward([SeqInput("c", c, 4)])
    torch.testing.assert_close(logits, fresh_logits(target_model, c, 4), atol=ATOL, rtol=0)


def test_prefix_donor_in_the_same_batch_and_short_matches(target_runner, target_model):
    shared = random_ids(15, 33)
    target_runner.forward([SeqInput("a", shared)])
    a2 = shared + random_ids(16, 3)  # a continues while b, sharing its prompt, starts beside it
    b = shared[:20] + random_ids(17, 5)
    short = shared[:10] + random_ids(18, 10)  # under one block in common: computed whole
    batch = target_runner.open([SeqInput("a", a2, 3), SeqInput("b", b, 1), SeqInput("s", short, 1)])
    assert batch.recomputed == 3 + 5 + 20
    for logits, ids, n in zip(batch.logits, (a2, b, short), (3, 1, 1)):
        torch.testing.assert_close(logits, fresh_logits(target_model, ids, n), atol=ATOL, rtol=0)
    batch.close([len(a2), len(b), len(short)])
    assert target_runner.cache.get("a").token_ids == a2


def test_prefix_index_is_confirmed_on_tokens():
    from app.model.kv import PREFIX_BLOCK

    store = kv_store(64)
    ids = list(range(2 * PREFIX_BLOCK + 3))
    a = put_ids(store, "a", ids)
    borrowed = store.borrow(ids + [7], limit=len(ids))
    assert len(borrowed) == len(ids)
    # by reference: the donor's two whole blocks, and a copy of the block the shared part ends in
    assert borrowed.blocks[:2] == a.blocks[:2] and borrowed.blocks[2] != a.blocks[2]
    store.free(borrowed)
    store.free(short := store.borrow(ids, limit=PREFIX_BLOCK + 1))
    assert len(short) == PREFIX_BLOCK + 1  # never past the limit
    store.get("a").token_ids[5] = -1  # the entry changed without a put: the stale index must not be trusted
    assert store.borrow(ids, limit=len(ids)) is None
    put_ids(store, "a", ids[:PREFIX_BLOCK + 4] + [99] * 8)  # re-put: blocks past 20 reindexed
    assert len(store.borrow(ids, limit=len(ids))) == PREFIX_BLOCK + 4
    store.drop("a")
    assert store.borrow(ids, limit=len(ids)) is None and not store._index


def test_rounds_of_changing_batches_keep_every_cache_exact(target_runner, target_model):
    """Many rounds mixing a lone sequence (computed in its own slab) and ragged batches (written back),
    rollbacks, extend() runs longer than a buffer's spare room, and a cache dropped mid-batch."""
    gen = torch.Generator().manual_seed(11)
    seqs = {name: random_ids(20 + i, 6 + 5 * i) for i, name in enumerate("abc")}
    groups = [["a"], ["a", "b", "c"], ["b"], ["c", "a"], ["a", "b", "c"], ["b"], ["a", "c"], ["c"]]
    for round_, group in enumerate(groups):
        for name in group:
            seqs[name] = seqs[name] + random_ids(200 + round_, 1 + round_ % 3)
        batch = target_runner.open([SeqInput(n, seqs[n], 2) for n in group])
        for n, logits in zip(group, batch.logits):
            torch.testing.assert_close(logits, fresh_logits(target_model, seqs[n], 2), atol=ATOL, rtol=0)
        steps = 12 if round_ % 2 else 2  # 12 extends overflow the batch buffer's spare room
        for step in range(steps):
            tokens = torch.randint(2, 98, (len(group),), generator=gen).tolist()
            logits = batch.extend(tokens)
            for i, n in enumerate(group):
                seqs[n] = seqs[n] + [tokens[i]]
                torch.testing.assert_close(logits[i], fresh_logits(target_model, seqs[n], 1)[0], atol=ATOL, rtol=0)
        if round_ == 4:
            target_runner.release("b")  # released while its batch computes: it must come back whole
        # keep all but a few trailing positions: the next round recomputes (rolls back) them
        keep = [len(seqs[n]) - (round_ + i) % 4 for i, n in enumerate(group)]
        batch.close(keep)
        for n, k in zip(group, keep):
            seqs[n] = seqs[n][:k]
            entry = target_runner.cache.get(n)
            assert entry.token_ids == seqs[n] and entry.capacity >= k
    store = target_runner.cache  # no block shared here: the store holds exactly the tables' blocks
    assert store.nbytes == sum(store.entry_bytes(store.get(n)) for n in seqs)
    for n, ids in seqs.items():  # the stored KV of every position equals a fresh forward's: check via logits
        batch = target_runner.open([SeqInput(n, ids + [5], 1)])
        assert batch.recomputed == 1
        torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, ids + [5], 1), atol=ATOL, rtol=0)
        batch.close([len(ids)])


def test_kv_store_mutates_its_maps_only_under_its_lock():
    """Releases come from the event loop while forwards put and evict in a worker thread: every change
    to the store's maps must hold its lock (checked on each change, whatever the thread timing)."""
    import threading
    from collections import OrderedDict

    store = kv_store(8)  # room for a few entries: puts evict
    changes = []

    def guarded(base):
        class Guarded(base):
            def _check(self):
                changes.append(store._lock._is_owned())

            def __setitem__(self, k, v):
                self._check()
                super().__setitem__(k, v)

            def __delitem__(self, k):
                self._check()
                super().__delitem__(k)

            def pop(self, *a):
                self._check()
                return super().pop(*a)

            def move_to_end(self, *a):
                self._check()
                return super().move_to_end(*a)
        return Guarded

    for name in ("_entries", "_retired", "_index", "_keys"):
        old = getattr(store, name)
        setattr(store, name, guarded(OrderedDict if isinstance(old, OrderedDict) else dict)(old))

    def forwards():
        for i in range(200):
            put_ids(store, f"s{i % 7}", range(i % 5, i % 5 + 20))
            if (borrowed := store.borrow(list(range(20)), 19)) is not None:
                store.free(borrowed)

    def releases():
        for i in range(200):
            store.retire(f"s{i % 7}")
            store.get(f"s{(i + 3) % 7}")
            if i % 11 == 0:
                store.drop(f"s{i % 7}")

    threads = [threading.Thread(target=forwards), threading.Thread(target=releases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert changes and all(changes)


@pytest.mark.parametrize("compact", [True, False], ids=["cpu-compacts", "shared-in-place"])
def test_a_borrowed_prefix_is_shared_by_reference_and_read_in_one_run_on_cpu(target_model, tokenizer, compact):
    runner = ModelRunner(target_model, tokenizer)
    runner.compact_tables = compact
    prompt = random_ids(30, 40)
    runner.forward([SeqInput("donor", prompt + [5])])
    runner.release("donor")
    donor = runner.cache.get("donor")
    b = prompt + random_ids(31, 6)
    batch = runner.open([SeqInput("b", b, 2)])
    assert batch.reuse == [len(prompt)] and batch.entries[0].blocks[:2] == donor.blocks[:2]  # by reference
    torch.testing.assert_close(batch.logits[0], fresh_logits(target_model, b, 2), atol=ATOL, rtol=0)
    batch.close([len(b)])
    entry = runner.cache.get("b")
    # on a CPU the table is moved into one run once, so attention reads it in place from then on
    assert (len(entry.runs(len(entry))) == 1) == compact
    assert (entry.blocks[:2] == donor.blocks[:2]) != compact
    (logits,) = runner.forward([SeqInput("b", b + [9, 10], 2)])
    torch.testing.assert_close(logits, fresh_logits(target_model, b + [9, 10], 2), atol=ATOL, rtol=0)
