"""Tensor parallelism: one rank worker per bundle of the TargetServer replica's placement group.

The ranks form a torch.distributed group (NCCL on GPU, gloo on CPU) and load the target sharded
with transformers' own tensor-parallel plan (`DistributedConfig(tp_size=N)`). Every verify batch
goes to every rank in the same order (collectives must match); each rank keeps its heads' share of
every sequence's KV cache and computes the same sampling from the same all-gathered logits (the
randomness is addressed by seed and position), so rank 0's answer is the group's.
"""

import asyncio
import os
import socket
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoConfig

from app.errors import RankFailure, is_fault
from app.model.loading import load_runner, warm_up
from app.model.memory import agree_on_budget
from app.speculation.steps import Verdict, VerifyItem, verify
from deployments.args import TargetConfig
from deployments.contexts import ContextMirror, ContextUnknown, Delta, SentContexts


def group_result(results: list):
    """Rank 0's answer of a call made to every rank (each result, or the exception it raised).

    Every rank computes the same thing from the same items, so a request's bad value raises the same
    error on every rank, at the same point, after the same collectives: the group is intact and the
    error is the request's (raised as its own type, for the forward queue to isolate). Anything else
    (a rank dead, hung, a device fault, ranks that disagree) is a RankFailure: collectives may be out
    of step, and only a new group is safe.
    """
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return results[0]
    request_errors = [e for e in errors if isinstance(e, RayTaskError) and not isinstance(e, RayActorError)
                      and not is_fault(e.cause)]
    if len(request_errors) == len(results) and len({type(e.cause) for e in request_errors}) == 1:
        raise request_errors[0].as_instanceof_cause()
    first = errors[0]
    raise RankFailure(f"{type(first).__name__}: {first}") from first


def check_divisible(path: str, n: int, trust_remote_code: bool = False) -> None:
    """Raise a clear error unless N divides the model's attention and key/value heads."""
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None or heads % n or kv % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the target's attention heads ({heads}) and "
                         f"key/value heads ({kv}); choose a divisor")


@dataclass
class CacheSnapshot:
    """A rank's KV cache occupancy, shaped like the KVStore the server metrics read."""

    nbytes: int = 0
    sequences: int = 0
    evictions: int = 0
    prefix_hit_tokens: int = 0
    max_bytes: int = 0  # the rank's KV budget (the group's agreed one)
    live_bytes: int = 0  # held by live sequences (not retired prefix donors); only when asked for

    @classmethod
    def of(cls, store, live: bool = False) -> "CacheSnapshot":
        """`live`: count live sequences' blocks too (a walk over every table: for stats, not per round)."""
        return cls(store.nbytes, len(store), store.evictions, store.prefix_hit_tokens, store.max_bytes,
                   store.live_bytes if live else 0)

    def __len__(self) -> int:
        return self.sequences


