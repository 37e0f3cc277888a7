"""The OpenAI API without its transport: a request's key checked, its body parsed and refused in OpenAI's
terms, its prompts tokenized, its choices turned into generation jobs, and a finished response written.

`OpenAIFront` is built from a tokenizer and `FrontSettings` and knows nothing of Ray or HTTP: whoever
holds the connection (the Serve ingress, deployments/ingress.py, or a test) reads the body and headers,
runs the blocking calls (`parse`, `prepare`, `tokenize`) off its event loop, sends the jobs to a target
and streams what comes back. Refusals are `APIError`s, which carry their status and OpenAI's error body.
The front keeps one tokenizer, whose settings are not safe to share between threads: call its blocking
methods from one thread.
"""

import functools
import hashlib
import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from app.openai.chat_template import chat_prompt_ids
from app.chunks import RESUME_HEADER, Chunk, Resume, ResumeState, read_resume
from app.errors import APIError, InvalidRequestError, invalid
from app.grammar import Grammars
from app.job import GenerationJob
from app.openai.protocol import choice_seed, default_max_tokens, load_json, normalise_body
from app.openai.responses import ChoiceView, choice_body, combined_speculation, completion_body, usage_body
from app.params import MAX_CHOICES, SamplingParams, SpeculationParams
from app.openai.tokenization import detokenize, tokenize
from app.request import streamed_text
from app.openai.tool_calls import PARSERS, enforced_tools, special_markers

# used when a tokenizer ships no chat template (the demo pair): plain "role: content" turns
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
RESUME_NAME = RESUME_HEADER.decode()  # the header a resumed stream's state arrives in (deployments/failover.py)


@dataclass(frozen=True)
class FrontSettings:
    """What the front checks requests against: the model's name and context, the operator's limits."""

    model_name: str
    max_context: int
    max_tokens_cap: int = 4096
    default_max_tokens: int = 16  # a completion that does not say (OpenAI's 16); a chat runs to the context
    max_body_bytes: int = 1 << 20
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None  # app/openai/tool_calls.py PARSERS; None refuses requests offering tools
    default_num_tokens: int | Literal["auto"] = "auto"  # a request's speculation K when it does not say
    api_keys: tuple[bytes, ...] = field(default=(), repr=False)  # none: every caller is let in
    chat_template: str | None = None  # the operator's, for a checkpoint whose own is missing or wrong


@dataclass
class Prepared:
    """A request ready for the targets: its prompts as ids, one job and one view per choice (OpenAI's
    order, n choices per prompt), and where a resumed stream stands (None: a new request)."""

    prompts: list[list[int]]
    jobs: list[GenerationJob]
    views: list[ChoiceView]
    resume: Resume | None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)  # each prompt counted once, whatever n

    @functools.cached_property
    def starts(self) -> list[ResumeState]:
        """Where each choice begins: from what it streamed (a resumed stream), else afresh. One list,
        which a streamed response then keeps up to date for the proxy's failover."""
        return self.resume.choices if self.resume else [ResumeState(seed=job.seed) for job in self.jobs]


