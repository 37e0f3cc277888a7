"""Real architectures behave as `generate` does: tiny random configs of the families users serve
(Llama-3, Qwen2/Qwen3, Mistral, Gemma-2/3), each with the feature that trips a serving engine.
Greedy output through the engine, speculating with a draft of the same family, must equal
Hugging Face `generate` of the target alone."""

import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from app.engine import Engine
from app.model.runner import ModelRunner
from tests.conftest import VOCAB

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}


def llama3(layers: int, vocab: int):
    # llama3 rope scaling; several stop ids (Llama-3.1-Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaConfig(**{**SMALL, "eos_token_id": [1, 96, 97]}, num_hidden_layers=layers, vocab_size=vocab,
                       rope_parameters=rope, tie_word_embeddings=False)


def qwen2(layers: int, vocab: int):
    # embedding rows padded past the tokenizer, by a different amount for draft and target; tied
    return Qwen2Config(**SMALL, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=True)


def qwen3(layers: int, vocab: int):
    return Qwen3Config(**SMALL, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=True)


def mistral(layers: int, vocab: int):
    # a sliding window shorter than the prompt
    return MistralConfig(**SMALL, num_hidden_layers=layers, vocab_size=vocab, sliding_window=12)


def gemma2(layers: int, vocab: int):
    # logit soft-capping (attention and final), sliding and full layers alternating
    return Gemma2Config(**SMALL, num_hidden_layers=layers, vocab_size=vocab, sliding_window=12,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16)


def gemma3(layers: int, vocab: int):
    return Gemma3TextConfig(**SMALL, num_hidden_layers=layers, vocab_size=vocab, sliding_window=12,
                            layer_types=["sliding_attention", "full_attention"][:layers],
                            query_pre_attn_scalar=16)


FAMILIES = {
    "llama3": (llama3, VOCAB, VOCAB),
    "qwen2": (qwen2, VOCAB + 30, VOCAB + 14),
    "qwen3": (qwen3, VOCAB + 30, VOCAB + 6),
    "mistral": (mistral, VOCAB, VOCAB),
    "gemma2": (gemma2, VOCAB + 2, VOCAB),
    "gemma3": (gemma3, VOCAB + 2, VOCAB + 2),
}


def build(make, layers: int, vocab: int, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make(layers, vocab)).eval()  # each family's default attention
    with torch.no_grad():  # peaked distributions, like a trained model's: greedy ties are not at stake
        model.get_output_embeddings().weight.mul_(6.0)
    return model


def reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=0)
    new = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    return next((new[:i] for i, t in enumerate(new) if t in stops), new)  # we do not emit the stop id


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_through_the_engine_equals_generate(family, tokenizer):
    make, target_vocab, draft_vocab = FAMILIES[family]
    target = build(make, 2, target_vocab, seed=1)
    draft = build(make, 1, draft_vocab, seed=2)
    engine = Engine(ModelRunner(target, tokenizer), ModelRunner(draft, tokenizer))
    prompts = ["def sliding(window, x):\n    return", "import os\nimport sys\n", "the quick brown fox jumps"]
    with warnings.catch_warnings():
        # a deprecated keyword is removed later, and then silently ignored: the cache by its current name
        warnings.filterwarnings("error", category=FutureWarning, message=".*past_key_values.*")
        results = engine.generate(prompts, {"max_tokens": 32, "temperature": 0.0, "speculation": {"num_tokens": 3}})
    for r in results:
        assert len(r.prompt_token_ids) > 12  # longer than the sliding windows
        assert r.token_ids == reference(target, r.prompt_token_ids, 32), family
    assert sum(len(r.token_ids) for r in results) >= 24  # not a run of immediate stops
    assert sum(r.speculation["drafted_tokens"] for r in results) > 0


def test_the_kv_cache_keyword_is_the_one_the_models_forward_takes():
    from app.model.hf_compat import returned_cache, with_cache

    class Old(torch.nn.Module):  # transformers before 5.2x
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
            return None

    assert with_cache(Old(), "c") == {"past_key_values": "c"} and with_cache(New(), "c") == {"cache": "c"}
    model = build(llama3, 1, VOCAB, seed=1)
    out = model(torch.tensor([[2, 3]]), use_cache=True)
    again = model(torch.tensor([[4]]), use_cache=True, **with_cache(model, returned_cache(out)))
    whole = model(torch.tensor([[2, 3, 4]])).logits[:, -1]
    assert torch.allclose(again.logits[:, -1], whole, atol=1e-4)  # the cache was used, not ignored
