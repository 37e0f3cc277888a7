"""A request as every entry point hands it to the engine, and the one check it must pass.

Whatever the entry point (the HTTP ingress, a Serve handle to a TargetServer replica, the in-process
`Engine`), a request becomes a `GenerationJob`: its prompt's token ids, typed `SamplingParams`, its
draw seed (chosen once, when the job is made, so a resumed job keeps its draws) and, when it resumes
on another replica, what was already streamed. `admit` is the only validation of a job against the
model that runs it: the engine calls it before the job joins any batch, so the same bad job gets
the same error wherever it entered, and no caller can skip it.
"""

import math
import secrets
from dataclasses import dataclass, field
from typing import Callable

from app.chunks import Chunk, ResumeState, advance
from app.errors import ContextLengthError, InvalidRequestError
from app.grammar import grammar_of
from app.params import MAX_SEED, MIN_SEED, SamplingParams, check_vocabulary, parse_sampling


@dataclass(frozen=True)
class Limits:
    """What the engine's models accept. `check_grammar` compiles a response format's grammar (or
    raises InvalidRequestError); `context_limit` names what `max_context` is in errors (the model's
    positions, or the target's KV budget where that is smaller)."""

    vocab_size: int
    max_context: int
    k_max: int
    context_limit: str = "the model's context"
    check_grammar: Callable | None = None


@dataclass
class GenerationJob:
    """Everything a replica needs to run a request from its start or to resume it elsewhere.

    The front keeps the job up to date from what was streamed (durable state is what was streamed):
    after a replica dies, the same job sent to another replica continues identically.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's draw seed: params' seed, or one chosen once when the job was made
    output_ids: list[int] = field(default_factory=list)  # tokens already streamed
    streamed_chars: int = 0  # characters of text already streamed
    controller: tuple | None = None  # the K controller's state after the last streamed round
    trace: dict | None = None  # W3C trace context of the caller's span
    group: str | None = None  # jobs of one group prefer one replica: a prompt's n choices share its prefill there

    @classmethod
    def new(cls, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
            **fields) -> "GenerationJob":
        """A new request's job: its draw seed is the request's own, else one chosen here, once."""
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        return cls(request_id or secrets.token_hex(16), list(prompt_ids), params, seed, **fields)

    def record(self, chunk: Chunk) -> None:
        """Take in a streamed chunk: its tokens, its text and the controller state it carries."""
        advance(self, chunk)

    def resume(self, state: ResumeState) -> None:
        """Continue from where a stream stood (a failed-over ingress's report): its draws, what it sent."""
        self.seed, self.output_ids, self.streamed_chars = state.seed, list(state.output_ids), state.streamed_chars
        self.controller = tuple(state.controller) if state.controller is not None else None


def admit(job: GenerationJob, limits: Limits) -> GenerationJob:
    """The job, checked against the models that will run it; raises InvalidRequestError (or its
    ContextLengthError) naming the first thing wrong. A token id outside the vocabulary would index
    past the embedding (on a GPU, a device fault that poisons the replica), a seed outside int64
    would fail every co-batched request's tensor: nothing of a job reaches a batch before this.
    Parameters sent as a dict (or a SamplingParams built without validation) are validated here."""
    vocab = limits.vocab_size
    _token_ids(job.prompt_ids, vocab, "prompt_ids")
    if not job.prompt_ids:
        raise InvalidRequestError("prompt is empty: give at least one token", param="prompt")
    _token_ids(job.output_ids, vocab, "output_ids")
    if type(job.seed) is not int or not MIN_SEED <= job.seed <= MAX_SEED:
        raise InvalidRequestError(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}]", param="seed")
    if job.controller is not None and (len(job.controller) != 3 or not all(
            isinstance(c, (int, float)) and math.isfinite(c) and c >= 0 for c in job.controller)):
        raise InvalidRequestError("controller must be three finite counts >= 0", param="controller")
    params = job.params
    if not isinstance(params, (SamplingParams, dict)):
        raise InvalidRequestError("params must be SamplingParams", param="params")
    job.params = params = parse_sampling(params.model_dump() if isinstance(params, SamplingParams) else params)
    check_vocabulary(params, vocab)
    pinned = params.speculation.pinned_k()
    if pinned is not None and pinned > limits.k_max:
        raise InvalidRequestError(f"speculation.num_tokens must be <= {limits.k_max}", param="speculation.num_tokens")
    if len(job.prompt_ids) >= limits.max_context:
        raise ContextLengthError(f"prompt has {len(job.prompt_ids)} tokens but {limits.context_limit} is "
                                 f"{limits.max_context} tokens: shorten the prompt", param="prompt")
    if len(job.output_ids) > params.max_tokens:
        raise InvalidRequestError("output_ids holds more than max_tokens tokens", param="output_ids")
    if limits.check_grammar is not None and (grammar := grammar_of(params.response_format)) is not None:
        limits.check_grammar(grammar)
    return job


def _token_ids(ids, vocab: int, param: str) -> None:
    if not isinstance(ids, list) or any(type(t) is not int or not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"{param} token ids must be in [0, {vocab})", param=param)