class RankWorker:
    """One rank: a shard of the target in a ModelRunner. Runs calls one at a time, in order."""

    def __init__(self, rank: int, world: int, address: str, port: int, cfg: TargetConfig, path: str,
                 forward_tokens: int):
        cuda = torch.cuda.is_available() and cfg.device != "cpu"
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0" if cuda else str(rank))  # Ray gives each rank its own GPU as cuda:0
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        # this rank's shard on this rank's device, its budget sized there; TP runs eagerly
        self.runner = load_runner(path, cfg, forward_tokens, tp_size=world)
        agree_on_budget(self.runner)  # ranks evicting differently would hang on mismatched collectives
        # every rank's first forward together, now: lazy CUDA, cuBLAS and NCCL set-up is paid before
        # the replica takes traffic, not by its first requests while health pings wait behind them
        warm_up(self.runner)
        self.contexts = ContextMirror()  # the sequences' contexts: rounds send only what changed
        self.rank, self.warmed = rank, True

    def verify(self, encoded: list[Delta]) -> tuple[list[Verdict], CacheSnapshot]:
        """The round's items rebuilt from the contexts this rank holds (deployments/contexts.py). Where it
        cannot, every rank alike fails the batch as a request's error: the forward queue forgets its
        sequences on both sides and runs it again, sent whole."""
        items = self.contexts.decode(encoded)
        if unknown := next((i for i in items if isinstance(i, ContextUnknown)), None):
            raise unknown
        return verify(self.runner, items), CacheSnapshot.of(self.runner.cache)

    def release(self, seq_id: str) -> None:
        self.contexts.drop(seq_id)
        self.runner.release(seq_id)

    def forget(self, seq_id: str) -> None:
        self.contexts.drop(seq_id)
        self.runner.forget(seq_id)

    def stats(self) -> "CacheSnapshot":
        return CacheSnapshot.of(self.runner.cache, live=True)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Answered at once, also while a forward runs: health checks do not queue behind the work."""
        return self.rank

    def ready(self) -> dict:
        return {"rank": self.rank, "warmed": self.warmed}

    def capacity_tokens(self) -> int:
        """The most positions one sequence can hold (the same on every rank: the budget is agreed)."""
        return self.runner.capacity_tokens()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankGroup:
    """The N rank workers of one TargetServer replica, placed in its placement group's bundles."""

    def __init__(self, cfg: TargetConfig, path: str, replica_id: str, forward_tokens: int, timeout_s: float = 120.0):
        """Start the ranks and wait, up to cfg.load_timeout_s, until every one has loaded and warmed."""
        n = cfg.tensor_parallel_size
        check_divisible(path, n, cfg.trust_remote_code)
        pg = get_current_placement_group()
        if pg is None or len(pg.bundle_specs) < n:
            raise RuntimeError(f"tensor_parallel_size={n} needs a placement group of {n} bundles "
                               "(build_app sets placement_group_bundles; is it overridden?)")
        gpus = float(cfg.rank_resources.get("GPU", 0))
        custom = {k: v for k, v in cfg.rank_resources.items() if k not in ("CPU", "GPU")}
        address, port = ray.util.get_node_ip_address(), _free_port()
        # calls run one at a time, in order, in the default group; pings in their own (RankWorker.ping)
        worker = ray.remote(concurrency_groups={"health": 1})(RankWorker)
        self.ranks = [
            worker.options(
                name=f"specserve-rank-{replica_id}-{i}", namespace="specserve",
                num_cpus=cfg.rank_resources.get("CPU", 0), num_gpus=gpus, resources=custom, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(i, n, address, port, cfg, path, forward_tokens)
            for i in range(n)
        ]
        self.timeout_s = timeout_s
        self.failed: str | None = None
        self.cache = CacheSnapshot()  # rank 0's, as of its last answer
        self.sent = SentContexts()  # what the ranks hold of each context
        # all loaded and warmed (or raise now): a cold pod may first download the weights (140 GB for 70B)
        ray.get([r.ready.remote() for r in self.ranks], timeout=cfg.load_timeout_s)
        self.capacity_tokens = ray.get(self.ranks[0].capacity_tokens.remote(), timeout=60)

    async def _all(self, method: str, *args):
        """Call every rank; rank 0's result. A dead or hung rank fails the whole replica."""
        if self.failed:
            raise RankFailure(self.failed)
        # the arguments serialised once into the object store, not once per rank: each rank receives
        # the same object
        shared = [ray.put(a) for a in args] if args and len(self.ranks) > 1 else list(args)
        refs = [getattr(r, method).remote(*shared) for r in self.ranks]
        try:
            results = await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), self.timeout_s)
            return group_result(results)
        except RankFailure as e:
            self.failed = f"rank worker failed during {method}: {e}"
            raise
        except asyncio.TimeoutError as e:
            self.failed = f"rank worker failed during {method}: no answer in {self.timeout_s:g} s"
            raise RankFailure(self.failed) from e

    async def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        verdicts, self.cache = await self._all("verify", self.sent.encode(items))
        return verdicts

    async def release(self, seq_id: str) -> None:
        self.sent.drop(seq_id)
        await self._all("release", seq_id)

    async def forget(self, seq_id: str) -> None:
        self.sent.drop(seq_id)
        await self._all("forget", seq_id)

    async def stats(self) -> CacheSnapshot:
        self.cache = await self._all("stats")
        return self.cache

    async def check_health(self) -> None:
        """Healthy only while every rank answers a ping."""
        await self._all("ping")

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
