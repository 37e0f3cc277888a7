"""Compile sessions kept apart from model code: no forward runs while torch compiles a step.

Why: torch 2.13 holds one process-wide flag for the whole of a compile session (dynamo's `compile_inner`
enters `torch.compiler._compile_session_context`), so `torch.compiler.is_compiling()` is True in every
thread for as long as a bucket's trace, lowering and C++ build take, seconds to minutes. Model code that
branches on it then takes its traced path inside another thread's eager forward. transformers 5.25's
hub-kernel wrappers do (kernels 0.19's `CompileableContextVar`): while "compiling" they keep a layer's
active functions in one process-wide slot instead of a context variable, so a forward beside a build
overwrote what the build read ("Guarded class id must be identical" from dynamo's guards) and the build
overwrote the forward's (a `'_contextvars.Token' object is not iterable` TypeError). Any library may
branch on the flag, so the cure is not a patch of one of them: model code and compile sessions take
turns. `install` (at import) wraps the function that raises the flag for a session, so that it first
takes MODEL_CODE alone. That covers our builds (`ModelRunner._build`,
one bucket a session), a recompile, and the sessions that eager FlexAttention starts inside a forward.

`MODEL_CODE.shared()` around every forward (any number at once: each runner has its forward thread);
each compile session holds it exclusively.

One order for the two locks of a compile: dynamo converts a frame under its own process-wide lock
(`torch._dynamo.convert_frame.compile_lock`) and opens the session inside it. A forward that met an
uncompiled frame (eager FlexAttention compiles its kernel on first use; a reduce-overhead step's first
call) waited for that lock while holding its share, and the thread holding that lock waited for the
share: two runners' forward threads hung for good (the suite's compiled-steps tests, 1 run in 2 on a
2-core machine). So `install` also puts MODEL_CODE, taken alone, in front of dynamo's lock: whoever
holds dynamo's lock holds MODEL_CODE alone, and a thread waiting for either has given up its share.

A waiting session goes before later forwards, so a build in the background pauses forwards for one
bucket at a time, between two of them. A thread that holds the
lock shared and starts a session (a forward that compiles) gives up its share meanwhile: two such
threads take turns and never deadlock.
"""

import contextlib
import functools
import sys
import threading

import torch


class SharedExclusiveLock:
    """A readers-writer lock that prefers writers, re-entrant in both modes for the thread that holds it.
    `on_wait(mode)`: called by a thread about to wait for the lock (tests see who waits, with no timing)."""

    def __init__(self, on_wait=None):
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # holds, over every thread
        self._writer: int | None = None  # the thread holding it exclusively
        self._writer_depth = 0
        self._writers_waiting = 0
        self._mine = threading.local()  # this thread's shared holds
        self.on_wait = on_wait

    def _held(self) -> int:
        return getattr(self._mine, "n", 0)

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        with self._cond:
            if self._writer != me and not self._held():
                if self._writer is not None or self._writers_waiting:
                    self._waiting("shared")
                while self._writer is not None or self._writers_waiting:
                    self._cond.wait()
            self._shared += 1
            self._mine.n = self._held() + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._mine.n -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._writer_depth += 1
                given_up = None
            else:
                given_up = self._held()  # this thread's own shares, given up while it holds the lock alone
                self._shared -= given_up
                self._mine.n = 0
                self._writers_waiting += 1
                if self._writer is not None or self._shared:
                    self._waiting("exclusive")
                while self._writer is not None or self._shared:
                    self._cond.wait()
                self._writers_waiting -= 1
                self._writer, self._writer_depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._writer_depth -= 1
                if not self._writer_depth:
                    self._writer = None
                    if given_up:  # taken back at once: no writer holds it now, and waiting ones wait for shares
                        self._shared += given_up
                        self._mine.n = given_up
                self._cond.notify_all()

    def _waiting(self, mode: str) -> None:
        if self.on_wait is not None:
            self.on_wait(mode)


# the one lock of the process: every runner's forwards and every compile session
MODEL_CODE = SharedExclusiveLock()


class _ExclusiveFirst:
    """dynamo's compile lock with MODEL_CODE taken alone in front of it (the same `with` protocol,
    re-entrant like the RLock it wraps): no thread ever waits for dynamo's lock while it holds a share."""

    def __init__(self, inner):
        self.inner = inner
        self._holds = threading.local()  # this thread's open MODEL_CODE.exclusive() contexts

    def __enter__(self):
        hold = MODEL_CODE.exclusive()
        hold.__enter__()
        self.inner.acquire()
        self._holds.stack = [*getattr(self._holds, "stack", []), hold]
        return self

    def __exit__(self, *exc):
        hold = self._holds.stack.pop()
        self.inner.release()
        hold.__exit__(None, None, None)
        return False


def install(dynamo: bool = False) -> bool:
    """Make every compile session of the process take MODEL_CODE alone first
    (torch.compiler._compile_session_context, which dynamo enters once per session), and with `dynamo`
    (or once dynamo is imported) its compile lock too (torch._dynamo.convert_frame.compile_lock, a module
    global looked up at each use). At import the lock is left until code that compiles asks
    (CompiledSteps, eager FlexAttention): importing dynamo costs seconds in processes that never load a
    model. Idempotent; False where this torch has no such function (then it has no process-wide flag to
    keep apart either)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is None:
        return False
    if dynamo or "torch._dynamo.convert_frame" in sys.modules:
        from torch._dynamo import convert_frame

        if not isinstance(convert_frame.compile_lock, _ExclusiveFirst):
            convert_frame.compile_lock = _ExclusiveFirst(convert_frame.compile_lock)
    if getattr(session, "_specserve_exclusive", False):
        return True

    @contextlib.contextmanager
    @functools.wraps(session)
    def exclusive_session(*args, **kwargs):
        with MODEL_CODE.exclusive(), session(*args, **kwargs):
            yield

    exclusive_session._specserve_exclusive = True
    torch.compiler._compile_session_context = exclusive_session
    return True


install()
