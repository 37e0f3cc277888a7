"""Reading a request's generation streams in the ingress: the next chunk within the deadline (its
failures as OpenAI errors), stopping every stream of a request together, and the server-sent events
of a streamed response."""

import asyncio
import logging
from dataclasses import dataclass

from ray.serve.exceptions import BackPressureError

from app.errors import InvalidRequestError
from app.chunks import Chunk, ResumeState
from app.openai.tool_calls import Parser, ToolStream
from app.openai.protocol import error_body
from app.openai.responses import (ChoiceView, choice_body, combined_speculation, completion_body, join_logprobs,
                                  sse_event, usage_body)
from deployments.failover import marker
from app.errors import APIError

log = logging.getLogger("ray.serve")
RESUME_FIELDS = ("token_ids", "text", "controller", "finish_reason")  # what a state report carries of a chunk


async def close_stream(stream) -> None:
    """Stop a generation stream (its dispatcher cancels the target replica's call)."""
    try:
        await stream.aclose()
    except RuntimeError:  # being closed already (a cancelled __anext__)
        pass


async def stop_streams(tasks: list[asyncio.Future], streams: list) -> None:
    """Cancel the tasks reading the streams, wait for them, then close the streams (a stream being
    read cannot be closed)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(close_stream(s) for s in streams))


async def all_or_stop(coros: list, streams: list) -> list:
    """Await every coroutine reading the streams; if one fails, stop the rest and close every stream."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await stop_streams(tasks, streams)
        raise


