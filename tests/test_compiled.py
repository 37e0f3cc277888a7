"""Compiled steps (app/model/compiled.py): the eager forward's tokens, no compile once warm, eager where a
compiled step cannot be trusted or built."""

import logging
import threading

import pytest
import torch
from torch._dynamo.utils import counters

from app.model import compiled
from app.engine import Engine
from app.model.runner import Execution, ModelRunner, SeqInput
from app.model.sessions import MODEL_CODE
from conftest import blend, make_model
from test_engine import PROMPTS, greedy, reference

MAX = 8  # buckets 1, 2, 4, 8: verify rows and steps compiled, the prompts (longer) eager


@pytest.fixture(scope="module")
def pair(target_model):
    return target_model, blend(target_model, 7, 0.85)


def warm_runners(pair, tokenizer, mode: str) -> list[ModelRunner]:
    runners = [ModelRunner(m, tokenizer, Execution(compile=mode, compile_max_tokens=MAX)) for m in pair]
    for r in runners:
        r.warm()
    return runners


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_compiled_and_eager_steps_give_the_same_tokens(k, pair, tokenizer):
    target, draft = warm_runners(pair, tokenizer, "default")
    assert target.steps is not None and draft.steps is not None, "the compiled path failed its check"
    assert target.steps.buckets == [1, 2, 4, 8]
    graphs = counters["stats"]["unique_graphs"]
    out = Engine(target, draft).generate(PROMPTS, greedy(num_tokens=k))
    eager = Engine(*warm_runners(pair, tokenizer, "off")).generate(PROMPTS, greedy(num_tokens=k))
    for c, e in zip(out, eager):
        assert c.token_ids == e.token_ids == reference(pair[0], c.prompt_token_ids, 24)
    assert counters["stats"]["unique_graphs"] == graphs, "a request waited for a compile"
    assert max(target.steps.bucket(n) or 0 for n in range(1, 9)) == 8 and target.steps.bucket(9) is None


