"""A request resumed on another replica streams exactly the text of the uncut stream (issue 24).

The failover resumes from what the client was sent: the output ids and the characters of text streamed
(app/chunks.py ResumeState: output_ids, streamed_chars). Ids may end with a token holding only the first
bytes of a character, or with text held back as a possible stop string: the resumed state must pick
both up as the uncut stream would.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.params import SamplingParams
from app.job import GenerationJob
from app.request import REPLACEMENT, RequestState
from tests.conftest import make_byte_tokenizer, make_tokenizer

# U+0608 and U+00E9 are 2 bytes in UTF-8, U+20AC 3, U+1D11E 4: each split over byte tokens
TEXT = "a\u0608\u0608b \u00e9\u20ac \U0001d11e x\u20ac \U0001d11e y \u0608b"
GROUPINGS = [[1], [2], [3], [1, 3, 2], [4, 1]]  # round sizes, repeated
PROMPT = [5, 6]


@pytest.fixture(scope="module")
def byte_tok():
    return make_byte_tokenizer()


def rounds(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids cut into rounds of the given sizes, cycled."""
    out, i, k = [], 0, 0
    while i < len(ids):
        out.append(ids[i : i + sizes[k % len(sizes)]])
        i, k = i + len(out[-1]), k + 1
    return out


def stream(s: RequestState, feed: list[list[int]]) -> tuple[str, list[tuple[list[int], int]]]:
    """Run rounds as the engine does (app/engine.py _produce): the text streamed, and after each round
    the resume point the failover keeps: (ids streamed, chars streamed)."""
    text, ids, points = "", list(s.output_ids), []
    for tokens in feed:
        if s.finished:
            break
        ids += s.append(tokens)
        text += s.take_delta()
        points.append((list(ids), len(text)))  # as GenerationJob.record counts them
    return text + s.take_delta(), points


def state(tok, params: SamplingParams, ids: list[int] | None = None, chars: int = 0) -> RequestState:
    return RequestState(GenerationJob("r", PROMPT, params, 0, ids or [], chars), tok, 4096)


def check_every_cut(tok, ids: list[int], params: SamplingParams) -> str:
    """Resume at every round boundary of several groupings: streamed-before + resumed == uncut text, and
    the tokens and finish of an uncut stream with the same rounds (ids stream before their text is known,
    so where a stop cuts the tokens depends on the rounds; the text never does)."""
    texts = set()
    for sizes in GROUPINGS:
        feed = rounds(ids, sizes)
        text, points = stream(state(tok, params), feed)
        texts.add(text)
        for k, (cut_ids, chars) in enumerate(points, 1):
            for later in ([1], [2], sizes):
                rest = rounds(ids[len(cut_ids):], later)
                resumed = state(tok, params, cut_ids, chars)
                tail, _ = stream(resumed, rest)
                uncut = state(tok, params)
                stream(uncut, feed[:k] + rest)
                where = f"rounds {sizes}, cut after {len(cut_ids)} tokens / {chars} chars, then rounds {later}"
                assert text[:chars] + tail == text, where
                assert resumed.output_ids == uncut.output_ids, where
                assert resumed.finish_reason == uncut.finish_reason, where
    assert len(texts) == 1, texts
    return text


def test_byte_tokens_split_characters(byte_tok):
    """The premise: the text's characters straddle token boundaries (a token alone decodes to U+FFFD)."""
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    assert byte_tok.decode(ids) == TEXT
    assert sum(byte_tok.decode([t]) == REPLACEMENT for t in ids) >= 8


@pytest.mark.parametrize("stop", [[], ["\u0608b"], ["\u20ac \U0001d11e y"], ["zz", "\U0001d11e x\u20ac"], ["b \u00e9"]])
def test_resume_at_every_cut_byte_level(byte_tok, stop):
    """A partial stop (or character) held back at the cut completes after it, as in the uncut stream."""
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    text = check_every_cut(byte_tok, ids, SamplingParams(max_tokens=100, temperature=0.0, stop=stop))
    assert text == (TEXT[: min(TEXT.find(s) for s in stop if s in TEXT)] if stop else TEXT)


