"""Client side of the cluster: connect, deploy, load a split, forward steps, detect failures.

Control requests (deploy, load, stats, pings) use one connection per node. Steps use two data
connections per plan: `in` to stage 1, whose data plane passes each step along the chain, and
`sink` from the last stage, on which the results come back. Results are matched to waiting steps
by (session, step), so many sessions are in flight at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite import manifest as mf
from edgelite import wire
from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import EdgeliteError, NodeError, NodeUnavailable
from edgelite.routes import Routes, route
from edgelite.runtime import KVCache, positions_for

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]


def parse_nodes(text: str) -> list[tuple[str, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise EdgeliteError(f"--nodes entry {part!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise EdgeliteError("--nodes lists no node")
    return out


def parse_split(text: str, n_layers: int, n_nodes: int) -> list[tuple[int, int]]:
    ranges = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or not (b or a).isdigit():
            raise EdgeliteError(f"--split entry {part!r} is not FIRST-LAST")
        ranges.append((int(a), int(b or a)))
    if len(ranges) != n_nodes:
        raise EdgeliteError(f"--split has {len(ranges)} ranges for {n_nodes} nodes")
    expect = 0
    for a, b in ranges:
        if a != expect or b < a:
            raise EdgeliteError(f"--split must cover layers 0-{n_layers - 1} in order; "
                                f"got {text!r}")
        expect = b + 1
    if expect != n_layers:
        raise EdgeliteError(f"--split covers layers 0-{expect - 1}, the model has 0-{n_layers - 1}")
    return ranges


def _read_chunk(path: Any, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def even_split(n_layers: int, n_nodes: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n_layers, n_nodes + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in itertools.pairwise(bounds)]


@dataclass
class NodeLink:
    """One authenticated connection to a node, with a reader that routes every reply."""

    addr: tuple[str, int]
    conn: wire.Conn
    on_result: Callable[[dict[str, Any]], None]
    on_lost: Callable[[NodeLink, BaseException | None], None]
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    task: asyncio.Task | None = None
    closed: bool = False

    @property
    def name(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._read(), name=f"link {self.name}")

    async def _read(self) -> None:
        exc: BaseException | None = None
        try:
            while True:
                msg = await self.conn.recv()
                if msg["type"] == "result":
                    self.on_result(msg)
                elif (fut := self.pending.pop(msg.get("id"), None)) is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, EdgeliteError) as e:
            exc = e
        finally:
            self.closed = True
            err = NodeUnavailable(f"node {self.name} closed the connection", node=self.name)
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(err)
            self.pending.clear()
            self.on_lost(self, exc)

    async def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.closed:
            raise NodeUnavailable(f"node {self.name} closed the connection", node=self.name)
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            await self.conn.send({**msg, "id": rid})
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise NodeUnavailable(f"node {self.name} did not answer {msg['type']} within "
                                  f"{timeout:g} s", node=self.name) from exc
        except (ConnectionError, OSError) as exc:
            raise NodeUnavailable(f"node {self.name}: {exc}", node=self.name) from exc
        finally:
            self.pending.pop(rid, None)
        if reply["type"] == "error":
            raise NodeError(f"node {self.name}: {reply.get('message')}", node=self.name)
        return reply

    async def close(self) -> None:
        await self.conn.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class Cluster:
    def __init__(self, manifest: mf.Manifest, token: str, cfg: ClientConfig | None = None,
                 limits: WireLimits | None = None) -> None:
        self.manifest, self.token = manifest, token
        self.cfg, self.limits = cfg or ClientConfig(), limits or WireLimits()
        self.links: list[NodeLink] = []
        self.stages: list[tuple[NodeLink, int, int]] = []
        self.plan_id = uuid.uuid4().hex[:16]
        self.waiting: dict[tuple[str, int], asyncio.Future] = {}
        self.lost: dict[str, str] = {}
        self.data_in: NodeLink | None = None  # steps go to stage 1 on this connection
        self.sink: NodeLink | None = None  # the last stage's results come back on this one

    async def connect(self, addrs: list[tuple[str, int]]) -> None:
        for addr in addrs:
            self.links.append(await self._open(addr))

    async def _open(self, addr: tuple[str, int]) -> NodeLink:
        try:
            conn, _ = await wire.connect(*addr, self.token, self.manifest.fingerprint,
                                         self.limits, self.cfg.connect_timeout_s)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            raise NodeUnavailable(f"node {addr[0]}:{addr[1]}: {exc or 'handshake timed out'}",
                                  node=f"{addr[0]}:{addr[1]}") from exc
        link = NodeLink(addr, conn, self._on_result, self._on_lost)
        link.start()
        return link

    async def _data_link(self, addr: tuple[str, int], role: str) -> NodeLink:
        """A connection the node hands to its data plane (role in: steps; sink: results)."""
        link = await self._open(addr)
        try:
            await link.request({"type": "data", "plan_id": self.plan_id, "role": role},
                               self.cfg.request_timeout_s)
        except BaseException:
            await link.close()
            raise
        return link

    def _on_result(self, msg: dict[str, Any]) -> None:
        fut = self.waiting.pop((msg.get("session"), msg.get("step")), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_lost(self, link: NodeLink, exc: BaseException | None) -> None:
        self.lost[link.name] = repr(exc) if exc else "closed"
        if link is self.data_in or link is self.sink or any(link is s[0] for s in self.stages):
            err = NodeUnavailable(f"node {link.name} (a stage of this plan) closed the connection",
                                  node=link.name)
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(err)
            self.waiting.clear()

    async def deploy(self, stages: list[tuple[NodeLink, int, int]], routes: Routes | None = None,
                     progress: Progress | None = None) -> None:
        """Send each stage's node the layer files it needs (skipping what it holds), then load
        the plan; each stage forwards to the next over `routes` (default: the client's address)."""
        if len({id(s[0]) for s in stages}) != len(stages):
            raise EdgeliteError("a node appears in two stages of one plan")
        self.stages = list(stages)
        for link, a, b in self.stages:
            await self.push_files(link, self.manifest.layers[a:b + 1], progress)
        for i in reversed(range(len(self.stages))):  # load downstream first: each connects onward
            link, a, b = self.stages[i]
            nxt = None
            if i + 1 < len(self.stages):
                dst = self.stages[i + 1][0]
                hop = route(routes or {}, link.name, dst.name, dst.addr)
                nxt = [hop.host, hop.port]
            await link.request({"type": "load", "plan_id": self.plan_id, "first": a, "last": b,
                                "next": nxt, "manifest": self.manifest.to_json()},
                               self.cfg.deploy_timeout_s)
        if self.stages:
            self.sink = await self._data_link(self.stages[-1][0].addr, "sink")
            self.data_in = await self._data_link(self.stages[0][0].addr, "in")

    async def push_files(self, link: NodeLink, entries: list[mf.FileEntry],
                          progress: Progress | None) -> None:
        shas = [e.sha256 for e in entries]
        state = await link.request({"type": "files", "sha256": shas}, self.cfg.request_timeout_s)
        todo = [e for e in entries if e.sha256 not in state["have"]]
        total = sum(e.bytes for e in todo)
        sent = 0
        for e in todo:
            offset = int(state["partial"].get(e.sha256, 0))
            sent += offset
            path, size = self.manifest.path(e), self.limits.deploy_chunk_bytes
            while chunk := await asyncio.to_thread(_read_chunk, path, offset, size):
                await link.request({"type": "upload", "sha256": e.sha256, "offset": offset,
                                    "total": e.bytes, "data": chunk}, self.cfg.deploy_timeout_s)
                offset += len(chunk)
                sent += len(chunk)
                if progress:
                    progress(link.name, sent, total)
        log.info("deploy %s: %d of %d files sent (%d bytes)", link.name, len(todo), len(entries), total)

    async def forward(self, session: str, step: int, start: int, hidden: np.ndarray) -> np.ndarray:
        """Send hidden (batch, seq, hidden) through every stage; the last stage's output."""
        if not self.stages or self.data_in is None:
            raise EdgeliteError("no plan deployed")
        if self.lost and any(s[0].name in self.lost for s in self.stages):
            dead = next(s[0].name for s in self.stages if s[0].name in self.lost)
            raise NodeUnavailable(f"node {dead} is gone ({self.lost[dead]})", node=dead)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[(session, step)] = fut
        timeout = self.cfg.step_timeout_s if hidden.shape[1] == 1 else self.cfg.prefill_timeout_s
        try:
            await self.data_in.conn.send({"type": "forward", "plan_id": self.plan_id,
                                          "session": session, "step": step, "start": start,
                                          "hidden": wire.encode_tensor(hidden)})
            msg = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise await self._diagnose(timeout) from None
        except (ConnectionError, OSError) as exc:
            first = self.stages[0][0].name
            raise NodeUnavailable(f"node {first}: {exc}", node=first) from exc
        finally:
            self.waiting.pop((session, step), None)
        if "error" in msg:
            raise NodeError(msg["error"])
        return wire.decode_tensor(msg["hidden"], self.limits, "hidden")

    async def _diagnose(self, timeout: float) -> NodeUnavailable:
        """Name the first stage that does not answer a ping."""
        ping_timeout = max(0.2, self.cfg.step_timeout_s / 2)
        for link, a, b in self.stages:
            try:
                await link.request({"type": "ping"}, ping_timeout)
            except NodeError:
                self.lost[link.name] = "stalled"
                return NodeUnavailable(f"node {link.name} (layers {a}-{b}) stalled: no reply "
                                       f"within {timeout:g} s", node=link.name)
        return NodeUnavailable(f"a step got no result within {timeout:g} s although every "
                               f"stage answers pings")

    async def end(self, session: str) -> None:
        """Free the session's KV on every stage still answering (best effort)."""
        live = [link for link, _, _ in self.stages if link.name not in self.lost]
        await asyncio.gather(*(link.request({"type": "end", "session": session}, self.cfg.end_timeout_s)
                               for link in live), return_exceptions=True)

    async def stats(self) -> list[dict[str, Any]]:
        return [await link.request({"type": "stats"}, self.cfg.request_timeout_s)
                for link in self.links]

    async def close(self) -> None:
        data = [x for x in (self.data_in, self.sink) if x is not None]
        await asyncio.gather(*(link.close() for link in [*self.links, *data]))


# One stage of a plan as the client deploys it: (index into the node list, or None for the
# client itself, which may run a prefix of the layers; first layer; last layer).
Assignment = list[tuple[int | None, int, int]]


def in_order(split: list[tuple[int, int]]) -> Assignment:
    """Node i runs split[i]: the --split form."""
    return [(i, a, b) for i, (a, b) in enumerate(split)]


class ClusterBackend:
    """Engine backend: embedding, head and (optionally) a prefix of the layers here; the other
    decoder layers on the cluster's stages."""

    def __init__(self, cluster: Cluster, threads: int = 2,
                 client_layers: tuple[int, int] | None = None) -> None:
        from edgelite.config import RuntimeConfig
        from edgelite.runtime import Embedding, Head, LayerRange

        self.cluster, self.manifest = cluster, cluster.manifest
        cfg = RuntimeConfig(threads=threads)
        self.embed, self.head = Embedding(self.manifest, cfg), Head(self.manifest, cfg)
        self.prefix = LayerRange(self.manifest, *client_layers, cfg) if client_layers else None
        self.caches: dict[str, KVCache] = {}  # session -> KV of the client's prefix layers
        self.pos: dict[str, tuple[int, int]] = {}  # session -> (tokens held, steps sent)
        # one long-lived thread for embedding and head, as on the nodes: the default pool
        # hands each call to whichever thread is free, with cold ORT state (~0.5 ms a call)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="client-onnx")

    def _local(self, session: str, start: int, ids: np.ndarray) -> np.ndarray:
        hidden = self.embed.run(ids)
        if self.prefix is None:
            return hidden
        pos, mask = positions_for(start, ids.shape[1], ids.shape[0])
        kv = self.caches.get(session) or self.prefix.new_cache(ids.shape[0])
        hidden, self.caches[session] = self.prefix.run(hidden, kv, pos, mask)
        return hidden

    async def step(self, session: str, ids: np.ndarray) -> np.ndarray:
        start, step = self.pos.get(session, (0, 0))
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.pool, self._local, session, start, ids)
        if self.cluster.stages:
            out = await self.cluster.forward(session, step, start, out)
        logits = await loop.run_in_executor(self.pool, self.head.run,
                                            np.ascontiguousarray(out[:, -1:, :]))
        self.pos[session] = (start + ids.shape[1], step + 1)
        return logits[0, 0]

    async def end(self, session: str) -> None:
        self.pos.pop(session, None)
        self.caches.pop(session, None)
        await self.cluster.end(session)

    async def close(self) -> None:
        await self.cluster.close()
        self.pool.shutdown(wait=False)


async def open_cluster(manifest: mf.Manifest, addrs: list[tuple[str, int]], assignment: Assignment,
                       token: str, cfg: ClientConfig | None = None, threads: int = 2,
                       routes: Routes | None = None,
                       progress: Progress | None = None) -> ClusterBackend:
    """Connect to the nodes, deploy the assignment, and return a backend ready to generate."""
    cluster = Cluster(manifest, token, cfg)
    try:
        await cluster.connect(addrs)
        await cluster.deploy([(cluster.links[i], a, b) for i, a, b in assignment if i is not None],
                             routes, progress)
        mine = [(a, b) for i, a, b in assignment if i is None]
        return ClusterBackend(cluster, threads, mine[0] if mine else None)
    except BaseException:
        await cluster.close()
        raise
