"""Bad input against a running node process: each is refused, the node keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
from typing import Any

import msgpack
import numpy as np
import pytest

from edgelite.cli.localnodes import TOKEN
from edgelite.config import WireLimits
from edgelite.errors import AuthError, NodeError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn, pack, read_frame
from edgelite.net.handshake import connect
from edgelite.net.tensors import encode_tensor
from test_distributed import _cluster, _tokens

pytestmark = pytest.mark.e2e
LIMITS = WireLimits()


def _frame(d: dict[str, Any]) -> bytes:
    body = msgpack.packb(d, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def _send_raw(conn: Conn, d: dict[str, Any]) -> None:
    conn.writer.write(_frame(d))
    await conn.writer.drain()


async def _raw(port: int, payload: bytes) -> bytes:
    """Send raw bytes after the node's hello; return whatever comes back until close."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    await read_frame(r, LIMITS.max_handshake_frame_bytes, 5)  # hello
    w.write(payload)
    await w.drain()
    try:
        data = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    return data


async def _authed(port: int, fingerprint: str | None = None) -> Conn:
    conn, _ = await connect(NodeAddr("127.0.0.1", port), TOKEN, fingerprint, LIMITS, 5)
    return conn


async def _data(port: int, plan: str, capability: str) -> Conn:
    """A data connection (steps in) for `plan`."""
    conn = await _authed(port)
    await conn.send(m.OpenData(id=9, plan_id=plan, role="in", capability=capability))
    assert isinstance(await conn.recv(), m.DataReady)
    return conn


