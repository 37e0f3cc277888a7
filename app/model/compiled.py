"""Compiled steps: a model's forward as torch.compile graphs over a few static token counts (on a CPU,
a decoder deeper than one graph holds as a graph of a few consecutive decoder layers, run by every such
run of layers: CompiledSteps, per_layer).

A ragged forward (app/model/ragged.py) of T tokens runs the graph of the smallest bucket >= T, its row
padded with token 0 at position 0: the padded rows never change a result, since attention (one
opaque op per layer) writes and reads only the layout's own tokens and the logits are taken at the
kept rows. On a CPU they cost little either: the packed linears (app/model/cpu_linear.py) compute the
real rows alone and leave the padding zero. Buckets are powers of two up to `max_tokens`, every one
compiled at warm-up, so no request ever waits for a compile; a larger forward (a long prompt's
chunk) runs eagerly, where the per-op cost the compiler removes is small against its size.

The graph is the decoder (embeddings, layers, final norm); the LM head runs after it on the kept rows
alone, so a prompt chunk never computes a vocabulary-wide row it does not need. A model whose
causal-LM forward does more than decoder then head (a logit scale, a soft cap) is caught by
`ModelRunner.check_compiled`, which compares the two paths at warm-up and keeps the eager one.

Measured in process on this project's 2-core CPU, demo pair, one thread, ms per forward, eager then
compiled (`specserve bench --threads 1 --compile off|default`): target (6 layers) step 4.28 -> 3.11,
K = 4 verify 4.91 -> 4.21; draft (1 layer) step 1.22 -> 0.94. With 16 sequences in a step, per-
sequence attention takes two thirds of it (torch profiler), and compiling does not change that.

Modes: "off" (eager), "default" (inductor's kernels), "reduce-overhead" (the same graphs replayed as
CUDA graphs on a GPU, the attention op called live between them: inductor's graph partition splits
around ops tagged cudagraph_unsafe). On a CPU the graphs need a C++ compiler; without one the runner
stays eager and says so.
"""

import collections
import logging
import shutil
import threading
import types

import torch

from app.model.cpu_linear import real_rows
from app.speculation.draft_vocab import FLOOR
from app.model.ragged import IN_ORDER, LAYOUT
from app.model import sessions
from app.model.sessions import MODEL_CODE

log = logging.getLogger(__name__)

MODES = ("off", "default", "reduce-overhead")


def buckets(max_tokens: int) -> list[int]:
    """The static token counts compiled: powers of two from 1 up to the first >= max_tokens."""
    out = [1]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


def unavailable(device: torch.device) -> str | None:
    """Why steps cannot be compiled on `device`, or None when they can."""
    if device.type == "cpu":
        import torch._inductor.config as inductor

        if not any(shutil.which(c) for c in (inductor.cpp.cxx[0] or "g++", "g++", "c++", "clang++")):
            return "no C++ compiler (g++) on this machine: install one to compile CPU steps"
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
    else:
        return f"steps compile for cpu and cuda only, not {device.type}"
    return None


