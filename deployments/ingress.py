"""OpenAI-compatible HTTP ingress: auth, parsing, chat template, tokenization, responses.

The FastAPI app and its errors are in deployments/http_api.py, reading the generation streams and
the server-sent events in deployments/streams.py, placement and failover in deployments/dispatch.py.
"""

import asyncio
import concurrent.futures
import hashlib
import hmac
import importlib.metadata
import logging
import os
import time
import uuid

import prometheus_client
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry.trace import SpanKind
from pydantic import ValidationError
from ray import serve
from transformers import AutoTokenizer

from app import telemetry
from app.errors import InvalidRequestError
from app.grammar import Grammars
from app.chat_template import chat_prompt_ids
from app.openai_protocol import (MAX_CHOICES, ChatCompletionRequest, CompletionRequest, choice_seed, default_max_tokens,
                                 load_json, new_id, normalise_body)
from app.openai_responses import (ChoiceView, choice_body, combined_speculation, completion_body, join_logprobs,
                                  usage_body)
from app.chunks import Chunk, ResumeState
from app.job import GenerationJob
from app.params import SamplingParams, SpeculationParams
from app.request import streamed_text
from app.sources import local_model, log_into
from app.tokenization import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize,
                              tokenize)
from app.tool_calls import PARSERS, enforced_tools, special_markers
from deployments.args import AppConfig, chat_template_text
from deployments.dispatch import Dispatcher
from deployments.failover import GUARD_HEADER, RESUME_HEADER, read_resume
from deployments.http_api import APIError, api, invalid, narrow_schema
from deployments.metrics import VLLMMetrics, totals_actor
from deployments.streams import (StreamedChoices, StreamedResponse, all_or_stop, next_chunk, sse_events,
                                 stop_streams)

log = logging.getLogger("ray.serve")
# used when a tokenizer ships no chat template (the demo pair): plain "role: content" turns
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

