"""Wire codec, message schema and handshake, in memory and over real loopback sockets."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net import stepframe as sf
from edgelite.net.frames import Conn, decode, pack, read_frame, unpack
from edgelite.net.handshake import connect, server_handshake
from edgelite.net.tensors import decode_tensor

pytestmark = pytest.mark.unit

LIMITS = WireLimits(max_frame_bytes=1 << 20, max_tensor_elements=1 << 16)


def _roundtrip(msg: m.Message) -> m.Message:
    return decode(pack(msg)[4:], LIMITS)


def test_tensor_roundtrip_zero_copy() -> None:
    """A tensor in a msgpack frame is a view of the received bytes (a step sent as msgpack by
    an older peer is still read); a binary step's tensor is copied out of the frame buffer."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    fwd = m.Forward(plan_id="p", session="s", step=1, start=0, hidden=a, trace=[(1, 2)])
    got = m.parse(unpack(msgpack.packb(fwd.to_wire(), use_bin_type=True)), LIMITS)
    assert isinstance(got, m.Forward)
    np.testing.assert_array_equal(a, got.hidden)
    assert not got.hidden.flags.owndata  # a view on the received bytes
    assert got.trace == [(1, 2)]
    body = pack(fwd)[4:]
    assert body[0] == 0xC1  # the binary step layout
    got = _roundtrip(fwd)
    assert isinstance(got, m.Forward) and got.hidden.flags.owndata and got.trace == [(1, 2)]
    np.testing.assert_array_equal(a, got.hidden)


def test_every_message_type_roundtrips() -> None:
    samples = [
        m.Error(message="no", id=3), m.Ping(id=1, t=2.5), m.Pong(id=1, rt=3.0),
        m.Load(id=2, plan_id="p", first=0, last=3, next=NodeAddr("h", 7), manifest={"a": 1}),
        m.Upload(id=4, sha256="a" * 64, offset=0, total=3, data=b"abc"),
        m.OpenData(id=5, plan_id="p", role="sink", capability="c" * 32),
        m.GenerateRequest(id=6, messages=[m.ChatMessage(role="user", content="hi")], seed=3),
        m.ProbeLink(id=7, peer=NodeAddr("h", 9, 10), config={}),
        m.Result(plan_id="p", session="s", step=2, start=5, error="boom", trace=[(3, 4)]),
    ]
    for msg in samples:
        assert _roundtrip(msg) == msg


