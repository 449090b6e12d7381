"""Measuring one link, from either end. A peer that fails is a measurement ("unreachable"), not
an error.

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
import statistics
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn
from edgelite.net.handshake import connect
from edgelite.net.schema import Message

_UDP = struct.Struct(">Q8s16s")  # seq, nonce, tag


@dataclass(frozen=True)
class ProbeConfig:
    pings: int = 40  # max - min of 20 samples under-reads uniform jitter by > 30 % in ~1 % of runs
    bulk_start_bytes: int = 1 << 20  # 1 MB as in the source method
    bulk_min_seconds: float = 0.2
    # on loopback-fast links the last size may last < 200 ms; both ends hold a few copies of
    # a transfer at once (a phone's whole budget may be a few hundred MiB)
    bulk_max_bytes: int = 4 << 20
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


async def _request(conn: Conn, msg: Message, timeout: float) -> Message:
    await conn.send(msg)
    reply = await asyncio.wait_for(conn.recv(), timeout)
    if isinstance(reply, m.Error):
        raise ConnectionError(reply.message)
    return reply


async def _bulk_seconds(conn: Conn, cfg: ProbeConfig, up: int, down: int) -> float:
    t0 = time.perf_counter()
    await _request(conn, m.Bulk(id=-1, data=bytes(up), reply_bytes=down),
                   cfg.timeout_s + (up + down) / 1e5)
    return time.perf_counter() - t0


async def _bulk_rates(conn: Conn, cfg: ProbeConfig, rtt_s: float) -> tuple[float, float]:
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


async def measure_link(conn: Conn, udp_addr: tuple[str, int] | None, token: str,
                       cfg: ProbeConfig) -> LinkStats:
    """Measure the link behind an authenticated connection to a node (and its UDP echo)."""
    udp = asyncio.ensure_future(udp_loss(*udp_addr, token, cfg)) if udp_addr and cfg.small else None
    try:  # the UDP exchange runs alongside the pings (small packets both)
        rtts, owd = [], []  # owd: one-way delay + an unknown constant clock offset
        for i in range(cfg.pings if cfg.small else 3):
            t0, sent_at = time.perf_counter(), time.monotonic()
            reply = await _request(conn, m.Ping(id=i), cfg.timeout_s)
            rtts.append((time.perf_counter() - t0) * 1e3)
            if isinstance(reply, m.Pong):
                owd.append((reply.rt - sent_at) * 1e3)
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


async def probe_peer(peer: NodeAddr, token: str, cfg: ProbeConfig) -> LinkStats:
    """Connect to a node and measure the link; never raises for a bad peer. `peer.udp_port`:
    its loss-probe port when known (else the node's welcome says)."""
    try:
        conn, welcome = await connect(peer, token, None, WireLimits(), cfg.timeout_s)
    except (ConnectionError, AuthError) as exc:
        return unreachable(str(exc))
    try:
        uport = peer.udp_port or _udp_port(welcome, peer.port)
        return await measure_link(conn, (peer.host, uport) if uport else None, token, cfg)
    except (TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
        return unreachable(f"{peer}: {exc or type(exc).__name__}")
    finally:
        await conn.close()


def _udp_port(welcome: m.Welcome, dialed: int) -> int | None:
    """The node's UDP echo port as seen from here. A node whose echo shares its TCP port number
    is reached on the number we dialed, so a proxy (the link emulator) that follows the same
    convention carries the loss probe too."""
    if welcome.udp_port is None:
        return None
    return dialed if welcome.udp_port == welcome.port else welcome.udp_port
