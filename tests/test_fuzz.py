"""A bounded fuzz run against a live node process: thousands of generated malformed frames on
connections before and after authentication, control and data, while another client's session
runs alongside. The node, its threads and that session must come through unharmed."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import struct
import time
from typing import Any

import msgpack
import pytest
from test_hardening import _clean_log, _fds, _rss_mib

from edgelite import manifest as mf
from edgelite.client.local import LocalBackend
from edgelite.config import WireLimits
from edgelite.ids import NodeAddr
from edgelite.net.frames import read_frame
from edgelite.net.schema import REGISTRY
from edgelite.net.tensors import DTYPES
from test_distributed import _cluster, _tokens
from test_node_bad_input import _authed, _data

pytestmark = pytest.mark.e2e
LIMITS = WireLimits()
# at least 5,000 (the acceptance line); a longer run by hand: EDGELITE_FUZZ_FRAMES=100000
FRAMES = int(os.environ.get("EDGELITE_FUZZ_FRAMES", 10_000))
BUDGET_S = 45.0 * FRAMES / 10_000  # the frames must go within this (the test's own bound: 60 s)


class Fuzz:
    """Frames from a seeded generator: schema-shaped messages with wrong parts."""

    def __init__(self, seed: int, plan: str, hidden: int) -> None:
        self.r = random.Random(seed)
        self.plan, self.hidden = plan, hidden

    def value(self, depth: int = 0) -> Any:
        r = self.r
        kinds = [lambda: r.choice([True, False, None]), lambda: r.randint(-2**63, 2**64 - 1),
                 lambda: r.choice([0, 1, -1, 7, 2**31, 2**53 + 1]), lambda: r.uniform(-1e9, 1e9),
                 lambda: r.choice([float("nan"), float("inf"), -0.0]),
                 lambda: "".join(r.choice("ab\0é/.") for _ in range(r.randint(0, 80))),
                 lambda: "x" * r.choice([63, 64, 65, 300, 3000]),
                 lambda: bytes(r.getrandbits(8) for _ in range(r.randint(0, 64))),
                 lambda: self.tensor()]
        if depth < 3:
            kinds += [lambda: [self.value(depth + 1) for _ in range(r.randint(0, 4))],
                      lambda: {self.key(): self.value(depth + 1) for _ in range(r.randint(0, 4))}]
        return r.choice(kinds)()

    def key(self) -> str:
        return self.r.choice(["id", "plan_id", "session", "step", "start", "hidden", "error",
                              "trace", "type", "manifest", "config", "peer", "host", "port",
                              "dtype", "shape", "data", "role", "capability", "sha256", "x"])

    def tensor(self) -> dict[str, Any]:
        r = self.r
        dtype = r.choice([*DTYPES, "float64", "bool", ["float32"], 5, None])
        shape = r.choice([[1, 1, self.hidden], [1, r.randint(0, 300), self.hidden], [0, 1, self.hidden],
                          [2, 1, self.hidden], [1, 1, r.randint(0, 100)], [True], [-1], [1 << 40],
                          "3", [1, 1, 1, 1, 1, 1, 1, 1], []])
        n = 1
        if isinstance(shape, list) and all(type(d) is int and 0 <= d < 4096 for d in shape):
            for d in shape:
                n *= d
        size = 4 * n if r.random() < 0.7 and n < 200_000 else r.randint(0, 4096)
        t: dict[str, Any] = {"dtype": dtype, "shape": shape, "data": os.urandom(min(size, 1 << 20))}
        if r.random() < 0.1:
            del t[r.choice(list(t))]
        return t

    def message(self, types: list[str]) -> dict[str, Any]:
        """A frame of one of `types`, its fields partly right, partly wrong or missing."""
        r = self.r
        frame: dict[str, Any] = {"type": r.choice(types)}
        if frame["type"] == "forward":
            frame.update(plan_id=self.plan, session=r.choice(["victim", "s1", "s2"]),
                         step=r.randint(0, 5), start=r.randint(0, 4), hidden=self.tensor())
        else:
            frame["id"] = r.randint(0, 1000)
        for _ in range(r.randint(0, 4)):
            frame[self.key()] = self.value()
        if r.random() < 0.05:
            frame["type"] = self.value()
        return frame

    def body(self, types: list[str]) -> bytes:
        r = self.r
        roll = r.random()
        if roll < 0.05:
            return os.urandom(r.randint(0, 64))  # not msgpack (or not a map)
        if roll < 0.08:
            return msgpack.packb(self.value(), use_bin_type=True)
        return msgpack.packb(self.message(types), use_bin_type=True)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Read replies until the node closes; how many bytes came. Then close our end."""
    got = 0
    try:
        while chunk := await reader.read(1 << 16):
            got += len(chunk)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    return got