@serve.ingress(api)
class Ingress:
    """FastAPI ingress: validates, tokenizes, and streams each request from a TargetServer replica
    through its Dispatcher (placement and failover, deployments/dispatch.py)."""

    def __init__(self, target, cfg: AppConfig, tokenizer_path: str, model_name: str, max_context: int):
        self.cfg, self.model_name, self.max_context = cfg, model_name, max_context
        log_into(log)
        # the target's tokenizer and config only: its weights are the target replicas' business
        self.tokenizer = AutoTokenizer.from_pretrained(
            local_model(tokenizer_path, cfg.target.revision, cfg.target.download_dir, weights=False))
        if cfg.chat_template:  # the operator's, for a checkpoint whose own is missing or wrong
            self.tokenizer.chat_template = chat_template_text(cfg.chat_template)
        elif not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        self.created = int(time.time())  # /v1/models' `created`: when this server started
        # secrets from the environment, never the config: one key, or several separated by commas
        self.api_keys = [k.strip().encode() for k in (os.environ.get(cfg.api_key_env) or "").split(",") if k.strip()]
        # tokenizing, chat templates and grammar checks run here, off the event loop that streams every
        # other request; one thread, since a fast tokenizer's settings are not safe to share between threads
        self.prepare = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-prepare")
        default = cfg.speculation.default_num_tokens
        self.default_spec = SpeculationParams(num_tokens=default)
        context = serve.get_replica_context()
        totals = totals_actor(context.app_name)
        self.vllm_metrics = VLLMMetrics(model_name, totals=lambda *args: totals.add.remote(*args),
                                        source=context.replica_id.unique_id)
        self.dispatch = Dispatcher(target, cfg, self.vllm_metrics)
        self.grammars = Grammars(self.tokenizer, len(self.tokenizer))  # tokens' bytes, as llguidance reads them
        # how this model writes tool calls (app/tool_calls.py); None: requests offering tools are refused
        self.tool_parser = PARSERS[cfg.tool_call_parser] if cfg.tool_call_parser else None
        self.tool_markers = special_markers(self.tokenizer, self.tool_parser) if self.tool_parser else {}
        narrow_schema(model_name, cfg.limits.max_tokens_cap)
        telemetry.configure_tracing("ingress")

    # -- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self):
        """vLLM's metrics, under vLLM's names, in Prometheus' text format (deployments/metrics.py)."""
        return Response(await self.vllm_metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specserve", "root": self.model_name, "parent": None,
                                            "max_model_len": self.max_context}]}

    @api.get("/version")
    async def version(self):
        """The server's version, as vLLM's /version gives its own."""
        return {"version": importlib.metadata.version("specserve")}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, chat=True)

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt's or a chat's token ids, as generation would see them."""
        self._authorize(request)
        body = await self._parse(request, lambda data: TokenizeChatRequest if "messages" in data
                                 else TokenizeCompletionRequest)
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            self._check_template(body)
        return await self._prepared(tokenize, self.tokenizer, body, self.max_context)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids back to text."""
        self._authorize(request)
        body = await self._parse(request, DetokenizeRequest)
        self._check_model(body.model)
        return await self._prepared(detokenize, self.tokenizer, body, len(self.tokenizer))

    async def _prepared(self, fn, *args):
        """fn(*args) on the request-preparing thread (tokenizers and templates), its refusal a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.prepare, fn, *args)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None

    def _check_template(self, body) -> None:
        """A request's own chat template runs only where the operator trusts request templates."""
        if body.chat_template is not None and not self.cfg.trust_request_chat_template:
            raise APIError(400, "this server does not run chat templates sent with requests (the operator can "
                           "allow them: args.trust_request_chat_template)", "invalid_request_error", "chat_template")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server has {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    # -- the request path --------------------------------------------------------------------
    def _authorize(self, request: Request) -> str | None:
        """Check the API key; the caller's prefix-cache scope: its key's digest (None: no keys set), so
        clients of different keys never reuse each other's cached prompts (nor learn of them)."""
        if not self.api_keys:
            return None
        given = request.headers.get("authorization", "")
        token = (given[7:] if given.lower().startswith("bearer ") else "").encode()
        # every key compared, in constant time: which key matched leaks nothing through timing
        matched = [hmac.compare_digest(token, key) for key in self.api_keys]
        if not any(matched):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           "authentication_error", code="invalid_api_key")
        return hashlib.sha256(token).hexdigest()[:32]

    async def _parse(self, request: Request, model_cls):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.cfg.limits.max_body_bytes:
            raise APIError(413, f"request body over {self.cfg.limits.max_body_bytes} bytes", "invalid_request_error")
        raw = await request.body()
        if len(raw) > self.cfg.limits.max_body_bytes:
            raise APIError(413, f"request body over {self.cfg.limits.max_body_bytes} bytes", "invalid_request_error")
        # parsing and validating up to max_body_bytes of JSON: on the worker thread, as tokenizing is
        return await asyncio.get_running_loop().run_in_executor(self.prepare, self._validate, raw, model_cls)

    @staticmethod
    def _validate(raw: bytes, model_cls):
        """A body as `model_cls` (or as the class `model_cls(data)` picks), or an APIError (400)."""
        try:
            data = load_json(raw)
            if not isinstance(data, dict):
                raise InvalidRequestError("body must be a JSON object")
            if not isinstance(model_cls, type):
                model_cls = model_cls(data)
            return model_cls.model_validate(normalise_body(data, model_cls))
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        except ValidationError as e:
            raise invalid(e.errors()) from None

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
                raise APIError(400, str(e), "invalid_request_error", e.param) from None
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
        room = self.max_context - prompt_len
        if room <= 0:
            raise APIError(400, f"prompt has {prompt_len} tokens; the context is {self.max_context}",
                           "invalid_request_error", "messages" if chat else "prompt", "context_length_exceeded")
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if asked is None:
            return default_max_tokens(chat, room, self.cfg.limits.default_max_tokens, self.cfg.limits.max_tokens_cap)
        if asked > self.cfg.limits.max_tokens_cap:
            raise APIError(400, f"max_tokens must be <= {self.cfg.limits.max_tokens_cap}", "invalid_request_error",
                           "max_tokens")
        if asked > room:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({asked}) exceeds the context "
                           f"({self.max_context})", "invalid_request_error", "max_tokens", "context_length_exceeded")
        return asked

    async def _serve(self, request: Request, model_cls, chat: bool):
        """The request in its HTTP span (a child of the client's traceparent, if it sent one)."""
        span = telemetry.start_span(f"POST {request.url.path}", dict(request.headers),
                                    {"http.request.method": "POST", "url.path": request.url.path}, SpanKind.SERVER)
        streaming = False
        try:
            response = await self._respond(request, model_cls, chat, span)
            streaming = isinstance(response, StreamingResponse)  # then the stream ends the span
            return response
        except APIError as e:
            telemetry.set_attributes(span, {"http.response.status_code": e.status, "error.type": e.type})
            raise
        finally:
            if span is not None and not streaming:
                span.end()

    async def _respond(self, request: Request, model_cls, chat: bool, span):
        scope = self._authorize(request)
        body = await self._parse(request, model_cls)
        self._check_model(body.model)
        salt = "/".join(s for s in (scope, body.cache_salt) if s is not None) or None
        resume_header = request.headers.get(RESUME_HEADER.decode())
        prompts, jobs, views, resume = await asyncio.get_running_loop().run_in_executor(
            self.prepare, self._prepare, body, chat, salt, resume_header)
        if resume:  # each choice continues from what it streamed, with the draws it began with
            for job, c in zip(jobs, resume.choices):
                job.resume(c)
        starts = resume.choices if resume else [ResumeState(seed=job.seed) for job in jobs]
        rid = resume.rid if resume else new_id("chatcmpl" if chat else "cmpl")
        live = [i for i, c in enumerate(starts) if not c.done]
        for i in live if resume else ():
            views[i].resume(starts[i].streamed_chars)
        # a prompt's n choices go to one target replica, which prefills their prompt once (app/engine.py)
        for i, job in enumerate(jobs):
            job.group = f"{rid}/{i // body.n}" if body.n > 1 else None
        # the engine on the target replica admits each job (app/job.py): a bad one's first chunk is its 400
        streams = [self.dispatch.generate(jobs[i], telemetry.carrier(span)) for i in live]
        deadline = asyncio.get_running_loop().time() + self.cfg.limits.request_timeout_s
        prompt_tokens = sum(len(ids) for ids in prompts)  # each prompt counted once, whatever n
        # errors before any token get a proper status
        firsts = await all_or_stop([self._next(s, deadline) for s in streams], streams)
        for first in firsts:
            if first.get("error"):
                await stop_streams([], streams)
                raise APIError.from_chunk(first["error"])
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            # as vLLM: usage on every chunk when both are asked for
            continuous = include_usage and options.continuous_usage_stats
            report = request.headers.get(GUARD_HEADER.decode()) == "1"  # the proxy's failover keeps the state
            tools, sent = self._reader(body) if chat and body.calling() else None, None
            if tools is not None and resume:  # a resumed stream's calls go on from the text its client had
                sent = await asyncio.get_running_loop().run_in_executor(self.prepare, lambda: [
                    streamed_text(self.tokenizer, job.params, c.output_ids, c.streamed_chars)
                    for job, c in zip(jobs, starts)])
            response = StreamedResponse(rid, self.model_name, chat, prompt_tokens, deadline,
                                        self.cfg.limits.request_timeout_s, include_usage, continuous, span, tools)
            choices = StreamedChoices(live, firsts, streams, views, starts if report else None, sent)
            return StreamingResponse(sse_events(response, choices), media_type="text/event-stream")
        try:
            done = await all_or_stop([self._rest(s, f, v, deadline) for s, f, v in zip(streams, firsts, views)],
                                      streams)
        finally:
            await stop_streams([], streams)
        usage = usage_body(prompt_tokens, sum(last["usage"]["completion_tokens"] for _, last, _ in done))
        choices = [choice_body(i, content, finish, chat, False, logprobs, calls)
                   for i, (text, last, logprobs) in enumerate(done)
                   for content, calls, finish in [self._calls(body, chat, text, last["finish_reason"])]]
        return completion_body(rid, self.model_name, choices, usage,
                               combined_speculation([last["speculation"] for _, last, _ in done]), chat, delta=False)

    def _prepare(self, body, chat: bool, salt: str | None, resume_header: str | None):
        """The request's prompts as ids, its choices' (prompt ids, params) and views in OpenAI's order
        (n choices per prompt), and where a resumed stream stands: the CPU work of a request, run off
        the event loop (tokenizer, chat template, grammar check)."""
        prompts = self._prompt_ids(body, chat)
        jobs, views = [], []
        echo = not chat and body.echo
        for i, ids in enumerate(prompts):
            sampling = self._sampling(body, len(ids), chat, salt)
            for j in range(body.n):
                params = sampling if sampling.seed is None else sampling.model_copy(
                    update={"seed": choice_seed(sampling.seed, j)})
                jobs.append(GenerationJob.new(ids, params, uuid.uuid4().hex))
                echoed = (p if isinstance(p := body.prompts()[i], str) else self.tokenizer.decode(ids)) if echo else None
                views.append(ChoiceView(self.tokenizer, chat, sampling.logprobs is not None, echoed, ids,
                                        self._token_bytes, sampling.skip_special_tokens))
        return prompts, jobs, views, self._resume(resume_header, body, jobs)

    def _resume(self, header: str | None, body, jobs: list[GenerationJob]):
        """Where a stream another ingress replica began stands (set by the proxy's failover), or None;
        checked like any input (whoever reaches a replica can send the header)."""
        name = RESUME_HEADER.decode()
        try:
            resume = read_resume(header)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error") from None
        if resume is None:
            return None
        if not body.stream or len(resume.choices) != len(jobs):
            raise APIError(400, f"{name} does not match this request: it resumes a stream of "
                           f"{len(resume.choices)} choices", "invalid_request_error")
        vocab = len(self.tokenizer)  # the header's own check, before its ids are used here
        for c, job in zip(resume.choices, jobs):
            if len(c.output_ids) > job.params.max_tokens or any(not 0 <= t < vocab for t in c.output_ids):
                raise APIError(400, f"{name} holds more than max_tokens tokens or ids outside [0, {vocab})",
                               "invalid_request_error")
        return resume

    def _token_bytes(self, token: int) -> bytes:
        """A token's own bytes, as llguidance reads the tokenizer; its text's where it cannot."""
        try:
            return self.grammars.tokenizer.decode_bytes([token])
        except InvalidRequestError:
            return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def _sampling(self, body, prompt_len: int, chat: bool, salt: str | None = None) -> SamplingParams:
        """A prompt's sampling parameters from the body (a 400 naming what is wrong). Checked against the
        model where every entry point's jobs are, by the engine that runs them (app/job.py)."""
        try:
            sampling = body.sampling(self._max_tokens(body, prompt_len, chat), self.default_spec, salt)
            if chat and body.calling():
                sampling = self._tool_constraint(body, sampling)
        except ValidationError as e:
            raise invalid(e.errors()) from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        return sampling

    def _tool_constraint(self, body, sampling: SamplingParams) -> SamplingParams:
        """A request offering tools: its format's markers kept in its text, and a required or named
        call as a grammar of the format (app/tool_calls.py)."""
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
        grammar = self._reader(body).grammar(must, body.parallel_tool_calls)
        try:  # checked here, where the tools are known: the engine would name the grammar, not them
            self.grammars.check(grammar)
        except InvalidRequestError as e:
            raise InvalidRequestError("a call of these tools cannot be forced: "
                                      f"{str(e).removeprefix('invalid response_format: ')}", param="tools") from None
        return sampling.model_copy(update={"response_format": {"type": "grammar", "grammar": grammar}})

    def _reader(self, body):
        """This model's tool-call parser, for a request: the first call only without parallel_tool_calls."""
        return self.tool_parser(max_calls=None if body.parallel_tool_calls else 1, specials=self.tool_markers)

    def _calls(self, body, chat: bool, text: str, finish: str) -> tuple[str, list[dict] | None, str]:
        """A finished choice's (content, tool_calls, finish_reason): its calls read when tools were offered."""
        if not (chat and body.calling()):
            return text, None, finish
        content, calls = self._reader(body).parse(text)
        return (content, [c.body() for c in calls], "tool_calls") if calls else (text, None, finish)

    async def _rest(self, stream, first: Chunk, view: ChoiceView, deadline: float) -> tuple[str, Chunk, dict | None]:
        """A generation's whole text, its last chunk (finish_reason, usage, speculation) and its logprobs."""
        last, texts, logprobs = first, [], []
        while True:
            text, lp = view.render(last)
            texts.append(text), logprobs.append(lp)
            if "finish_reason" in last:
                break
            last = await self._next(stream, deadline)
            if last.get("error"):
                raise APIError.from_chunk(last["error"])
        return "".join(texts), last, join_logprobs(logprobs)

    async def _next(self, stream, deadline: float) -> Chunk:
        return await next_chunk(stream, deadline, self.cfg.limits.request_timeout_s)
