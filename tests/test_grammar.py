"""Structured output (response_format) under speculation: the grammar masks target and draft alike,
advances along each proposal and rolls back, so output is valid, greedy output is the target's
constrained greedy output token for token, and acceptance is what the distributions allow."""

import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import app.grammar
import app.speculation.drafting as drafting
import app.speculation.steps as spec
from app.engine import Engine, EngineSettings
from app.errors import InvalidRequestError
from app.grammar import Grammars, grammar_of
from app.speculation.logits import LogitRules
from app.params import parse_sampling
from app.model.runner import ModelRunner
from conftest import blend, kv_store, make_byte_tokenizer, make_model, put_ids

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["ab", "cab", "b"]},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3}},
          "required": ["ok", "kind", "tags"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
PROMPTS = ["give me json:", '{"name": "ada"', "x", "def f(x):"]


@pytest.fixture(scope="module")
def byte_tokenizer():
    return make_byte_tokenizer()


@pytest.fixture(scope="module")
def byte_target(byte_tokenizer):
    return make_model(seed=4, vocab_rows=len(byte_tokenizer))


class ReferenceGrammar(LogitsProcessor):
    """The grammar applied step by step as plain decoding would: one matcher, one token at a time."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int):
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.matcher = llguidance.LLMatcher(self.tok, grammar)
        self.prompt_len, self.seen = prompt_len, 0

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:].tolist()
        for t in out[self.seen:]:
            assert self.matcher.consume_token(t)
        self.seen = len(out)
        # the tokenizer's vocabulary: embedding rows past it (a padded head) are never allowed
        vocab = min(self.tok.vocab_size, scores.shape[-1])
        mask = llguidance.torch.allocate_token_bitmask(1, self.tok.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, mask, 0)
        # the bits read in plain Python: an oracle apart from the engine's unpacking and from
        # llguidance's own torch.compile'd kernel (wrong under a forced AVX2 dispatch on an AVX-512 CPU)
        words = mask[0].tolist()
        allowed = [t for t in range(vocab) if words[t // 32] >> (t % 32) & 1]
        masked = torch.full_like(scores, float("-inf"))
        masked[:, allowed] = scores[:, allowed]
        return masked


def constrained_reference(model, tokenizer, prompt_ids, grammar, n):
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                         logits_processor=LogitsProcessorList([ReferenceGrammar(tokenizer, grammar, len(prompt_ids))]))
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("fmt", ["json_schema", "json_object"])
def test_greedy_structured_output_is_the_targets_constrained_greedy_output(k, fmt, byte_tokenizer, byte_target):
    draft = blend(byte_target, 7, 0.8)
    engine = Engine(ModelRunner(byte_target, byte_tokenizer), ModelRunner(draft, byte_tokenizer))
    response_format = JSON_SCHEMA if fmt == "json_schema" else {"type": "json_object"}
    params = dict(temperature=0, max_tokens=60, response_format=response_format, speculation={"num_tokens": k})
    grammar = grammar_of(parse_sampling(params).response_format)
    for r in engine.generate(PROMPTS, params):
        want = constrained_reference(byte_target, byte_tokenizer, r.prompt_token_ids, grammar, 60)
        assert r.token_ids == [t for t in want if t != byte_tokenizer.eos_token_id][: len(r.token_ids)]
        if fmt == "json_schema":  # short by construction: it ends, with the eos the grammar then forces
            assert r.finish_reason == "stop"
            jsonschema.validate(json.loads(r.text), SCHEMA)
        elif r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)


def test_sampled_structured_output_is_valid_for_every_seed(byte_tokenizer, byte_target):
    engine = Engine(ModelRunner(byte_target, byte_tokenizer), ModelRunner(blend(byte_target, 7, 0.8), byte_tokenizer))
    params = [dict(temperature=1.0, seed=s, max_tokens=80, response_format=JSON_SCHEMA) for s in range(8)]
    results = engine.generate(PROMPTS * 2, params)
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert len({r.text for r in results}) > 1  # sampling still samples within the grammar


def test_the_draft_masks_q_with_the_same_grammar(byte_tokenizer, byte_target, monkeypatch):
    """Target as its own draft, q untruncated: with the grammar on both sides q = p, every token passes.
    Planted bug: a draft that ignores the grammar proposes tokens the target's grammar refuses."""
    engine = Engine(ModelRunner(byte_target, byte_tokenizer), ModelRunner(byte_target, byte_tokenizer), EngineSettings(draft_top_n=0))
    params = dict(temperature=1.0, seed=5, max_tokens=60, response_format=JSON_SCHEMA, speculation={"num_tokens": 4})
    same = engine.generate(PROMPTS, params)
    assert all(r.speculation["acceptance_rate"] > 0.97 for r in same), [r.speculation for r in same]
    monkeypatch.setattr(drafting, "_ruled", lambda grammars, logits, items, drafted: logits)
    unmasked = engine.generate(PROMPTS, params)
    assert max(r.speculation["acceptance_rate"] for r in unmasked) < 0.9
    for r in unmasked:  # the target's mask alone still keeps the output valid
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_masks_follow_a_proposal_and_roll_back(byte_tokenizer):
    grammars = Grammars(byte_tokenizer, len(byte_tokenizer))
    grammar = grammar_of({"type": "json_object"})
    ids = byte_tokenizer('{"a": true}', add_special_tokens=False)["input_ids"]
    along = grammars.masks("s", grammar, [], ids, len(ids) + 1)
    # row j is the mask after ids[:j]: each token is allowed where it was proposed
    for j, t in enumerate(ids):
        assert along[j, t // 32] >> (t % 32) & 1
    # the matcher was rolled back: the same call gives the same masks; resyncing to the output so far
    # (advancing, then rolling back to a different branch) gives the masks from there
    assert torch.equal(grammars.masks("s", grammar, [], ids, len(ids) + 1), along)
    assert torch.equal(grammars.masks("s", grammar, ids[:2], ids[2:], len(ids) - 1), along[2:])
    assert torch.equal(grammars.masks("s", grammar, ids[:1], ids[1:], len(ids)), along[1:])
    # a token the grammar refuses: its row refuses it and the rows after it repeat that row
    bad = byte_tokenizer("x", add_special_tokens=False)["input_ids"][0]
    refused = grammars.masks("s", grammar, [], [bad, ids[1]], 3)
    assert not refused[0, bad // 32] >> (bad % 32) & 1
    assert torch.equal(refused[1], refused[0]) and torch.equal(refused[2], refused[0])
    grammars.release("s")
    assert torch.equal(grammars.masks("s", grammar, ids[:2], ids[2:], len(ids) - 1), along[2:])


def test_a_token_the_mask_allowed_and_the_matcher_refused_ends_the_output():
    """llguidance's mask and its parser can disagree: an added token that a grammar's literal spells as
    text passes the mask, then the matcher refuses it and stays where it was. Before, the mask from there
    let the same token through again, and a required tool call on the Qwen2.5-Coder pair came out as
    `<tool_call>` sixty times over; now only eos is allowed after such a token."""
    import copy

    tok = copy.deepcopy(make_byte_tokenizer())
    tok.add_tokens(["<tool_call>"])  # added, not special: Qwen2.5's kind
    marker, vocab = tok.convert_tokens_to_ids("<tool_call>"), len(tok)
    grammars = Grammars(tok, vocab)
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "<tool_call>" "\\n" "x"')
    logits = torch.zeros(1, vocab)
    first = grammars.apply(logits, "s", grammar, [])
    assert first[0, marker] == 0  # the mask lets the marker through (llguidance's own disagreement)
    after = grammars.apply(logits, "s", grammar, [marker])
    assert torch.isfinite(after[0]).nonzero().flatten().tolist() == [tok.eos_token_id]
    # the same sequence rolled back before the refused token is masked as at its start again
    assert torch.equal(grammars.apply(logits, "s", grammar, []), first)


def test_bad_formats_and_tokenizers_are_refused_by_name(byte_tokenizer, byte_target, tokenizer, target_model):
    engine = Engine(ModelRunner(byte_target, byte_tokenizer))
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}):
        with pytest.raises(InvalidRequestError) as e:
            engine.new_request("x", dict(response_format=bad))
        assert e.value.param == "response_format", bad
    # a tokenizer llguidance cannot read (character-level WordLevel): a clear refusal, not a crash
    with pytest.raises(InvalidRequestError) as e:
        Engine(ModelRunner(target_model, tokenizer)).new_request("x", dict(response_format={"type": "json_object"}))
    assert e.value.param == "response_format" and "tokenizer" in str(e.value)
    assert parse_sampling(dict(response_format={"type": "text"})).response_format is None


def test_a_sequence_evicted_from_the_kv_budget_loses_its_matcher(byte_tokenizer, byte_target):
    """A draft replica whose sequence's release never comes (its target died, or released elsewhere):
    the matcher goes with the sequence's KV, whatever ends it (eviction, drop, a retired donor's eviction)."""
    runner = ModelRunner(byte_target, byte_tokenizer)
    params = parse_sampling(dict(temperature=0, response_format={"type": "json_object"}))
    prompt = byte_tokenizer("give me json:")["input_ids"]
    rules = LogitRules.of(params, len(prompt), frozenset({byte_tokenizer.eos_token_id}))
    drafting.propose(runner, [spec.ProposeItem("a", prompt, 3, params, 0, rules=rules)])
    assert "a" in runner.grammars._matchers and "a" in runner.cache
    runner.cache.max_bytes = runner.cache.nbytes + 1  # room for one such cache: b's evicts a's
    drafting.propose(runner, [spec.ProposeItem("b", prompt[::-1], 3, params, 0, rules=rules)])
    assert "a" not in runner.cache and "a" not in runner.grammars._matchers
    assert "b" in runner.grammars._matchers
    runner.cache.drop("b")
    assert not runner.grammars._matchers

    dropped = []
    store = kv_store(3, on_drop=dropped.append)  # room for three entries of one block
    for seq in "abc":
        put_ids(store, seq, [1, 2])
    store.retire("b")
    put_ids(store, "d", [1, 2])  # the retired donor goes first
    put_ids(store, "e", [1, 2])  # then the least recently used live one
    store.drop("d")
    assert dropped == ["b", "a", "d"]


def test_matchers_never_exceed_their_bound(byte_tokenizer):
    grammars = Grammars(byte_tokenizer, len(byte_tokenizer), max_matchers=3)
    grammar = grammar_of({"type": "json_object"})
    for i in range(10):
        grammars.masks(f"s{i}", grammar, [], [], 1)
        assert len(grammars._matchers) <= 3
    grammars.masks("s7", grammar, [], [], 1)  # used again: the least recently used goes next, not s7
    grammars.masks("s10", grammar, [], [], 1)
    assert list(grammars._matchers) == ["s9", "s7", "s10"]


def test_output_is_unchanged_when_matchers_are_dropped_mid_generation(byte_tokenizer, byte_target, monkeypatch):
    """A bound of one matcher per model and four sequences: every call finds its matcher dropped and
    rebuilds it from the output tokens; greedy output is still the constrained reference, seeded
    sampled output still what an undisturbed engine gives."""
    built = []

    class Counted(app.grammar._Tracked):
        def __init__(self, *args):
            built.append(1)
            super().__init__(*args)

    monkeypatch.setattr(app.grammar, "_Tracked", Counted)
    draft = blend(byte_target, 7, 0.8)

    def engine(max_matchers):
        runners = ModelRunner(byte_target, byte_tokenizer), ModelRunner(draft, byte_tokenizer)
        for r in runners:
            r.grammars.max_matchers = max_matchers
        return Engine(*runners)

    greedy = dict(temperature=0, max_tokens=40, response_format=JSON_SCHEMA, speculation={"num_tokens": 3})
    grammar = grammar_of(parse_sampling(greedy).response_format)
    for r in engine(1).generate(PROMPTS, greedy):
        want = constrained_reference(byte_target, byte_tokenizer, r.prompt_token_ids, grammar, 40)
        assert r.token_ids == [t for t in want if t != byte_tokenizer.eos_token_id][: len(r.token_ids)]
    assert len(built) > 4 * len(PROMPTS)  # matchers were dropped and rebuilt mid-generation
    sampled = [dict(temperature=1.0, seed=s, max_tokens=40, response_format=JSON_SCHEMA) for s in range(4)]
    assert ([r.token_ids for r in engine(1).generate(PROMPTS, sampled)]
            == [r.token_ids for r in engine(4096).generate(PROMPTS, sampled)])


# vLLM's structured outputs (app/openai/structured.py): each kind, as the engine's response_format
STRUCTURED = {
    "regex": {"type": "regex", "regex": r"(yes|no), [0-9]{2,4}!"},
    "choice": {"type": "choice", "choice": ["ab", "a \"quoted\" word", "b\\c", "abc"]},
    "grammar": {"type": "grammar", "grammar": 'start: item ("," item)*\nitem: "x" | "yy" | NUM\nNUM: /[0-9]+/'},
}


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_greedy_output_under_vllms_structured_outputs_is_the_constrained_greedy_output(k, kind, byte_tokenizer,
                                                                                      byte_target):
    engine = Engine(ModelRunner(byte_target, byte_tokenizer), ModelRunner(blend(byte_target, 7, 0.8), byte_tokenizer))
    params = dict(temperature=0, max_tokens=24, response_format=STRUCTURED[kind], speculation={"num_tokens": k})
    grammar = grammar_of(parse_sampling(params).response_format)
    for r in engine.generate(PROMPTS, params):
        want = constrained_reference(byte_target, byte_tokenizer, r.prompt_token_ids, grammar, 24)
        assert r.token_ids == [t for t in want if t != byte_tokenizer.eos_token_id][: len(r.token_ids)]
        if kind == "choice":  # a choice ends with its string: always within the budget
            assert r.finish_reason == "stop" and r.text in STRUCTURED["choice"]["choice"]
        if kind == "regex" and r.finish_reason == "stop":
            assert __import__("re").fullmatch(STRUCTURED["regex"]["regex"], r.text)


def test_a_body_takes_one_output_constraint_under_any_of_its_names():
    from app.openai.protocol import CompletionRequest
    from app.params import SpeculationParams

    def fmt(**fields):
        body = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        return body.sampling(4, SpeculationParams()).response_format
    assert fmt(structured_outputs={"regex": "a+"}) == fmt(guided_regex="a+") == {"type": "regex", "regex": "a+"}
    assert fmt(structured_outputs={"choice": ["a", "b"]}) == fmt(guided_choice=["a", "b"])
    assert fmt(structured_outputs={"grammar": 'start: "a"'}) == {"type": "grammar", "grammar": 'start: "a"'}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert fmt(structured_outputs={"json": schema}) == fmt(guided_json=json.dumps(schema)) == fmt(
        response_format={"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}})
    assert fmt(structured_outputs={"json_object": True}) == {"type": "json_object"}
    for both in ({"guided_regex": "a", "guided_choice": ["a"]}, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                 {"guided_regex": "a", "response_format": {"type": "json_object"}}):
        with pytest.raises(InvalidRequestError, match="one output constraint"):
            fmt(**both)
    with pytest.raises(InvalidRequestError):
        fmt(guided_choice=[""])


def test_a_structured_output_llguidance_cannot_compile_is_refused_by_name(byte_tokenizer, byte_target):
    engine = Engine(ModelRunner(byte_target, byte_tokenizer))
    for bad in ({"type": "regex", "regex": "(unclosed"}, {"type": "grammar", "grammar": "start: ("}):
        with pytest.raises(InvalidRequestError) as e:
            engine.generate("x", dict(max_tokens=4, response_format=bad))
        assert e.value.param == "response_format"
