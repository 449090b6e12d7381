"""Attacks on a running node, one test per class of the hardening issue (#15): each is refused
with an error naming what was wrong, and the node, its threads and other clients' work go on.

Every test runs real node processes on loopback and talks to them over real sockets; the
"attacker" holds the cluster token (it is another client), unless the test says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN
from edgelite.client.cluster import Cluster
from edgelite.client.local import LocalBackend
from edgelite.config import ClientConfig, RuntimeConfig, WireLimits
from edgelite.errors import EdgeliteError, ManifestError, NodeError, ProtocolError
from edgelite.ids import NodeAddr, new_session_id
from edgelite.net import messages as m
from edgelite.net import stepframe
from edgelite.net.frames import Conn, read_frame
from edgelite.net.tensors import encode_tensor
from edgelite.planner.solve import split_plan
from test_distributed import _cluster, _tokens
from test_node_bad_input import _authed, _data, _send_raw

pytestmark = pytest.mark.e2e
LIMITS = WireLimits()
HIDDEN = 48  # the tiny llama's


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident set (VmRSS), or its peak (field VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(field)) / 1024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _clean_log(path: Path) -> None:
    text = path.read_text(errors="replace")
    for words in ("Traceback", " ERROR ", "restarting"):  # unhandled, or handled but a bug
        assert words not in text, text[text.index(words) - 2000:][:4000]


async def _stats(be) -> dict[str, Any]:  # be: a ClusterBackend
    return next(iter((await be.cluster.stats()).values()))


async def _reply(conn: Conn, timeout: float = 10) -> m.Message:
    return await asyncio.wait_for(conn.recv(), timeout)


def _text(reply: m.Message) -> str:
    """What a refusal says: an Error's message, or a refused step's error."""
    return getattr(reply, "error", None) or getattr(reply, "message", "")


def _forward(plan: str, **over: Any) -> dict[str, Any]:
    frame = {"type": "forward", "plan_id": plan, "session": "x", "step": 0, "start": 0,
             "hidden": encode_tensor(np.zeros((1, 1, HIDDEN), np.float32))}
    frame.update(over)
    return frame


# ---- 1. a single frame stopped the data plane ------------------------------------------------
def test_no_step_frame_stops_the_data_plane(exported, node_factory, tmp_path) -> None:
    model = exported["llama"]
    log = tmp_path / "node.log"
    node = node_factory(log_file=log)
    addr = NodeAddr.parse(node.addr)
    f32 = np.float32

    def t(a: np.ndarray) -> dict[str, Any]:
        return encode_tensor(a)

    async def main() -> None:
        want = await _tokens(LocalBackend(mf.load(model)), [5, 6, 7], 10)
        healthy = await _cluster(model, [node.addr], [(0, 2)])
        attacker = await _cluster(model, [node.addr], [(0, 2)])
        plan, cap = attacker.cluster.plan_id, attacker.cluster.capabilities[addr]
        good = encode_tensor(np.zeros((1, 1, HIDDEN), f32))
        bad_frames: list[tuple[dict[str, Any], str]] = [
            (_forward(plan, hidden={**good, "shape": [1, True, HIDDEN]}), "bad shape"),
            (_forward(plan, hidden={**good, "dtype": ["float32"]}), "unknown dtype"),
            (_forward([plan]), "forward.plan_id"),
            (_forward(plan, hidden=t(np.zeros((1, 1, HIDDEN), np.float16))), "expected float32"),
            (_forward(plan, hidden=t(np.zeros((1, 1, HIDDEN), np.int64))), "expected float32"),
            (_forward(plan, hidden=t(np.zeros((0, 1, HIDDEN), f32))), "batch 1"),
            (_forward(plan, hidden=t(np.zeros((1, 0, HIDDEN), f32))), "batch 1"),
            (_forward(plan, hidden=t(np.zeros((2, 1, HIDDEN), f32))), "batch 1"),
            (_forward(plan, hidden=t(np.zeros((1, 999, HIDDEN), f32))), "batch 1"),
            (_forward(plan, start=True), "forward.start"),
            (_forward(plan, step=[1]), "forward.step"),
            (_forward(plan, trace=[[0, 0]] * 64), "forward.trace"),
            (_forward(healthy.cluster.plan_id), "this connection carries plan"),
        ]
        try:
            conn = await _data(node.port, plan, cap)
            for frame, words in bad_frames:
                await _send_raw(conn, frame)
                text = _text(await _reply(conn))
                assert words in text, (frame, text)
            # a session whose batch size "changes" (a good step, then a batch of 2)
            await _send_raw(conn, _forward(plan, session="y"))
            await _send_raw(conn, _forward(plan, session="y", start=1,
                                           hidden=t(np.zeros((2, 1, HIDDEN), f32))))
            assert "batch 1" in _text(await _reply(conn))
            # the same session id as the healthy client's, on the attacker's own plan
            for _ in range(3):
                await _send_raw(conn, _forward(plan, session="victim", start=0))
            await conn.close()
            # fds: a hundred bad data connections leave nothing open behind
            before = _fds(node.proc.pid)
            for _ in range(100):
                c = await _data(node.port, plan, cap)
                await _send_raw(c, _forward(plan, hidden={**good, "shape": [True]}))
                await _reply(c)
                await c.close()
            await asyncio.sleep(0.5)
            assert _fds(node.proc.pid) <= before + 2
            assert await _tokens(healthy, [5, 6, 7], 10, session="victim") == want
            st = await _stats(healthy)
            assert st["data_plane"] == {"alive": True, "failures": 0, "restarts": 0}
        finally:
            await healthy.close()
            await attacker.close()
        # an honest client whose manifest disagrees with its files (num_kv_heads) gets a clear
        # refusal at load (graph admission: the node and the attribute); nothing runs
        wrong = tmp_path / "wrong"
        shutil.copytree(model, wrong)
        j = json.loads((wrong / "manifest.json").read_text())
        j["num_kv_heads"] = 3
        (wrong / "manifest.json").write_text(json.dumps(j))
        with pytest.raises(NodeError, match=r"kv_num_heads is 1, the manifest says 3"):
            await _cluster(wrong, [node.addr], [(0, 2)])
        with pytest.raises(EdgeliteError, match=r"kv_num_heads is 1, the manifest says 3"):
            LocalBackend(mf.load(wrong))

    asyncio.run(main())
    assert node.proc.poll() is None
    _clean_log(log)


def test_client_step_thread_survives_bad_results(exported, node_factory) -> None:
    """A node (or anyone on the path) sending malformed results: the client's step thread
    refuses them and keeps going."""
    model = exported["llama"]
    node = node_factory()

    async def main() -> None:
        be = await _cluster(model, [node.addr], [(0, 2)])
        try:
            plane = be.plane
            ours, theirs = socket.socketpair()  # a second "sink" into the client's thread
            plane.call(lambda: plane.add(ours, "sink"))
            for frame in ({"type": "result", "plan_id": "p", "session": "s", "step": [1], "start": 0},
                          {"type": "result", "plan_id": "p", "session": "s", "step": 0, "start": 0,
                           "hidden": encode_tensor(np.zeros((1, 1, 7), np.float32))},
                          {"type": "ping", "id": 1}):
                body = __import__("msgpack").packb(frame, use_bin_type=True)
                theirs.sendall(struct.pack(">I", len(body)) + body)
            await asyncio.sleep(0.3)
            assert plane.thread.is_alive() and plane.failures == 0
            assert plane.bad_frames >= 2
            assert len(await _tokens(be, [5, 6, 7], 4)) == 4
            theirs.close()
        finally:
            await be.close()

    asyncio.run(main())


# ---- 2. malformed control requests ended in an unhandled exception ---------------------------
def _control_mutations(plan: str) -> list[dict[str, Any]]:
    """Requests of every control type with one field wrong each (types, ranges, shapes: what
    the schema refuses), and well-formed ones whose values the node refuses."""
    base: dict[str, dict[str, Any]] = {
        "ping": {"t": 1.0}, "stats": {}, "files": {"sha256": ["a" * 64]},
        "upload": {"sha256": "a" * 64, "offset": 0, "total": 4, "data": b"abcd"},
        "load": {"plan_id": plan, "first": 0, "last": 1, "next": None, "manifest": {}},
        "end": {"plan_id": plan, "session": "s"},
        "kv_save": {"plan_id": plan, "session": "s", "tokens": b"\0" * 64},
        "kv_restore": {"plan_id": plan, "session": "s", "tokens": b"\0" * 64, "exact": False},
        "bulk": {"data": b"", "reply_bytes": 1},
        "profile": {"hidden_size": 8},
        "probe_link": {"peer": {"host": "127.0.0.1", "port": 1}, "config": {}},
        "data": {"plan_id": plan, "role": "in", "capability": "c" * 32},
    }
    wrong = [True, None, -1, 2**64 - 1, "x" * 300, [1], {}, 1.5, b"\0", "x", {"a": 1}, [[]]]
    out: list[dict[str, Any]] = []
    for kind, fields in base.items():
        out += [{"type": kind}, {"type": kind, **fields, "extra": 1}]
        out += [{"type": kind, **fields, name: v} for name in fields for v in wrong]

    def refused_by_schema(frame: dict[str, Any]) -> bool:
        try:
            m.parse({**frame, "id": 0}, LIMITS)
        except ProtocolError:
            return True
        return False

    out = [f for f in out if refused_by_schema(f)]
    h = {"host": "127.0.0.1", "port": 1}
    out += [  # well-formed, refused by the node
        {"type": "load", "plan_id": plan, "first": 0, "last": 1, "next": None, "manifest": {}},
        {"type": "load", "plan_id": plan, "first": 0, "last": 1, "next": None,
         "manifest": {"format": "edgelite-model/2"}},
        {"type": "load", "plan_id": plan, "first": 0, "last": 1, "next": h, "manifest": {}},
        {"type": "end", "plan_id": plan, "session": "s"},
        {"type": "kv_save", "plan_id": plan, "session": "s", "tokens": b"\0" * 64},
        {"type": "kv_restore", "plan_id": plan, "session": "s", "tokens": b"\0" * 64},
        {"type": "kv_save", "plan_id": plan, "session": "s", "tokens": b"\0" * (4 << 20 | 4)},
        {"type": "files", "sha256": ["../../etc/passwd"]},
        {"type": "upload", "sha256": "a" * 64, "offset": 5, "total": 4, "data": b"abcd"},
        {"type": "bulk", "data": b"", "reply_bytes": 1 << 30},
        {"type": "data", "plan_id": plan, "role": "sink", "capability": "c" * 32},
        {"type": "probe_link", "peer": h, "config": {"pings": "7"}},
        {"type": "probe_link", "peer": h, "config": {"udp_packets": 5000}},
        {"type": "probe_link", "peer": h, "config": {"nope": 1}},
        {"type": "probe_link", "peer": h, "config": {"small": 1}},
        {"type": "probe_link", "peer": h, "config": {"timeout_s": 1e9}}]
    return out


def test_malformed_control_requests_get_error_replies(exported, node_factory, tmp_path) -> None:
    log = tmp_path / "node.log"
    node = node_factory(log_file=log)

    async def main() -> None:
        conn = await _authed(node.port)
        requests = _control_mutations("p" * 32)
        assert len(requests) >= 139
        try:
            for i, frame in enumerate(requests):
                await _send_raw(conn, {**frame, "id": i})
                reply = await _reply(conn, 30)
                assert isinstance(reply, m.Error), (frame, reply)
                assert reply.id == i and reply.message, frame
            await conn.send(m.Ping(id=10**6))
            assert isinstance(await _reply(conn), m.Pong)
        finally:
            await conn.close()

    asyncio.run(main())
    assert node.proc.poll() is None
    _clean_log(log)


# ---- 3. memory before authentication ---------------------------------------------------------
def test_nothing_large_is_read_before_authentication(node_factory) -> None:
    node = node_factory()

    async def main() -> None:
        before = _rss_mib(node.proc.pid)
        for _ in range(3):
            r, w = await asyncio.open_connection("127.0.0.1", node.port)
            await read_frame(r, LIMITS.max_handshake_frame_bytes, 5)  # hello
            w.write(struct.pack(">I", 256 << 20) + os.urandom(1 << 20))
            try:
                await w.drain()
                data = await asyncio.wait_for(r.read(), 10)
                assert b"exceeds the limit of 4096" in data
            except ConnectionError:
                pass  # closed while we were still writing: refused all the same
            w.close()
        await asyncio.sleep(0.3)
        assert _rss_mib(node.proc.pid) < before + 16

    asyncio.run(main())


# ---- 4. no isolation between clients holding the token ---------------------------------------
def test_a_client_touches_only_its_own_plans_and_sessions(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()
    addr = NodeAddr.parse(node.addr)

    async def main() -> None:
        want = await _tokens(LocalBackend(mf.load(model)), [5, 6, 7], 10)
        a = await _cluster(model, [node.addr], [(0, 2)])
        b = await _cluster(model, [node.addr], [(0, 2)])
        pa, pb = a.cluster.plan_id, b.cluster.plan_id
        try:
            session = new_session_id()
            await a.forward(session, np.array([[5, 6, 7]], np.int64))  # A's session, left open
            st = await _stats(b)  # B sees A's work only as counts
            assert pa not in json.dumps(st) and st["other_plans"] == 1
            assert [s["plan_id"] for s in st["stages"]] == [pb]
            passes = st["stages"][0]["passes"]  # (the graph passes its range loaded with)
            assert passes[0] == "admit", passes
            assert passes[1] in ("attend-kernel", "attend-plain", "attend-padded"), passes
            assert set(passes[2:]) <= {"products", "norms", "products-padded"}, passes
            link = b.cluster.links[addr]
            with pytest.raises(NodeError, match="another client's"):  # load over A's plan
                await link.request(m.Load(id=0, plan_id=pa, first=0, last=2, next=addr,
                                          manifest=a.manifest.to_json(),
                                          next_capability="c" * 32), m.Loaded, 10)
            with pytest.raises(NodeError, match="not loaded here by this client"):
                await link.request(m.EndSession(id=0, plan_id=pa, session=session), m.Ended, 10)
            ids = np.arange(16, dtype="<i4").tobytes()
            with pytest.raises(NodeError, match="not loaded here by this client"):  # A's KV
                await link.request(m.KvSave(id=0, plan_id=pa, session=session, tokens=ids), m.KvSaved, 10)
            with pytest.raises(NodeError, match="not loaded here by this client"):
                await link.request(m.KvRestore(id=0, plan_id=pa, session=session, tokens=ids),
                                   m.KvRestored, 10)
            with pytest.raises(NodeError, match="whole number of int32"):
                await link.request(m.KvSave(id=0, plan_id=pb, session=session, tokens=b"\0" * 65),
                                   m.KvSaved, 10)
            with pytest.raises(NodeError, match="holds no KV"):  # B has no such session
                await link.request(m.KvSave(id=0, plan_id=pb, session=session, tokens=ids), m.KvSaved, 10)
            for cap in (b.cluster.capabilities[addr], "0" * 32):  # A's results, A's steps
                for role in ("sink", "in"):
                    conn = await _authed(node.port)
                    await conn.send(m.OpenData(id=1, plan_id=pa, role=role, capability=cap))
                    assert "wrong capability" in _text(await _reply(conn))
                    await conn.close()
            conn = await _data(node.port, pb, b.cluster.capabilities[addr])  # B's own data path
            await _send_raw(conn, _forward(pa, session=session, start=4))
            assert "this connection carries plan" in _text(await _reply(conn))
            await conn.close()
            # A's session goes on where it was (its KV untouched), and A's output is right
            await a.forward(session, np.array([[8]], np.int64))
            assert (await _stats(a))["own_sessions"] == 1
            assert await _tokens(a, [5, 6, 7], 10) == want
            ids = {new_session_id() for _ in range(100)}
            assert len(ids) == 100 and all(len(i) >= 32 for i in ids)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


# ---- 5. unbounded requests -------------------------------------------------------------------
def test_requests_that_allocate_send_or_connect_are_bounded(exported, node_factory) -> None:
    node = node_factory(extra=("--set", "disk_quota_bytes=200000", "--set", "part_ttl_s=1",
                               "--set", "supervise_s=0.2"))
    blobs = node.data_dir / "blobs"

    async def main() -> None:
        conn = await _authed(node.port)
        try:
            async def ask(msg: m.Message) -> m.Message:
                await conn.send(msg)
                return await _reply(conn, 30)

            big = await ask(m.Upload(id=1, sha256="a" * 64, offset=0, total=10**12, data=b"x"))
            assert "takes files of at most" in big.message
            over = await ask(m.Upload(id=2, sha256="b" * 64, offset=0, total=300_000, data=b"x"))
            assert "disk quota" in over.message
            part = await ask(m.Upload(id=3, sha256="c" * 64, offset=0, total=1000, data=b"x" * 10))
            assert isinstance(part, m.UploadAck) and part.held == 10
            assert (blobs / f"{'c' * 64}.part").exists()
            # the quota counts uploads under way at their declared size, not their bytes so far
            half = await ask(m.Upload(id=8, sha256="d" * 64, offset=0, total=150_000, data=b"x"))
            assert isinstance(half, m.UploadAck)
            assert "disk quota" in (await ask(m.Upload(id=9, sha256="e" * 64, offset=0,
                                                       total=150_000, data=b"x"))).message
            assert "reply_bytes" in (await ask(m.Bulk(id=4, data=b"", reply_bytes=64 << 20))).message
            before = _rss_mib(node.proc.pid)
            t0 = time.monotonic()
            prof = await ask(m.ProfileRequest(id=5, hidden_size=65535))
            # a GEMV of at most max_profile_bytes (16 MiB of float32: 1024 x 4096)
            assert isinstance(prof, m.ProfileReply) and "gemv 1024" in prof.profile["flops_source"]
            assert time.monotonic() - t0 < 20 and _rss_mib(node.proc.pid) < before + 40
            many = await ask(m.ProbeLink(id=6, peer=NodeAddr("127.0.0.1", 9),
                                         config={"udp_packets": 5000}))
            assert "udp_packets: 5000 is outside" in many.message
            # a probe toward something that is not a node sends it no datagram at all
            tcp = socket.create_server(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("127.0.0.1", port))
            udp.setblocking(False)
            report = await ask(m.ProbeLink(id=7, peer=NodeAddr("127.0.0.1", port, port),
                                           config={"udp_packets": 100, "timeout_s": 0.5}))
            assert isinstance(report, m.LinkReport) and report.link["reachable"] is False
            with pytest.raises(BlockingIOError):
                udp.recv(100)
            tcp.close()
            udp.close()
            await asyncio.sleep(2.5)  # the partial upload nobody finishes is deleted
            assert not (blobs / f"{'c' * 64}.part").exists()
        finally:
            await conn.close()

    asyncio.run(main())


def test_a_slow_request_holds_back_neither_pings_nor_other_requests(node_factory) -> None:
    """Requests on one control connection are answered as each is done: a slow one (a link
    probe toward a peer that accepts and never answers waits out its timeout, as a KV write
    behind a long prefill or a model load can) no longer holds back the pings a client's
    heartbeat sends there (it declared the node lost after 0.8 s) nor a quick request; the
    number under way at once is bounded (max_requests_per_connection)."""
    node = node_factory()
    one = node_factory(extra=("--set", "max_requests_per_connection=1",
                              "--set", "max_queued_request_bytes=4000000"))
    hung = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nothing ever answers

    async def main() -> None:
        conn = await _authed(node.port)
        peer = NodeAddr("127.0.0.1", hung.getsockname()[1])
        replies: dict[int, tuple[float, m.Message]] = {}

        async def read(n: int) -> None:
            for _ in range(n):
                reply = await _reply(conn, 10)
                replies[reply.id] = (time.monotonic() - t0, reply)  # type: ignore[attr-defined]

        try:
            t0 = time.monotonic()
            await conn.send(m.ProbeLink(id=1, peer=peer, config={"timeout_s": 2.0}))
            for i in range(5):
                await conn.send(m.Ping(id=10 + i))
            await conn.send(m.StatsRequest(id=2))
            await conn.send(m.Upload(id=3, sha256="a" * 64, offset=0, total=10**12, data=b"x"))
            await read(8)
            probe_at, probe = replies[1]
            assert isinstance(probe, m.LinkReport) and probe.link["reachable"] is False
            assert probe_at >= 1.9
            for i in range(5):
                at, pong = replies[10 + i]
                assert isinstance(pong, m.Pong) and at < 1.0, (at, pong)
            assert isinstance(replies[2][1], m.StatsReply) and replies[2][0] < 1.0
            assert "takes files of at most" in _text(replies[3][1])  # an error keeps its id
            # a node that takes one request at a time per connection: a quick one waits
            conn1 = await _authed(one.port)
            await conn1.send(m.ProbeLink(id=4, peer=peer, config={"timeout_s": 1.5}))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await conn1.send(m.StatsRequest(id=5))
            await conn1.send(m.Ping(id=6))
            at: dict[int, float] = {}
            for _ in range(3):
                at[(await _reply(conn1)).id] = time.monotonic() - t0  # type: ignore[attr-defined]
            assert list(at) == [6, 4, 5] and at[6] < 0.5 and at[5] >= 1.0, at
            # while its requests' frames hold max_queued_request_bytes, a connection is not read
            # (a client cannot make the node hold many large frames it has not answered)
            await conn1.send(m.ProbeLink(id=7, peer=peer, config={"timeout_s": 2.0}))
            sent = 0

            async def flood() -> None:
                nonlocal sent
                for i in range(40):
                    await conn1.send(m.Bulk(id=100 + i, data=bytes(1 << 20), reply_bytes=0))
                    sent += 1

            sending = asyncio.create_task(flood())
            await asyncio.sleep(1.0)
            assert not sending.done() and sent < 30, sent  # 4 MB held + what the sockets buffer
            replies = {(await _reply(conn1)).id for _ in range(41)}  # type: ignore[attr-defined]
            await sending
            assert replies == {7, *range(100, 140)}
            await conn1.close()
            alive = await _authed(node.port)  # the node serves other connections throughout
            await alive.send(m.StatsRequest(id=1))
            assert isinstance(await _reply(alive), m.StatsReply)
            await alive.close()
        finally:
            await conn.close()
            hung.close()

    asyncio.run(main())


# ---- 6. leaks --------------------------------------------------------------------------------
def test_a_clients_plans_and_sessions_go_with_it(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory(extra=("--set", "owner_grace_s=0.5", "--set", "supervise_s=0.2",
                               "--set", "max_sessions_per_client=3"))

    async def main() -> None:
        watcher = await _cluster(exported["qwen2"], [node.addr], [(0, 1)])  # shares no layers
        try:
            rss = []
            for _ in range(8):  # deploy, open sessions, vanish without ending anything
                be = await _cluster(model, [node.addr], [(0, 2)])
                for s in range(3):
                    await be.forward(f"s{s}", np.array([[5, 6, 7]], np.int64))
                with pytest.raises(NodeError, match="the limit is 3"):
                    await be.forward("fourth", np.array([[5, 6, 7]], np.int64))
                await be.plane.stop()  # no EndSession: the client is just gone
                for link in be.cluster.links.values():
                    link.conn.writer.transport.abort()
                await be.cluster.close()
                deadline = time.monotonic() + 5
                while True:
                    st = await _stats(watcher)
                    if st["other_plans"] == 0 and st["sessions"] == 0:
                        break
                    assert time.monotonic() < deadline, st
                    await asyncio.sleep(0.1)
                rss.append(_rss_mib(node.proc.pid))
            assert rss[-1] < rss[0] + 24, rss
        finally:
            await watcher.close()

    asyncio.run(main())


# ---- 7. cached files were never re-checked ---------------------------------------------------
async def _load_refused(m0: mf.Manifest, addr: str, first: int, last: int, match: str) -> None:
    """A `load` of layers first-last sent straight to the node (no deploy) is refused with an
    error matching `match`."""
    cluster = Cluster(m0, TOKEN)
    try:
        await cluster.connect([NodeAddr.parse(addr)])
        link = next(iter(cluster.links.values()))
        with pytest.raises(NodeError, match=match):
            await link.request(m.Load(id=0, plan_id="q" * 32, first=first, last=last, next=None,
                                      manifest=m0.to_json()), m.Loaded, 10)
    finally:
        await cluster.close()


def test_cached_blobs_are_verified_when_loaded_and_healed(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()
    blobs = node.data_dir / "blobs"
    m0 = mf.load(model)

    async def main() -> None:
        be = await _cluster(model, [node.addr], [(0, 2)])
        await be.close()
        target = blobs / m0.layers[1].data[0].sha256
        st = target.stat()
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
        target.write_bytes(bytes(data))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back
        # a load without a deploy finds it damaged: refused, and the blob deleted
        await _load_refused(m0, node.addr, 0, 2, "damaged since it was deployed.*deleted")
        assert not target.exists()
        # the next deploy uploads it again and runs
        await (await _cluster(model, [node.addr], [(0, 2)])).close()
        assert target.read_bytes() == (model / m0.layers[1].data[0].file).read_bytes()
        # damaged again: the deploy itself finds it (the node reports it missing) and heals it
        target.write_bytes(bytes(data))
        await (await _cluster(model, [node.addr], [(0, 2)])).close()
        assert target.read_bytes() == (model / m0.layers[1].data[0].file).read_bytes()
        target.unlink()
        copy = node.data_dir / "elsewhere"
        shutil.copy(model / m0.layers[1].data[0].file, copy)
        target.symlink_to(copy)
        # load without deploying (a deploy would replace the link)
        await _load_refused(m0, node.addr, 0, 2, "symbolic link")

    asyncio.run(main())


def test_plans_being_loaded_count_against_a_clients_limit(exported, node_factory) -> None:
    """Requests of a connection run side by side: loads under way count against
    max_plans_per_client, so three at once with a limit of two leave one refused."""
    model = exported["llama"]
    node = node_factory(extra=("--set", "max_plans_per_client=2"))
    m0 = mf.load(model)

    async def main() -> None:
        await (await _cluster(model, [node.addr], [(0, 2)])).close()  # the files are there now
        cluster = Cluster(m0, TOKEN)
        try:
            await cluster.connect([NodeAddr.parse(node.addr)])
            link = next(iter(cluster.links.values()))
            got = await asyncio.gather(*(
                link.request(m.Load(id=0, plan_id=f"{i}" * 32, first=0, last=2, next=None,
                                    manifest=m0.to_json()), m.Loaded, 20) for i in range(3)),
                return_exceptions=True)
            refused = [g for g in got if isinstance(g, NodeError)]
            assert len(refused) == 1 and "max_plans_per_client" in str(refused[0]), got
        finally:
            await cluster.close()

    asyncio.run(main())


# ---- 9. manifest values and corrupt files ----------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("eos_token_ids", "2", "eos_token_ids must be a list"),
    ("rope", None, "rope must be an object"),
    ("max_positions", -1, "max_positions must be an integer"),
    ("chat_template", 5, "chat_template must be a string"),
    ("num_layers", True, "num_layers must be an integer"),
])
def test_bad_manifest_values_are_named(exported, field, value, words) -> None:
    j = json.loads((exported["llama"] / "manifest.json").read_text())
    j[field] = value
    with pytest.raises(ManifestError, match=words):
        mf.parse(j, exported["llama"])


@pytest.mark.parametrize("field", ["narrow_resident_bytes", "narrow_scratch_bytes", "narrow_load_peak_bytes"])
@pytest.mark.parametrize("value", [-1, "64", 2.5, True, 1 << 80])
def test_bad_narrow_memory_figures_are_named(exported, field, value) -> None:
    """The figures a device with engine/matmul.c's products counts: integers, at least 0."""
    j = json.loads((exported["llama"] / "manifest.json").read_text())
    j["layers"][0][field] = value
    with pytest.raises(ManifestError, match=f"layers.*{field}"):
        mf.parse(j, exported["llama"])