def test_fuzzed_frames_leave_the_node_and_other_sessions_unharmed(exported, node_factory, tmp_path) -> None:
    model = exported["llama"]
    log = tmp_path / "node.log"
    node = node_factory(log_file=log, extra=tuple(os.environ.get("FUZZ_NODE_FLAGS", "").split()))
    addr = NodeAddr.parse(node.addr)
    m0 = mf.load(model)
    control_types = sorted(t for t in REGISTRY if t not in ("forward",))
    data_types = ["forward"] * 8 + ["result", "ping", "error", "data"]

    async def healthy_runs(be, want: list[int], stop: asyncio.Event) -> int:  # be: ClusterBackend
        runs = 0
        while not stop.is_set() or runs < 3:
            assert await _tokens(be, [5, 6, 7], 8, session="victim") == want
            runs += 1
        return runs

    async def main() -> dict[str, int]:
        want = await _tokens(LocalBackend(m0), [5, 6, 7], 8)
        healthy = await _cluster(model, [node.addr], [(0, 2)])
        fuzzer = await _cluster(model, [node.addr], [(0, 2)])  # the fuzzer's own plan
        plan, cap = fuzzer.cluster.plan_id, fuzzer.cluster.capabilities[addr]
        fz = Fuzz(1234, plan, m0.hidden_size)
        await asyncio.sleep(0.2)
        fds0, rss0 = _fds(node.proc.pid), _rss_mib(node.proc.pid)
        counts = {"pre_auth": 0, "control": 0, "data": 0, "connections": 0}
        stop = asyncio.Event()
        t0 = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            runs = tg.create_task(healthy_runs(healthy, want, stop))
            drains: list[asyncio.Task[int]] = []
            sent = 0
            while sent < FRAMES:
                assert time.monotonic() - t0 < BUDGET_S, f"{sent} frames in {BUDGET_S} s"
                while len(drains) > 16:  # a few connections open at once, no more
                    await asyncio.wait_for(drains.pop(0), 30)
                kind = fz.r.choice(["pre_auth"] * 8 + ["control"] * 2 + ["data"] * 3)
                if kind == "pre_auth":  # a stranger: one frame (refused, closed) or a huge length
                    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
                    await read_frame(reader, LIMITS.max_handshake_frame_bytes, 5)  # hello
                    burst = [fz.body(control_types)]
                    data = frame(burst[0]) + (os.urandom(8) if fz.r.random() < 0.2 else b"")
                    if fz.r.random() < 0.1:
                        data = struct.pack(">I", fz.r.choice([5000, 1 << 28, 0xFFFFFFFF])) + data
                else:
                    conn = (await _authed(node.port) if kind == "control"
                            else await _data(node.port, plan, cap))
                    reader, writer = conn.reader, conn.writer
                    types = control_types if kind == "control" else data_types
                    burst = [fz.body(types) for _ in range(fz.r.randint(20, 60))]
                    data = b"".join(frame(b) for b in burst)
                    if fz.r.random() < 0.05:  # a frame cut short, then the connection closes
                        data += struct.pack(">I", 1000) + b"\0" * 10
                counts["connections"] += 1
                counts[kind] += len(burst)
                sent += len(burst)
                drains.append(tg.create_task(drain(reader, writer)))
                try:
                    writer.write(data)
                    await writer.drain()
                    writer.write_eof()  # the node reads the burst, answers, and closes
                except (ConnectionError, OSError):
                    pass  # the node closed first (a frame it could not follow)
            stop.set()
        counts["healthy_runs"] = runs.result()
        counts["seconds"] = round(time.monotonic() - t0, 1)
        st = next(iter((await healthy.cluster.stats()).values()))
        assert st["data_plane"] == {"alive": True, "failures": 0, "restarts": 0}, st
        assert st["bad_frames"] >= FRAMES // 2, st
        counts["bad_frames"] = st["bad_frames"]
        await fuzzer.close()
        await healthy.close()
        await asyncio.sleep(1.0)
        assert _fds(node.proc.pid) <= fds0 + 4
        assert _rss_mib(node.proc.pid) <= rss0 + 64
        return counts

    counts = asyncio.run(main())
    logging.getLogger(__name__).info("fuzz: %s", counts)
    assert sum(counts[k] for k in ("pre_auth", "control", "data")) >= 5000, counts
    assert node.proc.poll() is None
    _clean_log(log)
