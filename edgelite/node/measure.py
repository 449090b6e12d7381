"""What a node measures for a client's planner: pings, bulk transfers, its compute (FLOP/s
and memory), and its link to another node."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edgelite import manifest as mf
from edgelite.config import NodeConfig, RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.passes import linear
from edgelite.engine.profile import host_profile
from edgelite.errors import ProtocolError
from edgelite.net import messages as m
from edgelite.net.linkprobe import ProbeConfig, probe_peer
from edgelite.node.dataplane import DataPlane
from edgelite.node.profile import loaded_flops, measure_flops
from edgelite.node.stages import StageStore


def probe_config(raw: dict[str, Any], cfg: NodeConfig) -> ProbeConfig:
    """A link probe's settings from a request, each field type-checked and within this node's
    limits (a probe makes the node send packets and bytes: a request may not ask for many)."""
    caps: dict[str, tuple[float, float]] = {
        "pings": (1, 1000), "bulk_start_bytes": (1, cfg.max_probe_bytes),
        "bulk_max_bytes": (1, cfg.max_probe_bytes), "bulk_min_seconds": (0, cfg.max_probe_timeout_s),
        "udp_packets": (0, cfg.max_probe_packets), "udp_interval_s": (0, 1),
        "udp_wait_s": (0, cfg.max_probe_timeout_s), "timeout_s": (0.01, cfg.max_probe_timeout_s)}
    known = {f.name: f for f in dataclasses.fields(ProbeConfig)}
    values: dict[str, Any] = {}
    for key, v in raw.items():
        f = known.get(key) if type(key) is str else None
        if f is None:
            raise ProtocolError(f"probe_link.config: unknown field {str(key)[:40]!r}")
        kind = type(f.default)
        if kind is bool:
            if type(v) is not bool:
                raise ProtocolError(f"probe_link.config.{key}: expected true or false")
        elif type(v) not in ((int,) if kind is int else (int, float)):
            raise ProtocolError(f"probe_link.config.{key}: expected a number, got {type(v).__name__}")
        elif not caps[key][0] <= v <= caps[key][1]:
            raise ProtocolError(f"probe_link.config.{key}: {v} is outside "
                                f"{caps[key][0]:g}..{caps[key][1]:g} (this node's limit)")
        values[key] = v
    return ProbeConfig(**values)


class Measure:
    """Answers ping, bulk, profile and probe_link, each within this node's limits."""

    def __init__(self, name: str, store: StageStore, cfg: NodeConfig, token: str,
                 data: Callable[[], DataPlane]) -> None:
        self.name, self.store, self.cfg, self.token, self.data = name, store, cfg, token, data
        self.bulk_slots = asyncio.Semaphore(cfg.bulk_concurrency)
        self.probe_slots = asyncio.Semaphore(cfg.probe_concurrency)
        self.profiling = False
        # FLOP/s measurements run here, off the loop (forward steps run in the data plane)
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="profile")

    def close(self) -> None:
        self.compute_pool.shutdown(wait=False)

    async def ping(self, msg: m.Ping, _owner: str) -> m.Pong:
        # the receive time on this node's clock: senders get one-way delay variation from it
        return m.Pong(id=msg.id, t=msg.t, rt=time.monotonic())

    async def bulk(self, msg: m.Bulk, _owner: str) -> m.BulkAck:
        if msg.reply_bytes > self.cfg.bulk_reply_max_bytes:
            raise ProtocolError(f"bulk.reply_bytes: {msg.reply_bytes} is over this node's limit "
                                f"of {self.cfg.bulk_reply_max_bytes}")
        if self.bulk_slots.locked():
            raise ProtocolError(f"bulk: {self.cfg.bulk_concurrency} transfers are under way "
                                f"(bulk_concurrency); try later")
        async with self.bulk_slots:
            return m.BulkAck(id=msg.id, received=len(msg.data), data=bytes(msg.reply_bytes))

    async def profile(self, msg: m.ProfileRequest, _owner: str) -> m.ProfileReply:
        if self.profiling:
            raise ProtocolError("profile: a profile is being measured already; try later")
        self.profiling = True
        try:
            runtime, kernel = await self._kernel()
            flops = await self.data().submit(lambda: loaded_flops(self.store))
            if flops is None:
                c = self.cfg
                flops = await asyncio.get_running_loop().run_in_executor(
                    self.compute_pool, measure_flops, self.store, msg.hidden_size, msg.manifest,
                    c.max_profile_hidden, c.max_profile_bytes, 20, runtime)
        finally:
            self.profiling = False
        budget = {} if self.cfg.memory_budget_bytes is None else {
            "memory_budget_bytes": self.cfg.memory_budget_bytes}
        # with a model to plan: whether its layers run edgelite's product operators (what they
        # hold); the kernel library is built (or known not to build) unless it says "building"
        narrow: dict[str, bool] = {}
        if msg.manifest is not None:
            manifest = mf.parse(msg.manifest, Path(self.store.blobs.dir))
            narrow["narrow_products"] = await asyncio.get_running_loop().run_in_executor(
                self.compute_pool, linear.narrow, runtime, manifest)
        return m.ProfileReply(id=msg.id, profile={"node": self.name, "threads": self.cfg.runtime.threads,
                                                  "provider": self.cfg.runtime.provider, "kernel": kernel,
                                                  **flops, **host_profile(), **budget, **narrow})

    async def _kernel(self) -> tuple[RuntimeConfig, str]:
        """The settings a profile measures with and what it says of the kernel library: which
        path runs each operator, "none", "off", or "building" (it did not finish within
        kernel_wait_s: onnxruntime's operators are measured meanwhile)."""
        runtime = self.cfg.runtime
        if runtime.attention_kernel or runtime.matmul_kernel:
            await asyncio.to_thread(kernels.library, runtime, self.cfg.kernel_wait_s)
        state = kernels.status(runtime)
        if state == "building":
            return dataclasses.replace(runtime, attention_kernel=False, matmul_kernel=False), state
        return runtime, state

    async def probe_link(self, msg: m.ProbeLink, _owner: str) -> m.LinkReport:
        """Measure the link to another node. Packets go only to a peer that has completed the
        handshake with this cluster's token (probe_peer connects first), within the limits."""
        cfg = probe_config(msg.config, self.cfg)
        async with self.probe_slots:  # at most probe_concurrency at once; the others wait
            stats = await probe_peer(msg.peer, self.token, cfg)
        return m.LinkReport(id=msg.id, link=stats.to_json())
