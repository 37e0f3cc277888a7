"""vLLM's structured-output extensions of the OpenAI bodies, as the engine's one constraint form.

A request may constrain its output by OpenAI's `response_format` (json_object, json_schema), by
vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`), or by the
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields: at most one of them.
Each becomes a `response_format` of SamplingParams (app/params.py), which app/grammar.py turns into
an llguidance grammar that masks target and draft alike, so the output stays exact under speculation.
"""

import json

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequestError

MAX_PATTERN_CHARS = 1 << 16  # a regex or a grammar's text
# JSON as json.dumps writes it, no free whitespace: with whitespace allowed anywhere a model can emit
# it without end (a known failure of structured output); a schema's "x-guidance" options override it
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICE_STRINGS = 1024  # strings of a choice
MAX_CHOICE_CHARS = 1024


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json", description="A JSON schema (an object, or its JSON text).")
    regex: str | None = Field(None, max_length=MAX_PATTERN_CHARS, description="The output matches this regex.")
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS,
                                     description="The output is one of these strings.")
    grammar: str | None = Field(None, max_length=MAX_PATTERN_CHARS,
                                description="A context-free grammar in Lark syntax (llguidance's), `start` its rule.")
    json_object: bool | None = Field(None, description="The output is a JSON object.")


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # their names before structured_outputs


def constraint(response_format: dict | None, structured: StructuredOutputs | None, guided: dict) -> dict | None:
    """The one response_format a body's constraint fields give (None: free text); a 400 naming the field
    when a body sets more than one."""
    given = {name: value for name, value in guided.items() if value is not None}
    if structured is not None:
        given |= {f"structured_outputs.{k}": v for k, v in structured.model_dump(by_alias=True).items()
                  if v is not None and v is not False}
    if response_format is not None and response_format.get("type", "text") != "text":
        given["response_format"] = response_format
    if len(given) > 1:
        raise InvalidRequestError(f"give one output constraint, not {' and '.join(sorted(given))}",
                                  param=sorted(given)[1])
    if not given:
        return response_format
    (name, value), = given.items()
    kind = name.rpartition(".")[2].removeprefix("guided_")
    if kind in ("json", "json_object"):
        if kind == "json_object":
            return {"type": "json_object"}
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            raise InvalidRequestError(f"{name} must be a JSON schema", param=name) from None
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if kind == "choice" and (not value or any(not s or len(s) > MAX_CHOICE_CHARS for s in value)):
        raise InvalidRequestError(f"{name} takes 1 to {MAX_CHOICE_STRINGS} non-empty strings of at most "
                                  f"{MAX_CHOICE_CHARS} characters", param=name)
    return response_format if kind == "response_format" else {"type": kind, kind: value}
