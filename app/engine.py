"""The in-process engine: many concurrent requests, their rounds batched, no Ray.

    engine = Engine.from_pretrained(target="path/or/hub-id", draft="path/or/hub-id")
    results = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app import telemetry
from app.speculation.pairing import check_vocabularies
from app.config import DraftSettings, ModelSettings, SpeculationSettings
from app.speculation.controller import CostEstimator, KController, KControllerConfig, VerifyCost
from app.speculation.gate import GoodputGate
from app.speculation.driver import DraftPolicy, RoundContext, VerifyFn, run_rounds
from app.errors import InvalidRequestError
from app.scheduler import BatchBudget, ForwardQueue, in_thread
from app.grammar import Grammars
from app.model.kv import PREFIX_BLOCK
from app.model.loading import load_pair
from app.params import SamplingParams, parse_sampling
from app.chunks import Chunk
from app.job import GenerationJob, Limits, admit
from app.request import RequestState
from app.model.runner import ModelRunner
from app.speculation.steps import family, verify, verify_tokens
from app.speculation.drafting import propose
from app.telemetry import NoObserver, RoundObserver

MAX_BATCH_TOKENS = 2048  # most positions one target forward computes in process (the KV budget leaves room for it)


class EngineConfig(BaseModel):
    """How the in-process engine loads its models and speculates: each model's settings and the
    speculation defaults (app/config.py, the same settings the served app's config holds)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="Target model: hub id or local directory.")
    draft: str | None = Field(None, description="Draft model: hub id or local directory; None = no speculation.")
    target_settings: ModelSettings = Field(default_factory=ModelSettings, description="How the target loads.")
    draft_settings: DraftSettings = Field(default_factory=DraftSettings, description="How the draft loads.")
    # In one process the two models' forwards take turns at the GIL, so drafting ahead slows the verify
    # it hides behind (2 CPU cores, demo pair, 16 code prompts, K = 4, `specserve bench` with and without
    # --draft-ahead: 145-155 tokens/s with it, 170-177 without). The served path, where the draft is
    # another process, keeps it.
    speculation: SpeculationSettings = Field(default_factory=lambda: SpeculationSettings(draft_ahead=False),
                                             description="Speculation defaults; drafting ahead is off in process.")

    @field_validator("draft_settings", mode="before")
    @classmethod
    def _draft_from_model_settings(cls, value):
        """A model's settings serve as a draft's (with the draft's own at their defaults)."""
        return value.model_dump() if isinstance(value, ModelSettings) and not isinstance(value, DraftSettings) else value

    @classmethod
    def of(cls, target: str, draft: str | None = None, **settings) -> "EngineConfig":
        """From flat keyword settings: `dtype` and `draft_dtype` per model; `device`, `max_cache_bytes`,
        `memory_utilization`, `trust_remote_code`, `compile`, `compile_max_tokens`, `attention` for both;
        `proposal_vocab` for the draft;
        the speculation settings (`k_max`, `draft_top_n`, `draft_ahead`, ...) by name."""
        per = {"dtype": "target_settings", "draft_dtype": "draft_settings", "proposal_vocab": "draft_settings"}
        both, speculation = set(ModelSettings.model_fields) - {"dtype"}, set(SpeculationSettings.model_fields)
        out: dict = {"target_settings": {}, "draft_settings": {}, "speculation": {"draft_ahead": False}}
        for name, value in settings.items():
            if name in per:
                out[per[name]][name.removeprefix("draft_")] = value
            elif name in both:
                out["target_settings"][name] = out["draft_settings"][name] = value
            elif name in speculation:
                out["speculation"][name] = value
            else:
                raise TypeError(f"unknown engine setting {name!r}")
        return cls.model_validate({"target": target, "draft": draft, **out})


@dataclass
class GenerationResult:
    """One request's output."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    speculation: dict
    logprobs: list[tuple] | None = None  # per output token, when asked: (logprob, [(id, logprob), ...])
    prompt_logprobs: list[tuple] | None = None  # per prompt token after the first, when asked


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs rounds: the largest K, the draft's sampled candidates, the draft policy
    (deadlines, drafting ahead, branches), prompt chunks, a target forward's tokens, the goodput gate
    (measure whether speculating emits more tokens per second than plain steps at the current load,
    and take plain steps where it does not: app/speculation/gate.py), and what K more tokens cost the target now."""

    k_max: int = 8
    draft_top_n: int = 32
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    prefill_chunk: int | None = 512  # most prompt tokens a sequence adds to one target forward
    max_batch_tokens: int | None = MAX_BATCH_TOKENS  # in process: most positions one target forward computes
    goodput_gate: bool = False
    verify_cost: Callable[[], VerifyCost] = lambda: 0.0  # what K more tokens cost the target's forwards now


@dataclass(frozen=True)
class RemoteTarget:
    """What the engine must be told of a target it reaches through a transport (a runner in this
    process tells it itself): its tokenizer, vocabulary, context, eos ids (None: the tokenizer's), KV
    capacity in tokens, and grammars to check requests against."""

    tokenizer: object
    vocab_size: int
    max_context: int | None
    eos_ids: frozenset[int] | None = None
    kv_capacity: int | None = None
    grammars: Grammars | None = None
    # positions of a context its prefix cache holds (KVStore.prefix_len); None where not known here
    prefix_len: Callable[[list[int], str | None], int] | None = None

    @classmethod
    def of(cls, runner: ModelRunner) -> "RemoteTarget":
        return cls(runner.tokenizer, runner.vocab_size, runner.max_context, runner.eos_ids, runner.capacity_tokens(),
                   runner.grammars, runner.cache.prefix_len)


class Transport(Protocol):
    """How the engine reaches a model: submit a round's item, release a finished sequence's cache."""

    async def submit(self, item): ...

    async def release(self, seq_id: str) -> None: ...


class Engine:
    """Serves many requests at once by batching their rounds continuously (app.speculation.driver).

    In process both models are local forward queues; a TargetServer replica builds the same engine
    over its own forward queue and a client of the draft pool (deployments.servers).
    """

    def __init__(self, target: ModelRunner | Transport, draft: ModelRunner | Transport | None = None,
                 settings: EngineSettings | None = None, remote: RemoteTarget | None = None):
        """target, draft: runners in this process, or transports to them (a TargetServer replica's forward
        queue and its client of the draft pool); `remote` tells what a transported target is."""
        settings = settings or EngineSettings()
        # the local runners, when in process (benchmarks read their models); None when remote
        self.target = target if isinstance(target, ModelRunner) else None
        self.draft = draft if isinstance(draft, ModelRunner) else None
        if isinstance(target, ModelRunner):
            remote = RemoteTarget.of(target)
            if isinstance(draft, ModelRunner):
                check_vocabularies(target.tokenizer, draft.tokenizer)
            budget = BatchBudget(None, settings.max_batch_tokens, verify_tokens)
            target = ForwardQueue(in_thread(functools.partial(verify, target), target.thread), target.release,
                                  name="verify.batch", budget=budget, forget=target.forget)
        if isinstance(draft, ModelRunner):
            draft = ForwardQueue(in_thread(functools.partial(propose, draft, top_n=settings.draft_top_n), draft.thread),
                                 draft.release, name="propose.batch", forget=draft.forget)
        self.verifier, self.drafter = target, draft
        self.tokenizer, self.vocab_size = remote.tokenizer, remote.vocab_size
        # admission: a sequence holds at most the target's whole KV budget, so a context past it is refused
        # (never admitted to be evicted and recomputed every round); past the model's positions, too
        self.max_context, self.context_limit = remote.max_context, "the model's context"
        if remote.kv_capacity is not None and (remote.max_context is None or remote.kv_capacity < remote.max_context):
            self.max_context, self.context_limit = remote.kv_capacity, "the target's KV cache budget"
        self.eos_ids = remote.eos_ids  # None: the tokenizer's
        # to check requests' grammars: the target runner's own where it is in this process (it masks with
        # them); a tensor-parallel replica's ranks hold theirs elsewhere, so it gets one of its own
        self.grammars = remote.grammars or Grammars(remote.tokenizer, remote.vocab_size)
        self.target_cached = remote.prefix_len
        self.k_max = settings.k_max
        self.limits = Limits(self.vocab_size, self.max_context, self.k_max, self.context_limit, self.grammars.check)
        self.policy = settings.policy
        self.verify_cost = settings.verify_cost
        self.costs = CostEstimator(gate=GoodputGate() if settings.goodput_gate else None)
        self.active = 0  # requests whose rounds run now: with company, a round never waits for the draft
        self.prefill_chunk = settings.prefill_chunk  # most prompt tokens a sequence adds to one target forward
        self.prefills = SharedPrefills()  # contexts being prefilled now: same-context sequences wait, then borrow

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        target, draft = load_pair(config.target, config.target_settings, config.draft, config.draft_settings,
                                  MAX_BATCH_TOKENS)
        spec = config.speculation
        return cls(target, draft, EngineSettings(k_max=spec.k_max, draft_top_n=spec.draft_top_n,
                                                 policy=DraftPolicy.of(spec), goodput_gate=spec.goodput_gate))

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, **kwargs) -> "Engine":
        """Build an engine from two model paths or hub ids; kwargs are settings (EngineConfig.of)."""
        return cls.from_config(EngineConfig.of(target, draft, **kwargs))

    def new_request(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                    request_id: str | None = None) -> RequestState:
        """Tokenize and admit one request (app/job.py: the same check as a job from any other entry point)."""
        params = parse_sampling(params)
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        else:
            ids = list(prompt)
        job = self.admit(GenerationJob.new(ids, params, request_id or uuid.uuid4().hex))
        return RequestState(job, self.tokenizer, self.max_context, self.eos_ids)

    def admit(self, job: GenerationJob) -> GenerationJob:
        """The job checked against this engine's models (app.job.admit)."""
        return admit(job, self.limits)

    def controller(self, params: SamplingParams) -> KController:
        """A request's K controller. It starts from this engine's recent acceptance rate, except for a
        seeded sampled request: its K schedule must depend on its own history only (its draws do)."""
        pinned = params.speculation.pinned_k() if self.drafter else 0
        own = params.seed is not None and not params.greedy
        return KController(KControllerConfig(k_max=self.k_max), pinned_k=pinned,
                           prior_alpha=None if own else self.costs.alpha)

    async def stream(self, state: RequestState, controller: KController | None = None,
                     observer: RoundObserver = NoObserver(), trace_parent: telemetry.Parent = None
                     ) -> AsyncIterator[list[int]]:
        """Run one request's rounds, yielding the tokens each round kept; frees its caches after."""
        verify, cached, prefilled = await self.prefills.join(state, self.verifier.submit)
        self.active += 1
        try:
            context = RoundContext(self.drafter.submit if self.drafter else None, verify, self.costs, self.verify_cost,
                                   self.policy, lambda: self.active > 1, lambda: self.active, self.prefill_chunk,
                                   self.target_cached)
            async for kept in run_rounds(state, context, controller or self.controller(state.params), observer,
                                         trace_parent, cached):
                yield kept
        finally:
            prefilled(False)  # a leader that ends (fails, is cancelled) before its prefill releases its waiters
            self.active -= 1
            # shielded: a cancelled request (client gone) must still free its caches
            await asyncio.shield(asyncio.ensure_future(self.release(state.request_id)))

    async def run_job(self, job: GenerationJob, observer: RoundObserver = NoObserver(),
                      trace_parent: telemetry.Parent = None) -> AsyncIterator[Chunk]:
        """Run (or resume) a request: chunks {token_ids, text, controller}, then a last chunk with
        finish_reason, usage and speculation stats. What a TargetServer replica streams.

        The rounds do not wait for their chunks to be sent: a round's tokens go to a queue and the
        next round joins the next forward at once (a sequence that waited on its stream would miss
        its batch). Whatever has queued while a chunk was being sent goes out as one chunk.
        """
        # a bad job fails here, alone; off the loop that runs every round (a grammar compiles in it)
        job = await asyncio.to_thread(self.admit, job)
        state = RequestState(job, self.tokenizer, self.max_context, self.eos_ids)
        chunks: asyncio.Queue = asyncio.Queue()
        producer = asyncio.ensure_future(self._produce(job, state, observer, trace_parent, chunks))
        try:
            while True:
                merged = await chunks.get()
                while not chunks.empty() and "finish_reason" not in merged and not isinstance(merged, BaseException):
                    merged = _merge(merged, chunks.get_nowait())
                if isinstance(merged, BaseException):
                    raise merged
                yield merged
                if "finish_reason" in merged:
                    return
        finally:
            producer.cancel()  # the stream was closed (client gone, replica shutting down): stop the rounds
            await asyncio.gather(producer, return_exceptions=True)

    async def _produce(self, job: GenerationJob, state: RequestState, observer: RoundObserver,
                       trace_parent: telemetry.Parent, chunks: asyncio.Queue) -> None:
        try:
            controller = self.controller(state.params).restore(job.controller)
            async for kept in self.stream(state, controller, observer, trace_parent):
                delta = state.take_delta()
                if kept or delta:
                    chunks.put_nowait(Chunk(token_ids=kept, text=delta, controller=controller.snapshot(),
                                            **_logprobs(state, len(kept))))
        except asyncio.CancelledError as e:
            # the stream is never left waiting: a round cancelled from elsewhere ends it with an error
            chunks.put_nowait(RuntimeError(f"generation cancelled: {e}"))
            raise
        except Exception as e:
            chunks.put_nowait(e)
            return
        prompt, completion = len(job.prompt_ids), len(state.output_ids)
        chunks.put_nowait(Chunk(token_ids=[], text=state.take_delta(), finish_reason=state.finish_reason,
                                **_logprobs(state, 0),
                                usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                       "total_tokens": prompt + completion},
                                speculation=state.stats.summary(), prompt_forward_s=state.stats.prompt_forward_s))

    async def release(self, seq_id: str) -> None:
        """Free a request's caches on both models (a release that fails is the remote replica's loss)."""
        await self.verifier.release(seq_id)
        if self.drafter:
            await self.drafter.release(seq_id)  # a draft pool's client frees the request's branches with it
            if self.draft is not None:  # in process: the queue frees each branch's cache (app/speculation/steps.py, family)
                for branch in family(seq_id)[1:]:
                    await self.drafter.release(branch)

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


