"""Request-level parameters: how to sample, when to stop, how to speculate."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from app.errors import InvalidRequestError

# seeds ride in int64 tensors beside other requests' (one outside int64 would fail the batch); the
# draws hash a seed's 64 bits, so a negative seed is as good as any
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Limits on what one request may ask for (docs/reliability.md lists them with their refusals): each
# bounds work done on shared loops or tensors shared with other requests.
MAX_TOKEN_ID = 2**31 - 1  # ids (top_k too) ride in int32/int64 tensors; the model's vocabulary is checked later
MAX_CHOICES = 64  # generations one request may ask for: prompts x n
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_KEPT_SPECIALS = 8  # keep_special_token_ids: a tool-call format has one or two markers
# Logits are divided by the temperature and by the repetition penalty: below these a finite logit
# overflows to inf and softmax gives NaN. A smaller temperature is raised to it (vLLM does the same:
# clients send 1e-6 to mean "nearly greedy"); a smaller penalty is refused.
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# min_tokens is checked against max_tokens, which each model declares after the shared fields: so each
# declares min_tokens after its max_tokens (a validator sees only the fields before its own), from this
MIN_TOKENS = dict(ge=0, le=MAX_TOKEN_ID, description="No end-of-sequence or stop id (or stop string) before "
                                                     "this many tokens.")


class SpeculationParams(BaseModel):
    """Per-request control of speculation (the `speculation` extension of the HTTP API)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(True, description="False runs plain target decoding (K = 0) for this request.")
    num_tokens: int | Literal["auto"] = Field(
        "auto", description='Draft tokens per round: a fixed K >= 0, or "auto" for the adaptive controller.'
    )

    @field_validator("num_tokens")
    @classmethod
    def _non_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= MAX_TOKEN_ID:
            raise ValueError("num_tokens must be >= 0 (and at most k_max) or 'auto'")
        return v

    def pinned_k(self) -> int | None:
        """The fixed K this request asks for, or None when the controller chooses."""
        if not self.enabled:
            return 0
        return None if self.num_tokens == "auto" else int(self.num_tokens)


