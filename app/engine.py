"""The in-process engine: many concurrent requests, their rounds batched, no Ray.

    engine = Engine.from_pretrained(target="path/or/hub-id", draft="path/or/hub-id")
    results = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel, Field

from app.batching import MicroBatcher
from app.compat import check_vocabularies
from app.controller import CostEstimator, KController, KControllerConfig
from app.driver import run_rounds
from app.errors import InvalidRequestError
from app.params import SamplingParams, parse_sampling
from app.request import RequestState
from app.runner import ModelRunner
from app.spec import propose, verify


class EngineConfig(BaseModel):
    """How the engine loads its models and speculates."""

    target: str = Field(description="Target model: hub id or local directory.")
    draft: str | None = Field(None, description="Draft model: hub id or local directory; None = no speculation.")
    dtype: str = Field("float32", description="Weights dtype of the target: float32, bfloat16, float16 or auto.")
    draft_dtype: str = Field("float32", description="Weights dtype of the draft.")
    device: str = Field("cpu", description="torch device of both models.")
    k_max: int = Field(8, ge=0, le=32, description="Largest K the controller may choose or a request may pin.")
    draft_top_n: int = Field(32, ge=0, description="Draft distribution truncated to its top-N (exact; 0 = full).")
    max_cache_bytes: int = Field(1 << 30, gt=0, description="KV cache budget of each model, bytes (LRU beyond).")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the weights (off: safer).")


@dataclass
class GenerationResult:
    """One request's output."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    speculation: dict


class Engine:
    """Serves many requests at once in one process by batching their rounds."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None = None, *, k_max: int = 8, draft_top_n: int = 32):
        if draft is not None:
            check_vocabularies(target.tokenizer, draft.tokenizer)
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.k_max, self.draft_top_n = k_max, draft_top_n
        self.costs = CostEstimator()
        self._verify = MicroBatcher(lambda items, _: verify(self.target, items))
        self._propose = MicroBatcher(lambda items, _: propose(self.draft, items, self.draft_top_n)) if draft else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        def load(path: str, dtype: str) -> ModelRunner:
            return ModelRunner.from_pretrained(path, dtype=dtype, device=config.device,
                                               max_cache_bytes=config.max_cache_bytes,
                                               trust_remote_code=config.trust_remote_code)
        target = load(config.target, config.dtype)
        draft = load(config.draft, config.draft_dtype) if config.draft else None
        return cls(target, draft, k_max=config.k_max, draft_top_n=config.draft_top_n)

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, **kwargs) -> "Engine":
        """Build an engine from two model paths or hub ids; kwargs are EngineConfig fields."""
        return cls.from_config(EngineConfig(target=target, draft=draft, **kwargs))

    def new_request(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                    request_id: str | None = None) -> RequestState:
        """Validate and tokenize one request."""
        params = parse_sampling(params)
        pinned = params.speculation.pinned_k()
        if pinned is not None and pinned > self.k_max:
            raise InvalidRequestError(f"speculation.num_tokens must be <= {self.k_max}", param="speculation.num_tokens")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.target.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.target.vocab_size})", param="prompt")
        return RequestState(request_id or uuid.uuid4().hex, ids, params, self.tokenizer, self.target.max_context)

    def controller(self, params: SamplingParams) -> KController:
        pinned = params.speculation.pinned_k() if self.draft else 0
        return KController(KControllerConfig(k_max=self.k_max), pinned_k=pinned)

    async def stream(self, state: RequestState) -> AsyncIterator[list[int]]:
        """Run one request's rounds, yielding the tokens each round kept; frees its caches after."""
        try:
            async for kept in run_rounds(state, self._propose.submit if self._propose else None,
                                         self._verify.submit, self.controller(state.params), self.costs):
                yield kept
        finally:
            self.target.release(state.request_id)
            if self.draft:
                self.draft.release(state.request_id)

    async def generate_async(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> GenerationResult:
        state = self.new_request(prompt, params)
        async for _ in self.stream(state):
            pass
        return result_of(state)

    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | dict | list | None = None) -> list[GenerationResult]:
        """Generate for many prompts concurrently (their rounds batched); params is one or one per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidRequestError("give one params per prompt, or one for all", param="params")
        states = [self.new_request(p, sp) for p, sp in zip(prompts, per)]  # validate all before any work

        async def run_all():
            async def one(s):
                async for _ in self.stream(s):
                    pass
            await asyncio.gather(*(one(s) for s in states))
        asyncio.run(run_all())
        return [result_of(s) for s in states]


def result_of(state: RequestState) -> GenerationResult:
    return GenerationResult(state.request_id, state.text, list(state.output_ids), list(state.prompt_ids),
                            state.finish_reason or "length", state.stats.summary())
