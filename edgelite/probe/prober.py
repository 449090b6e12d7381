"""Device and link measurement. A peer that fails is a measurement ("unreachable"), not an error.

Link metrics between an endpoint and a peer node (run by whichever end the client asks):
- latency: median RTT/2 over N small round trips;
- jitter: max - min one-way delay, and p95 - p50. The peer stamps each ping on arrival with its
  own clock; (arrival stamp - send time) is the one-way delay plus a constant clock offset, which
  max - min and p95 - p50 cancel, so no clock sync is needed;
- bandwidth, each direction: a bulk transfer of 1 MB, then one sized to last >= 200 ms (or the
  size cap);
- loss: a UDP echo exchange with sequence numbers; the round-trip loss r gives the one-way loss
  1 - sqrt(1 - r) (links assumed symmetric), with a Wilson 95 % interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import os
import platform
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError
from edgelite.net import wire

_UDP = struct.Struct(">Q8s16s")  # seq, nonce, tag


@dataclass(frozen=True)
class ProbeConfig:
    pings: int = 40  # max - min of 20 samples under-reads uniform jitter by > 30 % in ~1 % of runs
    bulk_start_bytes: int = 1 << 20  # 1 MB as in the source method
    bulk_min_seconds: float = 0.2
    bulk_max_bytes: int = 16 << 20  # on loopback-fast links the last size may last < 200 ms
    udp_packets: int = 200
    udp_interval_s: float = 0.002
    udp_wait_s: float = 0.3  # after the last packet, how long to wait for echoes
    timeout_s: float = 3.0  # one request of the probe; past it the peer is unreachable
    small: bool = True  # pings + UDP (safe to run for many links at once)
    bulk: bool = True  # the bandwidth transfer (run one link at a time: links share the air)


@dataclass
class LinkStats:
    latency_ms: float
    jitter_ms: float  # max - min one-way delay
    jitter_p95_p50_ms: float
    bandwidth_mbps: float  # to the peer
    loss: float  # one-way estimate
    loss_ci95: tuple[float, float]
    udp_sent: int
    udp_received: int
    bandwidth_back_mbps: float = math.nan  # from the peer (the same probe, the reverse direction)
    # max - min without the single largest and smallest one-way delay: what the planner prices
    # (one scheduling hiccup of a shared CPU would otherwise make a good link look worst)
    jitter_trim_ms: float = math.nan
    measured_at: float = field(default_factory=time.time)
    reachable: bool = True
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def unreachable(reason: str) -> LinkStats:
    nan = math.nan
    return LinkStats(nan, nan, nan, nan, nan, (nan, nan), 0, 0, reachable=False, reason=reason)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def one_way(rt_loss: float) -> float:
    return 1 - math.sqrt(max(0.0, 1 - rt_loss))


def udp_tag(token: str, seq: int, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), struct.pack(">Q", seq) + nonce, hashlib.sha256).digest()[:16]


class UdpEcho(asyncio.DatagramProtocol):
    """Echoes datagrams that carry a valid tag (no reflection for strangers)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) != _UDP.size or self.transport is None:
            return
        seq, nonce, tag = _UDP.unpack(data)
        if hmac.compare_digest(tag, udp_tag(self.token, seq, nonce)):
            self.transport.sendto(data, addr)


class _UdpClient(asyncio.DatagramProtocol):
    def __init__(self, expect: int) -> None:
        self.got: set[int] = set()
        self.expect, self.all_back = expect, asyncio.Event()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) == _UDP.size:
            self.got.add(_UDP.unpack(data)[0])
            if len(self.got) >= self.expect:
                self.all_back.set()


