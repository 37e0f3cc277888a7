"""OpenAI-compatible HTTP ingress: auth, validation, chat template, tokenization, SSE streaming.

Errors always take OpenAI's body ({"error": {message, type, param, code}}) with the right status:
400 invalid parameters (never FastAPI's 422), 401 bad key, 404 unknown model, 408 timeout,
413 body too large, 503 overloaded or no target.
"""

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import os
import secrets
import uuid

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import SpanKind
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from app import telemetry
from app.errors import InvalidRequestError
from app.grammar import Grammars, grammar_of
from app.openai_protocol import (MAX_CHOICES, ChatCompletionRequest, ChoiceView, CompletionRequest,
                                 chat_prompt_ids, choice_body, choice_seed, combined_speculation, completion_body,
                                 default_max_tokens, error_body, join_logprobs, load_json, new_id, normalise_body,
                                 sse_event, usage_body)
from app.params import SamplingParams, SpeculationParams, check_vocabulary
from deployments.config import AppConfig
from deployments.failover import GUARD_HEADER, RESUME_HEADER, ChoiceResume, marker, read_resume
from deployments.metrics import VLLMSpecDecodeCounters
from deployments.router import Router

log = logging.getLogger("ray.serve")
# used when a tokenizer ships no chat template (the demo pair): plain "role: content" turns
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

api = FastAPI(title="specserve", description="Exact speculative decoding, OpenAI-compatible.")
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _openapi() -> dict:
    """FastAPI's OpenAPI document with the request bodies the endpoints read. They parse bodies
    themselves (nulls, allowlisted fields, 400 rather than FastAPI's 422), so FastAPI cannot see them;
    clients, docs and schema fuzzers need them."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        error = {"description": "OpenAI's error body", "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            operation["responses"].update({str(code): error for code in (400, 401, 404, 408, 413, 503)})
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


def _narrow_schema(model_name: str, max_tokens_cap: int) -> None:
    """This deployment's limits in the published schema: the one model it serves, its max_tokens cap."""
    components = _openapi()["components"]["schemas"]
    for model in BODIES.values():
        fields = components[model.__name__]["properties"]
        fields["model"] = {**fields["model"], "enum": [model_name]}
        for name in ("max_tokens", "max_completion_tokens"):
            if name in fields:
                fields[name] = {**fields[name], "anyOf": [{"type": "integer", "minimum": 1, "maximum": max_tokens_cap},
                                                          {"type": "null"}]}
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "integer", "null"]}}}}}


