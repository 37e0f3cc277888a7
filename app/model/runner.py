"""ModelRunner: a Hugging Face causal LM with per-sequence KV caches and ragged batched forwards."""

import contextlib
import contextvars
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoTokenizer

from app.model import cpu_attention, dtypes
from app.model.compiled import LAYERS_PER_GRAPH, CompiledSteps, agrees, unavailable
from app.model.cpu_linear import own_unpacked, pack_linears
from app.model.eos import eos_ids
from app.grammar import Grammars
from app.model.kv import BLOCK_SIZE, KVStore, common_prefix
from app.model.norms import opaque_norms
from app.model.batches import Batch, RaggedBatch, SeqInput
from app.model.ragged import Layout, active, register, shape_free_sdpa, supports_ragged
from app.model.ragged import NAME as RAGGED
from app.model.varlen import varlen_available

if TYPE_CHECKING:  # the modeling stack loads with a model (load_model), not with this module
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def weights_dtype(name_or_path: str, dtype: str, device: str = "cpu", trust_remote_code: bool = False) -> torch.dtype:
    """The dtype to load a checkpoint in for a configured `dtype` on `device` (`app.model.dtypes.resolve`:
    "auto" is the checkpoint's own where the device computes it natively, else float32)."""
    checkpoint = None
    if dtype == "auto":
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                            local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
        checkpoint = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        checkpoint = getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint
    return dtypes.resolve(dtype, device, checkpoint)


def load_model(
    name_or_path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
    tp_size: int = 1,
) -> tuple["PreTrainedModel", object]:
    """Load (model, tokenizer) from a hub id or a local directory; offline when HF_HUB_OFFLINE=1.
    tp_size > 1: this process's shard of a tensor-parallel model (transformers' tp_plan, over the
    torch.distributed group the caller set up), on the device that group gave it."""
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    kwargs = dict(trust_remote_code=trust_remote_code, local_files_only=offline)
    # imported here, not with the module: transformers' modeling stack costs seconds of CPU in every process
    # that imports the engine without loading a model (the app's build)
    from transformers import AutoModelForCausalLM

    torch_dtype = weights_dtype(name_or_path, dtype, device, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype,
                                                     distributed_config=DistributedConfig(tp_size=tp_size), **kwargs)
        return model.eval(), tokenizer
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    return model.to(device).eval().requires_grad_(False), tokenizer


