"""The models `gpu_check` runs (specserve/gpu/check.py): Llama-shaped, built from configs with random
weights scaled so that their distributions are peaked like a trained model's, a word-level
tokenizer over their ids, random prompts, and the near-tie rule a bf16 difference is judged by."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab` ids (names t0, t1, ...): ids in, ids out."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def llama(layers: int, hidden: int, vocab: int, seed: int, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    with torch.device(device):  # initialised where it runs: a 1B model's init on the host took most of a minute
        model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: greedy is not decided by rounding
    return model.to(device=device, dtype=dtype).requires_grad_(False)


def blend(target: LlamaForCausalLM, layers: int, seed: int, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """A draft sharing the target's embeddings and head (so it agrees often), with its own layers."""
    cfg = target.config
    draft = llama(layers, cfg.hidden_size, cfg.vocab_size, seed, dtype, device)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
    return draft


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


@torch.inference_mode()
def near_tie(model, ids: list[int], position: int) -> tuple[bool, float]:
    """Whether the target's top two logits at `position` (of ids) are within one rounding step of the
    model's dtype: (is a near-tie, the gap)."""
    logits = model(torch.tensor([ids[:position]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    step = torch.finfo(model.dtype).eps * top[0].abs().item() * 4  # a few ulps of the largest logit
    return (top[0] - top[1]).item() <= step, (top[0] - top[1]).item()
