"""A request's state while it generates: its tokens, stop rules, streamed text and statistics."""

import functools
from dataclasses import dataclass, field

from app.speculation.logits import LogitRules
from app.job import GenerationJob
from app.model.eos import tokenizer_eos_ids
from app.params import SamplingParams

REPLACEMENT = "\ufffd"  # what a decoder shows for a UTF-8 sequence cut mid-way
DETOKENIZE_CONTEXT = 5  # tokens decoded again before new ones: how a piece reads can depend on those before it


def special_ids(tokenizer) -> frozenset[int]:
    """The ids a decode with skip_special_tokens leaves out: the tokenizer's special tokens and the
    added tokens marked special (a fast tokenizer skips those)."""
    cached = getattr(tokenizer, "_specserve_special_ids", None)
    if cached is None:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        cached = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        tokenizer._specserve_special_ids = cached  # the tokenizer is fixed once loaded
    return cached


def streamed_text(tokenizer, params: SamplingParams, output_ids: list[int], streamed_chars: int) -> str:
    """The text a stream of `output_ids` had sent when it had sent `streamed_chars` characters, decoded
    as the stream decoded it: a stream resumed on another replica rebuilds what its client has."""
    state = RequestState(GenerationJob("", [], params, 0, list(output_ids)), tokenizer, len(output_ids) + 1)
    return state.text[:streamed_chars]


# per-round timings summed in SpeculationStats: name in the summary -> RoundFacts attribute
TIMES = {
    "round": "round_s",  # the whole round on the target replica
    "verify": "verify_s",  # waiting for and running the target forward
    "verify_forward": "verify_forward_s",  # the target forward this round rode in
    "draft_wait": "draft_s",  # waiting for the proposal (the draft's time left on the critical path)
    "draft_forward": "draft_forward_s",  # the draft forward that made the proposal
    "draft_hidden": "draft_hidden_s",  # of the proposal's round trip, the part hidden behind the last verify
}


@dataclass
class SpeculationStats:
    """How speculation went for one request."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    prompt_rounds: int = 0  # first rounds (the prompt's prefill, a plain step by design): not in tau
    prompt_tokens_emitted: int = 0  # what those emitted
    drafted_rounds: int = 0  # rounds in which the draft proposed tokens
    fallback_rounds: int = 0
    emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    max_target_batch: int = 0
    ahead_checked: int = 0  # rounds that found a proposal drafted ahead
    ahead_hits: int = 0  # ...and could use it
    # seconds summed over rounds, as the replica running them saw them (see `timing` in summary())
    seconds: dict = field(default_factory=lambda: dict.fromkeys(TIMES, 0.0))
    prompt_forward_s: float = 0.0  # the target forwards of the prompt's rounds (not in `seconds`' means' meaning)

    def record(self, drafted: int, accepted: int, emitted: int, fallback: bool = False, batch_size: int = 1,
               ahead_hit: bool | None = None, prompt: bool = False) -> None:
        self.rounds += 1
        self.prompt_rounds += int(prompt)
        self.prompt_tokens_emitted += emitted if prompt else 0
        if ahead_hit is not None:
            self.ahead_checked += 1
            self.ahead_hits += int(ahead_hit)
        self.max_target_batch = max(self.max_target_batch, batch_size)
        self.drafted_rounds += int(drafted > 0)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        self.fallback_rounds += int(fallback)
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def time(self, facts) -> None:
        """Add one round's timings (an app.telemetry.RoundFacts)."""
        for key, attr in TIMES.items():
            self.seconds[key] += getattr(facts, attr)
        if facts.prompt:
            self.prompt_forward_s += facts.verify_forward_s

    def summary(self) -> dict:
        """The `speculation` object of responses."""
        return {
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rounds": self.rounds,
            "drafted_rounds": self.drafted_rounds,
            "accepted_per_position": list(self.accepted_per_position),  # accepted draft tokens at proposal position j
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            # tokens per decoding round's target forward, the bonus/recovered token included (tau); the
            # prompt's round, which emits the first token as plain decoding does, is not a decoding round
            "mean_accepted_length": ((self.emitted_tokens - self.prompt_tokens_emitted) / decoding if (
                decoding := self.rounds - self.prompt_rounds) else 0.0),
            "fallback_rounds": self.fallback_rounds,
            "max_target_batch_size": self.max_target_batch,  # the largest verify batch this request rode in
            # rounds whose proposal was drafted while the previous round verified, of those that tried
            "draft_ahead_hit_rate": self.ahead_hits / self.ahead_checked if self.ahead_checked else 0.0,
            # mean milliseconds per round: where a round's time went on the target replica
            "timing_ms": {k: round(v * 1000 / self.rounds, 3) if self.rounds else 0.0 for k, v in self.seconds.items()},
        }


