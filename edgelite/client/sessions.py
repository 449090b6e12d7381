"""Conversations kept on disk by name (`edgelite chat --session NAME`): the messages, written
atomically after every reply. Their KV lives in the KV stores, found again by token prefix, so
a resumed conversation computes only what is new."""

from __future__ import annotations

import json
import re
from pathlib import Path

from edgelite.engine.kvfile import write_atomic
from edgelite.errors import EdgeliteError
from edgelite.paths import home

Message = dict[str, str]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def path_of(name: str) -> Path:
    """A session's file: NAME in $EDGELITE_HOME/sessions, or a path given as such."""
    if "/" in name or name.endswith(".json"):
        return Path(name).expanduser()
    if not NAME.fullmatch(name):
        raise EdgeliteError(f"session name {name[:80]!r}: use letters, digits, '_', '-', '.' "
                            f"(at most 64), or a path to a .json file")
    return home() / "sessions" / f"{name}.json"


def load(name: str) -> list[Message]:
    """The session's messages ([] for a new one)."""
    path = path_of(name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise EdgeliteError(f"session file {path} cannot be read: {exc}") from None
    msgs = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise EdgeliteError(f"session file {path} is not a conversation (messages with role "
                            f"and content)")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def save(name: str, messages: list[Message]) -> None:
    path = path_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, [json.dumps({"messages": messages}, ensure_ascii=False, indent=1).encode()])
