"""The in-process benchmark's modes and how it runs one request in each (through our engine, or
Hugging Face's generate), and how it times a forward and counts host syncs."""

from __future__ import annotations

import asyncio
import copy
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from app.engine import Engine
from app.model.hf_compat import with_cache
from app.params import SamplingParams
from app.speculation.steps import Proposal, ProposeItem, VerifyItem, verify
from app.speculation.drafting import propose
from app.model.syncs import SyncCounter
from specserve.bench.figures import Timed


@dataclass(frozen=True)
class Mode:
    """One way of generating: through our engine (`speculation`) or Hugging Face (`assistant`)."""

    name: str
    speculation: dict | None = None  # engine modes: SamplingParams.speculation
    assistant: dict | None = None  # HF modes: assistant generation_config overrides; None = no assistant
    hf: bool = False


K_MATCHED = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
             "assistant_confidence_threshold": 0.0}
MODES = {m.name: m for m in [
    Mode("target", speculation={"enabled": False}),
    Mode("spec-k2", speculation={"num_tokens": 2}),
    Mode("spec-k4", speculation={"num_tokens": 4}),
    Mode("spec-k6", speculation={"num_tokens": 6}),
    Mode("spec-auto", speculation={"num_tokens": "auto"}),
    Mode("hf-assisted", assistant={}, hf=True),
    Mode("hf-assisted-k4", assistant=K_MATCHED, hf=True),
    Mode("hf-target", hf=True),
]}
@dataclass
class Round:
    """One target forward of an engine request."""

    drafted: int
    accepted: int
    emitted: int


@dataclass
class PromptRun(Timed):
    """One request's output and timings (seconds from its start)."""

    tokens: list[int]
    seconds: float
    chunk_times: list[float]
    chunk_sizes: list[int]
    rounds: list[Round] = field(default_factory=list)  # engine modes only

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


# --- running one request -------------------------------------------------------------------


def run_engine(engine: Engine, ids: list[int], mode: Mode, max_tokens: int) -> PromptRun:
    """Generate through the engine, recording each round's tokens and time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, speculation=mode.speculation)
    return asyncio.run(_run_engine(engine, engine.new_request(ids, params)))


async def _run_engine(engine: Engine, state) -> PromptRun:
    stats, run = state.stats, PromptRun([], 0.0, [], [])
    seen = (0, 0, 0)
    t0 = time.perf_counter()
    async for kept in engine.stream(state):
        now = time.perf_counter() - t0
        totals = (stats.drafted_tokens, stats.accepted_tokens, stats.emitted_tokens)
        run.rounds.append(Round(*(a - b for a, b in zip(totals, seen))))
        seen = totals
        if kept:
            run.chunk_times.append(now)
            run.chunk_sizes.append(len(kept))
    run.seconds = time.perf_counter() - t0
    run.tokens = list(state.output_ids)
    return run


class _ChunkClock(BaseStreamer):
    """A streamer that only notes when each chunk of new tokens arrives (the first put is the prompt)."""

    def __init__(self, t0: float):
        self.t0, self.times, self.sizes, self._prompt = t0, [], [], True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter() - self.t0)
        self.sizes.append(value.numel())

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(engine: Engine, ids: list[int], mode: Mode, max_tokens: int) -> PromptRun:
    """Generate with Hugging Face `generate` on the engine's loaded models, EOS ignored like ours."""
    target, draft = engine.target.model, engine.draft.model if mode.assistant is not None else None
    input_ids = torch.tensor([ids], device=engine.target.device)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    saved = copy.deepcopy(draft.generation_config) if draft is not None else None
    try:
        if draft is not None:
            # HF reads K, its schedule and the confidence stop from the *assistant's* config
            for key, value in mode.assistant.items():
                setattr(draft.generation_config, key, value)
        t0 = time.perf_counter()
        clock = _ChunkClock(t0)
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=draft,
                              do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=pad,
                              streamer=clock)
        seconds = time.perf_counter() - t0
    finally:
        if draft is not None:
            draft.generation_config = saved
    return PromptRun(out[0, len(ids):].tolist(), seconds, clock.times, clock.sizes)


def run_one(engine: Engine, ids: list[int], mode: Mode, max_tokens: int) -> PromptRun:
    return (run_hf if mode.hf else run_engine)(engine, ids, mode, max_tokens)


# --- the cost ratio ------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_ms(model, context: int, new_tokens: int = 1, steps: int = 20, batch: int = 1) -> float:
    """Median ms of one forward of `new_tokens` tokens per row, `batch` rows, over a KV cache of ~`context`."""
    device = next(model.parameters()).device
    ids = torch.randint(2, model.config.vocab_size, (batch, context + new_tokens * (steps + 3)), device=device)
    cache = DynamicCache()
    model(ids[:, :context], use_cache=True, **with_cache(model, cache))
    times, pos = [], context
    for _ in range(steps + 3):
        _sync(device)
        t0 = time.perf_counter()
        model(ids[:, pos:pos + new_tokens], use_cache=True, **with_cache(model, cache))
        _sync(device)
        times.append(time.perf_counter() - t0)
        pos += new_tokens
    return statistics.median(times[3:]) * 1e3  # the first steps warm up allocators


def measure_costs(engine: Engine, context: int, ks: list[int], steps: int = 20) -> dict:
    """Draft step, target step and target verify (K+1 tokens) times; c = draft / target step."""
    target_ms = forward_ms(engine.target.model, context, 1, steps)
    draft_ms = forward_ms(engine.draft.model, context, 1, steps)
    verify = {k: forward_ms(engine.target.model, context, k + 1, steps) for k in sorted(set(ks))}
    return {"context": context, "target_step_ms": target_ms, "draft_step_ms": draft_ms,
            "target_verify_ms": verify, "c": draft_ms / target_ms}


def measure_syncs(engine: Engine, ids: list[list[int]], k: int = 4) -> dict:
    """Host syncs (app/model/syncs.py) of one steady round over a batch of the prompts, greedy and sampled:
    the draft's proposal (k tokens and its guess) and the target's verify of it."""
    out = {"batch": len(ids), "k": k}
    for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=k + 1)),
                         ("sampled", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=k + 1))):
        asks = [ProposeItem(f"syncs-{name}-{i}", list(p), k, params, seed=i, guess=True) for i, p in enumerate(ids)]
        propose(engine.draft, asks)  # the contexts cached: what is counted is a steady round
        verify(engine.target, [VerifyItem(a.seq_id, a.token_ids, Proposal.empty(), params, a.seed) for a in asks])
        with SyncCounter() as draft:
            proposals = propose(engine.draft, asks)
        with SyncCounter() as target:
            verify(engine.target,
                   [VerifyItem(a.seq_id, a.token_ids, p, params, a.seed) for a, p in zip(asks, proposals)])
        for a in asks:
            engine.draft.forget(a.seq_id), engine.target.forget(a.seq_id)
        out[name] = {"propose": draft.count, "verify": target.count,
                     "propose_uploads": draft.upload_count, "verify_uploads": target.upload_count}
    return out
