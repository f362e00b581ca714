"""A request body that does not validate, in one line a person can act on.

pydantic reports a union's failure once per branch, each under a location that holds the branch's name
(``input.str``, ``input.list[str].0``, ``tool_choice.literal['none','auto']``): read as they come, they name a type
check, not the field. Here the branches' names leave the path; the branch that got furthest into the value
speaks for the union (a content list with one bad part is about that part), and when none did, the message says
what the field takes and what it got.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from localai.errors import InvalidRequest
from localai.models.modelfile import FLOAT_PARAMETERS, INT_PARAMETERS

_PLURAL = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans"}
_SINGULAR = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
             "none": "null"}
_SIMPLE = {
    "missing": "is required", "string_type": "must be a string", "int_type": "must be an integer",
    "int_parsing": "must be an integer", "int_from_float": "must be a whole number", "float_type": "must be a number",
    "float_parsing": "must be a number", "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "list_type": "must be a list", "dict_type": "must be an object", "model_type": "must be an object",
    "model_attributes_type": "must be an object", "finite_number": "must be a finite number",
    "none_required": "must be null", "extra_forbidden": "is not a field of this request",
}


def is_branch(part: object) -> bool:
    """A location part that names a union's branch (a type), not a field or an index."""
    if not isinstance(part, str):
        return False
    return part in _SINGULAR or "[" in part or (part[:1].isupper() and part.isidentifier())


def branch_name(tag: str, error: dict[str, Any]) -> str | None:
    """What a union branch takes, in words: ``list[str]`` is "a list of strings"."""
    if tag in _SINGULAR:
        return _SINGULAR[tag]
    if tag.startswith("literal["):
        expected = (error.get("ctx") or {}).get("expected")
        return str(expected) if expected else None
    if tag.startswith("list["):
        inner = tag[5:-1]
        if inner in _PLURAL:
            return f"a list of {_PLURAL[inner]}"
        if inner.startswith("list["):
            return f"a list of lists of {_PLURAL.get(inner[5:-1], 'values')}"
        return "a list of objects" if inner[:1].isupper() or inner.startswith("dict[") else "a list"
    if tag.startswith("dict[") or tag[:1].isupper():
        return "an object"
    match = re.match(r"function-\w+\[.*?, (.*)\]\Z", tag)  # a validator around the type: the type says it
    return branch_name(match.group(1), error) if match else None


def given(value: object) -> str:
    """The JSON type of what was sent, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        if value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return "a list of numbers"
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def phrase(error: dict[str, Any]) -> str:
    """What is wrong with a value, for one error (not a union's)."""
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind == "value_error" and "error" in ctx:
        return f": {ctx['error']}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {ctx.get('expected')} (got {error.get('input')!r:.60})"
    bounds = {"less_than_equal": ("at most", "le"), "greater_than_equal": ("at least", "ge"),
              "less_than": ("less than", "lt"), "greater_than": ("more than", "gt")}
    if kind in bounds:
        words, key = bounds[kind]
        bound = ctx.get(key)
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"must be {words} {bound} (got {error.get('input')!r:.40})"
    if kind == "too_short":
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"needs at least {least} items"
    if kind == "too_long":
        return f"takes at most {ctx.get('max_length')} items (got {ctx.get('actual_length')})"
    if kind == "string_too_short":
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"needs at least {least} characters"
    if kind == "string_too_long":
        return f"takes at most {ctx.get('max_length')} characters"
    if kind in _SIMPLE:
        simple = _SIMPLE[kind]
        return simple if kind in ("missing", "extra_forbidden") else f"{simple}, not {given(error.get('input'))}"
    return str(error.get("msg", "is not valid")).removeprefix("Value error, ")


def field_of(location: tuple[Any, ...]) -> str | None:
    """The dotted path of a location, without ``body`` and union branches."""
    parts = [str(part) for part in location if part != "body" and not is_branch(part)]
    return ".".join(parts) or None


def describe_validation(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """A one-line message naming the bad field and what it takes, and that field's dotted path (a request
    body's, or a WebSocket message's)."""
    errors = [dict(error) for error in exc.errors()]
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    location = tuple(first.get("loc", ()))
    split = next((index for index, part in enumerate(location) if is_branch(part)), None)
    if split is None:
        return _sentence(field_of(location), phrase(first)), field_of(location)
    union = location[:split]
    branches = [error for error in errors if tuple(error.get("loc", ()))[:split] == union
                and len(error.get("loc", ())) > split and is_branch(error["loc"][split])]
    # the branch that got furthest into the value (past its own type check) says what is wrong
    deepest = max(branches, key=lambda error: len(error["loc"]))
    if len(deepest["loc"]) > split + 1 and not _is_type_error(deepest):
        where = field_of(tuple(deepest["loc"]))
        return _sentence(where, phrase(deepest)), where
    names = [name for error in branches if (name := branch_name(str(error["loc"][split]), error))]
    names = list(dict.fromkeys(names))
    where = field_of(union)
    joint = ", or " if any(" or " in name for name in names) else " or "
    takes = ", ".join(names[:-1]) + joint + names[-1] if len(names) > 1 else (names[0] if names else "valid")
    return _sentence(where, f"must be {takes}, not {given(first.get('input'))}"), where


def _is_type_error(error: dict[str, Any]) -> bool:
    """A branch that failed on an item's type only (``list[str]`` given numbers): no deeper than the others."""
    return str(error.get("type", "")).endswith("_type") and isinstance(error["loc"][-1], int)


def _sentence(field: str | None, what: str) -> str:
    """``'field' must be ...``; a validator's own message follows a colon (``what`` starts with it)."""
    return f"'{field}'{'' if what.startswith(':') else ' '}{what}" if field else \
        f"the request body{'' if what.startswith(':') else ' '}{what}"


def json_typed(key: str, value: Any, where: str) -> None:
    """A numeric Modelfile parameter sent as JSON (Ollama's ``options``, /api/create's ``parameters``) is a JSON
    number, as Ollama's own ``FromMap`` has it: ``coerce_parameter`` also reads Modelfile text, so "2" and true were
    taken for 2 and 1. A whole number written as a float (2.0) is an integer, as in Ollama; 2.5 for an integer stays
    refused (Ollama truncates it). Switches keep ``coerce_parameter``'s reading (true/false, and "true"/"false" as a
    Modelfile writes them: fit_context "false" has always meant false)."""
    if value is None or (key not in INT_PARAMETERS and key not in FLOAT_PARAMETERS):
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "an integer" if key in INT_PARAMETERS else "a number"
        raise InvalidRequest(f"{where}: {key} must be {kind}, not {given(value)}", param=where)
