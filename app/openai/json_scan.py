"""Where JSON values begin and end in text a model is still writing.

A streamed tool call is sent as it is written: its name once whole, then its arguments' JSON text
piece by piece (app/openai/tool_calls.py). That needs the spans of values in a prefix of a JSON document, which
no JSON library gives: `json` parses only whole documents, and partial-JSON parsers return values,
not where they lie in the text. So this reads spans only: strings (with their escapes), nested
objects and arrays, and literals, each to its end or to the end of the text (None: not yet whole).
"""

import json

BLANKS = " \t\r\n"


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value that begins at text[i]; None when the text ends first."""
    n = len(text)
    if text[i] == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j = 0, i
        while j < n:
            c = text[j]
            if c == '"':
                end = value_end(text, j)  # a string: one level down, never deeper
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: up to the next delimiter (at the end, it may go on)
    while j < n and text[j] not in ",}]" + BLANKS:
        j += 1
    return j if j < n else None


def objects(text: str) -> list[tuple[int, int | None]]:
    """The (start, end) of each top-level object in the text, the last one's end None if it is not
    yet whole; text between objects (tags, list brackets, separators) is passed over."""
    out, i = [], text.find("{")
    while i >= 0:
        end = value_end(text, i)
        out.append((i, end))
        if end is None:
            break
        i = text.find("{", end)
    return out


def members(text: str, start: int) -> dict[str, tuple[int, int | None]]:
    """The members of the object at text[start] as far as the text goes: key -> (value start, value
    end or None). A member appears once its key, colon and first character of value are written."""
    out, j = {}, start + 1
    while True:
        j = _skip(text, j)
        if j >= len(text) or text[j] != '"':
            return out  # the end of the object, of the text, or not JSON
        key_end = value_end(text, j)
        if key_end is None:
            return out
        key = whole_string(text, (j, key_end))
        if key is None:
            return out
        j = _skip(text, key_end)
        if j >= len(text) or text[j] != ":":
            return out
        j = _skip(text, j + 1)
        if j >= len(text):
            return out
        end = value_end(text, j)
        out[key] = (j, end)
        if end is None:
            return out
        j = _skip(text, end)
        if j >= len(text) or text[j] != ",":
            return out
        j += 1


def whole_string(text: str, span: tuple[int, int | None] | None) -> str | None:
    """The string value at `span`, once it is whole; None if it is not, or is not a string."""
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    try:
        return json.loads(text[span[0]:span[1]])
    except json.JSONDecodeError:
        return None


def _skip(text: str, j: int) -> int:
    while j < len(text) and text[j] in BLANKS:
        j += 1
    return j
