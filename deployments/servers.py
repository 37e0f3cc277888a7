"""DraftServer and TargetServer: a model each behind its forward queue, the one batching layer.

A TargetServer replica runs the rounds of every request placed on it (the engine of app/, with the
draft pool as a remote transport) and streams each round's kept tokens back; a DraftServer
replica answers proposals for many sequences of many target replicas at once.
The classes carry no @serve.deployment: build_app applies it with options from the config.
"""

import asyncio
import functools
import logging
import sys
from collections.abc import AsyncIterator

import ray
import torch
from ray import serve

from app import telemetry
from app.speculation.controller import VerifyCurve
from app.speculation.driver import DraftPolicy
from app.engine import Engine, EngineSettings, RemoteTarget
from app.scheduler import BatchBudget, ForwardQueue, in_thread
from app.model.loading import load_runner, resolve_device
from app.model.memory import DRAFT_PREFILL_TOKENS
from app.chunks import Chunk
from app.job import GenerationJob
from app.model.eos import eos_ids
from app.model.runner import load_generation_config
from app.model.sources import local_model, log_into
from app.speculation.steps import Proposal, verify, verify_tokens
from app.speculation.drafting import propose
from deployments.affinity import Calls
from deployments.autoscaling import CallerWaits, Observers, RoundLoad
from deployments.contexts import ContextMirror, answer
from deployments.cores import Claim, pin_replica
from deployments.args import (
    BatchConfig,
    ModelConfig,
    SpeculationConfig,
    TargetBatchConfig,
    TargetConfig,
)
from deployments.draft_client import DraftClient
from deployments.metrics import RoundMetrics, ServerMetrics
from deployments.vllm_metrics import GaugeReport, totals_actor
from deployments.tp import RankGroup

# measured on 2 CPU cores, demo pair, one stream: 75 -> 105 tok/s speculative, target forward 25 -> 19 ms
SWITCH_INTERVAL_S = 0.0005
STEPS_EVERY_S = 5.0  # how often a replica building its steps in the background reports how far it got


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"


def _gauge_report(replica_id: str) -> GaugeReport | None:
    """This model replica's gauges (its steps' state; a target's KV usage), reported to its app's metric
    totals for the ingress's /metrics (None outside Serve)."""
    try:
        app = serve.get_replica_context().app_name
    except Exception:  # outside Serve (unit tests)
        return None
    totals = totals_actor(app)
    return GaugeReport(lambda gauges: totals.add.remote({}, gauges, replica_id))


def _pin(cfg: ModelConfig, name: str) -> Claim | None:
    """`pin_cores` on a CPU: this replica's threads on cores of its own, one per forward thread, before
    its model loads (the threads the load and the compile start inherit the binding)."""
    if not cfg.pin_cores or resolve_device(cfg.device) != "cpu":
        return None
    return pin_replica(cfg.torch_threads or torch.get_num_threads(), name)


def _start(coro):
    """Run a coroutine on the replica's event loop (Serve runs constructors on it); close it elsewhere."""
    try:
        return asyncio.get_running_loop().create_task(coro)
    except RuntimeError:  # no loop: built outside Serve
        coro.close()
        return None


class _Server:
    """What both servers share: a forward queue over the model, cache stats, health."""

    def __init__(self):
        # the forward runs in a worker thread beside the event loop that streams and calls other pools;
        # a thread waiting for the GIL waits up to the switch interval (5 ms by default), which showed as
        # forwards far slower in a replica than in process: hand the GIL over sooner
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        log_into(logging.getLogger("ray.serve"))  # a model's fetch progress in this replica's log
        self.replica_id = _replica_id()
        self.cores: Claim | None = None  # pinned cores (pin_cores), held while the replica lives
        self.metrics = ServerMetrics()
        self.gauge_report = _gauge_report(self.replica_id)  # summed over the app's replicas on the ingress's /metrics
        telemetry.configure_tracing(type(self).__name__)

    def _watch_steps(self) -> None:
        """Report the steps' state (ModelRunner.compile_status) now and, while they are built in the
        background, until the build ends (a failed build shows within STEPS_EVERY_S)."""
        self._report_steps()
        if self.runner is not None and self.runner.compile_thread is not None:
            _start(self._steps_until_built())

    async def _steps_until_built(self) -> None:
        while self.runner.compile_thread.is_alive():
            await asyncio.sleep(STEPS_EVERY_S)
            self._report_steps()
        self._report_steps()

    def _report_steps(self) -> None:
        state = telemetry.steps_state(self.runner.compile_status if self.runner is not None else "eager")
        self.metrics.steps(state)
        if self.gauge_report is not None:
            self.gauge_report.set(steps={self.SERVER: {state: 1}})

    def _queue(self, forward, release, budget: BatchBudget, name: str, forget) -> ForwardQueue:
        def on_batch(size: int, tokens: int, seconds: float) -> None:
            self.metrics.batch(size, self.cache)
        return ForwardQueue(forward, release, name=name, budget=budget, extra_stats={"replica": self.replica_id},
                            on_batch=on_batch, forget=forget)

    @property
    def cache(self):
        """The KV store (or a tensor-parallel group's snapshot of rank 0's) for stats and metrics."""
        return self.runner.cache

    @property
    def served(self) -> int:
        """Items answered: lets tests see that a refused request reached no model."""
        return self.queue.served

    async def stats(self) -> dict:
        """KV cache occupancy of this replica, and its steps (ModelRunner.compile_status)."""
        cache = self.cache
        return {"replica": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                "kv_cache_bytes": cache.nbytes, "sequences": len(cache), "evictions": cache.evictions,
                "prefix_hit_tokens": cache.prefix_hit_tokens, "served": self.served,
                "steps": self.runner.compile_status if self.runner is not None else "eager",
                "cores": self.cores.cores if self.cores is not None else None}

    async def check_health(self) -> None:
        """Serve's health check: the model must be loaded, and no forward may have hit a device fault."""
        if self.runner is None or self.runner.model is None:
            raise RuntimeError("model not loaded")
        if self.queue.fault:
            raise RuntimeError(f"a forward failed on the device: {self.queue.fault}")

    async def _release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        self.metrics.cache(self.cache)