def test_manifest_and_files_that_disagree(exported, node_factory, tmp_path) -> None:
    model = tmp_path / "m"
    shutil.copytree(exported["llama"], model)
    j = json.loads((model / "manifest.json").read_text())
    j["vocab_size"] = 10  # the graphs say otherwise
    (model / "manifest.json").write_text(json.dumps(j))
    with pytest.raises(EdgeliteError, match="vocab_size = 10"):
        LocalBackend(mf.load(model), RuntimeConfig(threads=1))
    shutil.rmtree(model)
    shutil.copytree(exported["llama"], model)
    m0 = mf.load(model)
    node = node_factory()

    async def main() -> None:
        # a truncated local file: named before anything is sent
        path = model / m0.layers[2].file
        path.write_bytes(path.read_bytes()[:-10])
        with pytest.raises(EdgeliteError, match="truncated or replaced"):
            await _cluster(model, [node.addr], [(0, 2)])
        # a file the node lacks (and the client too): named, not a traceback
        path.unlink()
        with pytest.raises(EdgeliteError, match="missing"):
            await _cluster(model, [node.addr], [(0, 2)])
        await _load_refused(m0, node.addr, 2, 2, "is not deployed to this node")
        plan = split_plan([(0, 2)], [NodeAddr.parse(node.addr)], m0.num_layers)
        assert plan.remote

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # on purpose
def test_a_dead_data_plane_thread_is_restarted(exported, tmp_path) -> None:
    """If the data plane's thread ends anyway, the node's supervisor starts a new one; the
    failure shows in stats and new plans run."""
    from edgelite.config import NodeConfig
    from edgelite.node.server import run_node

    model = exported["llama"]

    async def main() -> None:
        cfg = NodeConfig(port=0, supervise_s=0.1, runtime=RuntimeConfig(threads=1))
        async with run_node(TOKEN, tmp_path / "node", cfg) as node:
            want = await _tokens(LocalBackend(mf.load(model)), [5, 6, 7], 6)
            be = await _cluster(model, [str(node.addr)], [(0, 2)])
            assert await _tokens(be, [5, 6, 7], 6) == want
            old = node.data
            def die() -> None:
                raise SystemExit  # not an Exception: it ends the thread as a crash would

            old.call(die)
            for _ in range(100):
                if node.data is not old and node.data.thread.is_alive():
                    break
                await asyncio.sleep(0.05)
            assert node.restarts == 1
            with pytest.raises(EdgeliteError):  # the old plan's data connections went with it
                await _tokens(be, [5, 6, 7], 6)
            await be.close()
            again = await _cluster(model, [str(node.addr)], [(0, 2)])
            assert await _tokens(again, [5, 6, 7], 6) == want
            assert (await _stats(again))["data_plane"]["restarts"] == 1
            await again.close()

    asyncio.run(main())