@pytest.mark.parametrize("bad, match", [
    ({"dtype": "complex128", "shape": [1], "data": b"\0" * 16}, "unknown dtype"),
    ({"dtype": "float32", "shape": [2, 2], "data": b"\0" * 15}, "needs 16 bytes, got 15"),
    ({"dtype": "float32", "shape": [1 << 20], "data": b""}, "exceeds the limit"),
    ({"dtype": "float32", "shape": [-1], "data": b""}, "bad shape"),
    ({"dtype": "float32", "shape": [True], "data": b"\0" * 4}, "bad shape"),
    ({"dtype": "float32", "shape": "3", "data": b""}, "shape must be a list"),
    ({"dtype": ["float32"], "shape": [1], "data": b"\0" * 4}, "unknown dtype"),
    ({"dtype": "float32", "shape": [1]}, "expected a tensor"),
    ({"dtype": "float32", "shape": [1], "data": "abcd"}, "got str"),
])
def test_tensor_limits(bad: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_tensor(bad, LIMITS)


@pytest.mark.parametrize("frame, match", [
    ({"type": "nope"}, "unknown message type"),
    ({"type": ["forward"]}, "unknown message type"),
    ({"type": "ping"}, "missing field 'id'"),
    ({"type": "ping", "id": True}, r"ping.id: expected an integer, got True"),
    ({"type": "ping", "id": 1, "extra": 1}, "unknown field 'extra'"),
    ({"type": "forward", "plan_id": ["p"], "session": "s", "step": 0, "start": 0},
     "forward.plan_id: expected a string"),
    ({"type": "forward", "plan_id": "p", "session": "s", "step": 0, "start": False},
     "forward.start: expected an integer, got False"),
    ({"type": "forward", "plan_id": "p", "session": "s", "step": 0, "start": -1}, "outside"),
    ({"type": "data", "id": 0, "plan_id": "p", "role": "out"}, "is not one of in, sink"),
    ({"type": "generate", "id": 0, "temperature": float("nan")}, "not finite"),
    ({"type": "load", "id": 0, "plan_id": "p", "first": 0, "last": 1, "next": {"host": "h"},
      "manifest": {}}, "missing field 'port'"),
])
def test_schema_refuses_malformed_messages(frame: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        m.parse(frame, LIMITS)


def test_frame_must_be_a_map() -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        unpack(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        unpack(b"\xc1\xc1")


async def _pair(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port


def test_oversized_length_prefix_rejected_before_reading() -> None:
    async def main() -> None:
        got: list[Exception] = []

        async def handler(r, w):
            try:
                await read_frame(r, LIMITS.max_frame_bytes, 5)
            except ProtocolError as exc:
                got.append(exc)
            w.close()

        server, port = await _pair(handler)
        async with server:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(struct.pack(">I", 0xFFFFFFFF))
            await w.drain()
            await r.read()
            w.close()
        assert "exceeds the limit" in str(got[0])

    asyncio.run(main())


def test_handshake_both_ways_and_wrong_token() -> None:
    async def main() -> None:
        results: list[object] = []

        async def handler(r, w):
            conn = Conn(r, w, LIMITS)
            try:
                results.append(await server_handshake(conn, "secret", "n", []))
            except AuthError as exc:
                results.append(exc)
                await conn.send(m.Error(message=str(exc)))
            await conn.close()

        server, port = await _pair(handler)
        async with server:
            conn, welcome = await connect(NodeAddr("127.0.0.1", port), "secret", "fp", LIMITS, 5)
            assert welcome.node == "n"
            await conn.close()
            with pytest.raises(AuthError, match="wrong token"):
                await connect(NodeAddr("127.0.0.1", port), "guess", "fp", LIMITS, 5)
        assert isinstance(results[0], m.Auth) and results[0].fingerprint == "fp"
        assert isinstance(results[1], AuthError)

    asyncio.run(main())


def test_binary_steps_roundtrip_and_refuse_every_broken_header() -> None:
    """Steps travel as a binary header and raw tensor bytes (net/stepframe.py): every field
    survives; every truncation and 2,000 random corruptions of a frame give a ProtocolError or
    a message whose fields are within the schema's bounds, never another exception."""
    rng = np.random.default_rng(0)
    samples = [m.Forward(plan_id="p" * 32, session="s" * 32, step=2**53, start=1 << 30,
                         hidden=rng.standard_normal((1, 5, 7)).astype(np.float32),
                         trace=[(1, 2), (2**32 - 1, 0)]),
               m.Result(plan_id="p", session="s", step=0, start=0, error="bad \u00fc " * 200),
               m.Result(plan_id="", session="", step=1, start=2, hidden=np.zeros((2, 0), np.float16)),
               m.Forward(plan_id="p", session="s", step=1, start=0,
                         hidden=np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2])]
    for msg in samples:
        got = _roundtrip(msg)
        assert type(got) is type(msg)
        for f in ("plan_id", "session", "step", "start", "error", "trace"):
            assert getattr(got, f) == getattr(msg, f), f
        if msg.hidden is None:
            assert got.hidden is None
        else:
            assert got.hidden.dtype == msg.hidden.dtype
            np.testing.assert_array_equal(got.hidden, msg.hidden)
    body = pack(samples[0])[4:]
    for n in range(len(body)):
        with pytest.raises(ProtocolError):
            decode(body[:n], LIMITS)
    with pytest.raises(ProtocolError, match="bytes after the header and no tensor"):
        decode(pack(samples[1])[4:] + b"\0\0\0\0", LIMITS)
    for _ in range(2000):
        bad = bytearray(body)
        for i in rng.integers(0, 40, rng.integers(1, 4)):  # the header and the ids
            bad[i] = int(rng.integers(0, 256))
        try:
            got = decode(bytes(bad), LIMITS)
        except ProtocolError:
            continue
        assert isinstance(got, m.Forward | m.Result | m.Message)
        if isinstance(got, m.Forward | m.Result):
            assert 0 <= got.step <= m.RID and 0 <= got.start <= 1 << 30
            assert len(got.plan_id) <= m.ID and len(got.trace) < m.MAX_STAGES
    big = m.Forward(plan_id="p", session="s", step=0, start=0,
                    hidden=np.zeros((1, 1 << 17), np.float32))
    with pytest.raises(ProtocolError, match="limit 65536 elements"):
        decode(pack(big)[4:], LIMITS)


@settings(max_examples=3000, deadline=None)
@given(head=st.tuples(st.integers(0, 3), st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**64 - 1),
                      st.integers(0, 2**32 - 1), st.integers(0, 255), st.integers(0, 255),
                      st.integers(0, 2**16 - 1), st.integers(0, 255), st.integers(0, 255)),
       dims=st.lists(st.sampled_from([0, 1, 2, 3, 2**16, 2**31, 2**32 - 1]), max_size=8),
       tail=st.binary(max_size=96))
def test_any_step_header_is_a_message_or_a_protocol_error(head: tuple, dims: list[int], tail: bytes) -> None:
    """Arbitrary header fields, shapes (zeros among huge sizes: 0 elements that numpy cannot
    shape) and bytes after them: stepframe.parse, and decode, give a message within the
    schema's bounds or a ProtocolError, nothing else."""
    kind, flags, n_trace, step, start, n_plan, n_session, n_error, code, rank = head
    body = (sf.HEAD.pack(sf.MAGIC, kind, flags, n_trace, step, start, n_plan, n_session, n_error,
                         code, rank if rank < 16 else len(dims))
            + b"p" * min(n_plan, 64) + b"s" * min(n_session, 64) + struct.pack(f"<{len(dims)}I", *dims)
            + tail)
    for parse in (lambda b: sf.parse(b, LIMITS), lambda b: decode(b, LIMITS)):
        try:
            got = parse(body)
        except ProtocolError:
            continue
        assert isinstance(got, m.Forward | m.Result)
        assert got.hidden is None or got.hidden.size <= LIMITS.max_tensor_elements


def test_a_shape_of_zero_and_huge_sizes_is_refused() -> None:
    """(0, 2**32 - 1, 2**32 - 1) has 0 elements, yet no array has that shape: refused by name,
    on the step codec and the msgpack one (it used to kill the data-plane thread)."""
    body = sf.HEAD.pack(sf.MAGIC, 1, sf.HIDDEN, 0, 1, 0, 1, 1, 0, sf.F32, 3) + b"ps" \
        + struct.pack("<3I", 0, 2**32 - 1, 2**32 - 1) + b"\0\0"
    with pytest.raises(ProtocolError, match=r"hidden: shape \[0, 4294967295"):
        decode(body, LIMITS)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_tensor({"dtype": "float32", "shape": [0, 2**32 - 1, 2**32 - 1], "data": b""}, LIMITS)
