"""OpenAI-compatible HTTP ingress: the Serve replica that holds the OpenAI front end (app/openai/front.py:
auth, parsing, chat template, tokenization, responses) and streams each request from the targets.

The FastAPI app and its errors are in deployments/http_api.py, reading the generation streams and
the server-sent events in deployments/streams.py, placement and failover in deployments/dispatch.py.
"""

import asyncio
import concurrent.futures
import importlib.metadata
import logging
import os
import time

import prometheus_client
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry.trace import SpanKind
from ray import serve
from transformers import AutoTokenizer

from app import telemetry
from app.chunks import GUARD_HEADER, RESUME_HEADER
from app.errors import APIError
from app.openai.front import FrontSettings, OpenAIFront, Prepared
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, new_id
from app.model.sources import local_model, log_into
from app.openai.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from deployments.args import AppConfig, chat_template_text
from deployments.dispatch import Dispatcher
from deployments.http_api import api, narrow_schema
from deployments.vllm_metrics import VLLMMetrics, totals_actor
from deployments.streams import (StreamedChoices, StreamedResponse, all_or_stop, next_chunk, read_choice,
                                 sse_events, stop_streams)

log = logging.getLogger("ray.serve")
@serve.ingress(api)
class Ingress:
    """FastAPI ingress: the OpenAI front end checks and prepares each request; its jobs are streamed
    from a TargetServer replica through the Dispatcher (placement and failover, deployments/dispatch.py)."""

    def __init__(self, target, cfg: AppConfig, tokenizer_path: str, model_name: str, max_context: int):
        self.cfg = cfg
        log_into(log)
        # the target's tokenizer and config only: its weights are the target replicas' business
        tokenizer = AutoTokenizer.from_pretrained(
            local_model(tokenizer_path, cfg.target.revision, cfg.target.download_dir, weights=False))
        # secrets from the environment, never the config: one key, or several separated by commas
        keys = tuple(k.strip().encode() for k in (os.environ.get(cfg.api_key_env) or "").split(",") if k.strip())
        limits = cfg.limits
        self.front = OpenAIFront(tokenizer, FrontSettings(
            model_name, max_context, limits.max_tokens_cap, limits.default_max_tokens, limits.max_body_bytes,
            cfg.trust_request_chat_template, cfg.tool_call_parser, cfg.speculation.default_num_tokens, keys,
            chat_template_text(cfg.chat_template) if cfg.chat_template else None))
        self.created = int(time.time())  # /v1/models' `created`: when this server started
        # the front's blocking work (tokenizing, chat templates, grammar checks, parsing up to max_body_bytes
        # of JSON) runs here, off the event loop that streams every other request; one thread, since a
        # fast tokenizer's settings are not safe to share between threads
        self.prepare = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-prepare")
        context = serve.get_replica_context()
        totals = totals_actor(context.app_name)
        self.vllm_metrics = VLLMMetrics(model_name, totals=lambda *args: totals.add.remote(*args),
                                        source=context.replica_id.unique_id)
        self.dispatch = Dispatcher(target, cfg, self.vllm_metrics)
        narrow_schema(model_name, limits.max_tokens_cap)
        telemetry.configure_tracing("ingress")

    # -- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self):
        """vLLM's metrics, under vLLM's names, in Prometheus' text format (deployments/vllm_metrics.py)."""
        return Response(await self.vllm_metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self.front.authorize(request.headers)
        return self.front.models(self.created)

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
        self.front.authorize(request.headers)
        body = await self._parse(request, lambda data: TokenizeChatRequest if "messages" in data
                                 else TokenizeCompletionRequest)
        return await self._blocking(self.front.tokenize, body)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids back to text."""
        self.front.authorize(request.headers)
        return await self._blocking(self.front.detokenize, await self._parse(request, DetokenizeRequest))

    # -- the request path --------------------------------------------------------------------
    async def _blocking(self, fn, *args):
        """The front's blocking work, on the request-preparing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare, fn, *args)

    async def _parse(self, request: Request, model_cls):
        length = request.headers.get("content-length")
        if length and length.isdigit():
            self.front.check_size(int(length))  # refused before the body is read
        return await self._blocking(self.front.parse, await request.body(), model_cls)

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
        scope = self.front.authorize(request.headers)
        body = await self._parse(request, model_cls)
        prepared = await self._blocking(self.front.prepare, body, chat, scope,
                                        request.headers.get(RESUME_HEADER.decode()))
        resume, starts = prepared.resume, prepared.starts
        rid = resume.rid if resume else new_id("chatcmpl" if chat else "cmpl")
        live = [i for i, c in enumerate(starts) if not c.done]
        # a prompt's n choices go to one target replica, which prefills their prompt once (app/engine.py)
        for i, job in enumerate(prepared.jobs):
            job.group = f"{rid}/{i // body.n}" if body.n > 1 else None
        # the engine on the target replica admits each job (app/job.py): a bad one's first chunk is its 400
        streams = [self.dispatch.generate(prepared.jobs[i], telemetry.carrier(span)) for i in live]
        deadline = asyncio.get_running_loop().time() + self.cfg.limits.request_timeout_s
        # errors before any token get a proper status
        firsts = await all_or_stop([self._next(s, deadline) for s in streams], streams)
        for first in firsts:
            if first.get("error"):
                await stop_streams([], streams)
                raise APIError.from_chunk(first["error"])
        if body.stream:
            return await self._streamed(request, body, chat, prepared, rid, (live, firsts, streams, deadline), span)
        try:
            done = await all_or_stop([read_choice(s, f, prepared.views[i], deadline, self.cfg.limits.request_timeout_s)
                                      for i, s, f in zip(live, streams, firsts)], streams)
        finally:
            await stop_streams([], streams)
        return self.front.response(rid, body, chat, prepared, done)

    async def _streamed(self, request: Request, body, chat: bool, prepared: Prepared, rid: str, started, span):
        live, firsts, streams, deadline = started
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats  # as vLLM: usage on every chunk
        report = request.headers.get(GUARD_HEADER.decode()) == "1"  # the proxy's failover keeps the state
        tools, sent = self.front.tool_reader(body, chat), None
        if tools is not None and prepared.resume:  # a resumed stream's calls go on from the text its client had
            sent = await self._blocking(self.front.streamed_texts, prepared)
        response = StreamedResponse(rid, self.front.settings.model_name, chat, prepared.prompt_tokens, deadline,
                                    self.cfg.limits.request_timeout_s, include_usage, continuous, span, tools)
        choices = StreamedChoices(live, firsts, streams, prepared.views, prepared.starts if report else None, sent)
        return StreamingResponse(sse_events(response, choices), media_type="text/event-stream")

    async def _next(self, stream, deadline: float):
        return await next_chunk(stream, deadline, self.cfg.limits.request_timeout_s)
