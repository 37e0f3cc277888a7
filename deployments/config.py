"""Typed `args` of build_app: the application section of the Serve config."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ModelConfig(BaseModel):
    """One model of the pair."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="Hub id or local directory; None = the demo pair's model.")
    dtype: str = Field("float32", description="float32, bfloat16, float16 or auto.")
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
        "counts (powers of two), compiled before the replica takes traffic; larger forwards run eagerly. "
        "reduce-overhead replays the graphs as CUDA graphs on a GPU. CPU needs a C++ compiler; without one, eager.")
    compile_max_tokens: int = Field(128, ge=1, description="Largest compiled step, positions per forward.")
    attention: Literal["auto", "flex", "cpu_paged", "per_sequence"] = Field(
        "auto", description="How attention reads the paged KV cache: flex = one FlexAttention call per layer "
        "(auto on a GPU); cpu_paged = decode and verify rows in one call per layer of a C++ kernel built on "
        "the machine (auto on a CPU with a compiler, float32); per_sequence = one SDPA call per sequence.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of each replica (and rank worker); None = Ray's default, one "
        "per whole reserved CPU. Raise it on CPU nodes with cores to spare (on a 2-core node that also runs Ray's "
        "processes, 2 target threads measured slower than 1).")


class TargetConfig(ModelConfig):
    """The target model; tensor-parallel across the GPUs of one node when tensor_parallel_size > 1."""

    dtype: str = Field("float32", description="float32, bfloat16, float16 or auto (bf16: see the README on near-ties).")
    tensor_parallel_size: int = Field(1, ge=1, description="Rank workers (one GPU each) per TargetServer replica.")
    rank_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.25},
        description="Resources of each rank worker and its placement-group bundle ({GPU: 1, CPU: n} on GPU nodes).")
    replica_cpus: float = Field(
        0.25, ge=0, description="CPUs of the replica itself, in bundle 0 (>= TargetServer's ray_actor_options num_cpus).")
    pool_resource: str | None = Field(
        "target_pool", description="Custom resource of the target node pool, added to bundle 0 so the group lands there.")


class SpeculationConfig(BaseModel):
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
    goodput_gate: bool = Field(
        False, description="Measure whether speculating emits more tokens per second than plain steps at the "
        "current load (windows of 0.5 s, per load level, the slower mode retried one window in five), and take "
        "plain steps where it does not. For a draft that shares the target's cores. Greedy and unseeded "
        "requests only; exact either way.")
    verify_saturation_tokens: int = Field(
        64, gt=0, description="Tokens per target batch beyond which verifying more costs time (load-aware K).")


class BatchConfig(BaseModel):
    """The forward queue of one server: one forward at a time over every round waiting, never a timer."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(16, ge=1, description="Most sequences' rounds in one forward; the rest wait their turn.")


class TargetBatchConfig(BatchConfig):
    prefill_chunk_tokens: int = Field(
        512, ge=16, description="Most prompt tokens one sequence adds to a target forward: a longer prompt is "
        "prefilled over several forwards, each shared with the other sequences' rounds, so it never stalls them "
        "for its whole length.")
    max_batch_tokens: int = Field(
        2048, ge=16, description="Most positions one target forward computes (verify rows and prompt chunks); "
        "rounds go first, prompt chunks fill the rest, and what does not fit waits for the next forward.")


class LimitsConfig(BaseModel):
    """Request limits enforced by the ingress."""

    model_config = ConfigDict(extra="forbid")

    max_tokens_cap: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(
        16, ge=1, description="max_tokens of a completion that does not say (OpenAI's 16); a chat that does not "
        "say runs to the end of the context, within max_tokens_cap.")
    request_timeout_s: float = Field(300.0, gt=0, description="A request past this ends with 408.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Larger request bodies get 413.")
    target_retries: int = Field(
        8, ge=0, description="Resumptions of a request whose target replica died (backoff 0.5 s doubling to 5 s).")


class AppConfig(BaseModel):
    """Everything build_app needs; the `args` of cluster/serve_config.yaml."""

    model_config = ConfigDict(extra="forbid")

    target: TargetConfig = Field(default_factory=TargetConfig, description="The target model.")
    draft: ModelConfig | None = Field(default_factory=ModelConfig, description="The draft; null = no speculation.")
    demo_quick: bool = Field(False, description="Use the small quick demo pair when no model is named.")
    served_model_name: str | None = Field(None, description="Name in /v1/models; default: the target's name.")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Speculation defaults.")
    draft_batch: BatchConfig = Field(default_factory=BatchConfig, description="DraftServer batching.")
    target_batch: TargetBatchConfig = Field(
        default_factory=lambda: TargetBatchConfig(max_batch_size=32), description="TargetServer batching.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    api_key_env: str = Field("SPECSERVE_API_KEY", description="Environment variable holding the API key, if any.")