class SamplingFields(BaseModel):
    """The sampling and stopping fields that a request body and SamplingParams share, each declared
    once: the OpenAI request models (app/openai/protocol.py) derive from it and pass them on as they
    are. Every float is finite (a NaN compares false with every bound, so it would pass them), every
    integer bounded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"0 = greedy; higher flattens the distribution; "
                                                                f"below {MIN_TEMPERATURE} (but not 0) sampled at "
                                                                f"{MIN_TEMPERATURE}.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set with mass >= top_p.")
    top_k: int = Field(0, ge=-1, le=MAX_TOKEN_ID,
                       description="Keep the k most likely tokens; 0 or -1 keeps all; at most the vocabulary.")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED,
                             description="Makes sampling reproducible (any int64), whatever else is in the batch.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS,
                                      description="Token ids that end generation (excluded from the output), "
                                                  "beside the model's end-of-sequence ids; ignore_eos does not "
                                                  "apply to them.")
    # rules that depend on the tokens before each position (app/speculation/logits.py): exact under speculation
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                    description="Subtracted from the logit of every token already in the output.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                     description="Subtracted per occurrence of a token in the output so far.")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10.0,
                                      description="Divides positive and multiplies negative logits of tokens in "
                                                  "the prompt or output (1 = off).")
    min_p: float = Field(0.0, ge=0.0, le=1.0,
                         description="Drop tokens less likely than min_p times the most likely one.")
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw", description="raw: the model's own distribution; processed: the one sampled from (after "
                           "bias, penalties, temperature, min_p, top-k, top-p; greedy rows: before temperature).")
    cache_salt: str | None = Field(None, max_length=256, description="Prefix-cache scope: a sequence reuses only KV "
                                                                     "cached under the same salt (None: shared).")
    # how the output's text is decoded (app/request.py); the tokens are the same either way
    skip_special_tokens: bool = Field(True, description="Leave special tokens (control tokens such as a tool-call "
                                                        "marker) out of the text.")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        return MIN_TEMPERATURE if 0.0 < v < MIN_TEMPERATURE else v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v):
        if any(not 0 <= t <= MAX_TOKEN_ID for t in v):
            raise ValueError(f"stop_token_ids must be token ids in [0, {MAX_TOKEN_ID}]")
        return v


class SamplingParams(SamplingFields):
    """How one request samples and stops (the shared fields: SamplingFields). temperature 0 means greedy."""

    prompt_logprobs: int | None = Field(None, ge=0, le=20,
                                        description="Log-probabilities of each prompt token after the first (raw), "
                                                    "with this many alternatives.")
    max_tokens: int = Field(64, ge=0, le=MAX_TOKEN_ID, description="Most tokens to generate; 0 scores the prompt "
                                                                    "alone (with prompt_logprobs).")
    min_tokens: int = Field(0, **MIN_TOKENS)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS,
                            description="Strings that end generation; excluded from the text.")
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS,
                                         description="Token id -> bias in [-100, 100], added to its logit.")
    logprobs: int | None = Field(None, ge=0, le=20,
                                 description="Log-probabilities of each output token and of its `logprobs` most "
                                             "likely alternatives (None: none).")
    response_format: dict | None = Field(
        None, description='OpenAI\'s response_format: {"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}}}, or vLLM\'s structured outputs as {"type": '
                          '"regex" | "choice" | "grammar", <type>: ...}; output then follows it (app/grammar.py).')
    speculation: SpeculationParams = Field(default_factory=SpeculationParams, description="Speculation control.")
    keep_special_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=MAX_KEPT_SPECIALS,
        description="Special tokens shown in the text even when special tokens are skipped: a tool-call format's "
                    "markers (app/openai/tool_calls.py), which its parser must see.")

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        kind = v.get("type") if isinstance(v, dict) else None
        if v is None or kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            spec = v.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("json_schema.schema must be a JSON schema (an object)")
            return {"type": "json_schema", "json_schema": {"name": spec.get("name", "schema"), "schema": schema}}
        # vLLM's structured outputs (app/openai/structured.py): a regex, a choice of strings, a Lark grammar
        if kind in ("regex", "grammar") and isinstance(text := v.get(kind), str) and 0 < len(text) <= 1 << 16:
            return {"type": kind, kind: text}
        if kind == "choice" and isinstance(c := v.get("choice"), list) and 0 < len(c) <= 1024 and all(
                isinstance(s, str) and 0 < len(s) <= 1024 for s in c):
            return {"type": "choice", "choice": list(c)}
        if kind in ("regex", "grammar", "choice"):
            what = "list of strings" if kind == "choice" else "string"
            raise ValueError(f"response_format {kind} must be a non-empty {what} within its size limits")
        raise ValueError("response_format.type must be text, json_object, json_schema, regex, choice or grammar")

    @field_validator("max_tokens")
    @classmethod
    def _scoring_only(cls, v: int, info: ValidationInfo) -> int:
        if v == 0 and info.data.get("prompt_logprobs") is None:
            # prompt_logprobs is declared before max_tokens: validated first
            raise ValueError("max_tokens must be at least 1 (0 scores the prompt alone, with prompt_logprobs)")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _at_most_max_tokens(cls, v, info: ValidationInfo):
        if "max_tokens" in info.data and v > info.data["max_tokens"]:
            raise ValueError(f"min_tokens ({v}) must be <= max_tokens ({info.data['max_tokens']})")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        if any(not 0 <= t <= MAX_TOKEN_ID or not -100.0 <= b <= 100.0 for t, b in v.items()):
            raise ValueError("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_sampling(params: "SamplingParams | dict | None" = None, **overrides) -> SamplingParams:
    """Build SamplingParams, turning pydantic's error into an InvalidRequestError naming the parameter."""
    if isinstance(params, SamplingParams) and not overrides:
        return params
    data = params.model_dump() if isinstance(params, SamplingParams) else dict(params or {})
    data.update(overrides)
    try:
        return SamplingParams.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or None  # a field, not an index
        raise InvalidRequestError(f"invalid {param}: {err['msg']}", param=param) from None


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model does not have (a bias would index past its logits) and a top_k
    larger than its vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                      ("keep_special_token_ids", params.keep_special_token_ids)):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise InvalidRequestError(f"{name} token ids must be in [0, {vocab_size}); got {outside[0]}", param=name)
    if params.top_k > vocab_size:
        raise InvalidRequestError(f"top_k must be at most the vocabulary ({vocab_size}), or 0 or -1 for all; "
                                  f"got {params.top_k}", param="top_k")
