"""What a job's stream carries, and the resume state the front keeps from it: one schema, the job's.

Light on purpose (pydantic only): Serve's HTTP proxy imports it for its failover middleware
(deployments/failover.py), which keeps a `ResumeState` per choice of a stream.
"""

from typing import TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pydantic import ValidationError

from app.params import MAX_CHOICES, MAX_SEED, MAX_TOKEN_ID, MIN_SEED

GUARD_HEADER = b"x-specserve-failover"  # set by the proxy's failover: the front then reports its state
RESUME_HEADER = b"x-specserve-resume"  # the state a resumed request continues from


class Chunk(TypedDict, total=False):
    """One message of a job's stream, as a TargetServer replica streams it and the dispatcher relays it
    (a plain dict on the wire): a round's tokens, or the last message, or an error."""

    token_ids: list[int]  # the tokens a round kept (several rounds' when sending lagged: merged)
    text: str  # their text, less what is held back (a partial stop string, an incomplete UTF-8 sequence)
    controller: tuple  # the K controller's state after the round: resume state (GenerationJob.controller)
    logprobs: list  # per kept token, when the request asked for them (app/speculation/steps.py's shape)
    prompt_logprobs: list  # the prompt's, once, when asked
    finish_reason: str  # the last message only, with usage and speculation
    usage: dict
    speculation: dict
    prompt_forward_s: float  # the last message: seconds of the forwards that computed the prompt (queue time is the rest of TTFT)
    error: dict  # OpenAI's error object: the dispatcher could not get the job served


class ResumeState(BaseModel):
    """Where one job stands as its front has seen it stream: the GenerationJob fields another replica
    continues from (app/job.py), and whether its last chunk went out. Checked like user input: the
    proxy's failover sends it back in a header, and anyone who reaches an ingress replica can too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(ge=MIN_SEED, le=MAX_SEED, description="the job's draw seed (its own, or the one chosen for it)")
    output_ids: list[int] = Field(default_factory=list, description="output token ids already streamed")
    streamed_chars: int = Field(default=0, ge=0, le=MAX_TOKEN_ID, description="characters of output text streamed")
    controller: tuple[float, float, float] | None = Field(
        default=None, description="the K controller's state after the last streamed round")
    done: bool = Field(default=False, description="whether the job's last chunk was streamed")

    @field_validator("controller")
    @classmethod
    def _counts(cls, v):
        if v is not None and not all(0 <= c <= MAX_TOKEN_ID for c in v):
            raise ValueError(f"controller counts must be in [0, {MAX_TOKEN_ID}]")
        return v

    def record(self, chunk: Chunk) -> None:
        """Take in a streamed chunk, as the job does."""
        advance(self, chunk)
        self.done = self.done or "finish_reason" in chunk


def advance(state, chunk: Chunk) -> None:
    """Take a streamed chunk into resume state (a GenerationJob's or a ResumeState): its tokens, its
    text's length and the controller state it carries. The one place streamed output becomes state."""
    state.output_ids += chunk.get("token_ids", [])
    state.streamed_chars += len(chunk.get("text", ""))
    if chunk.get("controller") is not None:
        state.controller = tuple(chunk["controller"])


class Resume(BaseModel):
    """A streamed request's state, as the middleware sends it in RESUME_HEADER."""

    rid: str = Field(max_length=128, description="the response id the client has seen")
    choices: list[ResumeState] = Field(max_length=MAX_CHOICES, description="each choice's state, in the response's order")

    def apply(self, step: dict) -> None:
        """Take in one event's report: choice `i`'s chunk (its tokens, text, controller state, finish)."""
        self.choices[step["i"]].record(step)


def read_resume(value: str | None) -> Resume | None:
    """RESUME_HEADER's value; ValueError when it is not a valid state."""
    if value is None:
        return None
    try:
        return Resume.model_validate_json(value)
    except ValidationError as e:
        raise ValueError(f"invalid {RESUME_HEADER.decode()} header: {e.errors()[0]['msg']}") from None
