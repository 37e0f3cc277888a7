"""How a model loads and caches, and how the engine speculates: each setting defined once.

The in-process `EngineConfig` (app/engine.py) and the served app's config (deployments/args.py,
the `args` of cluster/serve_config.yaml) are both made of these.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ModelSettings(BaseModel):
    """How one model of the pair loads, computes and caches."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    dtype: str = Field("float32", description="float32, bfloat16, float16 or auto (bf16 can break a near-tie of "
                       "two logits differently in a batched verify than in a plain step: docs/configuration.md).")
    device: str = Field("auto", description="torch device; auto = cuda when available, else cpu.")
    max_cache_bytes: int | None = Field(
        None, gt=0, description="KV cache budget per replica (per rank in tensor parallel), bytes; least recently "
        "used sequences are evicted beyond it. None: on a GPU, what memory_utilization leaves; on a CPU, 1 GiB. "
        "On a GPU a given value only lowers the budget memory_utilization leaves.")
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU: the fraction of the device's memory this replica (or rank) may use for "
        "weights, working buffers and KV cache together (vLLM's gpu_memory_utilization).")
    trust_remote_code: bool = Field(False, description="Run code shipped with the weights; off unless you trust them.")
    compile: Literal["off", "default", "reduce-overhead"] = Field(
        "off", description="Steps of up to compile_max_tokens positions as torch.compile graphs over static token "
        "counts (powers of two); larger forwards run eagerly (compile_in_background says when they are built). "
        "reduce-overhead replays the graphs as CUDA graphs on a GPU. CPU needs a C++ compiler; without one, eager.")
    compile_max_tokens: int = Field(128, ge=1, description="Largest compiled step, positions per forward.")
    compile_layers: int = Field(
        15, ge=1, description="CPU: consecutive decoder layers per compiled graph (the largest divisor of the "
        "model's depth up to this). More layers a graph: fewer calls a step, each costing ~0.25 ms of the "
        "compiler's dispatch; a longer compile at start (the reference target, 30 layers, on a Zen 4: 15 a "
        "graph against 6, step 30.7 -> 28.8 ms in float32; its first compile 73 s). With the graphs' C++ wrapper, "
        "30 a graph against 15: step 26.95 -> 26.15 ms in float32, 17.22 -> 16.27 in bfloat16, for a first compile "
        "~2.5 times as long (~7 min against ~2.5 on a 2-core Zen 4; a served replica serves eagerly meanwhile). "
        "1: every layer runs one graph of one layer.")
    compile_in_background: bool = Field(
        True, description="A served replica on a CPU takes traffic at once on eager forwards and compiles its "
        "steps in a thread of its own, taking them (after the same check) once all are built; false: it "
        "compiles before taking traffic. A GPU compiles before traffic either way (CUDA graphs are recorded "
        "on the forward thread).")
    attention: Literal["auto", "flex", "cpu_paged", "per_sequence", "varlen"] = Field(
        "auto", description="How attention reads the paged KV cache: flex = one FlexAttention call per layer "
        "(opt-in: not yet proven on a GPU); cpu_paged = every span (steps, verify rows, prompt chunks) in one "
        "call per layer of a C++ kernel built on the machine, each row alone (auto on a CPU with a compiler); varlen = torch's variable-length "
        "FlashAttention, one call per layer for up to 65536 gathered context positions (auto on a GPU in float16 "
        "or bfloat16; a CPU runs a reference); per_sequence = one SDPA call per sequence (auto elsewhere).")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt and output) served, in tokens. The memory model "
        "sizes attention's buffers for it, and a replica whose KV cache cannot hold one sequence of it refuses "
        "to start, naming the settings to change (vLLM's max_model_len). None: the model's positions, lowered "
        "to what the KV cache holds.")
    packed_weights: Literal["model", "bfloat16"] = Field(
        "model", description="CPU: the dtype of the packed linears' weights (app/model/cpu_linear.py). bfloat16 halves "
        "the bytes a step streams while activations stay in the model's dtype; the weights are rounded once. "
        "For a draft it changes only its proposals, never the output (the target verifies every token); "
        "for a target it changes the model.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of each replica (and rank worker); None = Ray's default, one "
        "per whole reserved CPU. Raise it on CPU nodes with cores to spare (on a 2-core node that also runs Ray's "
        "processes, 2 target threads measured slower than 1).")


