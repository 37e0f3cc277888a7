"""Building and caching the demo pair: one directory per (quick, seed, build format), written
atomically so that an interrupted build is never taken for a finished one."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from app.model import dtypes
from specserve.demo import corpus, train
from specserve.demo.cache import build_atomically, cache_root
from specserve.demo.progress import BuildProgress, Costs

BUILD_FORMAT = 4  # bump when a change to the build makes old cached pairs wrong
MARKER = "build.json"  # written last: its presence means the pair is complete


# What each piece of a build costs on the reference machines (2 cores), by plan and by whether the
# CPU trains in bf16 (True) or float32 (False): the progress bar counts these, so its ETA holds.
COSTS = {  # bf16: a 2-core Xeon with AMX; float32: the same restricted to AVX2 (no native bf16)
    ("full", True): Costs(prepare=3.5, target_step=0.089, gen_batch=4.0, draft_step=0.092),
    ("full", False): Costs(prepare=3.3, target_step=0.185, gen_batch=8.6, draft_step=0.168),
    ("quick", True): Costs(prepare=3.3, target_step=0.047, gen_batch=0.05, draft_step=0.01),
    ("quick", False): Costs(prepare=3.4, target_step=0.077, gen_batch=0.05, draft_step=0.01),
}


def pair_dir(quick: bool, seed: int, cache_dir: str | None = None) -> Path:
    """The directory of one demo pair (holding target/ and draft/)."""
    return cache_root(cache_dir) / "demo" / f"{'quick' if quick else 'full'}-seed{seed}-v{BUILD_FORMAT}"


def demo_pair(quick: bool = False, rebuild: bool = False, seed: int = 0,
              cache_dir: str | None = None, progress: bool = True) -> tuple[str, str]:
    """(target_dir, draft_dir) of the demo pair, building it first if it is not cached.

    Both are Hugging Face model directories (safetensors + the shared tokenizer) for
    `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`. The target is saved in bfloat16
    (`dtype: auto` serves it so where the device does bf16 natively, in float32 elsewhere); the
    draft, whose step is overhead-bound, in float32.
    """
    final = pair_dir(quick, seed, cache_dir)
    if rebuild or not (final / MARKER).exists():
        _build_into(final, quick, seed, progress)
    return str(final / "target"), str(final / "draft")


def _build_into(final: Path, quick: bool, seed: int, progress: bool) -> None:
    build_atomically(final, lambda out: build_pair(out, quick, seed, progress))


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_pair(out: Path, quick: bool = False, seed: int = 0, progress: bool = True,
               plan: train.BuildPlan | None = None) -> None:
    """Build tokenizer, target and draft into out/target and out/draft (deterministic in seed).

    One recipe on every machine; the arithmetic is bf16 autocast where the CPU does bf16 natively,
    float32 elsewhere (`app.model.dtypes`), so weights agree across machines to rounding, not bit for bit.
    """
    name = "quick" if quick else "full"
    plan, bf16 = plan or train.PLANS[name], dtypes.native_bf16("cpu")  # a given plan: a recipe trial
    costs = COSTS[name, bf16]
    gen_batches = -(-plan.kd_sequences // train.GEN_BATCH)
    total = (costs.prepare + costs.target_step * plan.target_steps + costs.gen_batch * gen_batches
             + costs.draft_step * plan.draft_steps + costs.save)
    bar = BuildProgress(total, bf16, progress)
    phases, t0 = {}, time.time()

    def phase(step: str):
        phases[step] = time.time()
        bar.phase(step)

    with _torch_threads(2):
        try:
            phase("preparing")
            texts = corpus.training_texts()
            tok = train.train_tokenizer(texts, plan)
            stream = train.encode_corpus(tok, train.first_chars(texts, plan.corpus_chars))
            bar.advance(costs.prepare)

            torch.manual_seed(seed)
            gen = torch.Generator().manual_seed(seed)
            target = train.new_model(plan.target, plan)
            phase("target")
            train.train_target(target, stream, plan, gen, lambda loss: bar.advance(costs.target_step, loss), bf16)
            # The teacher is the served target: bf16 weights (as saved), computed in this CPU's dtype.
            target.to(torch.bfloat16).to(dtypes.compute_dtype("cpu"))
            phase("target greedy text")
            text = train.greedy_sequences(target, stream, plan, gen, lambda: bar.advance(costs.gen_batch))
            draft = train.new_model(plan.draft, plan)
            phase("draft")
            train.distill_draft(draft, text, plan, gen, lambda loss: bar.advance(costs.draft_step, loss), bf16)

            phase("saving")
            for part, model, dtype in (("target", target, torch.bfloat16), ("draft", draft, torch.float32)):
                model.to(dtype).save_pretrained(out / part)
                tok.save_pretrained(out / part)
            bar.advance(costs.save)
        finally:
            bar.close()
    phases["end"] = time.time()
    names = list(phases)
    info = {"format": BUILD_FORMAT, "seed": seed, "quick": quick, "plan": asdict(plan),
            "corpus_tokens": stream.numel(), "build_seconds": round(time.time() - t0, 1),
            "compute_dtype": "bfloat16" if bf16 else "float32",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "phase_seconds": {a: round(phases[b] - phases[a], 1) for a, b in zip(names, names[1:])}}
    (out / MARKER).write_text(json.dumps(info, indent=2))