def load_generation_config(name_or_path: str, trust_remote_code: bool = False):
    """A checkpoint's generation config, or None where it ships none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
    except (OSError, ValueError):
        return None


ATTENTION = ("auto", "flex", "cpu_paged", "per_sequence", "varlen")  # app/model/ragged.py


def _note_thread(holder: list) -> None:
    holder[0] = threading.get_ident()


@dataclass(frozen=True)
class Execution:
    """How a runner runs its model's forwards: `attention`'s path (one of ATTENTION; auto picks by
    device, _attention_path), the `compile` mode and its largest static bucket of tokens
    (app/model/compiled.py), and on a CPU whether linears run on packed weights (`pack`), in
    `packed_dtype` (default the model's) (app/model/cpu_linear.py)."""
    attention: str = "auto"
    compile: str = "off"
    compile_max_tokens: int = 128
    pack: bool = False
    packed_dtype: torch.dtype | None = None
    compile_per_layer: bool | None = None  # None: on a CPU, where the depth is more than compile_layers (CompiledSteps)
    compile_layers: int = LAYERS_PER_GRAPH  # per_layer: consecutive layers per graph (app/config.py)


def auto_attention(dtype: torch.dtype, device_type: str, cpu_kernel: bool) -> str:
    """The attention path `auto` takes (app/model/ragged.py): the paged kernel on a CPU that builds it
    (cpu_kernel); on a GPU, torch's variable-length FlashAttention, one call per layer for the batch,
    for the dtypes it takes (float16, bfloat16), else one SDPA call per sequence. On an H200 (the third
    GPU run, docs/configuration.md) varlen took a 5-row verify of 32 sequences in 12.1 ms against 28.5,
    and 32 requests in 1.1 s against 1.8. FlexAttention stays opt-in: on the first GPU run inductor
    could not lower its kernel for the pool's shapes, and new batch shapes recompiled it past dynamo's
    limit."""
    if device_type == "cpu" and cpu_kernel:
        return "cpu_paged"
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_available():
        return "varlen"
    return "per_sequence"


class ModelRunner:
    """Runs one model over many sequences at once, reusing each sequence's cached prefix."""

    def __init__(self, model: "PreTrainedModel", tokenizer, execution: Execution = Execution(), *,
                 max_cache_bytes: int = 1 << 30, max_forward_tokens: int = 2048):
        self.model = model
        # positions one forward computes at most (what the memory model sized working buffers for): a
        # context with more uncached positions is prefilled in chunks first (prefill())
        self.max_forward_tokens = max_forward_tokens
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # embedding rows past the tokenizer's vocabulary are padding: never sampled, sliced off
        self.vocab_size = min(len(tokenizer), model.get_output_embeddings().out_features)
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = eos_ids(getattr(model, "generation_config", None), tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size)  # structured output's matchers, per sequence
        # a sequence's matcher lives as long as its KV: on a draft replica the release may never come
        self.cache = KVStore(max_cache_bytes, on_drop=self.grammars.release)
        # sequences packed end to end, attention per sequence over its own slab (app/model/ragged.py); models
        # whose attention that cannot reproduce exactly (sliding windows, soft-capping) use padded batches
        self.ragged = supports_ragged(model)
        if self.ragged:
            register()
            model.config._attn_implementation = RAGGED
        self.attention = self._attention_path(execution.attention)
        if self.device.type == "cuda" and self.ragged:
            shape_free_sdpa()
        # CPU serving: linears on packed weights, streamed by the small-row kernel (app/model/cpu_linear.py),
        # eager and compiled alike; before the steps are built, so their head is the packed one
        compiling = execution.compile != "off" and not self._why_eager()
        self.packed_linears = (pack_linears(model, compiled=compiling, dtype=execution.packed_dtype)
                               if execution.pack and self.device.type == "cpu" else 0)
        if self.packed_linears:
            own_unpacked(model)  # the checkpoint's file mapping goes: no second copy of the packed weights
        # a compiled CPU step calls the norms as eager forwards compute them (app/model/norms.py): the same bits
        # whichever ran a sequence's step (a GPU's forwards are not batch-invariant: its kernels go by shape)
        self.opaque_norms = opaque_norms(model) if compiling and self.device.type == "cpu" else 0
        # compiled steps over static token counts (app/model/compiled.py): ragged forwards of one device only
        self.steps = self._compiled(execution)
        # what a replica reports (warm(background=True) builds the steps while forwards run eagerly):
        # "compiling i/n", "compiled", "eager" (compile off or impossible here), or "eager: why" (a build
        # that failed twice, or steps that failed their check); app.telemetry.steps_state names its kind
        self.compile_status = "eager"
        self.compile_thread: threading.Thread | None = None
        # models whose forward takes a per-row mask of the positions to project (transformers'
        # slice_logits_to_keep) run the LM head only where a logit is needed, not over every position
        self.ragged_logits = hasattr(sys.modules.get(type(model).__module__), "slice_logits_to_keep")
        # CPU attention reads a sequence's KV in place only where its blocks are one run (app/model/ragged.py):
        # a table left in several runs after a forward is moved into one (measured: gathers took 14 % of
        # a served target replica's time at 16 streams, half of them borrowers of a cached prompt)
        self.compact_tables = self.device.type == "cpu"
        # one thread runs every forward of this runner, its warm-up and compiles included (on_thread):
        # CUDA graphs are recorded per thread, so steps recorded in one thread and replayed from the
        # default pool's many would each re-record every bucket, after the KV pool took the memory
        # (the thread holds only this one-item list, never the runner: a runner no longer used is freed,
        # its KV pool with it, and its executor and thread then go too)
        self._thread_ident: list[int | None] = [None]
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-forward",
                                         initializer=_note_thread, initargs=(self._thread_ident,))

    def _attention_path(self, attention: str) -> str:
        """Ragged attention's path (app/model/ragged.py): auto_attention's choice, or the one asked for."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if attention == "auto":  # flex is opt-in on a GPU: docs/configuration.md, "What a GPU has proven"
            return auto_attention(self.model.dtype, self.device.type,
                                  self.ragged and cpu_attention.usable(self.model.dtype, self.device))
        if attention == "cpu_paged" and not cpu_attention.usable(self.model.dtype, self.device):
            raise ValueError("attention='cpu_paged' needs a float32 or bfloat16 model on a CPU and a C++ compiler")
        return attention

    @property
    def _ident(self) -> int | None:
        return self._thread_ident[0]

    def on_thread(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on this runner's forward thread; at once when called from it."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        ctx = contextvars.copy_context()  # the caller's context variables (torch's dynamo settings among them)
        return self.thread.submit(ctx.run, fn, *args, **kwargs).result()

    @property
    def flex(self) -> bool:
        return self.attention == "flex"

    @property
    def attention_path(self) -> str:
        """The attention path the memory model budgets (app/model/memory.py): the ragged one, or "padded"."""
        return self.attention if self.ragged else "padded"

    def _why_eager(self) -> str | None:
        """Why this runner's steps cannot be compiled, or None when they can."""
        return ("the model's attention is not ragged (app/model/ragged.py)" if not self.ragged
                else "tensor parallel forwards run eagerly" if getattr(self.model, "tp_size", None)
                else unavailable(self.device))

    def _compiled(self, execution: Execution) -> CompiledSteps | None:
        mode, per_layer = execution.compile, execution.compile_per_layer
        if mode == "off":
            return None
        why = self._why_eager()
        if why:
            log.warning("compile=%s: eager forwards: %s", mode, why)
            return None
        # symbolic token counts on a GPU, where a compile takes longest and a bucket's own kernels gain
        # little (the matmuls are cuBLAS's either way); static on a CPU, whose kernels gain from them
        # on a CPU, whose compiler took minutes per bucket for a whole 30-layer model, runs of layers a graph
        # where the decoder is deeper than one run; where one graph holds every layer it holds the embeddings,
        # rotary and final norm too, eager around a per-layer graph (the reference draft's step: -20 %)
        if per_layer is None:
            per_layer = self.device.type == "cpu" and self.kv_shape()[0] > execution.compile_layers
        return CompiledSteps(self.model, mode, min(execution.compile_max_tokens, self.max_forward_tokens),
                             dynamic=self.device.type == "cuda", per_layer=per_layer,
                             layers_per_graph=execution.compile_layers)

    def warm(self, progress=None, background: bool = False) -> None:
        """Compile every bucket now, so no request waits for a compile, then check the compiled path
        against the eager one (`check_compiled`). Says each bucket through `progress(message)` (default:
        this module's log): the first compile on a machine takes seconds per bucket (inductor caches
        them on disk for the next start).

        `background` (a CPU only): return at once, forwards eager, and compile in a thread of its own;
        when every bucket is built, the forward thread checks them between two forwards and takes them.
        A first start on a 2-core CPU without AVX-512 compiled its pair for more than 10 minutes: a
        replica serving eagerly meanwhile answers within minutes. A GPU always compiles here, on the
        forward thread (CUDA graphs are recorded per thread)."""
        progress = progress or log.info
        if not self.steps:
            return
        self.pool()  # made here, on the forward thread, never by the compile thread
        if background and self.device.type == "cpu":
            steps, self.steps = self.steps, None
            self.compile_status = f"compiling 0/{len(steps.buckets)}"
            self.compile_thread = threading.Thread(target=self._build_then_adopt, args=(steps, progress),
                                                   daemon=True, name="specserve-compile")
            self.compile_thread.start()
            return
        self._build(self.steps, progress)
        self._adopt(self.steps)

    def _build(self, steps: CompiledSteps, progress, attempt: str = "") -> None:
        """Compile every bucket of `steps` (one call of its graph each, over an empty layout: the
        attention op writes and reads no position, so no sequence's KV is touched). Each bucket's compile
        session holds MODEL_CODE alone: no forward of any runner of the process runs beside it
        (app/model/sessions.py), so a build in the background pauses forwards one bucket at a time."""
        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        with torch.inference_mode(), active(Layout([], self.pool(), self.attention)) as layout:
            for i, n in enumerate(steps.buckets):
                progress(f"compiling {name}'s step for {n} tokens ({i + 1}/{len(steps.buckets)}){attempt}")
                self.compile_status = f"compiling {i}/{len(steps.buckets)}{attempt}"
                if layout.flex:
                    layout.block_mask(n)
                ids, positions = (torch.zeros(1, n, dtype=torch.long, device=self.device) for _ in range(2))
                steps.run(ids, positions)  # its compile holds MODEL_CODE alone (app/model/sessions.py)

    def _build_then_adopt(self, steps: CompiledSteps, progress) -> None:
        """The background build: tried twice (a second try compiles only what the first left unbuilt),
        then the steps taken on the forward thread; a build that fails twice leaves the runner eager
        and says why in its status (app.telemetry.steps_state: "failed")."""
        failure = None
        for attempt in ("", ", retry"):
            try:
                self._build(steps, progress, attempt)
                self.on_thread(self._adopt, steps)
            except Exception as e:  # a failed compile leaves the replica serving as it did: eager
                failure = f"{type(e).__name__}: {e}"[:300]
                log.warning("compiling steps in the background failed%s: %s", attempt, failure)
                self.steps = None
            else:
                progress(f"compiled steps {'in use' if self.steps else 'failed their check: eager forwards'}")
                return
        self.compile_status = f"eager: the build failed twice ({failure})"
        with contextlib.suppress(Exception):  # a progress line that fails (as the build's did) changes nothing
            progress(f"compiling steps failed twice: eager forwards ({failure})")

    def _adopt(self, steps: CompiledSteps) -> None:
        """Take built steps (on the forward thread) if they pass `check_compiled`."""
        self.steps = steps
        self.compile_status = "compiled" if self.check_compiled() else "eager: compiled steps disagreed with eager ones"

    @torch.inference_mode()
    def check_compiled(self, ids: list[int] | None = None) -> bool:
        """Whether the compiled path gives the eager forward's logits (to rounding) and argmaxes on a short
        sequence; if not (a head that is more than a linear, a graph that miscompiles), the runner stays
        eager and logs why."""
        if not self.steps:
            return False
        ids = ids or self._probe_ids(min(8, self.steps.buckets[-1]))
        probe = [SeqInput(f"specserve-check-{i}", ids, len(ids)) for i in range(2)]
        steps, self.steps = self.steps, None
        try:
            eager = self.forward(probe[:1])[0]
            self.steps = steps
            compiled = self.forward(probe[1:])[0]
        finally:
            self.steps = steps
            for s in probe:
                self.forget(s.seq_id)
        ok, diff = agrees(eager, compiled, self.model.dtype)
        if not ok:
            log.warning("compiled steps disagree with the eager forward (max |diff| %.3g): eager forwards", diff)
            self.steps = None
        return ok

    def _probe_ids(self, n: int) -> list[int]:
        """n ids of ordinary text for the check. Special and unused ids make some models' half-precision
        activations blow up: the reference target in bf16 on ids 3-10 gave logits 47 apart between
        eager and compiled forwards that agree within 0.7 on text, so bf16 CPU steps never compiled."""
        try:
            ids = self.tokenizer.encode("The quick brown fox jumps over the lazy dog, then it naps.",
                                        add_special_tokens=False)
        except Exception:  # a tokenizer that cannot encode text: the plain range
            ids = []
        ids = [i for i in ids if 0 <= i < self.vocab_size][:n]
        return ids if len(ids) == n else [i % self.vocab_size for i in range(3, 3 + n)]

    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the model's KV cache, from its config."""
        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shards = getattr(self.model, "tp_size", None) or 1  # a tensor-parallel rank holds its share of the heads
        return text.num_hidden_layers, heads // shards, head_dim

    def pool(self):
        """The KV block pool (app/model/kv.py), made at the budget's size on first use."""
        return self.cache.configure(*self.kv_shape(), self.model.dtype, self.device, zeroed=self.flex)

    def kv_block_bytes(self) -> int:
        """Bytes one block of KV_BLOCK positions takes across every layer."""
        layers, heads, head_dim = self.kv_shape()
        return 2 * layers * heads * BLOCK_SIZE * head_dim * torch.finfo(self.model.dtype).bits // 8

    def capacity_tokens(self) -> int:
        """The most positions one sequence can hold: the whole KV budget."""
        return self.cache.capacity_tokens(self.kv_block_bytes())

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """One batched forward; returns per sequence its last num_logits logits, [num_logits, V] float32."""
        batch = self.open(seqs)
        logits = batch.logits
        batch.close([len(s.token_ids) for s in seqs])
        return logits

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqInput], budget: int | None = None) -> int:
        """Compute the sequences' uncached contexts in forwards of at most `budget` positions (default
        max_forward_tokens) until what is left of them all fits one such forward, so the caller's own
        forward stays within it: a long prompt new to the draft, or a sequence whose KV was evicted.
        Returns the forwards run."""
        budget = budget or self.max_forward_tokens
        for forwards in range(1 << 16):  # bounded: each forward computes at least one position
            chunk, left, total = [], budget, 0
            for s in seqs:
                entry = self.cache.get(s.seq_id)
                limit = len(s.token_ids) - s.num_logits
                # a new sequence starts from the prefix it will borrow (a request's branch: its own context's)
                done = min(common_prefix(entry.token_ids, s.token_ids) if entry else
                           self.cache.prefix_len(s.token_ids[:limit], s.salt), limit)
                total += len(s.token_ids) - done
                end = min(limit, done + left)
                if end > done and left > 0 and all(c.seq_id != s.seq_id for c in chunk):
                    chunk.append(SeqInput(s.seq_id, s.token_ids[:end], 1, s.salt))
                    left -= end - done
            if total <= budget or not chunk:
                return forwards
            self.forward(chunk)
        return forwards

    @torch.inference_mode()
    def open(self, seqs: list[SeqInput]) -> "RaggedBatch | Batch":
        """Start a batch: prefill what each sequence lacks; extend() decodes further, close() stores KV."""
        return RaggedBatch(self, seqs) if self.ragged else Batch(self, seqs)

    def release(self, seq_id: str) -> None:
        """A finished or cancelled sequence: its cache stays only as a prefix donor for others."""
        self.cache.retire(seq_id)
        self.grammars.release(seq_id)

    def forget(self, seq_id: str) -> None:
        """Drop a sequence's KV and grammar state outright (a failed forward may have left them half
        written): its next call recomputes both from the token ids it carries. The store's on_drop
        frees the grammar matcher."""
        self.cache.drop(seq_id)
