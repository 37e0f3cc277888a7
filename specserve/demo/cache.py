"""Where built pairs are kept."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root(cache_dir: str | None = None) -> Path:
    """Where built pairs live: cache_dir, else $SPECSERVE_CACHE, else the user cache dir."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("specserve"))


def build_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """`build(out)` into a temporary sibling of `final`, then rename it there: an interrupted build is
    never taken for a finished one, and a rebuild replaces the old directory only once it is whole."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-"))
    try:
        work = tmp / final.name
        build(work)
        if final.exists():  # a rebuild, or a stale partial directory
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        work.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: Path) -> str:
    """The file's sha256, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