def test_resume_at_every_cut_with_max_tokens_mid_character(byte_tok):
    """max_tokens ending inside a character: the uncut text ends with U+FFFD, and so does the resumed."""
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    mid = [m for m in range(1, len(ids)) if byte_tok.decode(ids[:m]).endswith(REPLACEMENT)]
    assert len(mid) >= 5
    for m in mid[:: 2]:
        text = check_every_cut(byte_tok, ids, SamplingParams(max_tokens=m, temperature=0.0))
        assert text == byte_tok.decode(ids[:m])
    check_every_cut(byte_tok, ids, SamplingParams(max_tokens=mid[-1], temperature=0.0, stop=["y \u0608"]))
    for stop in ("b \u00e9", "\u20ac \U0001d11e y"):  # the stop's last token is the last allowed
        m = next(m for m in range(len(ids)) if stop in byte_tok.decode(ids[:m]))
        text = check_every_cut(byte_tok, ids, SamplingParams(max_tokens=m, temperature=0.0, stop=[stop]))
        assert text == TEXT[: TEXT.index(stop)]


def test_resume_at_every_cut_with_min_tokens(byte_tok):
    """A stop inside the first min_tokens tokens' text is not sought, before the cut or after it."""
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=100, temperature=0.0, stop=["\u0608"], min_tokens=4)
    assert check_every_cut(byte_tok, ids, params) == TEXT[: TEXT.index("\u0608", 3)]


@pytest.mark.parametrize("stop", [[], ["END"], ["lo E", "D w"], ["NDx"]])
def test_resume_at_every_cut_character_level(stop):
    """The control: one token per character, nothing split. (Text follows every stop: a resumed stream
    finds a stop found before the cut in its next round, so the model has one to give.)"""
    tok = make_tokenizer()
    plain = "hello END world, hello ENDx!"
    ids = tok.encode(plain, add_special_tokens=False)
    text = check_every_cut(tok, ids, SamplingParams(max_tokens=100, temperature=0.0, stop=stop))
    assert text == (plain[: min(plain.find(s) for s in stop)] if stop else plain)


def partial_stop_quadratic(text: str, streamed: int, stop: str, end: int) -> int:
    """_partial_stop's definition: the longest proper prefix of stop that text[:end] ends with, unstreamed."""
    for j in range(min(len(stop) - 1, end - streamed), 0, -1):
        if text[end - j : end] == stop[:j]:
            return j
    return 0


def held(text: str, streamed: int) -> RequestState:
    s = state(make_tokenizer(), SamplingParams(max_tokens=100, temperature=0.0))
    s.text, s._streamed = text, streamed
    return s


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(st.text("ab\u0608", max_size=40), st.text("ab\u0608", min_size=1, max_size=12), st.data())
def test_partial_stop_matches_its_definition(text, stop, data):
    streamed = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(streamed, len(text)))
    assert held(text, streamed)._partial_stop(stop, end) == partial_stop_quadratic(text, streamed, stop, end)


def test_partial_stop_long_stop_and_long_held_text():
    """A 4096-character stop over 5000 unstreamed characters: the longest prefix held, whatever its length."""
    rng = random.Random(0)
    stop = "".join(rng.choice("ab") for _ in range(4096))
    for j in (0, 1, 7, 2048, 4095):
        noise = "".join(rng.choice("ab") for _ in range(5000 - j))
        text = "c" + noise + stop[:j]
        want = partial_stop_quadratic(text, 1, stop, len(text))
        assert want >= j
        assert held(text, 1)._partial_stop(stop, len(text)) == want
        assert held(text, len(text) - j)._partial_stop(stop, len(text)) == j  # only the unstreamed part
    assert held("x" + stop, 0)._partial_stop(stop, 4097) == partial_stop_quadratic("x" + stop, 0, stop, 4097)
