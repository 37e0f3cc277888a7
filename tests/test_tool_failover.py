"""A streamed choice with tools that fails over to another ingress replica: the client's stream
goes on as if it had not (deployments/streams.py and app/openai/tool_calls.py's ToolStream, against the state
the proxy's failover keeps, deployments/failover.py)."""

import json

import pytest

from app.openai.tool_calls import PARSERS
from conftest import make_byte_tokenizer
from test_tools import WRITTEN, assemble


class Chunks:
    """A job's chunks as a target replica streams them."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    async def aclose(self):
        pass


def engine_chunks(tok, ids: list[int], start) -> list[dict]:
    """What the engine streams of a job whose output is `ids`, a token a round (a cut anywhere), from where
    `start` (a ResumeState) stands, as app/request.py reads text."""
    from app.params import SamplingParams
    from app.job import GenerationJob
    from app.request import RequestState

    job = GenerationJob("r", [5], SamplingParams(max_tokens=len(ids)), 0, list(start.output_ids), start.streamed_chars)
    s = RequestState(job, tok, 4096)
    out, at = [], len(start.output_ids)
    while not s.finished:
        kept = s.append(ids[at:at + 1])
        at += len(kept)
        out.append({"token_ids": kept, "text": s.take_delta()})
    out[-1].update(finish_reason=s.finish_reason, speculation=s.stats.summary())
    return out


def tool_stream_events(tok, parser, ids: list[int], start) -> list[str]:
    """The ingress's SSE messages for one chat choice with tools, reporting state for the failover;
    resumed from `start` as the ingress resumes it (the text its client had, rebuilt)."""
    import asyncio

    from app.openai.responses import ChoiceView
    from app.params import SamplingParams
    from app.request import streamed_text
    from deployments.streams import StreamedChoices, StreamedResponse, sse_events

    chunks = engine_chunks(tok, ids, start)
    sent = streamed_text(tok, SamplingParams(max_tokens=len(ids)), start.output_ids, start.streamed_chars)

    async def go():
        deadline = asyncio.get_running_loop().time() + 60
        gen = sse_events(StreamedResponse("chatcmpl-1", "m", True, 1, deadline, 60.0, tools=parser),
                         StreamedChoices([0], chunks[:1], [Chunks(chunks[1:])], [ChoiceView(tok, chat=True, logprobs=False)],
                                         starts=[start], sent=[sent]))
        return [message async for message in gen]
    return asyncio.run(asyncio.wait_for(go(), 30))


def client_view(messages: list[str]) -> tuple[str, list, str | None]:
    """What a client reads of SSE messages: the content, the calls (name, arguments), the finish."""
    from deployments.failover import MARKER

    content, calls, finish = "", {}, None
    for event in "".join(messages).split("\n\n"):
        if event.startswith("data: {") and not event.startswith(MARKER.decode()):
            choice = json.loads(event[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            assemble(choice["delta"].get("tool_calls") or [], calls)
            finish = choice["finish_reason"] or finish
    return content, [(name, args) for _, name, args in calls.values()], finish


RESUMED = {**WRITTEN, "llama3_json text": 'Sure {"name": "get_time", "parameters": {"zone": 1}}'}


@pytest.mark.parametrize("case", sorted(RESUMED))
def test_a_tool_stream_cut_after_any_event_resumes_into_the_undisturbed_stream(case):
    """The proxy resumes a cut stream from the state the ingress reported beside each event
    (deployments/failover.py). Before, a resumed stream with tools began reading calls where it
    resumed: cut while a call was held back, the client got the call's tail as content and no call.
    Now the new ingress takes in the text its client had first; a format whose call is the whole
    output finds none after text already sent ("llama3_json text")."""
    from app.chunks import ResumeState
    from deployments.failover import MARKER, Resume

    tok = make_byte_tokenizer()
    parser = PARSERS[case.split()[0]]()
    ids = tok.encode(RESUMED[case], add_special_tokens=False)
    whole = tool_stream_events(tok, parser, ids, ResumeState(seed=0))
    want = client_view(whole)
    assert want == (parser.parse(RESUMED[case])[0] if want[1] else RESUMED[case], want[1], want[2])
    assert bool(want[1]) == (case != "llama3_json text")
    for cut in range(1, len(whole) - 2):  # after the stream's head and before its last event
        state = Resume(rid="chatcmpl-1", choices=[ResumeState(seed=0)])
        for message in whole[:cut]:
            for event in message.split("\n\n"):
                if event.startswith(MARKER.decode()) and '"i"' in event:
                    state.apply(json.loads(event[len(MARKER):]))
        rest = tool_stream_events(tok, parser, ids, state.choices[0].model_copy(deep=True))
        got = client_view(whole[:cut] + rest[1:])  # the resumed attempt's head goes to the proxy only
        assert got == want, cut
