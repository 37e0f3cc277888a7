"""The project's C++ kernels (app/model/kernels/): compiled here, once per machine, for its own CPU.

A kernel is built with `-march=native`, so the compiler uses the instruction set this CPU has
(AVX-512, AVX2 or plain SSE) and nothing it lacks: the binary is cached under a key of the source,
the flags, the compiler and the CPU's flags, never shared between different CPUs. It is loaded with
ctypes, which releases the GIL while it runs. No compiler or a failed build gives None, and the
caller keeps torch's own kernels.
"""

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # source name -> the loaded library or None, once tried


def _cpu_key() -> str:
    """What a binary depends on besides its source: the machine's ISA flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve", "kernels")
    return Path(root)


def _included(path: Path) -> list[str]:
    """The texts of the kernels' own files that `path` includes (`#include "name"`): part of its binary."""
    names = re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE)
    return [(path.parent / name).read_text() for name in names]


def build(source: str, flags: list[str], link: list[str] = ()) -> Path | None:
    """The shared library of app/model/kernels/`source`, compiled if this machine has none yet; None when
    it cannot be (said in the log). `link`: what the link step adds (libraries, their paths)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        log.info("%s: no C++ compiler; torch's kernels instead", source)
        return None
    path = KERNELS / source
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        parts = [path.read_text(), *_included(path), version, " ".join(flags), " ".join(link), _cpu_key()]
        key = hashlib.sha256("\0".join(parts).encode())
        lib = cache_dir() / f"{path.stem}-{key.hexdigest()[:20]}.so"
        if lib.exists():
            return lib
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # replicas may build at once: rename atomically
            obj, out = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
            subprocess.run([cxx, *flags, "-c", str(path), "-o", obj], check=True, capture_output=True, timeout=300)
            # flags go to the compile step alone: linked with -ffast-math, GCC would add a start-up
            # object that turns on flush-to-zero for the whole process
            subprocess.run([cxx, "-shared", "-pthread", obj, "-o", out, "-lm", *link], check=True,
                           capture_output=True, timeout=300)
            os.replace(out, lib)
        return lib
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("%s: build failed (%s %s); torch's kernels instead", source, e,
                    detail.decode(errors="replace")[-500:])
        return None


def load(source: str, flags: list[str], link: list[str] = ()) -> ctypes.CDLL | None:
    """The loaded library of app/model/kernels/`source` (built once a process), or None where it cannot be."""
    with _lock:
        if source not in _loaded:
            lib = build(source, flags, link)
            _loaded[source] = None if lib is None else ctypes.CDLL(str(lib))
        return _loaded[source]


def load_op(source: str, flags: list[str]) -> ctypes.CDLL | None:
    """A kernel that registers torch ops (`#include <torch/library.h>`), loaded (its load registers them with
    torch's dispatcher), or None where it cannot be built: `flags` as for its kernels, their -std replaced by
    torch's."""
    compile_flags, link = torch_flags()
    return load(source, [f for f in flags if not f.startswith("-std=")] + compile_flags, link)


def torch_flags() -> tuple[list[str], list[str]]:
    """What a kernel that registers torch ops (`#include <torch/library.h>`) adds to its compile and link
    steps: torch's headers and ABI, and its libraries, which the process has loaded already."""
    import torch

    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ["-std=c++20", f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     f"-DSPECSERVE_TORCH={torch.__version__}"]  # the version: a new torch, a new build
    return compile_flags, [f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}"]
