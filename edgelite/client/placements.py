"""Where this client's conversations' KV was stored, per model: the layer ranges of the plans
that saved it last (each on a node, or on this device), in $EDGELITE_HOME/kv_placements.json.

Every part of a plan stores its layers' KV under its own range. When a conversation goes on
under a plan that splits the model otherwise (other nodes, other ranges), a stage's own
entries do not cover its new range; `sources` tells it where the layers were held instead
(KvRestore.sources), and the node takes them from there (node/kvshare.py). This file only
points: entries are found and checked by their token ids, so a stale or wrong placement
costs a miss (the history is computed), never wrong KV.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass

from edgelite.engine.kvfile import write_atomic
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.paths import home

log = logging.getLogger(__name__)
FILE = "kv_placements.json"


@dataclass(frozen=True)
class Span:
    """Layers first..last, held by the node at `addr` (None: this device)."""

    addr: NodeAddr | None
    first: int
    last: int


Placement = tuple[Span, ...]


def load(fingerprint: str) -> Placement | None:
    """The model's newest placement (None when none is known or the file is unreadable)."""
    path = home() / FILE
    try:
        data = json.loads(path.read_text())
        raw = data.get(fingerprint)
        if raw is None:
            return None
        return tuple(Span(None if s["addr"] is None else NodeAddr.parse(s["addr"]),
                          int(s["first"]), int(s["last"])) for s in raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, EdgeliteError) as exc:
        log.warning("%s is not readable (%s); where earlier plans stored KV is forgotten", path, exc)
        return None


def record(fingerprint: str, placement: Placement) -> None:
    """Make `placement` the model's newest."""
    path = home() / FILE
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    data[fingerprint] = [{"addr": None if s.addr is None else str(s.addr), "first": s.first,
                          "last": s.last} for s in placement]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, [json.dumps(data, indent=1).encode()])
    except OSError as exc:
        log.warning("cannot write %s (%s); a plan that moves layers will compute their KV", path, exc)


def sources(newest: Placement | None, span: Span) -> list[m.KvSource]:
    """Where a node stage's layers were stored last, for KvRestore.sources: the stages of the
    newest placement that held them (the stage itself among them as addr None); [] when that
    placement had this very stage, or had some of its layers on this device (a node cannot
    take KV from a client), or nothing is known."""
    if newest is None or span in newest:
        return []
    held = sorted((s for s in newest if s.first <= span.last and s.last >= span.first),
                  key=lambda s: s.first)
    whole = (held and held[0].first <= span.first and held[-1].last >= span.last
             and all(a.last + 1 == b.first for a, b in itertools.pairwise(held)))
    if not whole or any(s.addr is None for s in held):
        return []
    return [m.KvSource(addr=None if s.addr == span.addr else s.addr, first=s.first, last=s.last)
            for s in held]


class Tracker:
    """A backend's view of where its model's KV was stored last: read once, written when a
    save happens under another placement."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.placement: Placement | None = None
        self.loaded = False

    async def newest(self) -> Placement | None:
        if not self.loaded:
            self.placement, self.loaded = await asyncio.to_thread(load, self.fingerprint), True
        return self.placement

    async def saved(self, placement: Placement) -> None:
        if await self.newest() != placement:
            await asyncio.to_thread(record, self.fingerprint, placement)
            self.placement = placement
