"""The demo draft/target pair: two small Llama models built locally from the Python standard
library's source, the draft distilled from the target, cached and loaded like any HF model.

    target_dir, draft_dir = demo_pair()          # builds once (minutes), then cached
    measure_pair(target_dir, draft_dir, k=4)     # tau, cost ratio c, parameter counts
"""

from demo.build import build_cli, demo_pair, pair_dir
from demo.corpus import load_heldout_prompts, write_heldout_prompts
from demo.measure import measure_pair

__all__ = ["build_cli", "demo_pair", "load_heldout_prompts", "measure_pair", "pair_dir",
           "write_heldout_prompts"]