async def udp_loss(host: str, port: int, token: str, cfg: ProbeConfig) -> tuple[int, int]:
    """(sent, echoed) over one UDP exchange."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: _UdpClient(cfg.udp_packets),
                                                           remote_addr=(host, port))
    try:
        nonce = os.urandom(8)
        for seq in range(cfg.udp_packets):
            transport.sendto(_UDP.pack(seq, nonce, udp_tag(token, seq, nonce)))
            await asyncio.sleep(cfg.udp_interval_s)
        with contextlib.suppress(TimeoutError):  # stop waiting once every echo is back
            await asyncio.wait_for(proto.all_back.wait(), cfg.udp_wait_s)
    finally:
        transport.close()
    return cfg.udp_packets, len(proto.got)


async def _request(conn: wire.Conn, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    await conn.send(msg)
    reply = await asyncio.wait_for(conn.recv(), timeout)
    if reply.get("type") == "error":
        raise ConnectionError(str(reply.get("message")))
    return reply


async def _bulk_seconds(conn: wire.Conn, cfg: ProbeConfig, up: int, down: int) -> float:
    t0 = time.perf_counter()
    await _request(conn, {"type": "bulk", "id": -1, "data": bytes(up), "reply_bytes": down},
                   cfg.timeout_s + (up + down) / 1e5)
    return time.perf_counter() - t0


async def _bulk_rates(conn: wire.Conn, cfg: ProbeConfig, rtt_s: float) -> tuple[float, float]:
    """(to the peer, from the peer) in Mbit/s. Each direction starts with 1 MB; when that is over
    in under bulk_min_seconds, one transfer sized from the first rate to last that long follows
    (capped at bulk_max_bytes: on loopback-fast links it may end sooner)."""
    rates = []
    for direction in ("up", "down"):
        size = cfg.bulk_start_bytes
        while True:
            up, down = (size, 0) if direction == "up" else (0, size)
            secs = max(1e-6, await _bulk_seconds(conn, cfg, up, down) - rtt_s)
            if secs >= cfg.bulk_min_seconds or size >= cfg.bulk_max_bytes:
                break
            size = min(cfg.bulk_max_bytes, int(size * 1.25 * cfg.bulk_min_seconds / secs))
        rates.append(size * 8 / secs / 1e6)
    return rates[0], rates[1]


async def measure_link(conn: wire.Conn, udp_addr: tuple[str, int] | None, token: str,
                       cfg: ProbeConfig) -> LinkStats:
    """Measure the link behind an authenticated connection to a node (and its UDP echo)."""
    udp = asyncio.ensure_future(udp_loss(*udp_addr, token, cfg)) if udp_addr and cfg.small else None
    try:  # the UDP exchange runs alongside the pings (small packets both)
        rtts, owd = [], []  # owd: one-way delay + an unknown constant clock offset
        for i in range(cfg.pings if cfg.small else 3):
            t0, sent_at = time.perf_counter(), time.monotonic()
            reply = await _request(conn, {"type": "ping", "id": i}, cfg.timeout_s)
            rtts.append((time.perf_counter() - t0) * 1e3)
            if isinstance(reply.get("rt"), float):
                owd.append((reply["rt"] - sent_at) * 1e3)
        sent, got = (await udp) if udp else (0, 0)
    finally:
        if udp is not None and not udp.done():
            udp.cancel()
            await asyncio.gather(udp, return_exceptions=True)
    ow = sorted(owd) if len(owd) == len(rtts) else sorted(r / 2 for r in rtts)
    rtt = statistics.median(rtts)
    bw, back = await _bulk_rates(conn, cfg, rtt / 1e3) if cfg.bulk else (math.nan, math.nan)
    lost = sent - got
    lo, hi = wilson(lost, sent)
    p95 = ow[min(len(ow) - 1, math.ceil(0.95 * len(ow)) - 1)]
    return LinkStats(latency_ms=rtt / 2, jitter_ms=ow[-1] - ow[0],
                     jitter_p95_p50_ms=p95 - statistics.median(ow), bandwidth_mbps=bw,
                     jitter_trim_ms=ow[-2] - ow[1] if len(ow) >= 10 else ow[-1] - ow[0],
                     bandwidth_back_mbps=back,
                     loss=one_way(lost / sent) if sent else math.nan,
                     loss_ci95=(one_way(lo), one_way(hi)) if sent else (math.nan, math.nan),
                     udp_sent=sent, udp_received=got)


async def probe_peer(host: str, port: int, udp_port: int | None, token: str,
                     cfg: ProbeConfig) -> LinkStats:
    """Connect to a node and measure the link; never raises for a bad peer."""
    try:
        conn, welcome = await wire.connect(host, port, token, None, WireLimits(), cfg.timeout_s)
    except (TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError, AuthError,
            ProtocolError) as exc:
        return unreachable(f"{host}:{port}: {exc or type(exc).__name__}")
    try:
        uport = udp_port or _udp_port(welcome, port)
        return await measure_link(conn, (host, uport) if uport else None, token, cfg)
    except (TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
        return unreachable(f"{host}:{port}: {exc or type(exc).__name__}")
    finally:
        await conn.close()


def _udp_port(welcome: dict[str, Any], dialed: int) -> int | None:
    """The node's UDP echo port as seen from here. A node whose echo shares its TCP port number
    is reached on the number we dialed, so a proxy (the link emulator) that follows the same
    convention carries the loss probe too."""
    udp = welcome.get("udp_port")
    if not isinstance(udp, int):
        return None
    return dialed if udp == welcome.get("port") else udp


@dataclass
class EMA:
    """Bias-corrected exponential moving average (as hivemind's PerformanceEMA)."""

    alpha: float = 0.3
    value: float = 0.0
    weight: float = 0.0

    def update(self, x: float) -> float:
        self.value = (1 - self.alpha) * self.value + self.alpha * x
        self.weight = (1 - self.alpha) * self.weight + self.alpha
        return self.value / self.weight


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def battery() -> dict[str, Any]:
    """Battery level/charging/temperature where the kernel exposes them (Android does); else {}."""
    base = Path("/sys/class/power_supply/battery")
    out: dict[str, Any] = {}
    for key, name, conv in (("capacity", "battery_percent", int), ("status", "charging", str),
                            ("temp", "battery_temp_c", lambda v: int(v) / 10)):
        try:
            raw = (base / key).read_text().strip()
        except OSError:
            continue
        out[name] = raw == "Charging" if key == "status" else conv(raw)
    return out


def host_profile() -> dict[str, Any]:
    mem = meminfo()
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "machine": platform.machine(), "memory_total_bytes": mem.get("MemTotal"),
            "memory_available_bytes": mem.get("MemAvailable"), **battery()}


