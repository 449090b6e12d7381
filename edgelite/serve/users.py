"""Who may use a gateway: users.json, each user with its own token and tier."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgelite.errors import EdgeliteError


@dataclass(frozen=True)
class User:
    name: str
    token: str
    tier: int


ANONYMOUS = User("anonymous", "", 0)  # every HTTP request when the server has no users file


def load_users(path: Path) -> dict[str, User]:
    """users.json: {"users": [{"name", "token", "tier"}]} (tier 0 = lowest)."""
    try:
        raw = json.loads(path.read_text())
        users = [User(str(u["name"]), str(u["token"]), int(u["tier"])) for u in raw["users"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EdgeliteError(f"{path}: not a users file ({exc!r}); expected "
                            f'{{"users": [{{"name", "token", "tier"}}]}}') from exc
    if any(u.tier < 0 for u in users) or len({u.name for u in users}) != len(users):
        raise EdgeliteError(f"{path}: user names must be unique and tiers >= 0")
    return {u.name: u for u in users}
