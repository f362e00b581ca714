"""References (``$ref``) and ``allOf`` in the JSON schemas that become grammars (worker side).

llama-cpp-python's converter resolves a ``$ref`` by splitting it on "/" without RFC 6901's unescaping
(``#/$defs/a~1b`` failed, and the tool that had it took any object), names a reference's rule after its last
token, so two references ending alike, or a definition named like a property, shared one rule, and reads of an
``allOf`` only its parts' properties (``allOf: [{"$ref": ...}]`` to an integer allowed ``{}``). So every reference
is checked first, whatever the schema is for: one outside the schema (a URL) or to nothing in it is a ``RefError``
naming it. For the converter (``flattened``) each reference then points to a definition of its own under a name
no other rule has, and each ``allOf`` is merged into one schema (``merged``; llguidance merges its own).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any
from urllib.parse import unquote

NAMED = ("properties", "$defs", "definitions", "patternProperties")  # keywords whose keys are names, not keywords
LITERALS = frozenset({"const", "enum", "default", "examples"})  # values taken as they are: no $ref inside is one
REF_HOMES = ("$defs", "definitions")
RULE_UNSAFE = re.compile(r"[^A-Za-z0-9-]+")
MAX_REF_HOPS = 32
REF_RULE = "ref--"  # the rules of references: the converter names no other rule so (a property "ref" gives "ref-x")
MAX_ALTERNATIVES = 64  # an allOf of several anyOfs becomes one anyOf of their combinations: at most this many
LOWER_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"})
UPPER_BOUNDS = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"})
ANNOTATIONS = frozenset({"description", "title", "examples", "default", "$schema", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$id"})


class GrammarError(ValueError):
    """The request's schema or tools cannot become a grammar: the request's fault, not the worker's."""


class RefError(GrammarError):
    """A ``$ref`` that leaves the schema or points to nothing in it: refused wherever the schema is (a tool's
    parameters too, which take any object when the engine merely cannot compile them)."""


def ref_tokens(ref: str) -> list[str]:
    """The tokens of a local ``$ref``'s JSON pointer, unescaped as RFC 6901 says ("#/$defs/A~1B~0" -> ["$defs",
    "A/B~"]); a ``$ref`` is a URI, so its fragment is percent-decoded first. "#" is the root: no tokens."""
    fragment = unquote(ref[1:]) if ref.startswith("#") else ""
    if not fragment.startswith("/"):
        return []
    return [token.replace("~1", "/").replace("~0", "~") for token in fragment[1:].split("/")]


def pointer(tokens: list[str]) -> str:
    """The local ``$ref`` of ``tokens`` (``ref_tokens`` reversed)."""
    return "#" + "".join("/" + token.replace("~", "~0").replace("/", "~1") for token in tokens)


def target(root: Any, ref: Any) -> Any:
    """The schema a ``$ref`` points to inside ``root``; RefError naming it when it is not local or resolves to
    nothing (or to something that is not a schema)."""
    if not isinstance(ref, str):
        raise RefError(f"$ref must be a string, not {type(ref).__name__}")
    shown = repr(ref[:100])
    if ref != "#" and not ref.startswith("#/"):
        raise RefError(f"$ref {shown}: only references within the schema (#/$defs/...) are supported")
    node = root
    for token in ref_tokens(ref):
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and re.fullmatch(r"0|[1-9][0-9]*", token) and int(token) < len(node):
            node = node[int(token)]
        else:
            raise RefError(f"$ref {shown} does not resolve: the schema has nothing at {token[:100]!r}")
    if not isinstance(node, dict | bool):
        raise RefError(f"$ref {shown} points to {type(node).__name__}, not a schema")
    return node


