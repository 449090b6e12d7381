"""Where a client keeps its files: $EDGELITE_HOME, else ~/.edgelite; and the machine's build cache."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)
KV_KEY_FILE = "kv_key"  # in home(): the secret under which nodes keep this client's KV


def home() -> Path:
    return Path(os.environ.get("EDGELITE_HOME") or Path.home() / ".edgelite")


def cache() -> Path:
    """Where this machine keeps what it builds for itself (engine/kernels' libraries, named
    by what they were built from): $EDGELITE_CACHE, else $XDG_CACHE_HOME/edgelite, else
    ~/.cache/edgelite. Shared by every edgelite home on the machine."""
    if os.environ.get("EDGELITE_CACHE"):
        return Path(os.environ["EDGELITE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgelite"


def kv_key() -> str | None:
    """This client's KV key (Auth.kv), made once and kept (readable by its user only), so that
    its conversations' KV on the nodes is its own and still found after a restart. None when
    it can be neither read nor made (then a key per process: nodes' KV is not reused across
    restarts)."""
    path = home() / KV_KEY_FILE
    try:
        key = path.read_text().strip()
        if len(key) >= 32:
            return key
    except OSError:
        pass
    key = secrets.token_hex(16)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
    except OSError as exc:
        log.info("cannot keep a KV key in %s (%s): this process's KV on the nodes is its own", path, exc)
        return None
    return key