class DraftServer(_Server):
    """Proposes K tokens per sequence for many sequences (of many target replicas) in one batch."""

    SERVER = "draft"

    def __init__(self, cfg: ModelConfig, path: str, batch: BatchConfig, top_n: int):
        super().__init__()
        path = local_model(path, cfg.revision, cfg.download_dir)  # fetched once per node when remote
        self.cores = _pin(cfg, "DraftServer")
        # a draft forward: a step of every sequence in the batch, or a new sequence's whole prompt
        self.runner = load_runner(path, cfg, max(batch.max_batch_size, DRAFT_PREFILL_TOKENS),
                                  logit_rows=batch.max_batch_size, batch=batch.max_batch_size)
        self.queue = self._queue(in_thread(functools.partial(propose, self.runner, top_n=top_n), self.runner.thread),
                                 self._release, BatchBudget(batch.max_batch_size), "DraftServer.propose",
                                 self.runner.forget)
        self.callers = CallerWaits()
        self.contexts = ContextMirror()  # the sequences' contexts: a call sends each one's new tokens
        self._watch_steps()

    async def propose_many(self, calls: Calls) -> list[Proposal | BaseException]:
        """A target replica's proposals of one step (deployments/contexts.py Deltas): each joins the
        forward queue; one that fails fails alone, one whose context this replica lacks is asked again whole."""
        self.callers.add(calls.wait_share)
        return await answer(self.contexts, calls.items, self.queue.submit)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The draft pool's signals since the last call (deployments/autoscaling.py)."""
        load = self.queue.load.read()
        return self.metrics.signal({"busy": load["busy"], "items_per_forward": load["items_per_forward"],
                                    "queue_forwards": load["queue_forwards"], "wait_share": self.callers.read()})

    async def release(self, seq_ids: Calls) -> None:
        """Free finished or cancelled sequences' caches (and again after a forward still computing them)."""
        for seq_id in seq_ids.items:
            self.contexts.drop(seq_id)
            await self.queue.release(seq_id)


