"""The demo build's progress bar: phases by name, counted in seconds of work on a reference machine,
so that its ETA holds from the first phase to the last, and a build far slower than that says why."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

SLOW = 2.0  # a pace this many times the reference's is reported, once, with its likely cause


@dataclass(frozen=True)
class Costs:
    """Seconds each piece of a build takes on the reference machine (2 cores)."""

    prepare: float      # read the corpus, train the tokenizer, encode
    target_step: float  # one training step of the target
    gen_batch: float    # one batch of the target's greedy text
    draft_step: float   # one distillation step of the draft
    save: float = 0.5


class BuildProgress:
    """A tqdm bar whose units are reference seconds; `advance` after each piece of work."""

    def __init__(self, total: float, bf16: bool, enabled: bool, clock=time.monotonic, label: str = "demo pair"):
        self.label = label
        self.bar = tqdm(total=round(total, 1), desc=f"{label}: preparing", disable=not enabled,
                        unit="s", unit_scale=False, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self.clock, self.warned = clock, False
        self.t0 = clock()
        if not bf16:
            self.say("this CPU has no native bf16 matmul (torch would take its scalar fallback), "
                     "so the pair trains in float32")

    def say(self, line: str) -> None:
        self.bar.write(f"{self.label}: {line}", file=sys.stderr)

    def phase(self, name: str) -> None:
        self.bar.set_description_str(f"{self.label}: {name}")

    def advance(self, seconds: float, loss: float | None = None) -> None:
        self.bar.update(seconds)
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}")
        self._check_pace()

    def _check_pace(self) -> None:
        """Once a tenth of the work is done, say so if this machine is far slower than the reference."""
        done, total = self.bar.n, self.bar.total
        if self.warned or not total or done < 0.1 * total:
            return
        self.warned = True
        pace = (self.clock() - self.t0) / done
        if pace > SLOW:
            self.say(f"building {pace:.1f}x slower than on the reference 2-core machine "
                     f"({torch.get_num_threads()} threads, CPU capability "
                     f"{torch.backends.cpu.get_cpu_capability()}): about {pace * total / 60:.0f} min in all")

    def close(self) -> None:
        self.bar.close()
