"""How well a draft/target pair would speculate, measured without the speculative engine.

τ (mean accepted length): greedy-decode the target, ask the draft for its argmax at every
position of that same text, and replay rounds of K: each round emits the longest run of
agreeing draft tokens plus one target token (the correction, or the bonus after K agreements).
c (cost ratio): median time of a one-token decode step with KV cache, draft over target, batch 1.
The draft may be measured as a replica serves it (`draft_weights`, `proposal_vocab`: its linears
packed, its head cut), for several packings against one greedy decode of the target.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import PreTrainedModel

from specserve.demo.corpus import load_heldout_prompts
from app.model.hf_compat import returned_cache, with_cache
from app.model.eos import eos_ids
from app.model.cpu_linear import kernel_available, pack_linears
from app.model.loading import PACKED_DTYPES
from app.model.runner import load_model
from app.speculation import draft_vocab


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    """The share of a text's n-grams that are distinct: near 1 for prose or code, low for text that
    loops (a looping target inflates τ without making a better pair)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def replay_rounds(agree: list[bool], k: int) -> tuple[int, int]:
    """Greedy rounds of K over a per-position agreement list. Returns (tokens emitted, rounds)."""
    i = rounds = 0
    while i < len(agree):
        run = 0
        while run < k and i + run < len(agree) and agree[i + run]:
            run += 1
        i += run + 1  # the accepted run, then the target's own token
        rounds += 1
    return len(agree), rounds


def acceptance_by_position(agrees: list[list[bool]], k: int) -> list[float]:
    """Greedy rounds of K replayed over each text: the share of rounds that reach draft position i
    (1-based) and accept it, for i = 1..K (what vLLM reports as per-position acceptance)."""
    reached, accepted = [0] * k, [0] * k
    for agree in agrees:
        i = 0
        while i < len(agree):
            run = 0
            while run < k and i + run < len(agree):
                reached[run] += 1
                if not agree[i + run]:
                    break
                accepted[run] += 1
                run += 1
            i += run + 1
    rounds = reached[0]
    return [a / max(1, rounds) for a in accepted]


@torch.no_grad()
def greedy_continuation(model: PreTrainedModel, ids: torch.Tensor, n: int, eos: frozenset[int] = frozenset()
                        ) -> torch.Tensor:
    """The target's greedy continuation of ids [1, S], up to n tokens and up to (with) the first in
    `eos`, where serving stops. Returns [<= n]."""
    out = model(ids, use_cache=True)
    cache, tok, toks = returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True), []
    for _ in range(n):
        toks.append(tok)
        if int(tok) in eos:
            break
        out = model(tok, use_cache=True, **with_cache(model, cache))
        cache, tok = returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(toks, dim=1)[0]


@torch.no_grad()
def agreement(draft: PreTrainedModel, ids: torch.Tensor, cont: torch.Tensor) -> list[bool]:
    """Per continuation position: does the draft's argmax, given the same prefix, match?"""
    full = torch.cat([ids[0], cont])[None]  # [1, S + n]
    guesses = draft(full).logits[0, ids.shape[1] - 1 : -1].argmax(-1)  # [n]
    return (guesses == cont).tolist()


@torch.no_grad()
def step_ms(model: PreTrainedModel, context: int = 128, steps: int = 40) -> float:
    """Median milliseconds of one decode step (1 token, KV cache of `context`), batch 1."""
    ids = torch.randint(2, model.config.vocab_size, (1, context))
    out = model(ids, use_cache=True)
    cache, tok, times = returned_cache(out), ids[:, -1:], []
    for _ in range(steps + 5):
        t0 = time.perf_counter()
        out = model(tok, use_cache=True, **with_cache(model, cache))
        times.append(time.perf_counter() - t0)
        cache = returned_cache(out)
    return statistics.median(times[5:]) * 1e3  # the first steps warm up allocators