def test_node_survives_every_kind_of_bad_input(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()

    async def main() -> None:
        be = await _cluster(model, [node.addr], [(0, 2)])
        plan = be.cluster.plan_id
        cap = be.cluster.capabilities[NodeAddr.parse(node.addr)]
        try:
            # 1. random bytes instead of a frame -> closed
            await _raw(node.port, os.urandom(64))
            # 2. a truncated frame: length says 1000, 10 bytes sent, then EOF
            r, w = await asyncio.open_connection("127.0.0.1", node.port)
            await read_frame(r, LIMITS.max_handshake_frame_bytes, 5)
            w.write(struct.pack(">I", 1000) + b"x" * 10)
            await w.drain()
            w.write_eof()
            await asyncio.wait_for(r.read(), 10)
            w.close()
            # 3. a 4 GiB length prefix -> an error reply naming the limit, then closed
            reply = await _raw(node.port, struct.pack(">I", 0xFFFFFFFF))
            assert b"exceeds the limit" in reply
            # before the handshake a frame may be only a few KiB
            reply = await _raw(node.port, struct.pack(">I", 1 << 20))
            assert b"exceeds the limit of 4096" in reply
            # 4. wrong token
            with pytest.raises(AuthError, match="wrong token"):
                await connect(NodeAddr("127.0.0.1", node.port), "wrong", None, LIMITS, 5)
            conn = await _authed(node.port)
            # 5. unknown message type -> error reply, connection still usable
            await _send_raw(conn, {"type": "teleport", "id": 1})
            msg = await conn.recv()
            assert isinstance(msg, m.Error) and "unknown message type" in msg.message
            # a step on a control connection -> refused
            await _send_raw(conn, {"type": "forward", "plan_id": plan, "session": "s", "step": 0,
                                   "start": 0})
            assert "not a request this node serves" in (await conn.recv()).message
            await conn.send(m.Ping(id=2, t=1.0))
            assert isinstance(await conn.recv(), m.Pong)
            await conn.close()
            # 6. wrong dtype and 7. wrong shape in a forward -> error results on a data connection
            conn = await _data(node.port, plan, cap)
            bad_dtype = {"dtype": "float32", "shape": [1, 1, 48], "data": b"\0" * 10}
            await _send_raw(conn, {"type": "forward", "plan_id": plan, "session": "b", "step": 0,
                                   "start": 0, "hidden": bad_dtype})
            msg = await conn.recv()
            assert isinstance(msg, m.Error) and "needs 192 bytes" in msg.message
            await conn.send(m.Forward(plan_id=plan, session="b", step=1, start=0,
                                      hidden=np.zeros((1, 1, 5), np.float32)))
            msg = await conn.recv()
            assert "expected float32 (batch, seq, 48)" in msg.error
            await conn.send(m.Forward(plan_id=plan, session="b", step=1, start=0,
                                      hidden=np.zeros((1, 1, 48), np.float16)))
            assert "expected float32" in (await conn.recv()).error
            for bad_trace in ("x", [[1, 2, 3]], [["a", 1]], [[0, 0]] * 65):  # per-stage timings
                await _send_raw(conn, {"type": "forward", "plan_id": plan, "session": "b",
                                       "step": 2, "start": 0, "trace": bad_trace,
                                       "hidden": encode_tensor(np.zeros((1, 1, 48), np.float32))})
                assert "forward.trace" in (await conn.recv()).message
            # binary step frames that lie about their sizes -> error replies naming the field
            good = pack(m.Forward(plan_id=plan, session="b", step=3, start=0,
                                  hidden=np.zeros((1, 1, 48), np.float32)))[4:]
            for cut, want in ((good[:10], "shorter than its 24-byte header"),
                              (good[:-4], "needs 192 bytes, the frame has 188"),
                              (good[:3] + b"\x40" + good[4:], "forward: trace: 64 long"),
                              (good[:1] + b"\x09" + good[2:], "unknown kind 9")):
                conn.writer.write(struct.pack(">I", len(cut)) + cut)
                msg = await conn.recv()
                assert isinstance(msg, m.Error) and want in msg.message, (want, msg)
            # a control request on a data connection -> refused, the connection stays
            await conn.send(m.Ping(id=5))
            assert "carries forward frames" in (await conn.recv()).message
            await conn.close()
            # 8. a connection opened for another model's fingerprint cannot carry steps
            conn = await _authed(node.port, fingerprint="0" * 32)
            await conn.send(m.OpenData(id=6, plan_id=plan, role="in", capability=cap))
            msg = await conn.recv()
            assert isinstance(msg, m.Error) and "this connection was opened for" in msg.message
            await conn.close()
            # a data connection for a plan this node never loaded
            conn = await _authed(node.port)
            await conn.send(m.OpenData(id=7, plan_id="nope", role="in", capability=cap))
            assert "not loaded" in (await conn.recv()).message
            await conn.close()
            # a huge length on a data connection -> refused and closed, the node goes on
            conn = await _data(node.port, plan, cap)
            conn.writer.write(struct.pack(">I", 0xFFFFFFFF))
            await conn.writer.drain()
            assert "exceeds the limit" in (await conn.recv()).message
            await conn.close()
            # 9. a wire name used as a path is refused
            conn = await _authed(node.port)
            await conn.send(m.Upload(id=3, sha256="../../etc/passwd", offset=0, total=4,
                                     data=b"abcd"))
            assert "not a sha256" in (await conn.recv()).message
            await conn.close()
            # 10. KV exports asked by other nodes (kv_export): a bad layout, layers outside
            # its range, token bytes that are no int32 ids, a handle that is not there; an
            # entry that is not stored is nothing (length 0), not an error
            conn = await _authed(node.port)
            lay = {"fingerprint": "f" * 64, "first": 0, "last": 2, "kv_heads": 2, "head_dim": 8,
                   "dtype": "float32"}
            for i, (req, want) in enumerate((
                    (m.KvExport(id=0, layout={**lay, "kv_heads": "2"}, tokens=b"", first=0, last=0),
                     "kv_export.layout"),
                    (m.KvExport(id=0, layout=lay, tokens=b"", first=1, last=5), "not within"),
                    (m.KvExport(id=0, layout=lay, tokens=b"abc", first=0, last=0), "whole number"),
                    (m.KvExportRead(id=0, handle="nope", offset=0), "no such export"))):
                await conn.send(dataclasses.replace(req, id=20 + i))
                msg = await conn.recv()
                assert isinstance(msg, m.Error) and msg.id == 20 + i and want in msg.message, msg
            await conn.send(m.KvExport(id=30, layout=lay, tokens=b"\1\0\0\0" * 40, first=0, last=2))
            assert (await conn.recv()).length == 0
            await conn.close()
            # kv_restore whose sources leave a layer of the stage out
            link = be.cluster.links[NodeAddr.parse(node.addr)]
            with pytest.raises(NodeError, match="do not cover layers 0-2"):
                await link.request(m.KvRestore(id=0, plan_id=plan, session="k", tokens=b"\1\0\0\0" * 40,
                                               sources=[m.KvSource(0, 1)]), m.KvRestored, 5)
            # a sender stalled mid-frame on a data connection holds up nobody
            stalled = await _data(node.port, plan, cap)
            stalled.writer.write(struct.pack(">I", 1000) + b"x" * 10)
            await stalled.writer.drain()
            # the normal session still completes, on the same cluster connection
            assert len(await asyncio.wait_for(_tokens(be, [5, 6, 7], 6), 10)) > 0
            await stalled.close()
            stats = next(iter((await be.cluster.stats()).values()))
            assert stats["bad_frames"] >= 16
        finally:
            await be.close()
        assert node.proc.poll() is None

    asyncio.run(main())