def schema_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every schema object in ``schema`` (itself, its subschemas, its definitions), not the values of ``const``,
    ``enum`` or ``default``, which hold data, nor the maps of names (``properties``) themselves."""
    found: list[dict[str, Any]] = []
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            found.append(node)
            for key, value in node.items():
                if key in NAMED and isinstance(value, dict):
                    pending.extend(value.values())
                elif key not in LITERALS:
                    pending.append(value)
    return found


def check_refs(schema: Any) -> None:
    """RefError for the first ``$ref`` in ``schema`` that is not local or does not resolve inside it."""
    for node in schema_nodes(schema):
        if "$ref" in node:
            target(schema, node["$ref"])


def with_refs(node: Any, rewritten: Callable[[Any], str], *, dropped: Collection[str] = ()) -> Any:
    """A copy of a schema ``node`` with each ``$ref`` replaced by ``rewritten(ref)`` (in subschemas only: not in
    literal values such as ``enum`` and ``const``, nor in property names), and the keys in ``dropped`` left out at
    every level."""
    if isinstance(node, list):
        return [with_refs(item, rewritten, dropped=dropped) for item in node]
    if not isinstance(node, dict):
        return node
    result: dict[str, Any] = {}
    for key, value in node.items():
        if key in dropped:
            continue
        if key == "$ref":
            result[key] = rewritten(value)
        elif key in NAMED and isinstance(value, dict):
            result[key] = {item: with_refs(sub, rewritten, dropped=dropped) for item, sub in value.items()}
        else:
            result[key] = value if key in LITERALS else with_refs(value, rewritten, dropped=dropped)
    return result


def hoisted(schema: dict[str, Any], tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool's parameters made ready to sit inside a larger schema (a call's, with the tool's name beside them).

    Their local ``$ref``s point into their own root ("#/$defs/P"), which inside the call's schema is no longer the
    root: the definitions move to the root's ``$defs`` under names of the tool's own (``tag``-P, so two tools'
    P never meet) and the references follow them; a reference to anything else of the parameters ("#",
    "#/properties/a") points into a copy of them stored as ``$defs``.``tag``. Returns the parameters without their
    definitions and the definitions for the root. A reference outside the schema (a URL) is a RefError."""
    homes = {home: schema[home] for home in REF_HOMES if isinstance(schema.get(home), dict)}
    needs_root = False
    names: dict[tuple[str, str], str] = {}
    for home, defined in homes.items():
        for key in defined:
            # a name that is a grammar rule's as it is: the converter names a recursive reference's rule unescaped
            plain = RULE_UNSAFE.sub("-", key if home == "$defs" else f"{home}-{key}")
            unique = f"{tag}-{plain}"
            while unique in names.values() or unique == tag:
                unique += "-"
            names[(home, key)] = unique

    def rewritten(ref: Any) -> str:
        nonlocal needs_root
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise RefError(f"$ref {str(ref)[:100]!r}: only references within the schema (#/$defs/...) are "
                           "supported")
        tokens = ref_tokens(ref)
        if len(tokens) >= 2 and tokens[0] in homes and tokens[1] in homes[tokens[0]]:
            return pointer(["$defs", names[(tokens[0], tokens[1])], *tokens[2:]])
        needs_root = True
        return pointer(["$defs", tag, *tokens])

    def walk(node: Any) -> Any:
        return with_refs(node, rewritten)

    body = walk({key: value for key, value in schema.items() if key not in homes})
    definitions = {names[(home, key)]: walk(sub) for home, defined in homes.items() for key, sub in defined.items()}
    if needs_root:
        definitions[tag] = body
    return body, definitions


def dereferenced(schema: Any, definitions: dict[str, Any]) -> Any:
    """``schema`` with a ``$ref`` or an ``allOf`` at its top followed into ``definitions`` (the root's, as
    ``hoisted`` made them) and merged: what a tagged call needs to see whether a parameter is text or an object."""
    return expanded(schema, {"$defs": definitions})


def expanded(schema: Any, root: Any) -> Any:
    """``schema`` (a part of ``root``) with a ``$ref`` at its top followed within ``root`` and an ``allOf`` there
    merged, until neither is left: what it takes, as far as its own type goes."""
    return _expanded(schema, lambda ref: target(root, ref), set())


