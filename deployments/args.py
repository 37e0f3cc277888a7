"""Typed `args` of build_app: the application section of the Serve config."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.config import DraftPacking, DraftSettings, ModelSettings, SpeculationSettings


class ModelConfig(ModelSettings):
    """One model of the pair: where it comes from, and its settings (app/config.py)."""

    model: str | None = Field(
        None, description="A local or mounted directory (a PVC), a hub id, or object storage (s3://bucket/prefix, "
        "gs://bucket/prefix); None = the built pair's model (`pair`). Each node fetches a remote model once "
        "(app/model/sources.py).")
    revision: str | None = Field(None, description="A hub id's branch, tag or commit, pinned (vLLM's --revision).")
    download_dir: str | None = Field(
        None, description="Where each node keeps the models it fetches, shared by its replicas (a node-local disk "
        "or a PVC): default $SPECSERVE_MODEL_CACHE or ~/.cache/specserve/models; hub ids: the Hugging Face cache.")
    pin_cores: bool = Field(
        False, description="CPU: each replica binds its threads to cores of its own, one per forward thread, among "
        "the cores its process may use, none held by another replica of the node (deployments/cores.py); one that "
        "finds too few free cores runs unpinned. `specserve serve` turns it on where the config does not say. On "
        "Kubernetes pods share a node's cores unless the kubelet's static CPU manager policy gives each its own: "
        "turn it on only there.")


class DraftConfig(ModelConfig, DraftSettings):
    """The draft model: where it comes from, and its settings."""

    # pydantic merges its bases' fields in reverse order: ModelConfig's packed_weights (the target's choices)
    # would shadow DraftSettings' own
    packed_weights: DraftPacking = DraftSettings.model_fields["packed_weights"]


class TargetConfig(ModelConfig):
    """The target model; tensor-parallel across the GPUs of one node when tensor_parallel_size > 1."""

    tensor_parallel_size: int = Field(1, ge=1, description="Rank workers (one GPU each) per TargetServer replica.")
    rank_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.25},
        description="Resources of each rank worker and its placement-group bundle ({GPU: 1, CPU: n} on GPU nodes).")
    replica_cpus: float = Field(
        0.25, ge=0, description="CPUs of the replica itself, in bundle 0 (>= TargetServer's ray_actor_options num_cpus).")
    load_timeout_s: float = Field(
        3600.0, gt=0, description="How long a tensor-parallel replica waits for its ranks to load and warm up: a "
        "cold pod downloads the weights first (about 140 GB for a 70B model in bf16).")
    pool_resource: str | None = Field(
        "target_pool", description="Custom resource of the target node pool, added to bundle 0 so the group lands there.")


# Speculation defaults (app/config.py); the name the served config's sections go by
SpeculationConfig = SpeculationSettings


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
    draft: DraftConfig | None = Field(default_factory=DraftConfig, description="The draft; null = no speculation.")
    pair: Literal["smollm2", "qwen2.5-coder", "demo", "quick"] = Field(
        "smollm2", description="The built pair whose models serve when none is named, filled in by the shipped "
        "configs' builder (import_path specserve.serving:build_app; deployments.application:build_app takes named "
        "models only): smollm2 (SmolLM2-135M-Instruct and its distilled draft), qwen2.5-coder "
        "(Qwen2.5-Coder-1.5B-Instruct, drafted by its 0.5B sibling), demo (a toy trained on the "
        "standard library) or quick.")
    served_model_name: str | None = Field(None, description="Name in /v1/models; default: the target's name.")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None, description="How the target writes tool calls (app/openai/tool_calls.py): hermes (Hermes, Qwen 2.5), llama3_json "
        "(Llama 3.1-3.3) or mistral; None refuses chat requests that offer tools.")
    chat_template: str | None = Field(
        None, description="The chat template to serve with, instead of the tokenizer's (for a checkpoint whose "
        "template is missing or wrong): a Jinja template, or the path of a file holding one.")
    trust_request_chat_template: bool = Field(
        False, description="Whether a request may bring its own chat_template. A template is code the ingress "
        "runs (sandboxed, but a template can loop for as long as it likes): trust only your own clients.")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Speculation defaults.")
    draft_batch: BatchConfig = Field(default_factory=BatchConfig, description="DraftServer batching.")
    target_batch: TargetBatchConfig = Field(
        default_factory=lambda: TargetBatchConfig(max_batch_size=32), description="TargetServer batching.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    api_key_env: str = Field("SPECSERVE_API_KEY", description="Environment variable holding the API key, if any.")

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, v):
        if v is not None:
            chat_template_text(v)
        return v


def chat_template_text(value: str) -> str:
    """A configured chat template: the template itself, or read from the file it names; its Jinja
    syntax checked (a broken template is the config's error, not every chat request's)."""
    import jinja2

    if "{{" in value or "{%" in value:
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template is neither a Jinja template nor a readable file: {value!r}")
        text = path.read_text()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e}") from None
    return text