async def next_chunk(stream, deadline: float, timeout_s: float) -> Chunk:
    """The generation's next chunk, within the request's deadline (past it the generation is stopped)."""
    timeout = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(stream.__anext__(), max(timeout, 0.001))
    except asyncio.TimeoutError:
        await close_stream(stream)
        raise APIError(408, f"request exceeded {timeout_s}s", "timeout_error",
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


async def read_choice(stream, first: Chunk, view: ChoiceView, deadline: float,
                      timeout_s: float) -> tuple[str, Chunk, dict | None]:
    """A generation's whole text, its last chunk (finish_reason, usage, speculation) and its logprobs."""
    last, texts, logprobs = first, [], []
    while True:
        text, lp = view.render(last)
        texts.append(text), logprobs.append(lp)
        if "finish_reason" in last:
            break
        last = await next_chunk(stream, deadline, timeout_s)
        if last.get("error"):
            raise APIError.from_chunk(last["error"])
    return "".join(texts), last, join_logprobs(logprobs)


@dataclass
class StreamedResponse:
    """What a streamed response is, beside its choices: its id and model, its flavour and usage
    options, the request's deadline, its trace span, and the model's tool-call format (`tools`: text
    that may begin a call is held back, and calls go out as `tool_calls` deltas as they are written)."""

    rid: str
    model_name: str
    chat: bool
    prompt_tokens: int
    deadline: float
    timeout_s: float
    include_usage: bool = False
    continuous: bool = False  # with include_usage: every chunk carries the usage so far
    span: object = None
    tools: Parser | None = None


@dataclass
class StreamedChoices:
    """A streamed response's choices. `live`: those generated here (a resumed stream's finished ones
    are not), in the order of `streams` and `firsts` (each stream's first chunk); `views` render every
    choice. With `starts`, each event goes with a report of the state it leaves its choice in
    (deployments/failover.py); `sent`: for a resumed stream, each choice's text so far
    (app/openai/tool_calls.py, ToolStream)."""

    live: list[int]
    firsts: list[Chunk]
    streams: list
    views: list[ChoiceView]
    starts: list[ResumeState] | None = None
    sent: list[str] | None = None


async def sse_events(response: StreamedResponse, choices: StreamedChoices):
    """The generations as one stream of server-sent events, each chunk naming its choice's index."""
    r, c = response, choices
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    pumps = [asyncio.ensure_future(_pump(queue, r, i, s, f)) for i, s, f in zip(c.live, c.streams, c.firsts)]
    everyone = c.starts or [ResumeState(seed=0) for _ in c.views]
    held = [ToolStream(r.tools, t) for t in c.sent or [""] * len(c.views)] if r.tools is not None else None
    completion = [len(state.output_ids) for state in everyone]
    finals = {i: {"usage": {"completion_tokens": len(state.output_ids)}, "speculation": None}
              for i, state in enumerate(everyone) if i not in c.live}
    if c.starts is not None:
        yield marker({"rid": r.rid, "seeds": [state.seed for state in c.starts]})
    try:
        while len(finals) < len(c.views):
            try:  # the pumps answer within the deadline; this bounds the wait if one cannot
                index, chunk = await asyncio.wait_for(queue.get(), max(r.deadline - loop.time(), 0) + 5.0)
            except asyncio.TimeoutError:
                yield sse_event(error_body(f"request exceeded {r.timeout_s}s", "timeout_error", code="timeout"))
                break
            if chunk.get("error"):
                yield sse_event({"error": chunk["error"]})
                break
            completion[index] += len(chunk.get("token_ids", ()))
            event = _chunk_event(r, c.views[index], held[index] if held else None, index, chunk, sum(completion))
            if c.starts is not None:  # one message: the client's event and its state arrive together or not at all
                # the chunk's resume fields, as the job records them (app/chunks.py, ResumeState.record)
                event += marker({"i": index, **{k: chunk[k] for k in RESUME_FIELDS if k in chunk}})
            if event:
                yield event
            if chunk.get("finish_reason"):
                finals[index] = chunk
        else:
            if r.include_usage:
                yield sse_event(_usage_chunk(r, finals))
    except Exception as e:  # a bug here must not leave the client waiting: an error event, then [DONE]
        log.exception("stream %s failed", r.rid)
        yield sse_event(error_body(f"internal error: {type(e).__name__}", "internal_error", code=500))
    finally:
        await stop_streams(pumps, c.streams)  # a client that went away stops the generations and frees their caches
        if r.span is not None:
            r.span.end()
    yield "data: [DONE]\n\n"


async def _pump(queue: asyncio.Queue, response: StreamedResponse, index: int, stream, chunk: Chunk) -> None:
    """Feed a choice's chunks to the response's queue, until it finishes or fails."""
    while True:
        await queue.put((index, chunk))
        if chunk.get("error") or "finish_reason" in chunk:
            return
        try:
            chunk = await next_chunk(stream, response.deadline, response.timeout_s)
        except APIError as e:
            chunk = error_body(e.message, e.type, e.param, e.code)
        except Exception as e:  # whatever it is, the stream hears of it and ends
            log.exception("stream %s: choice %d failed", response.rid, index)
            chunk = error_body(f"internal error: {type(e).__name__}", "internal_error", code=500)


def _chunk_event(r: StreamedResponse, view: ChoiceView, held: ToolStream | None, index: int, chunk: Chunk,
                 completion_tokens: int) -> str:
    """A chunk's server-sent event ("" when it shows the client nothing)."""
    finish = chunk.get("finish_reason")
    text, logprobs = view.render(chunk)
    calls = None
    if held is not None:
        text, calls = held.feed(text)
        if finish:
            rest, last, called = held.finish()
            text, calls = text + rest, calls + last
            finish = "tool_calls" if called else finish
        calls = calls or None
    if not (text or finish or calls or (logprobs and any(logprobs.values()))):
        return ""
    spec = chunk.get("speculation") if finish and not r.include_usage else None
    usage = usage_body(r.prompt_tokens, completion_tokens) if r.continuous else None
    choice = choice_body(index, text, finish, r.chat, True, logprobs, calls)
    return sse_event(completion_body(r.rid, r.model_name, [choice], usage, spec, r.chat, delta=True))


def _usage_chunk(r: StreamedResponse, finals: dict[int, Chunk]) -> dict:
    """The closing usage chunk (a resumed stream lacks the figures of choices finished before: those of the rest)."""
    specs = [finals[i]["speculation"] for i in sorted(finals) if finals[i]["speculation"] is not None]
    usage = usage_body(r.prompt_tokens, sum(f["usage"]["completion_tokens"] for f in finals.values()))
    return completion_body(r.rid, r.model_name, [], usage, combined_speculation(specs) if specs else None,
                           r.chat, delta=True)
