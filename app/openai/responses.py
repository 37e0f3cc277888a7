"""OpenAI-compatible response bodies: choices, usage, the speculation stats, server-sent events, and
how one choice's stream chunks render as text and logprobs (ChoiceView)."""

import json
import time

from app.chunks import Chunk


def combined_speculation(stats: list[dict]) -> dict:
    """One `speculation` object for several choices: counts summed, rates and per-round figures
    weighted by each choice's rounds."""
    if len(stats) == 1:
        return stats[0]
    rounds = sum(s["rounds"] for s in stats)
    drafted, accepted = sum(s["drafted_tokens"] for s in stats), sum(s["accepted_tokens"] for s in stats)

    def per_round(get) -> float:
        return sum(get(s) * s["rounds"] for s in stats) / rounds if rounds else 0.0
    per_position = [0] * max(len(s["accepted_per_position"]) for s in stats)
    for s in stats:
        for j, n in enumerate(s["accepted_per_position"]):
            per_position[j] += n
    return {
        "drafted_tokens": drafted, "accepted_tokens": accepted, "rounds": rounds,
        "drafted_rounds": sum(s["drafted_rounds"] for s in stats), "accepted_per_position": per_position,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": per_round(lambda s: s["mean_accepted_length"]),
        "fallback_rounds": sum(s["fallback_rounds"] for s in stats),
        "max_target_batch_size": max(s["max_target_batch_size"] for s in stats),
        "draft_ahead_hit_rate": per_round(lambda s: s["draft_ahead_hit_rate"]),
        "timing_ms": {k: round(per_round(lambda s: s["timing_ms"][k]), 3) for k in stats[0]["timing_ms"]},
    }


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_body(index: int, text: str, finish: str | None, chat: bool, delta: bool,
                logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:  # a message of calls alone has no content (OpenAI's null)
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        return {"index": index, ("delta" if delta else "message"): message, "finish_reason": finish,
                "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, model: str, choices: list[dict], usage: dict | None, speculation: dict | None,
                    chat: bool, delta: bool) -> dict:
    """A completion (or one streamed chunk of it), text or chat flavour, of the given choice_body()s."""
    obj = ("chat.completion.chunk" if delta else "chat.completion") if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    if speculation is not None:
        body["speculation"] = speculation
    return body


def sse_event(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body)}\n\n"


class ChoiceView:
    """One choice's generation chunks as OpenAI's body reads them: the text, with the prompt before it
    when echoed, and the logprobs object when asked for (completions': tokens, token_logprobs,
    top_logprobs, text_offset; chat's: content, a list of tokens with their alternatives)."""

    def __init__(self, tokenizer, chat: bool, logprobs: bool, echo: str | None = None,
                 prompt_ids: list[int] | None = None, token_bytes=None, skip_special_tokens: bool = True):
        """token_bytes(id): a token's own bytes (a piece of a multi-byte character is not valid UTF-8
        alone); by default its text's. skip_special_tokens: whether the text leaves them out (the
        request's), for the text offsets."""
        self.tokenizer, self.chat, self.logprobs = tokenizer, chat, logprobs
        self.skip_special_tokens = skip_special_tokens
        self.token_bytes = token_bytes or (lambda t: self._piece(t).encode())
        self.echo, self.prompt_ids = echo, prompt_ids or []
        self.offset = 0  # characters of this choice's text so far: the next token's text_offset

    def resume(self, streamed_chars: int) -> None:
        """Continue a choice whose echo and first `streamed_chars` characters of output were streamed already."""
        self.offset = len(self.echo or "") + streamed_chars
        self.echo = None

    def render(self, chunk: Chunk) -> tuple[str, dict | None]:
        """A chunk's text and logprobs (None when not asked for); the first chunk carries the echo."""
        text, ids, entries = chunk.get("text", ""), list(chunk.get("token_ids", ())), chunk.get("logprobs")
        if self.echo is not None:
            text, self.echo = self.echo + text, None
            if self.logprobs:  # the prompt's tokens first: the first has nothing before it to score it
                ids = self.prompt_ids + ids
                entries = [None] + list(chunk.get("prompt_logprobs") or []) + list(entries or [])
        if not self.logprobs:
            return text, None
        body = self._chat(ids, entries or []) if self.chat else self._completion(ids, entries or [])
        self.offset += len(text)
        return text, body

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _completion(self, ids: list[int], entries: list) -> dict:
        pieces = [self._piece(t) for t in ids]
        offsets, at = [], self.offset
        for t in ids:  # where each token's text starts in the choice's text (skipped special tokens have none)
            offsets.append(at)
            at += len(self.tokenizer.decode([t], skip_special_tokens=self.skip_special_tokens,
                                            clean_up_tokenization_spaces=False))
        return {"tokens": pieces, "token_logprobs": [e[0] if e else None for e in entries],
                "top_logprobs": [{self._piece(i): lp for i, lp in e[1]} if e else None for e in entries],
                "text_offset": offsets}

    def _chat(self, ids: list[int], entries: list) -> dict:
        def token(t: int, lp: float) -> dict:
            piece = self._piece(t)
            return {"token": piece, "logprob": lp, "bytes": list(self.token_bytes(t))}
        return {"content": [{**token(t, e[0]), "top_logprobs": [token(i, lp) for i, lp in e[1]]}
                            for t, e in zip(ids, entries)]}


def join_logprobs(parts: list[dict | None]) -> dict | None:
    """Several chunks' logprobs objects (one choice's, in order) as one."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}