def flattened(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as the converter reads it right: each reference (checked) points to a definition of its own,
    ``#/$defs/ref--NAME``, holding what it pointed to, the definitions nothing refers to are gone, and each
    ``allOf`` is merged into the schema that has it."""
    names: dict[tuple[str, ...], str] = {}
    definitions: dict[str, Any] = {}

    def rewritten(ref: Any) -> str:
        found = target(schema, ref)
        tokens = tuple(ref_tokens(ref))
        if tokens not in names:
            plain = RULE_UNSAFE.sub("-", tokens[-1]).strip("-") if tokens else "root"
            base = REF_RULE + (plain or "x")
            name, number = base, 1
            while name in definitions:
                number += 1
                name = f"{base}-{number}"
            names[tokens] = name
            definitions[name] = {}  # taken before the walk: a recursive reference meets its own name
            definitions[name] = walk({} if found is True else found)
        return pointer(["$defs", names[tokens]])

    def walk(node: Any) -> Any:
        # the definitions are left out: what is referred to is copied out of them, the rest is never read
        return with_refs(node, rewritten, dropped=REF_HOMES)

    body = walk(schema)
    return merged(body, definitions)


def merged(body: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """``body`` and ``definitions`` (``flattened``'s) with every ``allOf`` merged into the schema that holds it."""
    done: dict[str, Any] = {}
    active: set[str] = set()

    def definition(ref: str) -> Any:
        name = ref_tokens(ref)[-1]
        if name not in done:
            if name in active:
                raise GrammarError(f"allOf: {ref[:100]!r} includes itself")
            active.add(name)
            done[name] = without_allof(definitions[name])
            active.discard(name)
        return done[name]

    def without_allof(node: Any) -> Any:
        if isinstance(node, list):
            return [without_allof(item) for item in node]
        if not isinstance(node, dict):
            return node
        result = {key: value if key in LITERALS else (
            {item: without_allof(sub) for item, sub in value.items()} if key in NAMED and isinstance(value, dict)
            else without_allof(value)) for key, value in node.items()}
        return _expanded(result, definition, set()) if isinstance(result.get("allOf"), list) else result

    body = without_allof(body)
    for name in definitions:
        definition(pointer(["$defs", name]))
    return {**body, "$defs": done} if done else body


def _expanded(schema: Any, lookup: Callable[[str], Any], seen: set[str]) -> Any:
    """``schema`` with its top-level ``$ref`` followed (``lookup``) and its ``allOf`` merged, until neither is
    left; what is inside stays as it is."""
    for _ in range(MAX_REF_HOPS):
        if not isinstance(schema, dict):
            return schema
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in seen:
                raise GrammarError(f"$ref {ref[:100]!r}: a chain of references that never reaches a schema")
            found = lookup(ref)
            rest = {key: value for key, value in schema.items() if key != "$ref"}
            schema = _merge(_as_schema(found), rest) if rest else found
            seen = {*seen, ref}
            continue
        parts = schema.get("allOf")
        if not isinstance(parts, list):
            return schema
        result: dict[str, Any] = {}
        for part in parts:
            result = _merge(result, _as_schema(_expanded(part, lookup, seen)))
        # the schema's own keywords after its parts': a model's properties follow those of the models it extends
        result = _merge(result, {key: value for key, value in schema.items() if key != "allOf"})
        schema = _distributed(result, lookup, seen)
    raise GrammarError("$ref: a chain of references that never reaches a schema")


def _as_schema(value: Any) -> dict[str, Any]:
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise GrammarError("allOf: its items must be schemas (objects)")
    return value


def _distributed(schema: dict[str, Any], lookup: Callable[[str], Any], seen: set[str]) -> dict[str, Any]:
    """A merged schema whose alternatives (``anyOf``/``oneOf``) have keywords beside them, which the converter
    would not read: each alternative takes them."""
    key = "anyOf" if "anyOf" in schema else "oneOf"
    alternatives = schema.get(key)
    rest = {k: v for k, v in schema.items() if k != key}
    if not isinstance(alternatives, list) or not set(rest) - ANNOTATIONS:
        return schema
    return {key: [_merge(rest, _as_schema(_expanded(alternative, lookup, seen))) for alternative in alternatives]}


def _merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One schema that takes what both take, where a grammar can say so; GrammarError where it cannot."""
    result = dict(first)
    for key, value in second.items():
        if key not in result or result[key] == value:
            result[key] = value
            continue
        mine = result[key]
        if key in ANNOTATIONS:
            continue
        if key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            result[key] = {**mine, **{name: _merge(_as_schema(mine[name]), _as_schema(sub)) if name in mine else sub
                                      for name, sub in value.items()}}
        elif key == "required" and isinstance(mine, list) and isinstance(value, list):
            result[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "type":
            result[key] = _common_type(mine, value)
        elif key in LOWER_BOUNDS and _numbers(mine, value):
            result[key] = max(mine, value)
        elif key in UPPER_BOUNDS and _numbers(mine, value):
            result[key] = min(mine, value)
        elif key == "enum" and isinstance(mine, list) and isinstance(value, list):
            result[key] = [item for item in mine if item in value]
            if not result[key]:
                raise GrammarError("allOf: its schemas' enums have no value in common")
        elif key == "additionalProperties":
            result[key] = False if False in (mine, value) else (
                _merge(_as_schema(mine), _as_schema(value)))
        elif key == "items" and isinstance(mine, dict) and isinstance(value, dict):
            result[key] = _merge(mine, value)
        elif key in ("anyOf", "oneOf") and isinstance(mine, list) and isinstance(value, list):
            if len(mine) * len(value) > MAX_ALTERNATIVES:
                raise GrammarError(f"allOf: its alternatives make over {MAX_ALTERNATIVES} combinations")
            result[key] = [_merge(_as_schema(a), _as_schema(b)) for a in mine for b in value]
        else:
            raise GrammarError(f"allOf: its schemas give {key!r} two values ({str(mine)[:60]} and "
                               f"{str(value)[:60]}), which one grammar cannot hold both of")
    if "anyOf" in result and "oneOf" in result:  # the grammar cannot say "exactly one": both become any
        other = result.pop("oneOf")
        result["anyOf"] = _merge({"anyOf": result["anyOf"]}, {"anyOf": other})["anyOf"]
    return result


def _numbers(*values: Any) -> bool:
    return all(isinstance(value, int | float) and not isinstance(value, bool) for value in values)


def _common_type(first: Any, second: Any) -> Any:
    """The JSON types both allow ("integer" is a "number"); GrammarError when none."""
    def kinds(value: Any) -> set[str]:
        return {value} if isinstance(value, str) else {str(item) for item in value} if isinstance(value, list) \
            else set()

    mine, theirs = kinds(first), kinds(second)
    common = mine & theirs
    if ("integer" in mine and "number" in theirs) or ("number" in mine and "integer" in theirs):
        common.add("integer")
    if not common:
        raise GrammarError(f"allOf: its schemas' types {first!r} and {second!r} have no value in common")
    return common.pop() if len(common) == 1 else sorted(common)
