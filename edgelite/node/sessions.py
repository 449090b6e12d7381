"""A node's sessions and their KV beyond the steps: ending a session, storing its KV in the
node's KV store, starting one from stored KV (this node's own entries, or the layers' KV from
the nodes that held them before a re-split), and lending stored KV to other nodes. The one
owner of KV restore and export on a node; the steps themselves run in the data plane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine.kv import Slot
from edgelite.engine.kvstore import KVStore, hand_over, open_store, restore_into
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.net import messages as m
from edgelite.node import kvshare
from edgelite.node.dataplane import DataPlane
from edgelite.node.kvshare import kv_tokens
from edgelite.node.stages import Stage, StageStore

log = logging.getLogger(__name__)


class Sessions:
    """Answers end_session, kv_save, kv_restore, kv_export and kv_export_read. `data` gives
    the data plane now (the node restarts it if its thread dies)."""

    def __init__(self, store: StageStore, cfg: NodeConfig, token: str, limits: WireLimits,
                 data: Callable[[], DataPlane]) -> None:
        self.store, self.cfg, self.token, self.limits, self.data = store, cfg, token, limits, data
        self.kv: KVStore | None = None  # the KV store, opened by open()
        # restores under way, each reading a KV store entry into its session's slot
        self.restores: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.exports = kvshare.Exports(cfg)  # stored KV read for other nodes (kv_export)

    async def open(self, data_dir: Path) -> None:
        self.kv = await asyncio.to_thread(open_store, self.cfg.runtime.kv_store, data_dir / "kv")

    async def stop_restores(self) -> None:
        restores = list(self.restores.values())
        for t in restores:
            t.cancel()
        await asyncio.gather(*restores, return_exceptions=True)  # each frees its slot first

    async def close(self) -> None:
        """After the data plane stopped: the store, once its queued writes are done."""
        if self.kv is not None:
            await asyncio.to_thread(self.kv.close)

    def stats(self) -> dict[str, object]:
        return {"restores": len(self.restores),
                "kv_store": self.kv.stats() if self.kv is not None else None,
                "kv_exports": self.exports.stats()}

    def _own_stage(self, plan_id: str, owner: str, what: str) -> Stage:
        stage = self.store.stages.get(plan_id)
        if stage is None or stage.owner != owner:
            raise ProtocolError(f"{what}: plan {plan_id[:12]} is not loaded here by this client")
        return stage

    async def end(self, msg: m.EndSession, owner: str) -> m.Ended:
        self._own_stage(msg.plan_id, owner, "end")
        plan_id, session = msg.plan_id, msg.session
        await self._restore_done(plan_id, session)
        data = self.data()
        return m.Ended(id=msg.id, freed=await data.submit(lambda: data.end(plan_id, session)))

    async def kv_save(self, msg: m.KvSave, owner: str) -> m.KvSaved:
        """Store a session's KV (copied on the data plane's thread, after the steps before
        this request; written off it, and with `behind` after the answer: a later restore or
        export waits for the write)."""
        stage = self._own_stage(msg.plan_id, owner, "kv_save")
        tokens = kv_tokens(msg.tokens, "kv_save")
        if self.kv is None or len(tokens) < self.kv.block:
            return m.KvSaved(id=msg.id, bytes=0)
        plan_id, session = msg.plan_id, msg.session
        await self._restore_done(plan_id, session)
        kv = await self.data().submit(lambda: self.store.export_kv(plan_id, session, len(tokens)))
        try:
            put = self.kv.put_later if msg.behind else self.kv.put
            size = await asyncio.to_thread(put, stage.kv_layout, tokens, kv)
        except OSError as exc:
            raise EdgeliteError(f"kv_save: the KV store cannot write: {exc}") from exc
        return m.KvSaved(id=msg.id, bytes=size)

    async def kv_restore(self, msg: m.KvRestore, owner: str) -> m.KvRestored:
        """Start a session from the KV store, in two parts. The answer comes once the index
        has given the longest stored prefix and a slot is reserved for it (on the data plane's
        thread); the entry is then read and checked into the slot off that thread while the
        client goes on (its own layers, its first step). Steps of the session wait for the
        read on the data plane (no other session's step does); the slot then becomes the
        session's, or, when the entry failed its checks, is freed and those steps fail (the
        client computes the prompt instead)."""
        stage = self._own_stage(msg.plan_id, owner, "kv_restore")
        tokens = kv_tokens(msg.tokens, "kv_restore")[:stage.layers.pool.max_length]
        plan_id, session, kv, layout = msg.plan_id, msg.session, self.kv, stage.kv_layout
        await self._restore_done(plan_id, session)
        own = 0
        if kv is not None and len(tokens) >= kv.block:
            own = await asyncio.to_thread(kv.longest, layout, tokens)
        imp = None
        if msg.sources and own < len(tokens):  # its layers were held by other stages
            imp = await kvshare.plan(kv, layout, tokens, msg.sources, self.token, self.limits, self.cfg)
        data = self.data()
        try:
            use = imp if imp is not None and imp.length > own else None  # else its own entries
            length = use.length if use is not None else own
            if msg.exact and length != len(msg.tokens) // 4:
                length = 0
            if not length:
                await data.submit(lambda: data.end(plan_id, session))
                return m.KvRestored(id=msg.id, length=0)
            slot = await data.submit(lambda: data.reserve(stage, session, length))
            key = (plan_id, session)
            task = asyncio.create_task(self._fill(stage, session, slot, tokens[:length], use))
            imp = None if use is imp else imp  # the fill closes the import it was handed
            self.restores[key] = task
            task.add_done_callback(lambda t: self._forget_restore(key, t))
            return m.KvRestored(id=msg.id, length=length)
        finally:
            if imp is not None:
                await imp.close()

    async def _fill(self, stage: Stage, session: str, slot: Slot, tokens: np.ndarray,
                    imp: kvshare.Import | None) -> None:
        """Read the entry for exactly `tokens` (or, with `imp`, the layers' KV from where
        the plan before held them) into the reserved slot, then hand it over."""
        view = stage.layers.pool.view(slot)

        def attach(n: int) -> Awaitable[int]:
            data = self.data()
            return data.submit(lambda: data.restored(stage, session, slot, n))

        def abandon() -> Awaitable[None]:
            data = self.data()
            return data.submit(lambda: data.restored(stage, session, slot, None))

        try:
            if imp is None:
                assert self.kv is not None
                await restore_into(self.kv, stage.kv_layout, tokens, view, True, attach, abandon)
            else:
                await hand_over(kvshare.fill(self.kv, imp, tokens, view, self.cfg.kv_fetch_timeout_s),
                                attach, abandon)
        except (EdgeliteError, OSError, TimeoutError) as exc:  # unloaded meanwhile, stopping
            log.warning("session %s: its KV was not restored: %s", session[:12], exc)

    async def kv_export(self, msg: m.KvExport, owner: str) -> m.KvExportReady:
        """Another node takes over layers of a conversation this node stored (KvRestore.sources)."""
        return await self.exports.open(self.kv, msg, owner)

    async def kv_export_read(self, msg: m.KvExportRead, owner: str) -> m.KvExportData:
        return self.exports.read(msg, owner)

    def _forget_restore(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self.restores.get(key) is task:
            del self.restores[key]

    async def _restore_done(self, plan_id: str, session: str) -> None:
        """Wait for a restore of the session under way to end (a request about the session
        comes after it)."""
        task = self.restores.get((plan_id, session))
        if task is not None:
            await asyncio.wait([task])