class RequestState:
    """Token ids, sampling and stop rules of one request; `append` applies a round's tokens."""

    def __init__(self, job: GenerationJob, tokenizer, max_context: int,
                 eos_ids: set[int] | frozenset[int] | None = None):
        """Built from an admitted job (app/job.py, which checks the prompt against the context): its id,
        prompt, parameters, draw seed, and what an earlier replica already streamed (output_ids,
        streamed_chars) when the request resumes after failover. eos_ids: the model's end-of-sequence
        ids (app.model.eos.eos_ids: its generation config's and its tokenizer's), by default the
        tokenizer's alone."""
        self.request_id = job.request_id
        self.prompt_ids = list(job.prompt_ids)
        self.params = params = job.params
        self.seed = job.seed  # every request has one, so its randomness is addressable (GenerationJob.new)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.output_ids: list[int] = list(job.output_ids)
        # the special tokens the text leaves out, when some are kept (a tool-call format's markers)
        kept = params.keep_special_token_ids
        self._hidden = special_ids(tokenizer).difference(kept) if params.skip_special_tokens and kept else None
        self.finish_reason: str | None = None if self.room() > 0 else "length"  # resumed at its end
        # incremental detokenisation: text holds output_ids[:_read]; output_ids[_prefix:_read] is decoded
        # again with each round's new tokens, as context for tokenizers whose pieces depend on what precedes
        self._read = self._resume_point()
        self.text = self._decode(self.output_ids[: self._read])
        self._prefix = max(0, self._read - DETOKENIZE_CONTEXT)
        self._streamed = job.streamed_chars
        self._min_text: int | None = None  # _min_tokens_text, once known
        self.stats = SpeculationStats()
        self.eos_ids = frozenset(eos_ids) if eos_ids is not None else tokenizer_eos_ids(tokenizer)
        # the ids that end generation: the model's eos ids (unless ignored) and the request's own
        self.stop_ids = (frozenset() if params.ignore_eos else self.eos_ids) | frozenset(params.stop_token_ids)
        self.rules = LogitRules.of(params, len(self.prompt_ids), self.stop_ids)
        # per output token when asked for: (logprob, [(id, logprob), ...]) (app.speculation.steps.token_logprobs)
        self.logprobs: list[tuple] = []
        self.prompt_logprobs: list[tuple] = []  # the prompt's tokens after its first, when asked for
        if self.finished and params.stop and len(self.output_ids) >= params.min_tokens:
            # resumed at max_tokens, between the round that found a stop string and its final chunk: there
            # is no next round to find it again (any other resumed request finds it in its next round)
            self._apply_stop_strings([])

    def _resume_point(self) -> int:
        """How many of the output ids (those an earlier replica streamed) to count as read: not the trailing
        ones whose text is an incomplete UTF-8 sequence. That replica held their text back; decoded alone
        here they would read U+FFFD and their continuation another, so they wait for the next round, as
        in the uncut stream. A window of DETOKENIZE_CONTEXT tokens holds any character's bytes."""
        n = len(self.output_ids)
        if self.finished:  # nothing more comes: all is read, as when the uncut stream finished
            return n
        while n and self._decode(self.output_ids[max(0, n - DETOKENIZE_CONTEXT) : n]).endswith(REPLACEMENT):
            n -= 1
        return n

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """Tokens that may still be emitted (max_tokens and the context limit)."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_context - len(self.token_ids))

    def append(self, tokens: list[int], logprobs: list[tuple] | None = None) -> list[int]:
        """Apply one round's emitted tokens (and their logprobs, when asked for), truncating at the
        first stop; returns the tokens kept."""
        kept = []
        for t in tokens:
            if t in self.stop_ids:
                self.finish_reason = "stop"
                break
            kept.append(t)
            self.output_ids.append(t)
            if self.room() <= 0:
                self.finish_reason = "length"
                break
        if logprobs is not None:
            self.logprobs += logprobs[: len(kept)]
        self._detokenize()
        if self.params.stop and len(self.output_ids) >= self.params.min_tokens:
            kept = self._apply_stop_strings(kept)
            del self.logprobs[len(self.output_ids):]
        return kept

    def _decode(self, ids: list[int]) -> str:
        # never the tokenizer's clean-up of spaces: it rewrites text around tokens ("a ." -> "a."), so text
        # decoded a round at a time would differ from, or take back, text already streamed
        if not ids:
            return ""
        skip = self.params.skip_special_tokens
        if self._hidden is not None:  # the specials skipped by hand, all but the kept: as the tokenizer skips them
            ids, skip = [t for t in ids if t not in self._hidden], False
        return self.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def _detokenize(self) -> None:
        """Extend text by the new tokens' text: O(new tokens) per round, and text once added never changes.

        Tokens whose text is still an incomplete UTF-8 sequence wait for the next round (or the end); those
        before them are read now (one more decode per token held), so what is read depends on the tokens,
        not on how rounds group them: a request resumed elsewhere reads the same (_resume_point)."""
        ids = self.output_ids
        if self._read >= len(ids):
            return
        before = self._decode(ids[self._prefix : self._read])
        for end in range(len(ids), self._read, -1):
            after = self._decode(ids[self._prefix : end])
            if len(after) > len(before) and (self.finished or not after.endswith(REPLACEMENT)):
                self.text += after[len(before) :]
                self._read = end
                self._prefix = max(self._prefix, self._read - DETOKENIZE_CONTEXT)
                return

    def _apply_stop_strings(self, kept: list[int]) -> list[int]:
        """Find stop strings, also across token boundaries; truncate tokens and text there."""
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self._streamed - longest, self._min_tokens_text())
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return kept
        cut, stop = min(hits)
        # the fewest output tokens whose text contains the stop string, but not fewer than earlier rounds
        # streamed (their ids went out even while their text was held back): once a request, O(kept) decodes
        first_new = len(self.output_ids) - len(kept)
        n = first_new
        while n < len(self.output_ids) and self._decode(self.output_ids[:n])[cut : cut + len(stop)] != stop:
            n += 1
        del kept[n - first_new:]
        del self.output_ids[n:]
        self.text = self.text[:cut]
        self._read = self._prefix = len(self.output_ids)  # finished: nothing more is decoded
        self.finish_reason = "stop"
        return kept

    def _min_tokens_text(self) -> int:
        """Characters of the text the first min_tokens tokens make: no stop string is sought in them."""
        if not self.params.min_tokens:
            return 0
        if self._min_text is None:  # sought only once min_tokens are out: fixed from then on
            self._min_text = len(self._decode(self.output_ids[: self.params.min_tokens]))
        return self._min_text

    def take_delta(self) -> str:
        """Text not yet streamed, holding back a possible partial stop string or UTF-8 sequence."""
        end = len(self.text)
        if not self.finished:
            while end > self._streamed and self.text[end - 1] == REPLACEMENT:
                end -= 1
            end -= max((self._partial_stop(s, end) for s in self.params.stop), default=0)
        delta = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def _partial_stop(self, stop: str, end: int) -> int:
        """Length of the longest proper prefix of `stop` that text[:end] ends with (unstreamed part only).

        KMP over the at most len(stop) - 1 characters that can hold one: O(len(stop)), not O(len(stop)^2),
        on the replica's event loop each round."""
        tail = self.text[max(self._streamed, end - len(stop) + 1) : end]
        fail = prefix_function(stop)
        j = 0  # the longest prefix of stop that the tail read so far ends with (< len(stop): tail is shorter)
        for c in tail:
            while j and stop[j] != c:
                j = fail[j - 1]
            if stop[j] == c:
                j += 1
        return j


@functools.lru_cache(maxsize=256)
def prefix_function(s: str) -> tuple[int, ...]:
    """KMP's failure table: [i] is the length of the longest proper prefix of s[:i + 1] that it ends with."""
    fail = [0] * len(s)
    j = 0
    for i in range(1, len(s)):
        while j and s[i] != s[j]:
            j = fail[j - 1]
        if s[i] == s[j]:
            j += 1
        fail[i] = j
    return tuple(fail)
