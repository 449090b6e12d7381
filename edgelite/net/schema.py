"""How messages are declared and checked: the machinery behind messages.py.

A frame is a msgpack map whose `type` names a registered message class. `parse(frame, limits)`
builds that class after checking every field against its annotation: exact types (a bool is not an int, an
int is accepted where a float is expected), string, bytes and list lengths, integer ranges, known
literals, tensors (dtype, rank, shape x dtype = length, all within the wire limits); unknown
fields are refused. Every handler receives a typed message; a frame that fails gets a
ProtocolError naming the message and the field.

Bounds that depend on the receiver (a stage's hidden size, a node's quota) are checked where
the message is handled; bounds here are the protocol's own.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from edgelite.config import WireLimits
from edgelite.errors import ProtocolError
from edgelite.net.tensors import decode_tensor, encode_tensor

Json = dict[str, Any]  # a free-form map, validated by whoever consumes it (manifest, stats)
Tensor = np.ndarray
SHORT = 256  # default limit of a string field
MAX_ITEMS = 4096  # default limit of a list field


def bounds(lo: int | float | None = None, hi: int | float | None = None, max_len: int | None = None,
           default: Any = dataclasses.MISSING) -> Any:
    """A field with limits: integer or float range, or the length of a str/bytes/list."""
    meta = {"lo": lo, "hi": hi, "max_len": max_len}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class Message:
    """Base of every message class; `TYPE` is its tag on the wire."""

    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is not None or f.default is not None:
                out[f.name] = _encode(v)
        return out


def _encode(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return encode_tensor(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(v)
                if getattr(v, f.name) is not None}
    if isinstance(v, list | tuple):
        return [_encode(x) for x in v]
    return v


# ---- compiled checkers -------------------------------------------------------------------
Check = Callable[[Any, WireLimits, str], Any]


def _type_error(where: str, want: str, v: Any) -> ProtocolError:
    shown = repr(v) if isinstance(v, int | float | bool | type(None)) else type(v).__name__
    return ProtocolError(f"{where}: expected {want}, got {shown}")


def _int(lo: Any, hi: Any) -> Check:
    def check(v: Any, _limits: WireLimits, where: str) -> int:
        if type(v) is not int:
            raise _type_error(where, "an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ProtocolError(f"{where}: {v} is outside {lo}..{hi}")
        return v
    return check


def _float(lo: Any, hi: Any) -> Check:
    def check(v: Any, _limits: WireLimits, where: str) -> float:
        if type(v) is not float and type(v) is not int:
            raise _type_error(where, "a number", v)
        if not math.isfinite(v):
            raise ProtocolError(f"{where}: {v} is not finite")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ProtocolError(f"{where}: {v} is outside {lo}..{hi}")
        return float(v)
    return check


def _exact(kind: type, name: str, max_len: int | None) -> Check:
    def check(v: Any, limits: WireLimits, where: str) -> Any:
        if type(v) is not kind:
            raise _type_error(where, name, v)
        cap = max_len if max_len is not None else (limits.max_frame_bytes if kind is bytes else SHORT)
        if kind is not bool and len(v) > cap:
            raise ProtocolError(f"{where}: {len(v)} long, the limit is {cap}")
        return v
    return check


def _tensor(v: Any, limits: WireLimits, where: str) -> np.ndarray:
    return decode_tensor(v, limits, where)


def _json(v: Any, _limits: WireLimits, where: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise _type_error(where, "a map", v)
    return v


def _literal(values: tuple[Any, ...]) -> Check:
    def check(v: Any, _limits: WireLimits, where: str) -> Any:
        if type(v) is not str or v not in values:
            raise ProtocolError(f"{where}: {str(v)[:40]!r} is not one of {', '.join(values)}")
        return v
    return check


def _optional(inner: Check) -> Check:
    def check(v: Any, limits: WireLimits, where: str) -> Any:
        return None if v is None else inner(v, limits, where)
    return check


def _list(inner: Check, max_len: int | None, fixed: int | None = None) -> Check:
    cap = max_len if max_len is not None else MAX_ITEMS

    def check(v: Any, limits: WireLimits, where: str) -> list[Any]:
        if type(v) is not list:
            raise _type_error(where, "a list", v)
        if fixed is not None and len(v) != fixed:
            raise ProtocolError(f"{where}: expected {fixed} items, got {len(v)}")
        if len(v) > cap:
            raise ProtocolError(f"{where}: {len(v)} items, the limit is {cap}")
        return [inner(x, limits, f"{where}[{i}]") for i, x in enumerate(v)]
    return check


def _str_map(inner: Check, max_len: int | None) -> Check:
    cap = max_len if max_len is not None else MAX_ITEMS

    def check(v: Any, limits: WireLimits, where: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise _type_error(where, "a map", v)
        if len(v) > cap:
            raise ProtocolError(f"{where}: {len(v)} entries, the limit is {cap}")
        out = {}
        for k, x in v.items():
            if type(k) is not str or len(k) > SHORT:
                raise ProtocolError(f"{where}: keys must be short strings")
            out[k] = inner(x, limits, f"{where}[{k[:20]!r}]")
        return out
    return check


def _record(cls: type) -> Check:
    fields = _compile(cls)

    def check(v: Any, limits: WireLimits, where: str) -> Any:
        if type(v) is not dict:
            raise _type_error(where, "a map", v)
        return _build(cls, fields, v, limits, where)
    return check


def _checker(tp: Any, meta: Any) -> Check:
    lo, hi, max_len = meta.get("lo"), meta.get("hi"), meta.get("max_len")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {tp}")
        return _optional(_checker(rest[0], meta))
    if origin is Literal:
        return _literal(args)
    if origin is list:
        return _list(_checker(args[0], {}), max_len)
    if origin is tuple:
        items = _list(_checker(args[0], {}), max_len, fixed=len(args))
        return lambda v, limits, where: tuple(items(v, limits, where))
    if origin is dict:
        if args[1] is Any:
            return _json
        return _str_map(_checker(args[1], {}), max_len)
    if tp is int:
        return _int(lo, hi)
    if tp is float:
        return _float(lo, hi)
    if tp is str:
        return _exact(str, "a string", max_len)
    if tp is bytes:
        return _exact(bytes, "bytes", max_len)
    if tp is bool:
        return _exact(bool, "true or false", None)
    if tp is np.ndarray:
        return _tensor
    if tp is Any:
        return lambda v, _l, _w: v
    if dataclasses.is_dataclass(tp):
        return _record(tp)
    raise TypeError(f"no wire checker for {tp!r}")


Field = tuple[str, Check, bool, Any]  # name, checker, required, default
_COMPILED: dict[type, tuple[Field, ...]] = {}


def _compile(cls: type) -> tuple[Field, ...]:
    if cls not in _COMPILED:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = f.default_factory if f.default_factory is not dataclasses.MISSING else f.default
            out.append((f.name, _checker(hints[f.name], f.metadata), required, default))
        _COMPILED[cls] = tuple(out)
    return _COMPILED[cls]


def _build(cls: type, fields: tuple[Field, ...], raw: dict[str, Any], limits: WireLimits,
           where: str) -> Any:
    known = {name for name, *_ in fields}
    extra = [k for k in raw if k not in known and k != "type"]
    if extra:
        raise ProtocolError(f"{where}: unknown field {str(extra[0])[:40]!r}")
    values = {}
    for name, check, required, default in fields:
        if name in raw:
            values[name] = check(raw[name], limits, f"{where}.{name}")
        elif required:
            raise ProtocolError(f"{where}: missing field {name!r}")
        else:
            values[name] = default() if callable(default) else default
    return cls(**values)


REGISTRY: dict[str, type[Message]] = {}


def message(tag: str) -> Callable[[type], type]:
    """Register a frozen dataclass as the message with this wire tag."""
    def wrap(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        cls.TYPE = tag
        if tag in REGISTRY:
            raise TypeError(f"message type {tag!r} registered twice")
        REGISTRY[tag] = cls
        return cls
    return wrap


def record(cls: type) -> type:
    """A nested record inside messages (a frozen dataclass, checked like a message's fields)."""
    return dataclass(frozen=True)(cls)


def parse(frame: dict[str, Any], limits: WireLimits) -> Message:
    """The typed message for a decoded frame, or ProtocolError naming what is wrong."""
    tag = frame.get("type")
    cls = REGISTRY.get(tag) if type(tag) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(tag)[:40]!r}")
    return _build(cls, _compile(cls), frame, limits, tag)  # type: ignore[arg-type]
