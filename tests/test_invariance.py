"""Batch invariance: a sequence's logits are the same bits whatever else its forwards hold.

A row computed alone (a plain step), inside a verify of several rows, beside 2-16 other sequences at
random lengths (steps, verify rows, prompt chunks), after its prompt was chunked or borrowed from the
prefix cache, eagerly or in any compiled bucket: the same logits to the bit, in bfloat16 as in float32,
on tiny Qwen2, Llama and Gemma models (docs/architecture.md, "Batch invariance"). Then the engine's
greedy output with speculation equals its output without, alone and four at a time, in bfloat16.

The tiny models carry activations in the thousands in a few channels, as trained ones do: there a
norm's sum of squares differs in its last bit with the order of its adds, which small random
activations hide.
"""

import random

import pytest
import torch
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from app.engine import Engine, EngineSettings
from app.model import cpu_attention, cpu_linear
from app.model.batches import SeqInput
from app.model.compiled import unavailable
from app.model.runner import Execution, ModelRunner
from app.params import SamplingParams
from app.speculation.draft_policy import DraftPolicy
from conftest import VOCAB

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
         "gemma": (GemmaConfig, GemmaForCausalLM)}

needs_kernels = pytest.mark.skipif(
    not (cpu_linear.kernel_available() and cpu_attention.usable(torch.float32, torch.device("cpu"))),
    reason="no C++ compiler here: the row-invariant CPU kernels are not built (docs/architecture.md)")
needs_compiler = pytest.mark.skipif(unavailable(torch.device("cpu")) is not None, reason="compiled steps need a C++ compiler")


def tiny(arch: str, dtype: torch.dtype, seed: int = 0, twins: bool = False):
    """A random 2-layer model of `arch` whose residual stream's channels run from ~0.02 to ~2000.
    `twins`: the head's rows in pairs 1e-5 apart, so the top token's twin nearly ties it at every
    step and a last bit of the hidden state decides between them, as a real model's near ties do every
    few hundred tokens."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                        bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=arch == "gemma")
    model = model_cls(config).eval().requires_grad_(False)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        # channels from ~0.02 to ~2000 (Gemma scales its embeddings by sqrt(hidden) itself)
        embed.mul_(torch.logspace(0, 5, embed.shape[1]) / (embed.shape[1] ** 0.5 if arch == "gemma" else 1.0))
        head = model.get_output_embeddings().weight
        if arch != "gemma":
            head.mul_(8.0)  # peaked distributions, as a trained model's
        if twins:
            head[1::2] = head[0::2][: head[1::2].shape[0]] * (1 + 1e-5 * torch.randn(head[1::2].shape))
    return model.to(dtype)


def runner(model, tokenizer, compiled: bool) -> ModelRunner:
    execution = Execution(pack=True, compile="default" if compiled else "off", compile_max_tokens=16,
                          compile_per_layer=True, compile_layers=1)
    r = ModelRunner(model, tokenizer, execution, max_cache_bytes=32 << 20)
    if compiled:
        r.warm()
        assert r.compile_status == "compiled"
    return r


def history(r: ModelRunner, prompt: list[int], steps: int, others=None) -> list[torch.Tensor]:
    """A greedy sequence's logits: its prompt, then one step a token; `others(i)` adds other sequences to
    forward i. Returns the logits row of every step, prompt's last first."""
    seq = f"x{random.random()}"
    ids, rows = list(prompt), []
    for i in range(steps + 1):
        out = r.forward([SeqInput(seq, ids, 1, salt=seq)] + (others(i) if others else []))[0][-1]
        rows.append(out)
        ids.append(int(out.argmax()))
    r.release(seq)
    return rows


def crowd(gen: random.Random, tag: str):
    """Other sequences for each forward: 2-16 of them, each a new prompt (1-40 positions), a plain step
    or a verify of 2-6 rows over its cached context."""
    live: dict[str, list[int]] = {}

    def others(i: int) -> list[SeqInput]:
        seqs = []
        for j in range(gen.randint(2, 16)):
            name = f"{tag}{j}"
            ids = live.get(name)
            if ids is None or gen.random() < 0.2:  # a fresh prompt (another sequence's chunk)
                name = f"{tag}{j}-{i}"
                ids = [gen.randrange(2, VOCAB) for _ in range(gen.randint(1, 40))]
                seqs.append(SeqInput(name, ids, 1, salt=name))
                live[f"{tag}{j}"] = ids
                continue
            rows = gen.choice([1, 1, gen.randint(2, 6)])
            ids = ids + [gen.randrange(2, VOCAB) for _ in range(rows)]
            live[name] = ids
            seqs.append(SeqInput(name, ids, rows, salt=name))
        return seqs

    return others


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"row {i}: {(x != y).sum().item()} logits differ, by up to {(x - y).abs().max().item():.3g}"