class SharedPrefills:
    """The contexts an engine's target is prefilling now, so that sequences with the same context (a
    request's n choices) compute it once: the first to arrive leads, the others wait until its first
    verify over the whole context has returned (its KV is then in the target's store), then start.
    Their first round borrows that KV (a prefix hit, app/model/kv.py) and computes only the last position.
    Without this they would prefill it n times over, in one forward; waiting costs them one round.

    Keyed by (context ids, cache salt): a sequence borrows only within its salt. Only contexts that
    hold a whole prefix block before their last position (shorter ones are never borrowed), and not
    for requests that score their prompt (they compute every position anyway). A leader that fails or
    is cancelled first releases its waiters, which then prefill for themselves.
    """

    def __init__(self):
        self._now: dict[tuple, asyncio.Future] = {}  # key -> resolved True when the KV is stored, False if never

    async def join(self, state: RequestState, verify: VerifyFn) -> tuple[VerifyFn, int, Callable[[bool], None]]:
        """(verify, cached, prefilled): the verify to submit through, the context positions the target
        holds for this sequence now, and what to call when it ends."""
        ids = state.token_ids
        if len(ids) <= PREFIX_BLOCK or (state.params.prompt_logprobs is not None and not state.output_ids):
            return verify, 0, lambda ok: None
        key = (tuple(ids), state.params.cache_salt)
        if (leader := self._now.get(key)) is not None:
            stored = await asyncio.shield(leader)  # a waiter cancelled here leaves the leader's future alone
            return verify, len(ids) - 1 if stored else 0, lambda ok: None
        done = self._now[key] = asyncio.get_running_loop().create_future()

        def prefilled(ok: bool) -> None:
            if not done.done():
                done.set_result(ok)
            if self._now.get(key) is done:
                del self._now[key]

        async def leading(item):
            verdict = await verify(item)
            if len(item.token_ids) >= len(ids):  # the whole context (chunks before cover less)
                prefilled(True)
            return verdict
        return leading, 0, prefilled