# ---- round 2: strangers before authentication ----------------------------------------------
def test_strangers_cannot_keep_clients_out_nor_break_the_handshake(node_factory, tmp_path) -> None:
    """400 connections from another address that never authenticate, held open: a client's
    20 new connections (each a handshake and a ping) all get in, within the flood. A step frame
    of 0 x 2^32-1 x 2^32-1 in place of the Auth message gets a one-line refusal and no
    traceback (the node's log is clean)."""
    log = tmp_path / "node.log"
    node = node_factory(log_file=log)
    flood: list[socket.socket] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(400):
            s = socket.socket()
            s.setblocking(False)
            s.bind(("127.0.0.2", 0))
            try:
                await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", node.port)), 2)
            except (OSError, TimeoutError):
                pass  # refused or still pending: held open all the same
            flood.append(s)
        t0 = time.monotonic()
        for _ in range(20):
            conn = await _authed(node.port)
            try:
                await conn.send(m.Ping(id=1))
                assert isinstance(await _reply(conn), m.Pong)
            finally:
                await conn.close()
        assert time.monotonic() - t0 < 10
        r, w = await asyncio.open_connection("127.0.0.1", node.port)
        await read_frame(r, LIMITS.max_handshake_frame_bytes, 5)  # hello
        body = stepframe.HEAD.pack(stepframe.MAGIC, 1, stepframe.HIDDEN, 0, 1, 0, 1, 1, 0,
                                   stepframe.F32, 3) + b"ps"
        body += struct.pack("<3I", 0, 2**32 - 1, 2**32 - 1) + b"\0\0"
        w.write(struct.pack(">I", len(body)) + body)
        reply = await asyncio.wait_for(r.read(), 5)
        assert b"bad handshake" in reply and b"hidden: shape" in reply, reply
        w.close()
        stats = await _node_stats(node.port)
        assert stats["refused_strangers"] > 0, stats

    try:
        asyncio.run(main())
    finally:
        for s in flood:
            s.close()
    _clean_log(log)