def agrees(eager: torch.Tensor, compiled: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """Whether compiled logits are the eager ones to the rounding of `dtype` ([rows, V] each), and the
    largest difference. Within a tolerance relative to the largest logit, and where the two argmaxes
    differ, the compiled one must be a near-tie in the eager logits (within that tolerance of the
    best): bf16 graphs fuse and round differently, and on the first GPU run a random 8-layer model's
    top two logits fell within 0.28 of each other at one of eight positions. In bf16 each path is off
    the float32 logits by its own rounding, so the two may differ by twice that: on the reference
    target (30 layers, largest logit 31.4) eager and compiled were 1.05 and 0.84 off float32 and
    1.62 (5.2 %) from each other. A miscompile (a wrong op, a head that scales) is off by far more."""
    tol = 1e-3 if dtype == torch.float32 else 0.1
    eager, compiled = eager.float(), compiled.float()
    computed = eager > FLOOR  # a draft's restricted head leaves the other tokens at FLOOR (app/speculation/draft_vocab.py)
    bound = tol * eager[computed].abs().max().clamp_min(1.0)
    diff = (eager - compiled).abs().max()
    picked = eager.gather(-1, compiled.argmax(-1, keepdim=True)).squeeze(-1)
    return bool(diff <= bound and (picked >= eager.max(-1).values - bound).all()), diff.item()


_regional = threading.local()  # the CompiledSteps whose step this thread runs (per_layer), if any

# One reduce-overhead step at a time in the process, and no other forward beside it: CUDA graph capture
# and its memory pool's warm-up are process-wide state, and a capture in one thread breaks on another's
# work (torch 2.13 serialises them itself; 2.11, the lent GPUs' build, does not). MODEL_CODE taken alone,
# not a lock of its own: a forward holds its share of MODEL_CODE when it gets here, and a step's first
# call compiles (MODEL_CODE alone, app/model/sessions.py), so a second lock taken under the share hung
# two runners for good (one waiting for the lock, the other, holding it, for the first one's share).
# Two runners of one process (the engine in process, the gpu check) then take turns; served replicas
# are processes of their own.


def _own_graph_trees() -> None:
    """Give the calling thread inductor's CUDA graph tree state where it has none. Before torch 2.13 only
    the thread that imported inductor's cudagraph_trees (and autograd's threads) had it, and a step run on
    any other thread failed an assertion in `get_obj`: on the fourth GPU run the draft's forward thread,
    once the target's had imported the module. Each runner's one forward thread gets its own trees, as
    torch 2.13 does itself for every thread (there this finds the state made and returns)."""
    from torch._inductor import cudagraph_trees as trees

    local = getattr(trees, "local", None)
    if local is None or hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


# per_layer's default graph length. The compiler's dispatch costs ~0.25 ms a call (dynamo's guards, its
# wrappers and the graph's Python code: torch profiler, reference target, 1 row, one thread, a 2-core EPYC
# without AVX-512), 7.5 ms of a 71 ms step at one layer a graph; 6 layers a graph: 54 ms (10: 55 ms).
# Once the kernels were faster (a Zen 4 with AVX-512) the calls showed more: 15 layers a graph (two calls
# for that 30-layer target) against 6, a step 30.7 -> 28.8 ms in float32 and 22.5 -> 20.3 in bfloat16,
# 30 no better (`OMP_NUM_THREADS=1 python -m specserve.bench.kv --model DIR --sequences 1 --keys 200
# --compile-layers 6,15,30 --dtype float32|bfloat16`, the three interleaved in one process). The first compile
# grows with the graph (that target's 8 buckets: 73 s at 15 layers on the Zen 4, 85 s at 6 on the older
# EPYC, ~15 s from inductor's cache); a served CPU replica builds them in the background.
LAYERS_PER_GRAPH = 15


def _on_cpu(model) -> bool:
    """Whether the model's weights are on a CPU (the graphs then take inductor's C++ wrapper).

    Why: a compiled graph's wrapper calls its kernels and ops one by one, in Python by default, a few
    microseconds each; a 15-layer graph of the reference target makes a few hundred such calls. As C++
    (inductor's `cpp_wrapper`) they cost a step 28.7 -> 27.6 ms in float32 and 17.8 -> 16.6 in bfloat16,
    its draft's 2.59 -> 2.50 (one thread, 200 cached positions, the two runners' forwards interleaved in
    one process, the same logits to the bit; 2-core Zen 4 EPYC). The price is a longer first compile (a C++
    file per graph: the reference target's float32 buckets in 149 s against 123 from a cold cache; inductor
    caches them). GPUs keep the Python wrapper: not measured there, and reduce-overhead replays CUDA graphs,
    which make no per-kernel calls from the host."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


def _layers_forward(layers, hidden_states, *args, **kwargs):
    """Consecutive decoder layers' own forwards, each taking the last one's hidden states: the function
    compiled once for every run of that many layers of a model."""
    for layer in layers:
        hidden_states = type(layer).forward(layer, hidden_states, *args, **kwargs)
    return hidden_states


def _graph_length(layers: int, most: int) -> int:
    """The layers each graph runs: the largest divisor of the model's depth up to `most`, so that every
    run of layers is one length and one graph a bucket runs them all."""
    return max(k for k in range(1, min(layers, most) + 1) if layers % k == 0)


def _llama_shaped(decoder, depth: int) -> bool:
    """Whether the decoder's forward is transformers' Llama one (embeddings, rotary embeddings, every layer
    with one causal mask, final norm), inherited unchanged, over all its `depth` layers. Others (a scaled
    embedding, masks per layer type) keep their own forward around the graphs."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return type(decoder).forward is LlamaModel.forward and decoder.config.num_hidden_layers == depth


def _decoder_layers(decoder) -> list | None:
    """The decoder's repeated layers, where they are one ModuleList of one class whose parameters and
    buffers have one set of names, shapes and dtypes (the one graph runs them all, unguarded)."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return None
    shapes = {(type(m), tuple((n, t.shape, t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]))
              for m in layers}
    return list(layers) if len(shapes) == 1 else None


class CompiledSteps:
    """The compiled decoder of one model, over static token-count buckets.

    `per_layer`: the graph is a run of `layers_per_graph` consecutive decoder layers (the largest divisor
    of the depth up to it), compiled once and run by every such run (their weights are the graph's
    inputs), the rest of the decoder eager. The compiler then builds a few layers' code per bucket
    instead of the whole model's: the reference target's 30 layers compiled for more than 10 minutes on
    a 2-core CPU without AVX-512. A model whose layers are not one list of one class compiles whole."""

    def __init__(self, model, mode: str, max_tokens: int = 128, dynamic: bool = False, per_layer: bool = False,
                 layers_per_graph: int = LAYERS_PER_GRAPH):
        if mode not in MODES or mode == "off":
            raise ValueError(f"compile mode must be one of {MODES[1:]}, got {mode!r}")
        sessions.install(dynamo=True)  # dynamo's compile lock behind MODEL_CODE (app/model/sessions.py)
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.buckets = buckets(max_tokens)
        self.mode, self.dynamic = mode, dynamic
        layers = _decoder_layers(self.decoder) if per_layer and mode == "default" else None
        self.per_layer = layers is not None
        import torch._dynamo.config as dynamo

        # one graph per bucket and model (target and draft share the decoder's code in one process)
        # every runner of the process adds its own graphs to the one `_decode` code object: each one
        # raises the limit by its buckets (a test run builds dozens of runners in one process)
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(self.buckets) + 8) + len(self.buckets)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, dynamo.recompile_limit)
        import torch._inductor.config as inductor

        # a fused chain of bfloat16 / float16 ops rounds where eager rounds (each op's output), not once at its
        # end: a compiled step then gives eager's bits in every bucket, so a sequence's output does not depend
        # on which graph, or whether a graph, ran its step (docs/architecture.md, "Batch invariance")
        inductor.emulate_precision_casts = True
        if mode == "reduce-overhead":
            inductor.graph_partition = True  # CUDA graphs around the attention op, which runs live
        # dynamic: one graph for every bucket past 1 (dynamo specialises a size of 1), the token count
        # symbolic; static: one graph per bucket. On the first GPU runs an 8-layer model took tens of
        # seconds per static graph, 14 of them for a pair: the production check ran out of time compiling
        # CPU: the graphs' wrapper code (what calls each kernel and op in turn) as C++, not Python
        wrapper = {"cpp_wrapper": True} if _on_cpu(model) and mode == "default" else {}
        if self.per_layer:
            # no guards on the layers' modules: every layer's weights are of one shape and dtype
            # (_decoder_layers), and guarding each of their parameters took longer than a small step
            # (dynamo keeps compiled code per code object: each runner's layer function gets one of its
            # own, so that no other model's graphs, unguarded on their weights, are ever tried on it)
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, **wrapper}
            own = types.FunctionType(_layers_forward.__code__.replace(), _layers_forward.__globals__, "_layers_forward")
            self.layers = torch.compile(own, dynamic=dynamic, fullgraph=True, options=options)
            # each run's first layer runs the graph over the run, the others pass their input through
            k = _graph_length(len(layers), layers_per_graph)
            self.runs = {m: tuple(layers[i : i + k]) if i % k == 0 else () for i, m in enumerate(layers)}
            for m in layers:
                m.forward = types.MethodType(_dispatching_forward, m)
            # a decoder whose forward is Llama's calls its runs itself (_by_runs): the same calls, less the rest
            self.direct = _llama_shaped(self.decoder, len(layers))
            self.run_list = [run for run in self.runs.values() if run]
            self.graph = self._decode
        elif wrapper and not dynamic:
            # a CPU's whole decoder (its depth fits one graph): a code object of this runner's own, as per_layer's,
            # so its graphs are only ever tried on its own model and need no guards on its modules (guarded, the
            # reference draft's step took 1.76 ms, unguarded ~1.5, against ~1.9 per layer: the lookup checked
            # every parameter)
            own = types.FunctionType(CompiledSteps._decode.__code__.replace(), CompiledSteps._decode.__globals__,
                                     "_decode")
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, **wrapper}
            self.graph = torch.compile(types.MethodType(own, self), dynamic=dynamic, fullgraph=True, options=options)
        elif wrapper:  # torch.compile takes a mode or options, not both: "default" is no options
            self.graph = torch.compile(self._decode, dynamic=dynamic, fullgraph=True, options=wrapper)
        else:
            self.graph = torch.compile(self._decode, mode=mode, dynamic=dynamic, fullgraph=True)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states of a packed row whose length is a bucket, [1, T, H]."""
        if self.mode == "reduce-overhead":
            _own_graph_trees()
            with MODEL_CODE.exclusive():
                return self.graph(input_ids, position_ids)
        if not self.per_layer:
            return self.graph(input_ids, position_ids)
        if self.direct:
            return self._by_runs(input_ids, position_ids)
        _regional.steps = self
        try:
            return self.graph(input_ids, position_ids)
        finally:
            _regional.steps = None

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        empty = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=input_ids.device)  # no dense mask: attention is ragged
        # per layer: attention takes the layers in order (a layer's index would be the one graph's constant)
        return self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=empty, use_cache=False,
                            **{LAYOUT: IN_ORDER if self.per_layer else True}).last_hidden_state

    def _by_runs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """A Llama-shaped decoder's forward (_llama_shaped) as its own code runs it, with each run of layers
        called here, once: the graphs get the arguments the decoder would pass its layers (its causal mask of
        our empty mask is that mask, its cache None), so they are the same graphs and give the same bits.

        Why: through the decoder's forward a step also paid for every layer's module call (the runs' heads
        call the graph, the rest pass their input on), the decoder's wrappers, its mask and its output; the
        reference target's bfloat16 step spent ~0.5 ms of ~16 there (py-spy, one thread)."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
        empty = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=input_ids.device)
        for run in self.run_list:
            hidden = self.layers(run, hidden, attention_mask=empty, position_embeddings=position_embeddings,
                                 position_ids=position_ids, cache=None, use_cache=False, **{LAYOUT: IN_ORDER})
        return decoder.norm(hidden)

    def bucket(self, tokens: int) -> int | None:
        """The bucket a forward of `tokens` runs in; None when it is larger than every bucket (eager)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits at the flat rows `keep` of the packed row ([1, T] ids and positions), [len(keep), V],
        under the active Layout. Pads the row to its bucket on the device (no host read)."""
        if not input_ids.is_inference():  # a draft's tokens sampled outside inference mode: the graphs
            input_ids = input_ids.clone()  # were compiled for inference tensors (a guard on dispatch keys)
        pad = self.bucket(input_ids.shape[1]) - input_ids.shape[1]
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            position_ids = torch.nn.functional.pad(position_ids, (0, pad))
        with real_rows(input_ids.shape[1] - pad):  # the linears skip the padding (app/model/cpu_linear.py)
            hidden = self.run(input_ids, position_ids)
        return self.head(hidden[0].index_select(0, keep))


def _dispatching_forward(self, hidden_states, *args, **kwargs):
    """A decoder layer's forward under per-layer steps: within a step this thread runs (CompiledSteps.run),
    the first layer of each run of layers runs the compiled graph over the run and the others return
    their input (the graph ran them); the layer's own forward elsewhere (an eager forward, a prompt chunk
    larger than every bucket, a copy of the model). Bound to the layer as a method, so a copy of the
    model (copy.deepcopy) binds its own. The decoder calls its layers in order, each on the last one's
    hidden states: what every causal LM of transformers does."""
    steps = getattr(_regional, "steps", None)
    run = None if steps is None else steps.runs.get(self)
    if run is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return steps.layers(run, hidden_states, *args, **kwargs) if run else hidden_states
