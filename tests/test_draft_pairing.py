"""M:N pairing of target and draft replicas while the draft pool scales, without a cluster.

`Homes` decides where each of a target replica's sequences is drafted; the engine-level tests run a
DraftClient over a stand-in draft pool whose replicas (real draft runners) join and leave in the
middle of a generation, and check that output does not change and caches move as little as claimed.
"""

import functools
from collections import Counter
from types import SimpleNamespace

import pytest

from app.speculation.driver import DraftPolicy, DraftUnavailable
from app.engine import Engine, EngineSettings
from app.params import SamplingParams
from app.model.runner import ModelRunner
from app.scheduler import ForwardQueue, in_thread
from app.speculation.drafting import propose
from conftest import blend
from deployments.affinity import Homes
from deployments.contexts import ContextMirror, answer
from deployments.draft_client import DraftClient

PROMPTS = [[20 + i, 30 + i, 40, 41, 42 + i] for i in range(6)]
N = 40


# -- Homes, from given memberships -------------------------------------------------------------------
def placed(homes: Homes, seqs, members) -> dict[str, str]:
    return {s: homes.place(s, members) for s in seqs}


def test_new_sequences_spread_evenly_and_stay_home():
    homes, pool = Homes(), frozenset({"a", "b", "c"})
    assert homes.settle(pool) == {}
    first = placed(homes, [f"s{i}" for i in range(10)], pool)
    assert sorted(Counter(first.values()).values()) == [3, 3, 4]
    assert placed(homes, first, pool) == first  # every later call goes to the same home
    assert homes.settle(pool) == {}  # the same pool again moves nothing


def test_a_joining_replica_takes_only_the_busiest_homes_excess():
    homes, pool = Homes(), frozenset({"a", "b"})
    homes.settle(pool)
    before = placed(homes, [f"s{i}" for i in range(9)], pool)  # a: 5, b: 4 (or the other way)
    grown = pool | {"c"}
    moved = homes.settle(grown)
    after = placed(homes, before, grown)
    movers = {s for s in before if after[s] != before[s]}
    assert {after[s] for s in movers} == {"c"}  # every moved sequence went to the new replica
    assert movers == {s for seqs in moved.values() for s in seqs}  # and its old home is told
    assert all(before[s] == old for old, seqs in moved.items() for s in seqs)
    assert sorted(Counter(after.values()).values()) == [3, 3, 3]  # only the excess moved: 3 of 9
    assert homes.settle(grown) == {}


def test_a_leaving_replica_moves_only_its_own_sequences():
    homes, pool = Homes(), frozenset({"a", "b", "c"})
    homes.settle(pool)
    before = placed(homes, [f"s{i}" for i in range(9)], pool)
    shrunk = frozenset({"a", "b"})
    assert homes.settle(shrunk) == {}  # nothing to free: the cache left with the replica
    after = placed(homes, before, shrunk)
    assert all(after[s] == before[s] for s in before if before[s] != "c")
    assert sorted(Counter(after.values()).values()) in ([4, 5], [5, 4])


def test_an_answer_from_before_a_move_does_not_move_the_sequence_back():
    homes, pool = Homes(), frozenset({"a"})
    homes.settle(pool)
    for s in ("s0", "s1", "s2", "s3"):
        homes.place(s, pool)
    moved = homes.settle(pool | {"b"})
    mover = moved["a"][0]
    homes.record(mover, "a", "a")  # the call sent to "a" before the move answers late
    assert homes.get(mover) == "b"
    homes.record("s9", None, "a")  # routed by Serve while the pool was unknown: its answerer is home
    assert homes.get("s9") == "a"


def test_a_call_in_flight_when_its_home_left_makes_its_answerer_the_new_home():
    homes = Homes()
    homes.settle(frozenset({"a", "b", "c"}))
    for s in ("s0", "s1", "s2"):
        homes.place(s, frozenset({"a", "b", "c"}))
    gone = homes.get("s0")
    rest = frozenset({"a", "b", "c"} - {gone})
    homes.settle(rest)
    assert homes.get("s0") is None
    answerer = homes.get("s1") if homes.get("s1") != gone else homes.get("s2")
    homes.record("s0", gone, answerer)  # Serve sent the call elsewhere: its cache is there now
    assert homes.place("s0", rest) == answerer
    homes.record("s0", gone, "z")  # a later stale answer changes nothing
    assert homes.get("s0") == answerer


def test_without_a_known_pool_the_router_decides():
    homes = Homes()
    assert homes.place("s0", None) is None
    homes.record("s0", None, "x")
    assert homes.place("s0", None) == "x"
    assert homes.forget("s0") == "x" and homes.counts() == {}