def check_invariance(r: ModelRunner, seed: int) -> None:
    gen = random.Random(seed)
    prompt = [gen.randrange(2, VOCAB) for _ in range(gen.randint(5, 30))]
    steps = 6
    alone = history(r, prompt, steps)
    ids = prompt + [int(x.argmax()) for x in alone[:-1]]
    # beside 2-16 others every forward, the others' own steps, verifies and prompt chunks
    same(history(r, prompt, steps, crowd(gen, "o")), alone)
    # a verify of every step's row at once, after the prompt alone
    seq = "verify"
    r.forward([SeqInput(seq, prompt, 1, salt=seq)])
    same(r.forward([SeqInput(seq, ids, steps + 1, salt=seq)])[0], alone)
    # the prompt in two chunks, the last of them beside others, then the steps as one verify
    seq, cut = "chunked", len(prompt) // 2
    r.forward([SeqInput(seq, prompt[:cut], 1, salt=seq)])
    same(r.forward([SeqInput(seq, ids, len(ids) - cut, salt=seq)] + crowd(gen, "c")(0))[0][-steps - 1:], alone)
    # borrowing a cached prefix: the first history's context (retired, a prefix donor) under its salt
    r.forward([SeqInput("donor", ids[:-2], 1)])
    r.release("donor")
    same(r.forward([SeqInput("borrower", ids, 3)])[0], alone[-3:])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_rows_logits_do_not_depend_on_its_batch_eagerly(arch, dtype, tokenizer):
    """Eager forwards (compile off): every row through the row-invariant kernels. bfloat16 takes the
    AVX512-BF16 pair path where the CPU has it, else bfloat16 widened to float32 FMAs: invariant either way."""
    r = runner(tiny(arch, dtype), tokenizer, compiled=False)
    for seed in range(3):
        check_invariance(r, seed)


@needs_kernels
@needs_compiler
@pytest.mark.parametrize("arch,dtype", [("qwen2", torch.bfloat16), ("llama", torch.bfloat16),
                                        ("gemma", torch.bfloat16), ("qwen2", torch.float32)],
                         ids=["qwen2-bf16", "llama-bf16", "gemma-bf16", "qwen2-fp32"])
def test_a_rows_logits_do_not_depend_on_its_batch_across_compiled_buckets(arch, dtype, tokenizer):
    """Compiled steps of 1-16 tokens, eager past them: a row's bits the same in every bucket and
    eagerly (a forward with a prompt chunk past every bucket runs eagerly), so norms and fused
    bfloat16 chains must compute as eager does (app/model/norms.py, app/model/compiled.py)."""
    r = runner(tiny(arch, dtype), tokenizer, compiled=True)
    assert r.opaque_norms == 2 * 2 + 1  # two a layer and the final norm
    for seed in range(2):
        check_invariance(r, seed)


@needs_kernels
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)], ids=["eager", "compiled"])
def test_bfloat16_greedy_speculation_equals_plain_decoding_alone_and_four_at_a_time(compiled, tokenizer):
    """The engine on a tiny bfloat16 Qwen2 pair (a draft that half agrees): speculative output equals
    its output with speculation off, one request at a time and four at once, token for token."""
    target = tiny("qwen2", torch.bfloat16, twins=True)
    draft = tiny("qwen2", torch.bfloat16, seed=1, twins=True)
    with torch.no_grad():
        for pd, pt in zip(draft.parameters(), target.parameters()):
            pd.copy_((0.5 * pd.float() + 0.5 * pt.float()).to(pd.dtype))
    engine = Engine(runner(target, tokenizer, compiled), runner(draft, tokenizer, compiled),
                    EngineSettings(policy=DraftPolicy(stop_below=0.0)))
    prompts = ["def fib(n):", "hello world, this is a longer prompt than the others", "x", "for i in range(10):\n  "]

    def params(**spec):
        return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculation=spec)

    off = [engine.generate(p, params(enabled=False))[0].token_ids for p in prompts]
    for k in (2, 8):
        alone = [engine.generate(p, params(num_tokens=k))[0].token_ids for p in prompts]
        together = [r.token_ids for r in engine.generate(prompts, params(num_tokens=k))]
        assert alone == off and together == off
    assert [r.token_ids for r in engine.generate(prompts, params(enabled=False))] == off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_each_models_norm_is_put_behind_the_op_only_where_it_gives_the_modules_bits(dtype):
    """Llama's form (weight times the rounded normalised row) and Gemma's (1 + weight, rounded last) are
    replaced by `rms_norm`, which gives each module's own output to the bit; a norm of another form stays."""
    from torch import nn
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from app.model.norms import OpaqueRMSNorm, opaque_norms

    class OtherRMSNorm(nn.Module):  # eps outside the root: not a form the op knows
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), 0.5

        def forward(self, x):
            return self.weight * (x / (x.float().pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(x.dtype)

    gen = torch.Generator().manual_seed(0)
    norms = nn.ModuleList([LlamaRMSNorm(96, eps=1e-5), GemmaRMSNorm(96), OtherRMSNorm(96)]).to(dtype)
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.randn(96, generator=gen))
    x = (torch.randn(7, 96, generator=gen) * torch.logspace(-2, 3, 96)).to(dtype)
    want = [m(x) for m in norms]
    assert opaque_norms(norms) == 2
    assert [type(m) for m in norms] == [OpaqueRMSNorm, OpaqueRMSNorm, OtherRMSNorm]
    assert [norms[0].offset, norms[1].offset] == [False, True]
    for m, w in zip(norms, want):
        assert torch.equal(m(x), w)