class OpenAIFront:
    """OpenAI's completions, chat completions, tokenize and detokenize, for one model."""

    def __init__(self, tokenizer, settings: FrontSettings):
        """The front takes the tokenizer over: it sets its chat template (the operator's, else its own,
        else DEFAULT_CHAT_TEMPLATE) and calls it from one thread."""
        self.tokenizer, self.settings = tokenizer, settings
        if settings.chat_template:
            tokenizer.chat_template = settings.chat_template
        elif not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        self.default_spec = SpeculationParams(num_tokens=settings.default_num_tokens)
        self.grammars = Grammars(tokenizer, len(tokenizer))  # tokens' bytes, as llguidance reads them
        self.tool_parser = PARSERS[settings.tool_call_parser] if settings.tool_call_parser else None
        self.tool_markers = special_markers(tokenizer, self.tool_parser) if self.tool_parser else {}

    # -- checks before the body is read ----------------------------------------------------------
    def authorize(self, headers: Mapping[str, str]) -> str | None:
        """Check the API key; the caller's prefix-cache scope: its key's digest (None: no keys set), so
        clients of different keys never reuse each other's cached prompts (nor learn of them)."""
        if not self.settings.api_keys:
            return None
        given = headers.get("authorization", "")
        token = (given[7:] if given.lower().startswith("bearer ") else "").encode()
        # every key compared, in constant time: which key matched leaks nothing through timing
        matched = [hmac.compare_digest(token, key) for key in self.settings.api_keys]
        if not any(matched):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           "authentication_error", code="invalid_api_key")
        return hashlib.sha256(token).hexdigest()[:32]

    def check_size(self, size: int) -> None:
        if size > self.settings.max_body_bytes:
            raise APIError(413, f"request body over {self.settings.max_body_bytes} bytes", "invalid_request_error")

    def models(self, created: int) -> dict:
        """/v1/models' body: the one model served."""
        name = self.settings.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "specserve",
                                            "root": name, "parent": None, "max_model_len": self.settings.max_context}]}

    # -- blocking work: one thread ----------------------------------------------------------------
    def parse(self, raw: bytes, model_cls):
        """A body as `model_cls` (or as the class `model_cls(data)` picks) for this model."""
        self.check_size(len(raw))
        try:
            data = load_json(raw)
            if not isinstance(data, dict):
                raise InvalidRequestError("body must be a JSON object")
            if not isinstance(model_cls, type):
                model_cls = model_cls(data)
            body = model_cls.model_validate(normalise_body(data, model_cls))
        except InvalidRequestError as e:
            raise APIError.bad(e) from None
        except ValidationError as e:
            raise invalid(e.errors()) from None
        if body.model is not None and body.model != self.settings.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server has {self.settings.model_name!r}",
                           "not_found_error", "model", "model_not_found")
        return body

    def tokenize(self, body) -> dict:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as generation would see them."""
        if hasattr(body, "messages"):
            self._check_template(body)
        try:
            return tokenize(self.tokenizer, body, self.settings.max_context)
        except InvalidRequestError as e:
            raise APIError.bad(e) from None

    def detokenize(self, body) -> dict:
        """vLLM's /detokenize: token ids back to text."""
        try:
            return detokenize(self.tokenizer, body, len(self.tokenizer))
        except InvalidRequestError as e:
            raise APIError.bad(e) from None

    def prepare(self, body, chat: bool, scope: str | None = None, resume_header: str | None = None) -> Prepared:
        """A completion or chat request as generation jobs: tokenizer, chat template, sampling
        parameters and grammar checks. `scope` (authorize's) keeps callers' prompt caches apart;
        `resume_header`, a stream another front began, is checked like any input."""
        salt = "/".join(s for s in (scope, body.cache_salt) if s is not None) or None
        prompts = self._prompt_ids(body, chat)
        jobs, views = [], []
        for i, ids in enumerate(prompts):
            sampling = self._sampling(body, len(ids), chat, salt)
            echoed = None
            if not chat and body.echo:
                echoed = p if isinstance(p := body.prompts()[i], str) else self.tokenizer.decode(ids)
            for j in range(body.n):
                params = sampling if sampling.seed is None else sampling.model_copy(
                    update={"seed": choice_seed(sampling.seed, j)})
                jobs.append(GenerationJob.new(ids, params, uuid.uuid4().hex))
                views.append(ChoiceView(self.tokenizer, chat, sampling.logprobs is not None, echoed, ids,
                                        self._token_bytes, sampling.skip_special_tokens))
        prepared = Prepared(prompts, jobs, views, self._resume(resume_header, body, jobs))
        if prepared.resume:  # each choice continues from what it streamed, with the draws it began with
            for job, view, c in zip(jobs, views, prepared.resume.choices):
                job.resume(c)
                view.resume(c.streamed_chars)
        return prepared

    def streamed_texts(self, prepared: Prepared) -> list[str]:
        """The text each choice of a resumed stream had sent (its tool calls go on from it)."""
        return [streamed_text(self.tokenizer, job.params, c.output_ids, c.streamed_chars)
                for job, c in zip(prepared.jobs, prepared.starts)]

    # -- reading what was generated ----------------------------------------------------------------
    def tool_reader(self, body, chat: bool):
        """This model's tool-call parser for a chat offering tools (the first call only without
        parallel_tool_calls); None for any other request."""
        if not (chat and body.calling()):
            return None
        return self.tool_parser(max_calls=None if body.parallel_tool_calls else 1, specials=self.tool_markers)

    def response(self, rid: str, body, chat: bool, prepared: Prepared,
                 done: list[tuple[str, Chunk, dict | None]]) -> dict:
        """A whole (not streamed) response from each choice's (text, last chunk, logprobs)."""
        usage = usage_body(prepared.prompt_tokens, sum(last["usage"]["completion_tokens"] for _, last, _ in done))
        choices = []
        for i, (text, last, logprobs) in enumerate(done):
            content, calls, finish = text, None, last["finish_reason"]
            reader = self.tool_reader(body, chat)  # each choice's calls read by a parser of its own
            if reader is not None and (found := reader.parse(text))[1]:
                content, calls, finish = found[0], [c.body() for c in found[1]], "tool_calls"
            choices.append(choice_body(i, content, finish, chat, False, logprobs, calls))
        speculation = combined_speculation([last["speculation"] for _, last, _ in done])
        return completion_body(rid, self.settings.model_name, choices, usage, speculation, chat, delta=False)

    # -- the parts of prepare ------------------------------------------------------------------------
    def _check_template(self, body) -> None:
        """A request's own chat template runs only where the operator trusts request templates."""
        if body.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(400, "this server does not run chat templates sent with requests (the operator can "
                           "allow them: args.trust_request_chat_template)", "invalid_request_error", "chat_template")

    def _prompt_ids(self, body, chat: bool) -> list[list[int]]:
        """The request's prompts (a completion's batch, or the one chat) as token ids."""
        if chat:
            if body.calling() and self.tool_parser is None:
                raise APIError(400, "this server reads no tool calls: serve it with args.tool_call_parser "
                               f"({', '.join(PARSERS)})", "invalid_request_error", "tools")
            self._check_template(body)
            try:
                return [chat_prompt_ids(self.tokenizer, body.messages, body, tools=body.tool_dicts())]
            except InvalidRequestError as e:
                raise APIError.bad(e) from None
        prompts, vocab = body.prompts(), len(self.tokenizer)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"prompts x n must be <= {MAX_CHOICES}", "invalid_request_error", "n")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.tokenizer(p)["input_ids"])
            elif any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error", "prompt")
            else:
                out.append(list(p))
        return out

    def _max_tokens(self, body, prompt_len: int, chat: bool) -> int:
        limits, context = self.settings, self.settings.max_context
        room = context - prompt_len
        if room <= 0:
            raise APIError(400, f"prompt has {prompt_len} tokens; the context is {context}",
                           "invalid_request_error", "messages" if chat else "prompt", "context_length_exceeded")
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if asked is None:
            return default_max_tokens(chat, room, limits.default_max_tokens, limits.max_tokens_cap)
        if asked > limits.max_tokens_cap:
            raise APIError(400, f"max_tokens must be <= {limits.max_tokens_cap}", "invalid_request_error", "max_tokens")
        if asked > room:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({asked}) exceeds the context "
                           f"({context})", "invalid_request_error", "max_tokens", "context_length_exceeded")
        return asked

    def _sampling(self, body, prompt_len: int, chat: bool, salt: str | None) -> SamplingParams:
        """A prompt's sampling parameters from the body. Checked against the model where every entry
        point's jobs are, by the engine that runs them (app/job.py)."""
        try:
            sampling = body.sampling(self._max_tokens(body, prompt_len, chat), self.default_spec, salt)
            if chat and body.calling():
                sampling = self._tool_constraint(body, sampling)
        except ValidationError as e:
            raise invalid(e.errors()) from None
        except InvalidRequestError as e:
            raise APIError.bad(e) from None
        return sampling

    def _tool_constraint(self, body, sampling: SamplingParams) -> SamplingParams:
        """A request offering tools: its format's markers kept in its text, and a required or named
        call as a grammar of the format (app/openai/tool_calls.py)."""
        if self.tool_markers:
            sampling = sampling.model_copy(update={"keep_special_token_ids": sorted(self.tool_markers.values())})
        try:
            must = enforced_tools(body.tools, body.tool_choice)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="tool_choice") from None
        if must is None:
            return sampling
        if sampling.response_format is not None:
            raise InvalidRequestError("give one output constraint, not tool_choice and an output format",
                                      param="tool_choice")
        grammar = self.tool_reader(body, chat=True).grammar(must, body.parallel_tool_calls)
        try:  # checked here, where the tools are known: the engine would name the grammar, not them
            self.grammars.check(grammar)
        except InvalidRequestError as e:
            raise InvalidRequestError("a call of these tools cannot be forced: "
                                      f"{str(e).removeprefix('invalid response_format: ')}", param="tools") from None
        return sampling.model_copy(update={"response_format": {"type": "grammar", "grammar": grammar}})

    def _resume(self, header: str | None, body, jobs: list[GenerationJob]) -> Resume | None:
        """Where a stream another front began stands, or None."""
        try:
            resume = read_resume(header)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error") from None
        if resume is None:
            return None
        if not body.stream or len(resume.choices) != len(jobs):
            raise APIError(400, f"{RESUME_NAME} does not match this request: it resumes a stream of "
                           f"{len(resume.choices)} choices", "invalid_request_error")
        vocab = len(self.tokenizer)  # the header's own check, before its ids are used here
        for c, job in zip(resume.choices, jobs):
            if len(c.output_ids) > job.params.max_tokens or any(not 0 <= t < vocab for t in c.output_ids):
                raise APIError(400, f"{RESUME_NAME} holds more than max_tokens tokens or ids outside [0, {vocab})",
                               "invalid_request_error")
        return resume

    def _token_bytes(self, token: int) -> bytes:
        """A token's own bytes, as llguidance reads the tokenizer; its text's where it cannot."""
        try:
            return self.grammars.tokenizer.decode_bytes([token])
        except InvalidRequestError:
            return self.tokenizer.decode([token], skip_special_tokens=False).encode()