class TargetServer(_Server):
    """Runs the rounds of every request placed on it: one forward per step over all its sequences.

    Tensor-parallel over rank workers when tensor_parallel_size > 1 (rank 0 answers).
    """

    SERVER = "target"

    def __init__(self, cfg: TargetConfig, path: str, batch: TargetBatchConfig, draft, speculation: SpeculationConfig,
                 max_context: int):
        super().__init__()
        path = local_model(path, cfg.revision, cfg.download_dir)  # fetched once per node; its ranks share it
        self.ranks: RankGroup | None = None
        if cfg.tensor_parallel_size == 1:
            self.cores = _pin(cfg, "TargetServer")
            # logits for the verify rows and each prompt's last position (specserve/plan.py counts the same)
            rows = batch.max_batch_size * (speculation.k_max + 2)
            self.runner = load_runner(path, cfg, batch.max_batch_tokens, logit_rows=rows, batch=batch.max_batch_size)
            tokenizer, vocab, eos = self.runner.tokenizer, self.runner.vocab_size, self.runner.eos_ids
            forward, release = in_thread(functools.partial(verify, self.runner), self.runner.thread), self._release
            forget, kv_capacity = self.runner.forget, self.runner.capacity_tokens()
        else:
            from transformers import AutoTokenizer

            self.runner = None
            self.ranks = RankGroup(cfg, path, self.replica_id, batch.max_batch_tokens)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            vocab = len(tokenizer)
            eos = eos_ids(load_generation_config(path, cfg.trust_remote_code), tokenizer)
            forward, release, forget = self.ranks.verify, self._release_ranks, self.ranks.forget
            kv_capacity = self.ranks.capacity_tokens
        budget = BatchBudget(batch.max_batch_size, batch.max_batch_tokens, verify_tokens)
        self.queue = self._queue(forward, release, budget, "TargetServer.verify", forget)
        self.round_metrics = RoundMetrics()
        self.round_load = RoundLoad()  # the autoscaler's view of this replica's rounds
        self.max_batch_tokens = batch.max_batch_tokens
        self.speculation = speculation
        self.batch_ema = 1.0  # verify batch size, smoothed: the load that load-aware K weighs
        self.verify_curve = VerifyCurve(speculation.verify_saturation_tokens)  # forward time by tokens
        self.queue.on_batch = self._on_batch
        self._watch_steps()
        policy = DraftPolicy.of(speculation)
        if draft is not None:
            self._warming = _start(self._connect(draft))
        self.draft_client = (DraftClient(draft, max_batch=None, wait_share=lambda: self.round_load.wait_share)
                             if draft is not None else None)
        settings = EngineSettings(k_max=speculation.k_max, policy=policy, prefill_chunk=batch.prefill_chunk_tokens,
                                  goodput_gate=speculation.goodput_gate, verify_cost=self._verify_cost)
        local = self.runner is not None  # a tensor-parallel group's cache is its ranks'
        remote = RemoteTarget(tokenizer, vocab, max_context, eos, kv_capacity, self.runner.grammars if local else None,
                              self.runner.cache.prefix_len if local else None)
        self.engine = Engine(self.queue, self.draft_client, settings, remote)

    @staticmethod
    async def _connect(draft) -> None:
        """Open the handle to the draft pool before the first request needs it (its first call sets up
        Serve's routing: tens of ms that would otherwise land on a round and on the cost estimate)."""
        try:
            await draft.stats.remote()
        except Exception:  # the draft pool is not up yet: the first proposals pay, or fail open
            pass

    def _on_batch(self, size: int, tokens: int, seconds: float) -> None:
        self.batch_ema = 0.8 * self.batch_ema + 0.2 * size
        self.verify_curve.observe(tokens, seconds)
        self.metrics.batch(size, self.cache)
        self._report_kv()

    def _report_kv(self) -> None:
        if self.gauge_report is not None:
            cache = self.cache
            self.gauge_report.set(kv_usage=cache.live_bytes / cache.max_bytes if cache.max_bytes else 0.0, kv_replicas=1)

    async def _release(self, seq_id: str) -> None:
        await super()._release(seq_id)
        self._report_kv()

    def _verify_cost(self) -> list[float]:
        # what K more draft tokens per sequence cost this replica's forwards at its batch, measured
        return self.verify_curve.extra(self.batch_ema, self.speculation.k_max)

    async def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        """Run (or resume) one request: its rounds' chunks, then the summary (app.engine.Engine.run_job)."""
        span = telemetry.start_span("TargetServer.generate", job.trace, {"specserve.replica": self.replica_id})
        try:
            observer = Observers(self.round_metrics.request(), self.round_load)
            async for chunk in self.engine.run_job(job, observer, telemetry.context_of(span)):
                yield chunk
        finally:
            if span is not None:
                span.end()

    @property
    def cache(self):
        return self.ranks.cache if self.ranks else self.runner.cache

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The target pool's signals since the last call (deployments/autoscaling.py)."""
        if self.ranks:
            await self.ranks.stats()  # rank 0's occupancy now, live sequences counted
        load, rounds, cache = self.queue.load.read(), self.round_load.read(), self.cache
        budget = cache.max_bytes
        return self.metrics.signal({
            "busy": load["busy"], "kv": cache.live_bytes / budget if budget else 0.0,
            "fill": load["tokens_per_forward"] / self.max_batch_tokens, "queue_wait_s": load["queue_wait_s"],
            "queue_forwards": load["queue_forwards"], "ttft_s": rounds["ttft_s"]})

    async def _release_ranks(self, seq_id: str) -> None:
        await self.ranks.release(seq_id)
        self.metrics.cache(self.cache)
        self._report_kv()

    async def stats(self) -> dict:
        """The base stats, and where this replica's sequences are drafted: {draft replica: sequences}."""
        if self.ranks:
            await self.ranks.stats()
        stats = await super().stats()
        stats["verify_ms_by_tokens"] = {n: round(s * 1e3, 2) for n, s in self.verify_curve.points().items()}
        if self.draft_client is not None:
            stats["draft_homes"] = self.draft_client.homes.counts()
            stats["draft_moves"] = self.draft_client.moved
        return stats

    async def check_health(self) -> None:
        """Unhealthy when a rank worker died or hangs: Serve then replaces the replica and its group."""
        if self.ranks:
            await self.ranks.check_health()
        else:
            await super().check_health()

    def __del__(self):
        if getattr(self, "ranks", None):
            self.ranks.shutdown()