async def _node_stats(port: int) -> dict[str, Any]:
    conn = await _authed(port)
    try:
        await conn.send(m.StatsRequest(id=1))
        reply = await _reply(conn)
        assert isinstance(reply, m.StatsReply)
        return reply.stats
    finally:
        await conn.close()


def test_large_frames_of_many_connections_wait_for_the_nodes_frame_budget(node_factory) -> None:
    """Eight connections each send a 60 MiB request at once: the node reads them within its
    frame budget (max_held_frame_bytes, 96 MiB: one such frame at a time), so its peak memory
    grows by a few frames' worth, not eight; every request is answered."""
    node = node_factory()
    frame = m.Bulk(id=1, data=bytes(60 << 20), reply_bytes=0)

    async def one() -> m.Message:
        conn = await _authed(node.port)
        try:
            await conn.send(frame)
            return await _reply(conn, 60)
        finally:
            await conn.close()

    async def main() -> list[m.Message]:
        return await asyncio.gather(*(one() for _ in range(8)))

    before = _rss_mib(node.proc.pid, "VmHWM")
    replies = asyncio.run(main())
    assert all(isinstance(r, m.BulkAck | m.Error) for r in replies), replies
    assert sum(isinstance(r, m.BulkAck) for r in replies) >= 2
    grew = _rss_mib(node.proc.pid, "VmHWM") - before
    assert grew < 260, grew  # (without the budget: ~8 x 2 x 60 MiB)
    assert asyncio.run(_node_stats(node.port))["frame_budget"]["waited"] > 0




