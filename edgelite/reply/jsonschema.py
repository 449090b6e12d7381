"""Replies that follow a JSON schema (`response_format: json_schema`): which schemas are taken,
and whether a JSON object's prefix (reply/jsonprefix.py took its syntax) can still become an
object the schema accepts.

The subset: `type` (object, array, string, number, integer, boolean, null, or a list of
them), `properties` (an object's keys: no others are written), `required`, `items`, `enum`
(of strings, numbers, booleans and null), `anyOf` (a value any of its schemas accepts: how a
tool call's schema is built, reply/tools.py), nesting; `title`, `description`, `default`,
`additionalProperties: false` and `strict` are accepted and change nothing. Anything else is
refused, naming the keyword. The prefix is parsed again at each check (a reply is short);
every check is pure Python.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edgelite.errors import EdgeliteError

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
KEYWORDS = {"type", "properties", "required", "items", "enum", "anyOf", "title", "description",
            "default", "additionalProperties", "$schema"}
CONSTRAINING = {"type", "properties", "required", "items", "enum"}  # (the rest only annotate)
MAX_DEPTH = 16
PENDING = "\u0080"  # stands for a character whose bytes are still coming (any non-ASCII one)
BYTE_MARK = 0xE000  # after PENDING: its bytes so far, each as the character BYTE_MARK + byte
ESCAPED = "\x00escaped"  # a key written with an escape: it matches no property


def pending(tail: bytes) -> str:
    """A character still coming, its first bytes `tail`, as the end of a text `fits` takes."""
    return PENDING + "".join(chr(BYTE_MARK + b) for b in tail)


def _starts(value: str, prefix: str) -> bool:
    """Whether `value` begins with `prefix`, which may end with a character still coming
    (`pending`: that character is non-ASCII, and begins with the bytes given, if any)."""
    at = prefix.find(PENDING)
    if at < 0:
        return value.startswith(prefix)
    head, tail = prefix[:at], bytes(ord(c) - BYTE_MARK for c in prefix[at + 1:])
    return (value.startswith(head) and len(value) > at and value[at] >= PENDING
            and value[at].encode().startswith(tail))


def check_reply_schema(schema: Any) -> dict[str, Any]:
    """A reply's schema: an object's (the reply is one JSON object), within the subset."""
    check_schema(schema)
    if _types(schema) not in ((), ("object",)):
        raise EdgeliteError("schema: a reply is one JSON object: its type must be object")
    return schema


def check_schema(schema: Any, where: str = "schema", depth: int = 0) -> None:
    """Raise EdgeliteError naming the first part of `schema` outside the subset."""
    if not isinstance(schema, dict):
        raise EdgeliteError(f"{where} must be an object")
    if depth > MAX_DEPTH:
        raise EdgeliteError(f"{where}: nested deeper than {MAX_DEPTH}")
    unknown = sorted(set(schema) - KEYWORDS)
    if unknown:
        raise EdgeliteError(f"{where}: keyword {unknown[0]!r} is not supported (supported: "
                            f"{', '.join(sorted(KEYWORDS - {'$schema'}))})")
    if schema.get("additionalProperties", False) is not False:
        raise EdgeliteError(f"{where}: additionalProperties must be false (an object holds its "
                            f"properties only)")
    for t in _types(schema, where):
        if t not in TYPES:
            raise EdgeliteError(f"{where}: type {t!r} is not one of {', '.join(TYPES)}")
    if "enum" in schema:
        enum = schema["enum"]
        if (not isinstance(enum, list) or not enum
                or not all(v is None or isinstance(v, str | int | float | bool) for v in enum)):
            raise EdgeliteError(f"{where}: enum must be a non-empty list of strings, numbers, "
                                f"booleans or null")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise EdgeliteError(f"{where}: properties must be an object")
    for key, sub in props.items():
        check_schema(sub, f"{where}.properties.{key}", depth + 1)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(k in props for k in required):
        raise EdgeliteError(f"{where}: required must list keys of properties")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items", depth + 1)
    if "anyOf" in schema:
        branches = schema["anyOf"]
        if not isinstance(branches, list) or not branches:
            raise EdgeliteError(f"{where}: anyOf must be a non-empty list of schemas")
        for i, sub in enumerate(branches):
            check_schema(sub, f"{where}.anyOf[{i}]", depth + 1)


def schema_size(schema: Any) -> int:
    """The alternatives a schema makes its constraint weigh for each candidate token: its enum
    values, properties and anyOf branches, counted through its whole nesting (a reply's token
    choice re-parses the prefix against each: the gateway bounds it, GatewayConfig's
    max_schema_values)."""
    if not isinstance(schema, dict):
        return 0
    props = schema.get("properties", {})
    own = (len(schema.get("enum", ())) + (len(props) if isinstance(props, dict) else 0)
           + len(schema.get("anyOf", ())))
    subs = [*(props.values() if isinstance(props, dict) else ()), *schema.get("anyOf", ()),
            *([schema["items"]] if "items" in schema else ())]
    return own + sum(schema_size(sub) for sub in subs)


def _types(schema: dict[str, Any], where: str = "schema") -> tuple[str, ...]:
    t = schema.get("type")
    if t is None:
        return ()
    if isinstance(t, str):
        return (t,)
    if isinstance(t, list) and t and all(isinstance(x, str) for x in t):
        return tuple(t)
    raise EdgeliteError(f"{where}: type must be a string or a list of strings")


# ---- a JSON prefix as a partial tree -----------------------------------------------------
@dataclass
class Node:
    """A value of the prefix: `kind` (object, array, string, number, literal), whether it is
    complete, its raw text (scalars; a string's unescaped so far), its items or pairs."""

    kind: str
    closed: bool = False
    text: str = ""
    items: list[Node] = field(default_factory=list)
    pairs: list[tuple[str, bool, Node | None]] = field(default_factory=list)  # key, key done, value
    wants_key: bool = False  # an object that ends where a key must follow (after `{` or `,`)
    escaped: bool = False  # a string holding an escape (keys and enum values are written plain)


class _Parser:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def at_end(self) -> bool:
        return self.i >= len(self.s)

    def value(self) -> Node | None:
        self.ws()
        if self.at_end():
            return None
        ch = self.s[self.i]
        if ch == "{":
            return self.obj()
        if ch == "[":
            return self.arr()
        if ch == '"':
            text, closed, escaped = self.string()
            return Node("string", closed, text, escaped=escaped)
        start = self.i
        while not self.at_end() and self.s[self.i] not in ",]} \t\n\r":
            self.i += 1
        raw = self.s[start:self.i]
        kind = "literal" if raw[:1] in "tfn" else "number"
        return Node(kind, not self.at_end(), raw)

    def string(self) -> tuple[str, bool, bool]:
        """(its characters so far, closed, whether it holds an escape)."""
        self.i += 1  # the opening quote
        out, escaped = [], False
        while not self.at_end():
            ch = self.s[self.i]
            if ch == '"':
                self.i += 1
                return "".join(out), True, escaped
            if ch == "\\":
                escaped = True
                chunk = self.s[self.i:self.i + 6] if self.s[self.i + 1:self.i + 2] == "u" else \
                    self.s[self.i:self.i + 2]
                try:
                    out.append(json.loads(f'"{chunk}"'))
                except ValueError:
                    self.i = len(self.s)  # an escape still incomplete: the prefix ends here
                    break
                self.i += len(chunk)
                continue
            out.append(ch)
            self.i += 1
        return "".join(out), False, escaped

    def obj(self) -> Node:
        node = Node("object")
        self.i += 1
        comma = False
        while True:
            self.ws()
            if self.at_end():
                node.wants_key = comma
                return node
            if self.s[self.i] == "}":
                self.i += 1
                node.closed = True
                return node
            if self.s[self.i] == ",":
                self.i += 1
                comma = True
                continue
            comma = False
            key, done, escaped = self.string()
            if escaped:
                key = ESCAPED  # (no property is written with an escape)
            if not done:
                node.pairs.append((key, False, None))
                return node
            self.ws()
            if not self.at_end() and self.s[self.i] == ":":
                self.i += 1
            value = self.value()
            node.pairs.append((key, True, value))
            if value is None or not value.closed:
                return node

    def arr(self) -> Node:
        node = Node("array")
        self.i += 1
        while True:
            self.ws()
            if self.at_end():
                return node
            if self.s[self.i] == "]":
                self.i += 1
                node.closed = True
                return node
            if self.s[self.i] == ",":
                self.i += 1
                continue
            value = self.value()
            if value is None:
                return node
            node.items.append(value)
            if not value.closed:
                return node


def fits(schema: dict[str, Any], text: str) -> bool:
    """Whether `text`, a JSON object's prefix, can still become a value `schema` accepts (it
    may end with PENDING inside a string: a character not complete yet)."""
    node = _Parser(text).value()
    return node is None or _fits(schema, node)


def _fits(schema: dict[str, Any], node: Node) -> bool:
    if "anyOf" in schema:  # (and whatever else the schema says beside it)
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        return any(_fits(sub, node) for sub in schema["anyOf"]) and (
            not rest.keys() & CONSTRAINING or _fits(rest, node))
    types = _types(schema)
    if "enum" in schema:  # (of scalars only)
        return node.kind not in ("object", "array") and _enum_any(schema["enum"], node)
    if node.kind == "object":
        return (not types or "object" in types) and _object_fits(schema, node)
    if node.kind == "array":
        items = schema.get("items")
        return (not types or "array" in types) and all(
            items is None or _fits(items, x) for x in node.items)
    if node.kind == "string":
        return not types or "string" in types
    if node.kind == "number":
        if not types or "number" in types:
            return True
        return "integer" in types and not any(c in node.text for c in ".eE")
    words = [w for w, t in (("true", "boolean"), ("false", "boolean"), ("null", "null"))
             if not types or t in types]
    return any(w == node.text if node.closed else w.startswith(node.text) for w in words)


@dataclass(frozen=True)
class _Index:
    """An enum's values or an object's keys as the checks take them: the strings sorted (the
    ones a prefix begins are neighbours), and as a set; the rest as they are."""

    strings: list[str]
    exact: frozenset[str]
    others: list[Any]

    def starting(self, prefix: str) -> Iterator[str]:
        """The strings that can begin with `prefix` (which may end with a character still
        coming: `pending`)."""
        at = prefix.find(PENDING)
        head = prefix if at < 0 else prefix[:at]
        i = bisect.bisect_left(self.strings, head)
        while i < len(self.strings) and self.strings[i].startswith(head):
            if at < 0 or _starts(self.strings[i], prefix):
                yield self.strings[i]
            i += 1


_INDEXES: dict[int, tuple[Any, _Index]] = {}  # id of an enum's list or a properties dict -> (it, its index)
MAX_INDEXES = 256  # indexes kept at once (all dropped past it: each is made again in one pass)


def _index(values: list[Any] | dict[str, Any]) -> _Index:
    """The index of an enum's values or an object's keys (made once: a schema is weighed for
    every candidate token, and a scan of each of 500 values cost seconds a token)."""
    hit = _INDEXES.get(id(values))
    if hit is None or hit[0] is not values:
        strings = sorted(v for v in values if isinstance(v, str))
        if len(_INDEXES) >= MAX_INDEXES:
            _INDEXES.clear()
        hit = _INDEXES[id(values)] = (values, _Index(strings, frozenset(strings),
                                                     [v for v in values if not isinstance(v, str)]))
    return hit[1]


def _enum_any(enum: list[Any], node: Node) -> bool:
    """Whether some value of `enum` can be (or begin with) the node."""
    index = _index(enum)
    if node.kind != "string":
        return any(_enum_fits(v, node) for v in index.others)
    if node.escaped:
        return False
    if node.closed:
        return node.text in index.exact
    return next(index.starting(node.text), None) is not None


def _enum_fits(value: Any, node: Node) -> bool:
    if isinstance(value, str):
        if node.kind != "string" or node.escaped:
            return False
        return value == node.text if node.closed else _starts(value, node.text)
    if node.kind == "string":
        return False
    raw = json.dumps(value)
    return raw == node.text if node.closed else raw.startswith(node.text)


def _object_fits(schema: dict[str, Any], node: Node) -> bool:
    props: dict[str, Any] = schema.get("properties", {})
    seen: set[str] = set()
    for key, key_done, value in node.pairs:
        if not key_done:
            return any(k not in seen for k in _index(props).starting(key))
        if key not in props or key in seen:
            return False
        seen.add(key)
        if value is not None and not _fits(props[key], value):
            return False
    if node.wants_key and not set(props) - seen:
        return False  # (a comma with no key left to write)
    return not node.closed or all(k in seen for k in schema.get("required", []))