@torch.no_grad()
def heldout_loss(model_dir: str, windows: int = 32, length: int = 256) -> float:
    """Cross-entropy (nats per token) of a saved model on random windows of the held-out modules."""
    from specserve.demo.corpus import heldout_files, read_source
    from specserve.demo.train import encode_corpus, sample_batch

    model, tok = load_model(model_dir, dtype="float32")
    stream = encode_corpus(tok, [read_source(p) for p in heldout_files()])
    x = sample_batch(stream, windows, length, torch.Generator().manual_seed(1))  # [windows, length + 1]
    logits = model(x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()


def prompt_ids(tok, prompt: dict) -> torch.Tensor:
    """A held-out prompt's ids [1, S]: a chat prompt through the chat template, others as raw text."""
    if prompt["kind"] == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        return torch.tensor([ids])
    return tok(prompt["prompt"], return_tensors="pt").input_ids


def served_draft(draft_dir: str, weights: str = "model", proposal_vocab: int | None = None
                 ) -> tuple[PreTrainedModel, int]:
    """The draft as a replica computes it, and its parameter count as loaded (packed linears are buffers):
    its head cut to `proposal_vocab` rows, its linears packed in `weights` (a draft's packed_weights;
    where no kernel builds, as loaded)."""
    draft, _ = load_model(draft_dir, dtype="auto")
    params = draft.num_parameters()
    if proposal_vocab:
        draft_vocab.restrict_head(draft, draft_dir, proposal_vocab)
    if weights != "model" and kernel_available():
        pack_linears(draft, dtype=PACKED_DTYPES[weights])
    return draft, params


def measure_pair(target_dir: str, draft_dir: str, k: int = 4, new_tokens: int = 64,
                 prompts: list[dict] | None = None, draft_weights: tuple[str, ...] = ("model",),
                 proposal_vocab: int | None = None, progress=None) -> dict:
    """τ at K (greedy, held-out prompts: the demo's unless given), acceptance by draft position, cost
    ratio c and parameter counts of a saved pair; the draft in its first `draft_weights`, and each
    packing's τ and α in "by_weights". `progress(line)`: told of each prompt decoded and packing measured."""
    say = progress or (lambda line: None)
    target, tok = load_model(target_dir, dtype="auto")  # bf16 only where this CPU does it natively
    emitted, rounds, by_kind, distinct, texts = 0, 0, {}, [], []
    stops = eos_ids(target.generation_config, tok)
    prompts = prompts or load_heldout_prompts()
    for i, p in enumerate(prompts):
        ids = prompt_ids(tok, p)
        cont = greedy_continuation(target, ids, new_tokens, stops)
        distinct.append(distinct_ngrams(cont.tolist()))
        texts.append((p["kind"], ids, cont))
        say(f"target's text {i + 1}/{len(prompts)}: {len(cont)} tokens")
    by_weights = {}
    for weights in reversed(draft_weights):  # the first last: its draft is the one timed below
        draft, draft_params = served_draft(draft_dir, weights, proposal_vocab)
        agrees = [agreement(draft, ids, cont) for _, ids, cont in texts]
        done, taken = map(sum, zip(*(replay_rounds(agree, k) for agree in agrees)))
        by_weights[weights] = {"tau": done / taken, "alpha": sum(map(sum, agrees)) / max(1, sum(map(len, agrees)))}
        say(f"draft on {weights} weights: measured")
    agree_all = agrees
    for (kind, _, _), agree in zip(texts, agree_all):
        e, r = replay_rounds(agree, k)
        emitted, rounds = emitted + e, rounds + r
        ke, kr = by_kind.get(kind, (0, 0))
        by_kind[kind] = (ke + e, kr + r)
    target_ms, draft_ms = step_ms(target), step_ms(draft)
    return {
        "k": k,
        "tau": emitted / rounds,
        "tau_by_kind": {kind: e / r for kind, (e, r) in by_kind.items()},
        "acceptance_by_position": acceptance_by_position(agree_all, k),
        "alpha": sum(map(sum, agree_all)) / max(1, sum(map(len, agree_all))),
        "distinct_4grams": statistics.mean(distinct),
        "target_step_ms": target_ms,
        "draft_step_ms": draft_ms,
        "c": draft_ms / target_ms,
        "target_params": target.num_parameters(),
        "draft_params": draft_params,
        "target_dtype": str(target.dtype),
        "draft_dtype": str(draft.dtype),
        "by_weights": {w: by_weights[w] for w in draft_weights},
    }