def _logprobs(state: RequestState, kept: int) -> dict:
    """A chunk's logprob fields, when the request asked for them: those of its `kept` last output tokens,
    and the prompt's until a chunk has carried them (a resumed request's front has them already)."""
    out = {}
    if state.params.logprobs is not None:
        out["logprobs"] = state.logprobs[len(state.logprobs) - kept:]
    if state.prompt_logprobs:
        out["prompt_logprobs"], state.prompt_logprobs = state.prompt_logprobs, []
    return out


def _merge(first: Chunk | BaseException, then: Chunk | BaseException) -> Chunk | BaseException:
    """Two queued chunks as one: tokens, text and logprobs joined, the later chunk's other fields (an
    error wins)."""
    if isinstance(first, BaseException) or isinstance(then, BaseException):
        return first if isinstance(first, BaseException) else then
    joined = {key: first[key] + then[key] for key in ("token_ids", "text", "logprobs", "prompt_logprobs")
              if key in first and key in then}
    return Chunk(**{**first, **then, **joined})


def result_of(state: RequestState) -> GenerationResult:
    params = state.params
    return GenerationResult(state.request_id, state.text, list(state.output_ids), list(state.prompt_ids),
                            state.finish_reason or "length", state.stats.summary(),
                            list(state.logprobs) if params.logprobs is not None else None,
                            list(state.prompt_logprobs) if params.prompt_logprobs is not None else None)
