"""Client side of the cluster: connect, deploy, load a split, forward steps, detect failures.

Control requests (deploy, load, stats, pings) use one connection per node, on the event loop.
Steps use two data connections per plan, owned by the step plane's thread (stepplane.py): `in` to
stage 1, whose data plane passes each step along the chain, and `sink` from the last stage, on
which the results come back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite import manifest as mf
from edgelite.client.stepplane import StepPlane, StepTimeout
from edgelite.config import ClientConfig, WireLimits
from edgelite.engine.runtime import KVCache, positions_for
from edgelite.errors import EdgeliteError, NodeError, NodeUnavailable
from edgelite.net import wire
from edgelite.net.routes import Routes, route
from edgelite.net.steptrace import StepTrace

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
                if (fut := self.pending.pop(msg.get("id"), None)) is not None and not fut.done():
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
        self.lost: dict[str, str] = {}
        self.plane: StepPlane | None = None  # the plan's data connections, once deployed

    @property
    def traces(self) -> deque[StepTrace]:
        """Recent steps' timings (per stage, and the round trip)."""
        return self.plane.traces if self.plane else deque()

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
        link = NodeLink(addr, conn, self._on_lost)
        link.start()
        return link

    async def _data_socket(self, addr: tuple[str, int], role: str) -> socket.socket:
        """A connection the node hands to its data plane (role in: steps; sink: results), taken
        off this event loop for the step plane."""
        name = f"{addr[0]}:{addr[1]}"
        try:
            conn, _ = await wire.connect(*addr, self.token, self.manifest.fingerprint, self.limits,
                                         self.cfg.connect_timeout_s)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            raise NodeUnavailable(f"node {name}: {exc or 'handshake timed out'}", node=name) from exc
        try:
            await conn.send({"type": "data", "id": 0, "plan_id": self.plan_id, "role": role})
            reply = await asyncio.wait_for(conn.recv(), self.cfg.request_timeout_s)
            if reply["type"] != "data_ok":
                raise NodeError(f"node {name}: {reply.get('message')}", node=name)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            await conn.close()
            raise NodeUnavailable(f"node {name}: no data connection: {exc!r}", node=name) from exc
        except BaseException:
            await conn.close()
            raise
        return wire.detach(conn.writer, self.cfg.prefill_timeout_s)

    def _on_lost(self, link: NodeLink, exc: BaseException | None) -> None:
        self.lost[link.name] = repr(exc) if exc else "closed"
        if self.plane is not None and any(link is s[0] for s in self.stages):
            self.plane.fail_all(NodeUnavailable(f"node {link.name} (a stage of this plan) closed "
                                                f"the connection", node=link.name))

    def _plane_lost(self, name: str, reason: str) -> None:
        self.lost.setdefault(name, reason)

    async def deploy(self, stages: list[tuple[NodeLink, int, int]], routes: Routes | None = None,
                     progress: Progress | None = None) -> None:
        """Send each stage's node the layer files it needs (skipping what it holds), then load
        the plan; each stage forwards to the next over `routes` (default: the client's address)."""
        if len({id(s[0]) for s in stages}) != len(stages):
            raise EdgeliteError("a node appears in two stages of one plan")
        if self.plane is not None:
            raise EdgeliteError("this cluster has deployed its plan already; open another one")
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
            sink = await self._data_socket(self.stages[-1][0].addr, "sink")
            try:
                data_in = await self._data_socket(self.stages[0][0].addr, "in")
            except BaseException:
                sink.close()
                raise
            self.plane = StepPlane(asyncio.get_running_loop(), self.cfg, self.limits,
                                   self.stages[0][0].name, self.stages[-1][0].name, self._plane_lost)
            self.plane.start()
            self.plane.attach(data_in, sink)

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
        return await self.run_step(session, step, start, hidden.shape[1], lambda: hidden,
                                   lambda out: out)

    async def run_step(self, session: str, step: int, start: int, tokens: int,
                       before: Callable[[], np.ndarray], after: Callable[[np.ndarray], Any]) -> Any:
        """One step of a session through the stages: before() makes its input and after() takes
        the last stage's output, both on the step plane's thread (the client's ONNX work)."""
        if self.plane is None:
            raise EdgeliteError("no plan deployed")
        if self.lost and any(s[0].name in self.lost for s in self.stages):
            dead = next(s[0].name for s in self.stages if s[0].name in self.lost)
            raise NodeUnavailable(f"node {dead} is gone ({self.lost[dead]})", node=dead)
        fields = {"plan_id": self.plan_id, "session": session, "step": step, "start": start}
        try:
            return await self.plane.step(fields, tokens, before, after)
        except StepTimeout as exc:
            raise await self._diagnose(exc) from None

    async def _diagnose(self, timeout: StepTimeout) -> NodeUnavailable:
        """Name the first stage that does not answer a ping."""
        ping_timeout = max(0.2, self.cfg.step_timeout_s / 2)
        for link, a, b in self.stages:
            try:
                await link.request({"type": "ping"}, ping_timeout)
            except NodeError:
                self.lost[link.name] = "stalled"
                return NodeUnavailable(f"node {link.name} (layers {a}-{b}) stalled: {timeout}",
                                       node=link.name)
        return NodeUnavailable(f"a step got {timeout} although every stage answers pings")

    async def end(self, session: str) -> None:
        """Free the session's KV on every stage still answering (best effort)."""
        live = [link for link, _, _ in self.stages if link.name not in self.lost]
        await asyncio.gather(*(link.request({"type": "end", "session": session}, self.cfg.end_timeout_s)
                               for link in live), return_exceptions=True)

    async def stats(self) -> list[dict[str, Any]]:
        return [await link.request({"type": "stats"}, self.cfg.request_timeout_s)
                for link in self.links]

    async def close(self) -> None:
        if self.plane is not None:
            await self.plane.stop()
        await asyncio.gather(*(link.close() for link in self.links))


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
        from edgelite.engine.runtime import Embedding, Head, LayerRange

        self.cluster, self.manifest = cluster, cluster.manifest
        cfg = RuntimeConfig(threads=threads)
        self.embed, self.head = Embedding(self.manifest, cfg), Head(self.manifest, cfg)
        self.prefix = LayerRange(self.manifest, *client_layers, cfg) if client_layers else None
        self.caches: dict[str, KVCache] = {}  # session -> KV of the client's prefix layers
        self.pos: dict[str, tuple[int, int]] = {}  # session -> (tokens held, steps sent)
        # with stages, embedding and head run on the step plane's thread; without, on this one
        # (long-lived: the default pool hands each call to whichever thread is free, with cold
        # ORT state, ~0.5 ms a call)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="client-onnx")

    def _local(self, session: str, start: int, ids: np.ndarray) -> np.ndarray:
        hidden = self.embed.run(ids)
        if self.prefix is None:
            return hidden
        pos, mask = positions_for(start, ids.shape[1], ids.shape[0])
        kv = self.caches.get(session) or self.prefix.new_cache(ids.shape[0])
        hidden, self.caches[session] = self.prefix.run(hidden, kv, pos, mask)
        return hidden

    def _head(self, hidden: np.ndarray) -> np.ndarray:
        return self.head.run(np.ascontiguousarray(hidden[:, -1:, :]))[0, 0]

    async def step(self, session: str, ids: np.ndarray) -> np.ndarray:
        start, step = self.pos.get(session, (0, 0))
        if self.cluster.stages:
            logits = await self.cluster.run_step(session, step, start, ids.shape[1],
                                                 lambda: self._local(session, start, ids), self._head)
        else:  # the client runs every layer
            logits = await asyncio.get_running_loop().run_in_executor(
                self.pool, lambda: self._head(self._local(session, start, ids)))
        self.pos[session] = (start + ids.shape[1], step + 1)
        return logits

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
