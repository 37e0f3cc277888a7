"""Structured output: a grammar (any JSON object, or a JSON schema) masks the logits, exactly.

The mask at a position is a function of the tokens before it: the grammar's state after the output
so far and the draft tokens before that position. Like the rules of app/speculation/logits.py it therefore
keeps speculation exact. A verify round advances one matcher along its proposal, taking each row's
mask before consuming that row's draft token, and rolls it back after; a draft token the grammar
refuses has p = 0 there and is rejected, and the rows after it are never read. The draft masks its
q with the same grammar, so it proposes only what the grammar allows and acceptance stays high.

The grammar work is llguidance's (guidance-ai): matchers that consume, validate and roll back
tokens, and token bitmasks, over a Hugging Face tokenizer. It has no dependencies of its own; the
other well-kept choice, xgrammar, pulls in Triton. It is imported when a grammar is first used: the
engine must run where only torch and transformers are installed (`make gpu-check`).

Matchers are state kept per sequence, like KV caches: each is resynchronised to the tokens the call
carries (rolled back to the common prefix, then advanced), so any replica can serve any round and
a lost matcher only costs recomputation. That makes them safe to bound: a matcher goes with its
sequence's KV (app/model/kv.py's on_drop), and beyond MAX_MATCHERS the least recently used go, so a draft
replica whose sequences' releases never come (their target died, or released on another draft
replica) does not keep their matchers for ever.
"""

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from app.errors import InvalidRequestError
from app.model.kv import common_prefix
from app.openai.structured import JSON_LAYOUT


def grammar_of(response_format: dict | None) -> str | None:
    """The llguidance grammar of a response_format (None: free text): OpenAI's JSON ones, and vLLM's
    structured outputs (a regex, a choice of strings, a Lark grammar; app/openai/structured.py)."""
    if not response_format or response_format["type"] == "text":
        return None
    import llguidance

    kind = response_format["type"]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(response_format["regex"])
    if kind == "choice":  # one alternative per string, each a Lark string literal (JSON's escapes)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(s) for s in response_format["choice"]))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(response_format["grammar"])
    schema = {"type": "object"} if kind == "json_object" else response_format["json_schema"]["schema"]
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)



MAX_MATCHERS = 4096  # matchers kept per model, least recently used dropped beyond: far above a batch's sequences


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask [N, words] as booleans [N, vocab_size] (bit t % 32 of word t // 32).
    Not llguidance.torch's apply function: it is torch.compiled, a compile on first use that needs a
    C toolchain on CPU machines."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


@dataclass
class _Tracked:
    grammar: str
    matcher: "llguidance.LLMatcher"  # noqa: F821 (imported where first used)
    consumed: list[int] = field(default_factory=list)  # the output tokens the matcher has taken
    # the matcher refused an output token its own mask had allowed, before its grammar's end (llguidance's
    # mask and parser disagree, e.g. on an added token a literal spells as text): the output ends there
    refused: bool = False


class Grammars:
    """The grammar matchers of one model's sequences, and the masks they give."""

    def __init__(self, tokenizer, vocab_size: int, max_matchers: int = MAX_MATCHERS):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None  # llguidance's view of the tokenizer, made on first use
        self._unsupported: str | None = None  # why llguidance cannot read the tokenizer, once tried
        self.max_matchers = max_matchers
        self._matchers: OrderedDict[str, _Tracked] = OrderedDict()  # least recently used first
        # release() runs on the event loop (and from the KV store's evictions), masks in the forward thread
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's LLTokenizer of the model's tokenizer."""
        if self._tokenizer is None and self._unsupported is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            except ValueError as e:
                self._unsupported = str(e)  # remembered: not tried again on every request
        if self._tokenizer is None:
            raise InvalidRequestError("response_format is not supported with this model's tokenizer: "
                                      f"{self._unsupported}", param="response_format")
        return self._tokenizer

    def check(self, grammar: str) -> None:
        """Refuse a grammar llguidance cannot compile (a 400 naming why)."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(f"invalid response_format: {error}", param="response_format")

    def masks(self, seq_id: str, grammar: str, output: list[int], new: list[int], rows: int) -> torch.Tensor:
        """Token bitmasks [rows, words] (llguidance's layout): row j allows what the grammar allows after
        output + new[:j]. Rows after a draft token the grammar refuses repeat the mask that refused it."""
        import llguidance.torch

        tracked = self._sync(seq_id, grammar, output)
        matcher = tracked.matcher
        bitmask = llguidance.torch.allocate_token_bitmask(rows, self.vocab_size)
        if tracked.refused:  # nothing allowed: apply() leaves eos alone, and the output ends
            return bitmask.zero_()
        consumed = 0
        for j in range(rows):
            if consumed < j:  # the token before this row was refused: this row is never read
                bitmask[j] = bitmask[j - 1]
                continue
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, j)
            if j < min(len(new), rows - 1) and matcher.try_consume_tokens([new[j]]) == 1:
                consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return bitmask

    def apply(self, logits: torch.Tensor, seq_id: str, grammar: str, output: list[int],
              new: list[int] = ()) -> torch.Tensor:
        """logits [N, V] of N consecutive positions (row j after output + new[:j]), with what the grammar
        refuses at -inf. A row where it allows nothing (its end passed under ignore_eos) allows eos."""
        bitmask = self.masks(seq_id, grammar, output, list(new), logits.shape[0])
        empty = ~bitmask.any(-1)
        if bool(empty.any()):
            eos = self.tokenizer.eos_token
            bitmask[empty, eos // 32] |= 1 << (eos % 32)
        return logits.float().masked_fill(~unpack(bitmask, logits.shape[-1]).to(logits.device), float("-inf"))

    def release(self, seq_id: str) -> None:
        """Forget a sequence's matcher (it ended, or its KV went): its next call, if any, rebuilds it."""
        with self._lock:
            self._matchers.pop(seq_id, None)

    def _sync(self, seq_id: str, grammar: str, output: list[int]) -> _Tracked:
        """The sequence's matcher, having consumed exactly `output` (rolled back and advanced as needed)."""
        import llguidance

        with self._lock:
            tracked = self._matchers.get(seq_id)
        if tracked is not None and tracked.grammar == grammar:
            keep = common_prefix(tracked.consumed, output)
            back = len(tracked.consumed) - keep
            if back and not tracked.matcher.rollback(back):
                tracked = None
            elif tracked is not None:
                del tracked.consumed[keep:]
        else:
            tracked = None
        if tracked is None:
            tracked = _Tracked(grammar, llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))
        rest = output[len(tracked.consumed):]
        if rest:
            taken = tracked.matcher.try_consume_tokens(rest)
            # fewer when the output went on past the grammar's end (under ignore_eos): the matcher stays
            # stopped there, allowing eos alone, whatever follows
            tracked.consumed += rest[:taken]
        # a refusal anywhere but past the grammar's end means the mask let through what the parser cannot
        # take: masked again from the same state, the same token would pass again, for ever
        tracked.refused = len(tracked.consumed) < len(output) and not tracked.matcher.is_stopped()
        with self._lock:
            self._matchers[seq_id] = tracked
            self._matchers.move_to_end(seq_id)
            while len(self._matchers) > self.max_matchers:
                self._matchers.popitem(last=False)  # only recomputation: _sync rebuilds it from the tokens
        return tracked
