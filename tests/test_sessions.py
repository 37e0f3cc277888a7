"""Compile sessions apart from model code (app/model/sessions.py): the lock's laws, and no forward of any
runner ever running while a compile session holds torch's process-wide "compiling" flag, made to
happen on purpose (a backend that waits inside the session until a forward was tried beside it)."""

import threading
import types

import torch

from app.model import sessions
from app.model.compiled import CompiledSteps
from app.model.runner import Execution, ModelRunner, SeqInput
from app.model.sessions import MODEL_CODE, SharedExclusiveLock
from app.telemetry import STEP_STATES, steps_state
from conftest import make_model

BOUND_S = 120  # a safety net for a broken lock (a hang), never a verdict


def started(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_shares_are_held_at_once_and_an_exclusive_hold_waits_for_them():
    waits = []
    lock = SharedExclusiveLock(on_wait=waits.append)
    order, first_in, second_in, release = [], threading.Event(), threading.Event(), threading.Event()

    def reader(flag):
        with lock.shared():
            flag.set()
            release.wait(BOUND_S)
            order.append("read")

    readers = [started(lambda: reader(first_in)), started(lambda: reader(second_in))]
    assert first_in.wait(BOUND_S) and second_in.wait(BOUND_S)  # both inside together

    def writer():
        with lock.exclusive():
            order.append("write")

    w = started(writer)
    while "exclusive" not in waits:  # the writer said it waits (before any reader left)
        threading.Event().wait(0.001)
    release.set()
    for t in (*readers, w):
        t.join(BOUND_S)
    assert order == ["read", "read", "write"]


def test_a_waiting_exclusive_hold_goes_before_later_shares():
    waits = []
    lock = SharedExclusiveLock(on_wait=waits.append)
    order, inside, release = [], threading.Event(), threading.Event()

    def first_reader():
        with lock.shared():
            inside.set()
            release.wait(BOUND_S)

    def writer():
        with lock.exclusive():
            order.append("write")

    def late_reader():
        with lock.shared():
            order.append("late read")

    r = started(first_reader)
    inside.wait(BOUND_S)
    w = started(writer)
    while waits.count("exclusive") < 1:
        threading.Event().wait(0.001)
    late = started(late_reader)
    while waits.count("shared") < 1:  # the late reader waits behind the writer
        threading.Event().wait(0.001)
    release.set()
    for t in (r, w, late):
        t.join(BOUND_S)
    assert order == ["write", "late read"]


def test_holds_are_reentrant_and_a_share_holder_may_take_it_alone():
    lock = SharedExclusiveLock()
    with lock.shared(), lock.shared():
        with lock.exclusive(), lock.exclusive(), lock.shared():
            pass
        with lock.shared():
            pass
    assert lock._shared == 0 and lock._writer is None


def test_two_share_holders_that_both_take_it_alone_take_turns():
    lock = SharedExclusiveLock()
    both_shared, order = threading.Barrier(2, timeout=BOUND_S), []

    def forward_that_compiles(name):
        with lock.shared():
            both_shared.wait()
            with lock.exclusive():
                order.append(name)

    threads = [started(lambda n=n: forward_that_compiles(n)) for n in "ab"]
    for t in threads:
        t.join(BOUND_S)
    assert sorted(order) == ["a", "b"] and lock._shared == 0 and lock._writer is None


def test_every_compile_session_of_the_process_takes_the_lock_alone():
    assert sessions.install() and sessions.install()  # idempotent
    seen = []

    def backend(gm, example_inputs):
        seen.append((MODEL_CODE._writer == threading.get_ident(), torch.compiler.is_compiling()))
        return gm.forward

    torch.compile(lambda x: x * 2 + 1, backend=backend, fullgraph=True)(torch.ones(3))
    assert seen == [(True, True)]
    assert MODEL_CODE._writer is None and not torch.compiler.is_compiling()


def test_a_forward_that_compiles_beside_another_threads_compile_never_hangs():
    """Two locks, one order, made to happen: thread B converts a frame (dynamo's compile lock) while
    forward A holds its share of MODEL_CODE, and then A meets an uncompiled frame of its own (as eager
    FlexAttention's first call does). Without MODEL_CODE in front of dynamo's lock, B held that lock and
    waited for A's share while A waited for the lock: both hung for good, every run."""
    assert sessions.install(dynamo=True)  # as CompiledSteps and eager FlexAttention ask
    forward_in, b_waits, results = threading.Event(), threading.Event(), {}

    def backend(gm, example_inputs):
        return gm.forward

    def compiler():
        results["b"] = torch.compile(lambda x: x * 3, backend=backend, fullgraph=True)(torch.ones(2))

    def forward():
        with MODEL_CODE.shared():
            forward_in.set()
            assert b_waits.wait(BOUND_S)  # B is inside its compile and waits for this share to go
            results["a"] = torch.compile(lambda x: x - 1, backend=backend, fullgraph=True)(torch.ones(2))

    MODEL_CODE.on_wait = lambda mode: b_waits.set() if mode == "exclusive" else None
    try:
        a = started(forward)
        assert forward_in.wait(BOUND_S)
        b = started(compiler)
        for t in (a, b):
            t.join(BOUND_S)
        hung = [t for t in (a, b) if t.is_alive()]
    finally:
        MODEL_CODE.on_wait = None
    assert not hung, "a forward and a compile beside it hung on each other's locks"
    assert torch.equal(results["a"], torch.zeros(2)) and torch.equal(results["b"], torch.full((2,), 3.0))
    assert MODEL_CODE._writer is None and MODEL_CODE._shared == 0


def test_no_forward_runs_inside_another_runners_compile_session(target_model, tokenizer):
    """The race of a background build, made to happen: runner A's build holds its compile session open
    (its backend waits there) until runner B's eager forward was tried beside it. Without the lock B's
    forward runs inside the session and sees torch's flag raised (transformers' hub-kernel wrappers
    then share one process-wide slot between the two threads); with it, B waits and runs after."""
    building = ModelRunner(target_model, tokenizer, Execution(compile="default", compile_max_tokens=1))
    eager = ModelRunner(make_model(seed=3), tokenizer, Execution(compile="off"))
    reference = ModelRunner(make_model(seed=3), tokenizer, Execution(compile="off"))
    inside, tried, done, waiting = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def backend(gm, example_inputs):  # runs inside A's compile session
        inside.set()
        tried.wait(BOUND_S)
        for _ in range(BOUND_S * 1000):  # until B's forward ran (no lock) or waits for the lock
            if done.is_set() or waiting.is_set():
                break
            done.wait(0.001)
        return gm.forward

    steps = building.steps
    own = types.FunctionType(CompiledSteps._decode.__code__.replace(), CompiledSteps._decode.__globals__, "_decode")
    steps.graph = torch.compile(types.MethodType(own, steps), backend=backend, fullgraph=True)
    flags = []
    layer = eager.model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda module, args: flags.append(torch.compiler.is_compiling()))
    MODEL_CODE.on_wait = lambda mode: waiting.set() if mode == "shared" else None
    try:
        building.on_thread(building.warm, None, True)
        assert inside.wait(BOUND_S), "the build never entered its compile session"
        seq = SeqInput("b", [5, 9, 30, 7], 2)
        tried.set()
        try:
            got = eager.forward([seq])[0]
        finally:
            done.set()
            building.compile_thread.join(BOUND_S)
    finally:
        MODEL_CODE.on_wait = None
        hook.remove()
    assert flags and not any(flags), "an eager forward ran inside another thread's compile session"
    assert waiting.is_set(), "B's forward never waited for A's compile session"
    assert torch.equal(got, reference.forward([seq])[0])
    assert building.compile_status == "compiled" and building.steps is not None


