"""DraftServer and TargetServer: a ModelRunner each, calls fused into one forward by @serve.batch.

The classes carry no @serve.deployment: build_app applies it with options from the config.
"""

import asyncio
import collections
import contextlib
import time

import ray
import torch
from ray import serve

from app import telemetry
from app.batching import MicroBatcher
from app.runner import ModelRunner
from app.spec import Proposal, ProposeItem, Verdict, VerifyItem, propose, verify
from deployments.affinity import Calls
from deployments.config import BatchConfig, ModelConfig, TargetConfig
from deployments.metrics import ServerMetrics
from deployments.tp import RankGroup, set_torch_threads


def load_runner(cfg: ModelConfig, path: str) -> ModelRunner:
    set_torch_threads(cfg)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return ModelRunner.from_pretrained(path, dtype=cfg.dtype, device=device, max_cache_bytes=cfg.max_cache_bytes,
                                       trust_remote_code=cfg.trust_remote_code)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"


class _Server:
    """What both servers share: the runner, batching settings, cache release and stats."""

    def __init__(self, cfg: ModelConfig, path: str, batch: BatchConfig, method):
        self.replica_id = _replica_id()
        self.runner = self._load(cfg, path)
        self.metrics = ServerMetrics()
        self.served = 0  # propose/verify items answered: lets tests see that a refused request reached no model
        # ids of ended requests (never reused): a batch still computing one (a cancelled request's last
        # call, queued or in flight) would store its cache again after the release, so it drops it
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        telemetry.configure_tracing(type(self).__name__)
        method.set_max_batch_size(batch.max_batch_size)
        method.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)
        # @serve.batch fuses the calls that arrive together, but it forms its next batch at once, not
        # when the model is free: under load its batches queue one behind another, a call or two each.
        # So every batch joins the forward queue, which runs one forward at a time over everything
        # waiting: batches grow with the load (the Serve benchmark's `Bmax` column shows them).
        self._forwards = MicroBatcher(lambda items, _: self._forward(items), batch.max_batch_size, serial=True)

    def _load(self, cfg: ModelConfig, path: str):
        return load_runner(cfg, path)

    @property
    def cache(self):
        """The KV store (or a tensor-parallel group's snapshot of rank 0's) for stats and metrics."""
        return self.runner.cache

    @contextlib.asynccontextmanager
    async def _observed(self, name: str, items: list):
        """Spans (one per traced item) and metrics around a batch; yields the stats each answer carries."""
        stats = {"batch_size": len(items), "replica": self.replica_id}
        attrs = {"specserve.batch_size": len(items), "specserve.replica": self.replica_id}
        t0 = time.perf_counter()
        try:
            with telemetry.batch_spans(name, [it.trace for it in items], attrs):
                yield stats
        finally:
            for seq_id in {it.seq_id for it in items} & self._released.keys():
                await self._drop(seq_id)
        stats["forward_s"] = time.perf_counter() - t0
        self.served += len(items)
        self.metrics.batch(len(items), self.cache)

    async def release(self, seq_ids: Calls) -> None:
        """Free finished or cancelled requests' caches (and again after a batch still computing them)."""
        for seq_id in seq_ids.items:
            self._released[seq_id] = None
            if len(self._released) > 4096:
                self._released.popitem(last=False)
            await self._drop(seq_id)

    async def _queue(self, items: list) -> list:
        """Hand a Serve batch to the forward queue; its items may share a forward with other batches."""
        return list(await asyncio.gather(*(self._forwards.submit(item) for item in items)))

    async def _forward(self, items: list) -> list:
        """One forward over a batch (in a thread, so the replica keeps taking calls meanwhile)."""
        async with self._observed(self.span_name, items) as stats:
            results = await self._compute(items)
        for r in results:
            r.stats.update(stats)
        return results

    @staticmethod
    async def _each(method, calls: Calls) -> list:
        """A router's coalesced call: every item joins this replica's batch queue (with other routers'
        items) at once; an item that fails fails alone."""
        return await asyncio.gather(*(method(item) for item in calls.items), return_exceptions=True)

    async def _drop(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        self.metrics.cache(self.cache)

    async def stats(self) -> dict:
        """KV cache occupancy of this replica."""
        cache = self.cache
        return {"replica": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                "kv_cache_bytes": cache.nbytes, "sequences": len(cache), "evictions": cache.evictions,
                "served": self.served}

    async def check_health(self) -> None:
        """Serve's health check: the runner must be usable."""
        if self.runner.model is None:
            raise RuntimeError("model not loaded")


class DraftServer(_Server):
    """Proposes K tokens per sequence for many sequences in one batch."""

    span_name = "DraftServer.propose"

    def __init__(self, cfg: ModelConfig, path: str, batch: BatchConfig, top_n: int):
        super().__init__(cfg, path, batch, self.propose)
        self.top_n = top_n

    async def propose_many(self, calls: Calls) -> list[Proposal | BaseException]:
        return await self._each(self.propose, calls)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002, max_concurrent_batches=4)
    async def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return await self._queue(items)

    async def _compute(self, items: list[ProposeItem]) -> list[Proposal]:
        return await asyncio.to_thread(propose, self.runner, items, self.top_n)


class TargetServer(_Server):
    """Verifies many sequences' proposals in one target forward; tensor-parallel over rank workers when N > 1."""

    span_name = "TargetServer.verify"

    def __init__(self, cfg: TargetConfig, path: str, batch: BatchConfig):
        self.ranks: RankGroup | None = None
        super().__init__(cfg, path, batch, self.verify)

    def _load(self, cfg: TargetConfig, path: str):
        if cfg.tensor_parallel_size == 1:
            return load_runner(cfg, path)
        self.ranks = RankGroup(cfg, path, self.replica_id)
        return None

    @property
    def cache(self):
        return self.ranks.cache if self.ranks else self.runner.cache

    async def _drop(self, seq_id: str) -> None:
        if self.ranks:
            await self.ranks.release(seq_id)
            self.metrics.cache(self.cache)
        else:
            await super()._drop(seq_id)

    async def stats(self) -> dict:
        if self.ranks:
            await self.ranks.stats()
        return await super().stats()

    async def check_health(self) -> None:
        """Unhealthy when a rank worker died or hangs: Serve then replaces the replica and its group."""
        if self.ranks:
            await self.ranks.check_health()
        else:
            await super().check_health()

    def __del__(self):
        if getattr(self, "ranks", None):
            self.ranks.shutdown()

    async def verify_many(self, calls: Calls) -> list[Verdict | BaseException]:
        return await self._each(self.verify, calls)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002, max_concurrent_batches=4)
    async def verify(self, items: list[VerifyItem]) -> list[Verdict]:
        return await self._queue(items)

    async def _compute(self, items: list[VerifyItem]) -> list[Verdict]:
        if self.ranks:
            return await self.ranks.verify(items)
        return await asyncio.to_thread(verify, self.runner, items)