EVICT_BYTES = 64 * 1024 * 1024  # larger than a phone's (or this PC's) last-level cache


def median_seconds(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None,
                   inner: int = 1) -> float:
    """Median wall time of fn() over `repeats` samples (each `inner` calls) after one warm-up;
    `before` runs untimed ahead of each sample."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def layer_decode_seconds(session: Any, hidden_size: int, kv_heads: int, head_dim: int,
                         past: int = 64, repeats: int = 20) -> float:
    """Median time of one decode step of a layer session (blocking). In real decoding a layer's
    weights were evicted by everything run since its last step, so every timed run starts with
    a cold cache."""
    import numpy as np

    rng = np.random.default_rng(0)
    kv = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
    feed = {"hidden": rng.standard_normal((1, 1, hidden_size)).astype(np.float32),
            "past_key": kv, "past_value": kv, "position_ids": np.array([[past]]),
            "attention_mask": np.ones((1, past + 1), np.int64)}
    evict = np.zeros(EVICT_BYTES // 4, np.float32)
    return median_seconds(lambda: session.run(None, feed), repeats,
                          before=lambda: np.add(evict, 1.0, out=evict))


def gemv_seconds(hidden_size: int, weight_bytes: int, repeats: int = 20) -> float:
    """Median time of a (1, h) x (h, weight_bytes / 4h) float32 product with a cold cache: a
    decode step's memory traffic when no layer file is at hand."""
    import numpy as np

    cols = max(1, weight_bytes // (4 * hidden_size))
    a = np.ones((1, hidden_size), np.float32)
    w = np.ones((hidden_size, cols), np.float32)
    evict = np.zeros(EVICT_BYTES // 4, np.float32)
    return median_seconds(lambda: a @ w, repeats, before=lambda: np.add(evict, 1.0, out=evict))


def gemv_flops(hidden_size: int, repeats: int = 20) -> float:
    """FLOP/s of a (1, h) x (h, 4h) numpy product: the fallback when no layer is deployed."""
    import numpy as np

    a = np.ones((1, hidden_size), np.float32)
    w = np.ones((hidden_size, 4 * hidden_size), np.float32)
    return 2 * hidden_size * 4 * hidden_size / median_seconds(lambda: a @ w, repeats, inner=2)