def test_a_background_build_is_retried_once_then_reported_failed(target_model, tokenizer):
    calls = []

    def fail_first(message):
        calls.append(message)
        if len(calls) == 1:
            raise RuntimeError("the compiler's process died")

    runner = ModelRunner(target_model, tokenizer, Execution(compile="default", compile_max_tokens=2))
    runner.on_thread(runner.warm, fail_first, True)
    runner.compile_thread.join(600)
    assert runner.compile_status == "compiled" and steps_state(runner.compile_status) == "compiled"
    assert any(m.endswith(", retry") for m in calls)

    def fail_always(message):
        raise RuntimeError("no room to compile")

    runner = ModelRunner(target_model, tokenizer, Execution(compile="default", compile_max_tokens=2))
    runner.on_thread(runner.warm, fail_always, True)
    runner.compile_thread.join(600)
    assert runner.steps is None and steps_state(runner.compile_status) == "failed"
    assert "failed twice" in runner.compile_status and "no room to compile" in runner.compile_status


def test_step_states_name_every_status():
    assert [steps_state(s) for s in ("compiling 3/8", "compiling 0/8, retry", "compiled", "eager",
                                     "eager: the build failed twice (OSError: disk full)",
                                     "eager: compiled steps disagreed with eager ones")] == \
        ["compiling", "compiling", "compiled", "eager", "failed", "failed"]
    assert set(STEP_STATES) == {"compiling", "compiled", "eager", "failed"}