def test_padded_rows_leave_the_cache_as_eager_forwards_do(pair, tokenizer):
    """Three sequences' rows (6 tokens: bucket 8, 2 rows of padding): the logits and every cached
    position match an eager forward's."""
    runners = {mode: warm_runners(pair, tokenizer, mode)[0] for mode in ("default", "off")}
    seqs = [SeqInput(f"s{i}", [5 + i, 9, 30 + i][: 1 + i % 3], 1) for i in range(3)]
    logits = {mode: r.forward(seqs) for mode, r in runners.items()}
    for c, e in zip(logits["default"], logits["off"]):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    for s in seqs:
        for mode, r in runners.items():
            assert r.cache.get(s.seq_id).token_ids == s.token_ids, mode
        for layer in range(pair[0].config.num_hidden_layers):
            c, e = (r.cache.read(r.cache.get(s.seq_id), layer) for r in runners.values())
            for a, b in zip(c, e):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_head_that_is_more_than_a_linear_stays_eager(tokenizer, caplog):
    """A causal LM whose forward scales its logits (as some architectures do) disagrees with decoder +
    head: the warm-up's check catches it and the runner keeps its eager forward."""
    model = make_model(seed=3, layers=1)
    plain = model.forward

    def scaled(*args, **kwargs):
        out = plain(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = scaled
    runner = ModelRunner(model, tokenizer, Execution(compile="default", compile_max_tokens=1))
    with caplog.at_level(logging.WARNING):
        runner.warm()
    assert runner.steps is None
    assert "disagree" in caplog.text


def test_no_compiler_means_eager_with_a_warning(tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(make_model(seed=3, layers=1), tokenizer, Execution(compile="default"))
    assert runner.steps is None
    assert "no C++ compiler" in caplog.text
    assert runner.forward([SeqInput("a", [5, 6, 7], 1)])[0].shape == (1, runner.vocab_size)


def test_the_gpu_shape_compiled_steps_over_flex_attention_gives_the_same_tokens(pair, tokenizer):
    """What a GPU runs: compiled steps, attention one FlexAttention call per layer over the whole pool
    (here FlexAttention's reference code on the CPU, over small pools)."""
    flex = Execution(attention="flex", compile="default", compile_max_tokens=MAX)
    runners = [ModelRunner(m, tokenizer, flex, max_cache_bytes=4 << 20) for m in pair]
    for r in runners:
        r.warm()
    assert all(r.steps is not None and r.flex for r in runners)
    out = Engine(*runners).generate(PROMPTS, greedy(num_tokens=4))
    for r in out:
        assert r.token_ids == reference(pair[0], r.prompt_token_ids, 24)


def test_the_gpu_compile_is_one_graph_past_a_single_token_and_never_recompiles(pair, tokenizer):
    """On a GPU the token count is symbolic (one graph for buckets 2..MAX, dynamo specialising 1):
    the eager tokens, at most two graphs per model, and no recompile on mixed batches once warm."""
    # models of its own: a CPU runner's steps (per layer) left the shared pair's layers dispatching
    models = [make_model(seed=1), blend(make_model(seed=1), 7, 0.85)]
    runners = [ModelRunner(m, tokenizer, Execution(compile="default", compile_max_tokens=MAX, compile_per_layer=False))
               for m in models]
    torch._dynamo.reset()  # no graph of an earlier test's runner over these shapes to reuse
    before = counters["stats"]["unique_graphs"]
    for r in runners:
        r.steps = compiled.CompiledSteps(r.model, "default", MAX, dynamic=True)
        r.warm()
    assert all(r.steps is not None for r in runners), "the compiled path failed its check"
    # two: the draft, the target's shape, reuses the target's graphs; static buckets would take four
    assert 0 < counters["stats"]["unique_graphs"] - before <= 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = Engine(*runners).generate(PROMPTS, greedy(num_tokens="auto"))
    for r in out:
        assert r.token_ids == reference(pair[0], r.prompt_token_ids, 24)


def test_compiled_logits_may_break_a_near_tie_of_their_dtype_but_no_more():
    """bf16 tolerance 0.1 of the largest logit (here 10: 1.0). A flip between two logits within it
    agrees; the same small differences flipping to a logit further below the best do not; a head
    that doubles its logits does not."""
    eager = torch.tensor([[10.0, 9.9, 0.0], [1.0, 2.0, 3.0]])
    near_tie = torch.tensor([[9.6, 10.0, 0.0], [1.0, 2.0, 3.0]])
    assert compiled.agrees(eager, near_tie, torch.bfloat16) == (True, pytest.approx(0.4))
    assert not compiled.agrees(eager, near_tie, torch.float32)[0]  # float32: 1e-3 of 10
    eager_gap = torch.tensor([[10.0, 8.9, 0.0], [1.0, 2.0, 3.0]])
    flipped = torch.tensor([[9.1, 9.8, 0.0], [1.0, 2.0, 3.0]])  # every difference 0.9, within 1.0
    assert not compiled.agrees(eager_gap, flipped, torch.bfloat16)[0]
    assert not compiled.agrees(eager, eager * 2, torch.bfloat16)[0]
    assert compiled.agrees(eager, eager.clone(), torch.float32) == (True, 0.0)


def test_a_runner_serves_eagerly_while_its_steps_compile_in_the_background(pair, tokenizer):
    """warm(background=True) returns before a step is built; forwards meanwhile are the eager ones,
    while the build waits and while it runs beside them; once built and checked, the steps are taken
    between two forwards and give the eager tokens."""
    eager = warm_runners(pair, tokenizer, "off")[0]
    runner = ModelRunner(pair[0], tokenizer, Execution(compile="default", compile_max_tokens=MAX))
    hold = threading.Event()
    runner.on_thread(runner.warm, lambda message: hold.wait(), True)
    assert runner.steps is None and runner.compile_status.startswith("compiling")

    def same_as_eager(i: int) -> None:
        seq = SeqInput(f"s{i}", [5 + i % 50, 9, 30], 2)
        torch.testing.assert_close(runner.forward([seq])[0], eager.forward([seq])[0], rtol=1e-4, atol=1e-4)

    for i in range(3):  # the build held before its first bucket: eager forwards
        same_as_eager(i)
        assert runner.steps is None
    hold.set()
    for i in range(3, 400):  # bounded: forwards beside the build until it ends
        if not runner.compile_thread.is_alive():
            break
        same_as_eager(i)
    runner.compile_thread.join(timeout=600)
    assert runner.compile_status == "compiled" and runner.steps is not None
    out = Engine(runner, None).generate(PROMPTS, greedy())
    for c in out:
        assert c.token_ids == reference(pair[0], c.prompt_token_ids, 24)


def test_a_background_build_that_fails_leaves_the_runner_eager(pair, tokenizer, caplog):
    runner = ModelRunner(pair[1], tokenizer, Execution(compile="default", compile_max_tokens=MAX))

    def fail(message):
        raise RuntimeError("no room to compile")

    with caplog.at_level(logging.WARNING):
        runner.on_thread(runner.warm, fail, True)
        runner.compile_thread.join(timeout=600)
    assert runner.steps is None and runner.compile_status.startswith("eager: the build failed twice")
    assert "no room to compile" in caplog.text
    assert runner.forward([SeqInput("a", [5, 6, 7], 1)])[0].shape == (1, runner.vocab_size)


def test_a_cpu_compiles_one_graph_per_bucket_whatever_the_depth(tokenizer):
    """On a CPU the graph is a run of consecutive decoder layers, run by every such run: a 4-layer model
    at two layers a graph compiles one graph per bucket (not per layer or run), gives the eager tokens,
    and compiles nothing more once warm. (Two layers of the `pair`'s shapes: the graphs the tests above
    compiled, which inductor's cache then holds.)"""
    model = make_model(seed=1, layers=4)
    runner = ModelRunner(model, tokenizer, Execution(compile="default", compile_max_tokens=MAX, compile_layers=2))
    before = counters["stats"]["unique_graphs"]
    runner.warm()
    assert runner.steps is not None and runner.steps.per_layer
    assert counters["stats"]["unique_graphs"] - before == len(runner.steps.buckets) == 4
    layers = list(model.model.layers)
    assert runner.steps.runs == {layers[0]: tuple(layers[:2]), layers[1]: (), layers[2]: tuple(layers[2:]),
                                 layers[3]: ()}
    eager = ModelRunner(model, tokenizer, Execution(compile="off"))
    params = greedy()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = Engine(runner, None).generate(PROMPTS, params)
    for c, e in zip(out, Engine(eager, None).generate(PROMPTS, params)):
        assert c.token_ids == e.token_ids


def test_a_llama_decoder_calls_its_runs_of_layers_itself_for_the_same_bits(tokenizer, monkeypatch):
    """Per layer, a decoder whose forward is Llama's has its runs of layers called by the steps themselves
    (CompiledSteps._by_runs): a compiled step never enters the decoder's forward, compiles nothing new, and
    its logits are those of the same graphs called through the decoder's forward, to the bit."""
    model = make_model(seed=1, layers=4)
    runner = ModelRunner(model, tokenizer, Execution(compile="default", compile_max_tokens=MAX, compile_layers=2))
    runner.warm()
    steps = runner.steps
    assert steps.per_layer and steps.direct and steps.run_list == [tuple(model.model.layers[:2]),
                                                                    tuple(model.model.layers[2:])]
    entered = []
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda *a, **kw: entered.append(1) or forward(*a, **kw))
    prompt = list(range(3, 20))
    runner.forward([SeqInput("x", prompt, 1)])  # longer than every bucket: eager, through the decoder
    entered.clear()
    logits = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for direct in (True, False):
            steps.direct = direct
            logits[direct] = runner.forward([SeqInput(f"{direct}", prompt + [21, 22, 23], 3)])[0]
            assert bool(entered) is not direct
            entered.clear()
    assert torch.equal(logits[True], logits[False])
    assert not compiled._llama_shaped(model.model, 3)  # a decoder that runs fewer layers than it holds


def test_a_cpu_steps_wrapper_code_is_cpp(pair, tokenizer, monkeypatch):
    """On a CPU inductor writes each graph's wrapper (the code that calls its kernels and ops in turn) as
    C++, not Python (app/model/compiled.py, _on_cpu): every graph a runner's warm-up compiles (or loads
    from inductor's cache) is C++, and its tokens are the eager ones (the tests above)."""
    from torch._inductor.graph import GraphLowering

    codes = []
    monkeypatch.setattr(GraphLowering, "save_output_code", codes.append)
    runner = ModelRunner(pair[0], tokenizer, Execution(compile="default", compile_max_tokens=MAX))
    runner.warm()
    assert runner.steps is not None and len(codes) == len(runner.steps.buckets)
    for code in codes:
        assert "inductor_entry_impl" in code and "def call(" not in code


@pytest.mark.parametrize("depth, most, length", [(30, 6, 6), (30, 4, 3), (7, 6, 1), (2, 6, 2), (4, 1, 1)])
def test_a_graph_runs_the_largest_divisor_of_the_depth_up_to_the_setting(depth, most, length):
    assert compiled._graph_length(depth, most) == length


def test_a_reduce_overhead_step_gives_its_thread_cuda_graph_trees_of_its_own(monkeypatch):
    """Inductor's CUDA graph trees keep their managers in thread-local state. Before torch 2.13 only the
    thread that imported the module had it, and the fourth GPU run (an H200, torch 2.11) failed there:
    the draft's forward thread met `assert torch._C._is_key_in_tls(...)` once the target's forward
    thread had imported the module. A reduce-overhead step gives its thread the state first, and runs
    one at a time in the process, holding MODEL_CODE alone (capture is process-wide state; a lock of its
    own, taken under a forward's share, hung two runners: app/model/sessions.py). The graph is stubbed: a
    CPU records no CUDA graph."""
    from torch._inductor import cudagraph_trees as trees

    steps = compiled.CompiledSteps.__new__(compiled.CompiledSteps)
    steps.mode, steps.per_layer = "reduce-overhead", False
    seen = {}

    def graph(ids, positions):
        seen["state"] = trees.local.__dict__.get("tree_manager_containers")
        seen["in_tls"] = torch._C._is_key_in_tls("tree_manager_containers")
        seen["serialised"] = MODEL_CODE._writer == threading.get_ident()
        return ids

    steps.graph = graph
    worker = threading.Thread(target=steps.run, args=(torch.zeros(1, 1), torch.zeros(1, 1)))
    worker.start()
    worker.join(timeout=60)
    assert seen == {"state": {}, "in_tls": True, "serialised": True}
    assert MODEL_CODE._writer is None


def test_two_forwards_whose_reduce_overhead_steps_compile_take_turns():
    """Two runners' forward threads, each holding its share of MODEL_CODE, each run a reduce-overhead
    step whose first call compiles (MODEL_CODE alone; here a stub graph takes it as a compile does).
    With a lock of the steps' own taken under the share, one held that lock waiting for the other's
    share, which waited for that lock: both hung, every run."""
    both_in, done = threading.Barrier(2, timeout=60), []

    def graph(ids, positions):
        with MODEL_CODE.exclusive():  # what the step's first call does: compile
            return ids + 1

    def forward(name):
        steps = compiled.CompiledSteps.__new__(compiled.CompiledSteps)
        steps.mode, steps.per_layer, steps.graph = "reduce-overhead", False, graph
        with MODEL_CODE.shared():
            both_in.wait()
            done.append((name, steps.run(torch.zeros(1, 1), torch.zeros(1, 1)).item()))

    threads = [threading.Thread(target=forward, args=(n,), daemon=True) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "two reduce-overhead steps hung on each other"
    assert sorted(done) == [("a", 1.0), ("b", 1.0)] and MODEL_CODE._writer is None and MODEL_CODE._shared == 0


def test_a_cpu_model_one_graph_holds_compiles_whole_and_each_model_gets_its_own_logits(pair, tokenizer):
    """A decoder no deeper than `compile_layers` compiles whole on a CPU (embeddings to final norm, no
    eager work around a per-layer graph), unguarded on its modules: two models of one shape and different
    weights in one process each get the logits of their own eager forward from their graphs."""
    runners = warm_runners(pair, tokenizer, "default")
    assert all(r.steps is not None and not r.steps.per_layer for r in runners)
    prompt, rows = list(range(3, 20)), [21, 22, 23, 24]
    logits = []
    for runner, model in zip(runners, pair):
        runner.forward([SeqInput("x", prompt, 1)])  # longer than every bucket: eager
        got = runner.forward([SeqInput("x", prompt + rows, 4)])[0]  # the 4-token bucket's graph
        want = model(torch.tensor([prompt + rows])).logits[0, -4:].float()
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
        logits.append(got.float())
    assert (logits[0] - logits[1]).abs().max() > 0.1  # the two models' logits are not alike
