"""What clients deploy on a node: files (content-addressed blobs), model folders (the shelf),
and plans: a stage's layers loaded, installed in the data plane and connected onward to the
next stage; and what `edgelite models` asks of what is kept (list, remove, collect)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from edgelite.config import NodeConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.net import messages as m
from edgelite.net.frames import detach
from edgelite.net.handshake import connect
from edgelite.node.blobs import check_sha
from edgelite.node.dataplane import DataPlane
from edgelite.node.shelf import Shelf
from edgelite.node.stages import Stage, StageStore

log = logging.getLogger(__name__)


class Deploy:
    """Answers files, upload, model_put, load, models, model_rm and blobs_gc. `data` gives the
    data plane now; `who` gives a client key's (KV domain, address)."""

    def __init__(self, store: StageStore, shelf: Shelf, cfg: NodeConfig, token: str,
                 limits: WireLimits, data: Callable[[], DataPlane],
                 who: Callable[[str], tuple[str, str]]) -> None:
        self.store, self.shelf, self.cfg, self.token, self.limits = store, shelf, cfg, token, limits
        self.data, self.who = data, who
        self.loading: dict[str, str] = {}  # plan ids being loaded -> their owners

    async def files(self, msg: m.FilesQuery, _owner: str) -> m.FilesState:
        shas = [check_sha(s) for s in msg.sha256]
        b = self.store.blobs
        # (a blob counts only when intact: a damaged one is deleted and uploaded again)
        have = await asyncio.to_thread(lambda: [s for s in shas if b.intact(s)])
        return m.FilesState(id=msg.id, have=have, partial={s: b.partial(s) for s in shas})

    async def upload(self, msg: m.Upload, _owner: str) -> m.UploadAck:
        held = await asyncio.to_thread(self.store.blobs.append, check_sha(msg.sha256), msg.offset,
                                       msg.total, msg.data)
        return m.UploadAck(id=msg.id, held=held, complete=held == msg.total)

    async def model_put(self, msg: m.ModelPut, owner: str) -> m.ModelStored:
        path = await asyncio.to_thread(self.shelf.put, msg.name, msg.files, self.who(owner)[0])
        return m.ModelStored(id=msg.id, path=str(path), files=len(msg.files))

    async def models(self, msg: m.ModelsQuery, owner: str) -> m.ModelsState:
        domain = self.who(owner)[0]
        shelved = await asyncio.to_thread(self.shelf.entries)
        f = await asyncio.to_thread(self.store.blobs.figures)
        return m.ModelsState(
            id=msg.id, blobs=m.BlobSummary(f.files, f.bytes, f.unused_files, f.unused_bytes,
                                           f.recent_files, f.recent_bytes),
            models=[m.ShelvedModel(s.path.name, s.title[:256], s.weights[:16], s.layers, s.bytes,
                                   s.owner == domain) for s in shelved])

    async def model_rm(self, msg: m.ModelRemove, owner: str) -> m.ModelRemoved:
        size = await asyncio.to_thread(self.shelf.remove, msg.name, self.who(owner)[0])
        return m.ModelRemoved(id=msg.id, bytes=size)

    async def blobs_gc(self, msg: m.BlobsCollect, _owner: str) -> m.BlobsCollected:
        """Any client may ask: only files nothing uses go, and a deploy under way keeps its
        own (used within the grace time)."""
        files, freed = await asyncio.to_thread(self.store.blobs.collect, self.store.blobs.grace_s)
        return m.BlobsCollected(id=msg.id, files=files, bytes=freed)

    async def load(self, msg: m.Load, owner: str) -> m.Loaded:
        pid = msg.plan_id
        existing = self.store.stages.get(pid)
        if pid in self.loading or (existing is not None and existing.owner != owner):
            raise ProtocolError(f"load: plan_id {pid[:12]} is another client's")
        held = len(self.store.plans_of(owner)) + sum(o == owner for o in self.loading.values())
        if existing is None and held >= self.cfg.max_plans_per_client:  # (loading ones count)
            raise ProtocolError(f"load: this client has {self.cfg.max_plans_per_client} plans "
                                f"loaded here, the limit (max_plans_per_client)")
        if (msg.next is None) != (msg.next_capability is None):
            raise ProtocolError("load: next and next_capability go together")
        self.loading[pid] = owner
        domain, address = self.who(owner)
        try:
            stage = await asyncio.to_thread(self.store.build, pid, msg.manifest, msg.first,
                                            msg.last, msg.next, owner, msg.next_capability,
                                            domain, address, msg.max_chunk)
            try:
                await self.data().install(stage)
            except BaseException:
                self.store.release(stage)
                raise
            if msg.next is not None:
                try:
                    await self.connect_onward(stage)
                except BaseException:
                    await self.data().unload(pid)
                    raise
        finally:
            self.loading.pop(pid, None)
        log.info("plan %s of client %s: layers %d-%d of %s loaded, next %s", pid[:8], owner[:8],
                 msg.first, msg.last, stage.manifest.name, msg.next or "the client")
        return m.Loaded(id=msg.id, first=msg.first, last=msg.last, capability=stage.capability)

    async def connect_onward(self, stage: Stage) -> None:
        """A data connection of the stage's plan to its next stage (which has loaded it)."""
        addr = stage.next_addr
        assert addr is not None and stage.next_capability is not None
        try:
            conn, _ = await connect(addr, self.token, stage.manifest.fingerprint, self.limits,
                                    self.cfg.forward_connect_timeout_s)
        except (ConnectionError, AuthError) as exc:
            raise EdgeliteError(f"next stage {exc}") from exc
        try:
            await conn.send(m.OpenData(id=0, plan_id=stage.plan_id, role="in",
                                       capability=stage.next_capability))
            reply = await asyncio.wait_for(conn.recv(), self.cfg.forward_connect_timeout_s)
            if not isinstance(reply, m.DataReady):
                raise EdgeliteError(f"next stage {addr}: "
                                    f"{getattr(reply, 'message', reply.TYPE)}")
        except BaseException:
            await conn.close()
            raise
        self.data().set_outbound(stage.plan_id, detach(conn.writer))