class APIError(Exception):
    """An error answered with OpenAI's body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    @classmethod
    def from_router(cls, err: dict) -> "APIError":
        """An error chunk of the generation stream as an APIError."""
        return cls(int(err.get("code") or 503), err["message"], err["type"], err.get("param"), err.get("code"))

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status, self.headers)


@api.exception_handler(APIError)
async def _api_error(_, exc: APIError):
    return exc.response()


@api.exception_handler(RequestValidationError)
async def _validation_error(_, exc: RequestValidationError):
    return invalid(exc.errors()).response()


@api.exception_handler(StarletteHTTPException)
async def _http_error(_, exc: StarletteHTTPException):
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    return JSONResponse(error_body(str(exc.detail), kinds.get(exc.status_code, "invalid_request_error")),
                        exc.status_code)


@api.exception_handler(Exception)
async def _internal(request: Request, exc: Exception):
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error", code=500), 500)


def invalid(errors: list[dict]) -> APIError:
    """pydantic errors as a 400 naming the first bad parameter."""
    err = errors[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not isinstance(p, int)) or None
    return APIError(400, f"invalid {param or 'request'}: {err.get('msg')}", "invalid_request_error", param)


async def _close(stream) -> None:
    """Stop a generation stream (its router cancels the target replica's call)."""
    try:
        await stream.aclose()
    except RuntimeError:  # being closed already (a cancelled __anext__)
        pass


async def _stop(tasks: list[asyncio.Future], streams: list) -> None:
    """Cancel the tasks reading the streams, wait for them, then close the streams (a stream being
    read cannot be closed)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(_close(s) for s in streams))


async def _all_or_stop(coros: list, streams: list) -> list:
    """Await every coroutine reading the streams; if one fails, stop the rest and close every stream."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await _stop(tasks, streams)
        raise


@serve.ingress(api)
class Ingress:
    """FastAPI ingress: validates, tokenizes, and streams each request from a TargetServer replica
    through its Router (placement and failover, deployments/router.py)."""

    def __init__(self, target, cfg: AppConfig, tokenizer_path: str, model_name: str, max_context: int):
        self.router = Router(target, cfg)
        self.cfg, self.model_name, self.max_context = cfg, model_name, max_context
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        # secrets from the environment, never the config: one key, or several separated by commas
        self.api_keys = [k.strip().encode() for k in (os.environ.get(cfg.api_key_env) or "").split(",") if k.strip()]
        # tokenizing, chat templates and grammar checks run here, off the event loop that streams every
        # other request; one thread, since a fast tokenizer's settings are not safe to share between threads
        self.prepare = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-prepare")
        default = cfg.speculation.default_num_tokens
        self.default_spec = SpeculationParams(num_tokens=default)
        self.spec_counters = VLLMSpecDecodeCounters(model_name)
        self.grammars = Grammars(self.tokenizer, len(self.tokenizer))  # checks response_format before any work
        _narrow_schema(model_name, cfg.limits.max_tokens_cap)
        telemetry.configure_tracing("ingress")

    # -- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self):
        """vLLM's spec-decode counters in Prometheus' text format (deployments/metrics.py)."""
        return Response(self.spec_counters.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "specserve"}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, chat=True)

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
        """A body as `model_cls`, or an APIError (400) naming what is wrong."""
        try:
            data = load_json(raw)
            if not isinstance(data, dict):
                raise InvalidRequestError("body must be a JSON object")
            return model_cls.model_validate(normalise_body(data, model_cls))
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        except ValidationError as e:
            raise invalid(e.errors()) from None

    def _prompt_ids(self, body, chat: bool) -> list[list[int]]:
        """The request's prompts (a completion's batch, or the one chat) as token ids."""
        if chat:
            try:
                return [chat_prompt_ids(self.tokenizer, body.messages)]
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
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server has {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")
        spec = body.speculation
        if spec is not None and spec.pinned_k() is not None and spec.pinned_k() > self.cfg.speculation.k_max:
            raise APIError(400, f"speculation.num_tokens must be <= {self.cfg.speculation.k_max}",
                           "invalid_request_error", "speculation.num_tokens")
        salt = "/".join(s for s in (scope, body.cache_salt) if s is not None) or None
        resume_header = request.headers.get(RESUME_HEADER.decode())
        prompts, jobs, views, resume = await asyncio.get_running_loop().run_in_executor(
            self.prepare, self._prepare, body, chat, salt, resume_header)
        starts = resume.choices if resume else [ChoiceResume(seed=p["seed"] if p["seed"] is not None
                                                             else secrets.randbits(62)) for _, p in jobs]
        rid = resume.rid if resume else new_id("chatcmpl" if chat else "cmpl")
        live = [i for i, c in enumerate(starts) if not c.done]
        for i in live if resume else ():
            views[i].resume(starts[i].chars)
        # a prompt's n choices go to one target replica, which prefills their prompt once (app/engine.py)
        groups = [f"{rid}/{i // body.n}" if body.n > 1 else None for i in range(len(jobs))]
        streams = [self.router.generate(uuid.uuid4().hex, *jobs[i], telemetry.carrier(span), starts[i], groups[i])
                   for i in live]
        deadline = asyncio.get_running_loop().time() + self.cfg.limits.request_timeout_s
        prompt_tokens = sum(len(ids) for ids in prompts)  # each prompt counted once, whatever n
        # errors before any token get a proper status
        firsts = await _all_or_stop([self._next(s, deadline) for s in streams], streams)
        for first in firsts:
            if first.get("error"):
                await _stop([], streams)
                raise APIError.from_router(first["error"])
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            # as vLLM: usage on every chunk when both are asked for
            continuous = include_usage and options.continuous_usage_stats
            report = request.headers.get(GUARD_HEADER.decode()) == "1"  # the proxy's failover keeps the state
            return StreamingResponse(self._sse(rid, live, firsts, streams, views, deadline, chat, include_usage,
                                               prompt_tokens, continuous, span, starts if report else None),
                                     media_type="text/event-stream")
        try:
            done = await _all_or_stop([self._rest(s, f, v, deadline) for s, f, v in zip(streams, firsts, views)],
                                      streams)
        finally:
            await _stop([], streams)
        usage = usage_body(prompt_tokens, sum(last["usage"]["completion_tokens"] for _, last, _ in done))
        choices = [choice_body(i, text, last["finish_reason"], chat, False, logprobs)
                   for i, (text, last, logprobs) in enumerate(done)]
        return completion_body(rid, self.model_name, choices, None, usage,
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
            params = sampling.model_dump()
            for j in range(body.n):
                seed = params["seed"]
                jobs.append((ids, {**params, "seed": choice_seed(seed, j) if seed is not None else None}))
                echoed = (p if isinstance(p := body.prompts()[i], str) else self.tokenizer.decode(ids)) if echo else None
                views.append(ChoiceView(self.tokenizer, chat, sampling.logprobs is not None, echoed, ids,
                                        self._token_bytes))
        return prompts, jobs, views, self._resume(resume_header, body, jobs)

    def _resume(self, header: str | None, body, jobs: list[tuple[list[int], dict]]):
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
        vocab = len(self.tokenizer)
        for c, (_, params) in zip(resume.choices, jobs):
            if len(c.ids) > params["max_tokens"] or any(not 0 <= t < vocab for t in c.ids):
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
        """A prompt's sampling parameters, checked against the model (a 400 naming what is wrong)."""
        try:
            sampling = body.sampling(self._max_tokens(body, prompt_len, chat), self.default_spec, salt)
            check_vocabulary(sampling, len(self.tokenizer))
            if (grammar := grammar_of(sampling.response_format)) is not None:
                self.grammars.check(grammar)
        except ValidationError as e:
            raise invalid(e.errors()) from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        return sampling

    async def _rest(self, stream, first: dict, view: ChoiceView, deadline: float) -> tuple[str, dict, dict | None]:
        """A generation's whole text, its last chunk (finish_reason, usage, speculation) and its logprobs."""
        last, texts, logprobs = first, [], []
        while True:
            text, lp = view.render(last)
            texts.append(text), logprobs.append(lp)
            if "finish_reason" in last:
                break
            last = await self._next(stream, deadline)
            if last.get("error"):
                raise APIError.from_router(last["error"])
        self.spec_counters.count(last["speculation"])
        return "".join(texts), last, join_logprobs(logprobs)

    async def _next(self, stream, deadline: float) -> dict:
        """The generation's next chunk, within the request's deadline (past it the generation is stopped)."""
        timeout = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(stream.__anext__(), max(timeout, 0.001))
        except asyncio.TimeoutError:
            await _close(stream)
            raise APIError(408, f"request exceeded {self.cfg.limits.request_timeout_s}s", "timeout_error",
                           code="timeout") from None
        except BackPressureError:
            raise APIError(503, "server overloaded: retry later", "service_unavailable",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except StopAsyncIteration:
            raise APIError(503, "generation ended without a result", "service_unavailable") from None
        except InvalidRequestError as e:  # the target refused the job (Ray re-raises it as a subclass)
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as e:  # the server's fault: said in OpenAI's body, logged with what it was
            log.exception("generation failed")
            raise APIError(500, f"internal error: {type(e).__name__}", "internal_error", code=500) from None

    async def _sse(self, rid: str, live: list[int], firsts: list[dict], streams: list, views: list[ChoiceView],
                   deadline: float, chat: bool, include_usage: bool, prompt_tokens: int, continuous: bool, span=None,
                   starts: list[ChoiceResume] | None = None):
        """The generations as one stream of server-sent events, each chunk naming its choice's index;
        with `continuous`, every chunk carries the usage so far. `live`: the choices generated here
        (a resumed stream's finished ones are not), in the order of `streams`. With `starts`, each
        event goes with a report of the state it leaves its choice in (deployments/failover.py)."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def pump(index: int, stream, chunk: dict) -> None:
            while True:
                await queue.put((index, chunk))
                if chunk.get("error") or "finish_reason" in chunk:
                    return
                try:
                    chunk = await self._next(stream, deadline)
                except APIError as e:
                    chunk = error_body(e.message, e.type, e.param, e.code)
                except Exception as e:  # whatever it is, the stream hears of it and ends
                    log.exception("stream %s: choice %d failed", rid, index)
                    chunk = error_body(f"internal error: {type(e).__name__}", "internal_error", code=500)

        pumps = [asyncio.ensure_future(pump(i, s, f)) for i, s, f in zip(live, streams, firsts)]
        everyone = starts or [ChoiceResume(seed=0) for _ in views]
        completion = [len(c.ids) for c in everyone]
        finals = {i: {"usage": {"completion_tokens": len(c.ids)}, "speculation": None}
                  for i, c in enumerate(everyone) if i not in live}
        if starts is not None:
            yield marker({"rid": rid, "seeds": [c.seed for c in starts]})
        try:
            while len(finals) < len(views):
                try:  # the pumps answer within the deadline; this bounds the wait if one cannot
                    index, chunk = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0) + 5.0)
                except asyncio.TimeoutError:
                    yield sse_event(error_body(f"request exceeded {self.cfg.limits.request_timeout_s}s",
                                               "timeout_error", code="timeout"))
                    break
                if chunk.get("error"):
                    yield sse_event({"error": chunk["error"]})
                    break
                finish = chunk.get("finish_reason")
                completion[index] += len(chunk.get("token_ids", ()))
                text, logprobs = views[index].render(chunk)
                event = ""
                if text or finish or (logprobs and any(logprobs.values())):
                    spec = chunk.get("speculation") if finish and not include_usage else None
                    usage = usage_body(prompt_tokens, sum(completion)) if continuous else None
                    event = sse_event(completion_body(rid, self.model_name, text, finish, usage, spec,
                                                      chat, delta=True, index=index, logprobs=logprobs))
                if starts is not None:  # one message: the client's event and its state arrive together or not at all
                    event += marker({"i": index, "ids": chunk.get("token_ids", []), "chars": len(chunk.get("text", "")),
                                     "ctl": chunk.get("controller"), "done": bool(finish)})
                if event:
                    yield event
                if finish:
                    finals[index] = chunk
                    self.spec_counters.count(chunk["speculation"])
            else:
                if include_usage:
                    # a resumed stream lacks the figures of choices finished before: those of the rest
                    specs = [finals[i]["speculation"] for i in sorted(finals) if finals[i]["speculation"] is not None]
                    usage_chunk = completion_body(
                        rid, self.model_name, [], None,
                        usage_body(prompt_tokens, sum(f["usage"]["completion_tokens"] for f in finals.values())),
                        combined_speculation(specs) if specs else None, chat, delta=True)
                    yield sse_event(usage_chunk)
        except Exception as e:  # a bug here must not leave the client waiting: an error event, then [DONE]
            log.exception("stream %s failed", rid)
            yield sse_event(error_body(f"internal error: {type(e).__name__}", "internal_error", code=500))
        finally:
            await _stop(pumps, streams)  # a client that went away stops the generations and frees their caches
            if span is not None:
                span.end()
        yield "data: [DONE]\n\n"
