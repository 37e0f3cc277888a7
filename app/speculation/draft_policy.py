"""How a sequence uses its draft: how long it waits for a proposal, what a failure costs it, and the
error by which a draft that cannot answer turns a round into a plain target step (fail open)."""

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.config import SpeculationSettings


class DraftUnavailable(Exception):
    """The draft could not answer: the round falls back to a plain target step.

    `reason` says why, for metrics and traces: "draft_unavailable" (an error, or backing off after
    one) or "deadline" (the draft was slower than its timeout).
    """

    def __init__(self, message: str = "", reason: str = "draft_unavailable"):
        super().__init__(message)
        self.reason = reason


_SETTINGS = SpeculationSettings()


@dataclass
class DraftPolicy:
    """How a sequence uses its draft."""

    # the speculation settings' defaults (app/config.py: draft_timeout_s, draft_retry_after_s, draft_ahead)
    timeout_s: float = _SETTINGS.draft_timeout_s  # a proposal later than this: the round runs as a plain target step
    retry_after_s: float = _SETTINGS.draft_retry_after_s  # after a draft failure, plain steps this long
    # A seeded sampled request's draws depend on each round's K, so falling open would change its
    # output: it asks again (another replica answers with the same proposal), this many times with
    # this backoff doubling (1.5 s in all), before it falls open after all, like the others: then its
    # output is distribution-exact but no longer what an undisturbed run gives.
    seeded_retries: int = 4
    seeded_backoff_s: float = 0.1
    ahead: bool = _SETTINGS.draft_ahead  # ask for round n+1's proposal while round n is verified
    branches: int = _SETTINGS.draft_ahead_branches  # and for its likely rejections: runner-ups per position
    stop_below: float = _SETTINGS.draft_stop_below  # a flexible request's proposal ends below this draft probability
    beside_cached: bool = _SETTINGS.draft_beside_cached_prefill  # asked beside a prefill the target's cache holds
    clock: Callable[[], float] = time.monotonic  # injected by tests

    @classmethod
    def of(cls, settings: SpeculationSettings) -> "DraftPolicy":
        return cls(timeout_s=settings.draft_timeout_s, retry_after_s=settings.draft_retry_after_s,
                   ahead=settings.draft_ahead, branches=settings.draft_ahead_branches,
                   stop_below=settings.draft_stop_below, beside_cached=settings.draft_beside_cached_prefill)