DraftPacking = Literal["model", "bfloat16", "int8", "int4"]  # a draft's packed weights (a target's: no int8, int4)


class DraftSettings(ModelSettings):
    """How the draft loads: a model's settings, and what only a draft may change."""

    proposal_vocab: int | None = Field(
        None, ge=1, description="The draft proposes from its n most frequent tokens alone (the ranking beside its "
        "weights, token_ranking.json): its head computes n rows instead of the vocabulary's (app/speculation/draft_vocab.py). "
        "Exact: the target verifies every token. None (or a draft without a ranking): the whole head.")
    packed_weights: DraftPacking = Field(
        "model", description="CPU: the dtype of the packed linears' weights (app/model/cpu_linear.py). bfloat16 "
        "halves a float32 draft's bytes a step; int8 (each output's weights in 255 steps of a scale of its own) "
        "halves a bfloat16 draft's, its activations staying in the model's dtype: the draft's step streams "
        "half as much and its proposals may change a little, never the output (the target verifies every "
        "token). int4 (a bfloat16 draft on a CPU with AVX512-BF16; elsewhere int8): each output's weights in "
        "blocks of 32 inputs, 16 steps of a bfloat16 scale from a zero point of the block's own: 0.59 of int8's "
        "bytes. int8 and int4 are a draft's alone: a target's weights are the model.")


class SpeculationSettings(BaseModel):
    """Speculation defaults; requests may pin K or turn speculation off."""

    model_config = ConfigDict(extra="forbid")

    k_max: int = Field(8, ge=0, le=32, description="Largest K chosen by the controller or pinned by a request.")
    default_num_tokens: int | Literal["auto"] = Field("auto", description="K when a request does not say.")
    draft_top_n: int = Field(32, ge=0, description="Draft distribution truncated to its top-N (exact; 0 = full).")
    draft_timeout_s: float = Field(2.0, gt=0, description="A propose slower than this falls back to a target step.")
    draft_retry_after_s: float = Field(5.0, gt=0, description="After a draft failure, plain target steps this long.")
    draft_ahead: bool = Field(
        True, description="While a round verifies, draft the next one for the likely outcome (all accepted, bonus = "
        "the draft's guess); exact, it only hides the draft's time. Costs one more draft step per round.")
    draft_ahead_branches: int = Field(
        2, ge=0, le=4, description="A greedy sequence alone in its target forwards (whose draft would otherwise "
        "idle while it verifies) also drafts ahead for its likely rejections: the draft's next-best `n` tokens at "
        "each of the proposal's first two positions, each a context the round may end in. 0 = off. Exact: only "
        "which proposal a round finds ready changes.")
    draft_beside_cached_prefill: bool = Field(
        True, description="Ask the draft for the prompt's proposal beside a prefill that the target's prefix cache "
        "holds to its last block (the target's first step then computes a few positions, as a decode step does). "
        "Where both pools share a machine's memory (a CPU node) the draft's forwards slow that step: on the Coder "
        "pair the first token came 12-16 % later with them, and the draft's own catch-up in the next round is a "
        "short forward. false: not beside such a prefill. A prefill the cache does not hold is always drafted "
        "beside: it hides the draft's own prefill of the prompt (on that pair ~2 s of a 550-token prompt). Exact "
        "either way: only when the draft is asked changes.")
    draft_stop_below: float = Field(
        0.3, ge=0, le=1, description="A greedy or unseeded request's proposal ends at the first token the draft gives "
        "less than this probability (its top probability there): the tokens after it would likely be refused, "
        "so the draft stops there and the verify carries fewer rows; K is then the longest proposal. 0 = always "
        "K. Exact: a proposal's length depends on the draft's own distribution alone.")
    goodput_gate: bool = Field(
        False, description="Measure whether speculating emits more tokens per second than plain steps at the "
        "current load (windows of 0.5 s and 16 rounds, per load level, the slower mode retried one window in "
        "five), and take plain steps where it does not. For a draft that shares the target's cores. Greedy and "
        "unseeded requests with company only (a request alone is its K controller's); exact either way.")
    verify_saturation_tokens: int = Field(
        64, gt=0, description="Load-aware K's prior: tokens per target forward beyond which verifying more costs "
        "time. A replica measures its forwards' time by token count and uses the prior only where it has not.")