def test_a_refusal_echoes_only_an_id_the_schema_takes(node_factory) -> None:
    """A refused request whose id is out of the schema's range (|id| > 2^53) gets an Error
    without that id, which the client's parser accepts; an id in range is echoed."""
    node = node_factory()

    async def main() -> list[m.Message]:
        conn = await _authed(node.port)
        try:
            out = []
            for rid in (2**60, -(2**60), 2**53):
                await _send_raw(conn, {"type": "stats", "id": rid, "junk": 1})
                out.append(await _reply(conn))  # parsed: a reply the schema refused would raise
            return out
        finally:
            await conn.close()

    replies = asyncio.run(main())
    assert all(isinstance(r, m.Error) for r in replies), replies
    assert [r.id for r in replies] == [None, None, 2**53]


def test_one_address_with_many_keys_leaves_kv_for_others(exported, node_factory) -> None:
    """Client keys are chosen freely, so the KV budget is shared by address: two clients from
    127.0.0.2 (two keys) hold at most max_address_kv_share (0.75) of a node's KV between them,
    and a client from another address still starts a session."""
    model = exported["llama"]
    m0 = mf.load(model)
    per_session = m0.kv_bytes(0, m0.num_layers - 1, 16)  # a short session's first bucket
    node = node_factory(kv_budget_mb=4 * per_session / 2**20,
                        extra=("--kv-buckets", "16,32,64,128,256"))
    ids = np.array([[5, 6, 7]], np.int64)

    async def fill(be, tag: str) -> int:
        n = 0
        for i in range(8):
            try:
                await be.forward(f"{tag}{i}" + "0" * 28, ids)
            except NodeError as exc:
                assert "max_address_kv_share" in str(exc) or "left" in str(exc), exc
                break
            n += 1
        return n

    async def main() -> tuple[int, int, int]:
        far = ClientConfig(local_host="127.0.0.2")
        hogs = [await _cluster(model, [node.addr], [(0, m0.num_layers - 1)], far) for _ in range(2)]
        victim = await _cluster(model, [node.addr], [(0, m0.num_layers - 1)])
        try:
            got = [await fill(h, f"h{k}") for k, h in enumerate(hogs)]
            mine = await fill(victim, "v")
        finally:
            for be in (*hogs, victim):
                await be.close()
        return got[0], got[1], mine

    first, second, mine = asyncio.run(main())
    assert first + second == 3, (first, second)  # 0.75 of 4 sessions' KV, two keys or not
    assert mine >= 1
