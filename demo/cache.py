"""Where built pairs are kept."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    """Where built pairs live: cache_dir, else $SPECSERVE_CACHE, else the user cache dir."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("specserve"))