# -- a DraftClient over a stand-in pool, mid-generation ---------------------------------------------
class Replica:
    """A draft replica: its own runner behind a forward queue, as DraftServer; `gone` makes the calls
    it is computing fail (a replica stopping mid-call)."""

    def __init__(self, name: str, model, tokenizer):
        self.runner = ModelRunner(model, tokenizer)
        self.queue = ForwardQueue(in_thread(functools.partial(propose, self.runner)), self.runner.release,
                                  name=name, extra_stats={"replica": name}, forget=self.runner.forget)
        self.gone = False
        self.arrivals: Counter[str] = Counter()  # calls that found no draft cache of their sequence here
        self.contexts = ContextMirror()  # as DraftServer: a call carries each sequence's new tokens

    async def propose_many(self, items):
        return await answer(self.contexts, items, self.propose)

    async def propose(self, item):
        if item.seq_id not in self.runner.cache:
            self.arrivals[item.seq_id] += 1
        proposal = await self.queue.submit(item)
        if self.gone:
            raise RuntimeError("the replica stopped during the call")
        return proposal


class Pool:
    """Stands in for the DraftServer deployment's handle: a call goes to its home if it is up, else to
    another replica (Serve's fallback); `events` {call number: action} change the pool mid-generation."""

    def __init__(self, make, names, events=None):
        self.make, self.events, self.calls = make, dict(events or {}), 0
        self.sent_ids = self.context_ids = 0  # context ids sent, and the contexts they stood for
        self.replicas = {n: make(n) for n in names}
        self.propose_many = SimpleNamespace(remote=self._propose_many)
        self.release = SimpleNamespace(remote=self._release)

    def members(self) -> frozenset[str]:
        return frozenset(n for n, r in self.replicas.items() if not r.gone)

    def join(self, name: str) -> None:
        self.replicas[name] = self.make(name)

    def leave(self, name: str) -> None:
        self.replicas[name].gone = True

    def _route(self, hint):
        up = sorted(self.members())
        return self.replicas[hint if hint in up else up[0]]

    async def _propose_many(self, calls):
        self.calls += 1
        if action := self.events.pop(self.calls, None):
            action(self)
        replica = self._route(calls.replica_hint)
        self.sent_ids += sum(len(d.item.token_ids) for d in calls.items)
        self.context_ids += sum(d.base + len(d.item.token_ids) for d in calls.items)
        return await replica.propose_many(calls.items)

    async def _release(self, calls):
        if calls.replica_hint in self.replicas:
            for seq_id in calls.items:
                self.replicas[calls.replica_hint].contexts.drop(seq_id)
                self.replicas[calls.replica_hint].runner.release(seq_id)


class CountingClient(DraftClient):
    """Counts each sequence's failed-open proposals."""

    def __init__(self, pool: Pool):
        super().__init__(pool, pool=pool.members)
        self.failed: Counter[str] = Counter()

    async def submit(self, item):
        try:
            return await super().submit(item)
        except DraftUnavailable:
            self.failed[item.seq_id] += 1
            raise


@pytest.fixture(scope="module")
def draft_model(target_model):
    return blend(target_model, 7, 0.85)


def run(target_model, tokenizer, draft_model, names, events, params):
    pool = Pool(lambda name: Replica(name, draft_model, tokenizer), names, events)
    client = CountingClient(pool)
    engine = Engine(ModelRunner(target_model, tokenizer), client,
                    EngineSettings(k_max=4, policy=DraftPolicy(ahead=False, retry_after_s=0.0)))  # one call in flight per sequence
    return engine.generate(PROMPTS, params), pool, client


SCALING = {4: lambda pool: pool.join("c"), 12: lambda pool: pool.leave("a")}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_draft_replicas_joining_and_leaving_mid_generation_change_no_output(target_model, tokenizer, draft_model,
                                                                         kind):
    if kind == "greedy":
        params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation={"num_tokens": 4})
    else:
        params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=N, ignore_eos=True,
                                 speculation={"num_tokens": 4}) for i in range(len(PROMPTS))]
    steady, _, _ = run(target_model, tokenizer, draft_model, ["a", "b"], {}, params)
    scaled, pool, client = run(target_model, tokenizer, draft_model, ["a", "b"], SCALING, params)
    assert [r.token_ids for r in scaled] == [r.token_ids for r in steady]
    if kind == "greedy":  # and both are the target's own greedy decode
        plain = Engine(ModelRunner(target_model, tokenizer)).generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation={"enabled": False}))
        assert [r.token_ids for r in scaled] == [r.token_ids for r in plain]
    assert not pool.events, "the pool did not change during the generation"
    a, b, c = (pool.replicas[n].arrivals for n in "abc")
    moved_to_c = set(c)
    assert moved_to_c, "the new replica drafted for no sequence"
    assert all(n == 1 for n in c.values())  # a sequence that moves re-prefills once
    assert max(client.failed.values(), default=0) <= 1  # the leaving replica's: one round fails open at most
    # a sequence is prefilled where it starts, and again only where it moves: to "c" when it joins,
    # or off "a" when it leaves (never both: "c" is not left)
    for seq_id in set(a) | set(b) | set(c):
        assert a[seq_id] + b[seq_id] + c[seq_id] <= 2, (seq_id, a[seq_id], b[seq_id], c[seq_id])
    assert client.moved >= 1
    # each call carried the new tokens of its sequences: whole contexts only where one started or
    # moved (client.resent: a call that found a replica without its context, sent again whole)
    assert pool.sent_ids < pool.context_ids / 3, (pool.sent_ids, pool.context_ids)
    assert sum(r.speculation.get("drafted_tokens", 0) for r in scaled) > 0
