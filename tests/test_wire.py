"""Wire codec and handshake, in memory and over real loopback sockets."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import numpy as np
import pytest

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError
from edgelite.net import wire

LIMITS = WireLimits(max_frame_bytes=1 << 20, max_tensor_elements=1 << 16)


def test_tensor_roundtrip_zero_copy() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    msg = wire.unpack(wire.pack({"type": "t", "x": wire.encode_tensor(a)})[4:])
    b = wire.decode_tensor(msg["x"], LIMITS)
    np.testing.assert_array_equal(a, b)
    assert not b.flags.owndata  # a view on the received bytes


@pytest.mark.parametrize("bad, match", [
    ({"dtype": "complex128", "shape": [1], "data": b"\0" * 16}, "unknown dtype"),
    ({"dtype": "float32", "shape": [2, 2], "data": b"\0" * 15}, "needs 16 bytes, got 15"),
    ({"dtype": "float32", "shape": [1 << 20], "data": b""}, "exceed the limit"),
    ({"dtype": "float32", "shape": [-1], "data": b""}, "bad shape"),
    ({"dtype": "float32", "shape": "3", "data": b""}, "bad shape"),
    ({"dtype": "float32", "shape": [1]}, "expected"),
    ({"dtype": "float32", "shape": [1], "data": "abcd"}, "got str"),
])
def test_tensor_limits(bad: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode_tensor(bad, LIMITS)


def test_frame_must_be_a_typed_map() -> None:
    with pytest.raises(ProtocolError, match="string 'type'"):
        wire.unpack(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        wire.unpack(b"\xc1\xc1")


async def _pair(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port


def test_oversized_length_prefix_rejected_before_reading() -> None:
    async def main() -> None:
        got: list[Exception] = []

        async def handler(r, w):
            try:
                await wire.read_frame(r, LIMITS)
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
            conn = wire.Conn(r, w, LIMITS)
            try:
                results.append(await wire.server_handshake(conn, "secret", "n", []))
            except AuthError as exc:
                results.append(exc)
                await conn.send({"type": "error", "message": str(exc)})
            await conn.close()

        server, port = await _pair(handler)
        async with server:
            conn, welcome = await wire.connect("127.0.0.1", port, "secret", "fp", LIMITS, 5)
            assert welcome["node"] == "n"
            await conn.close()
            with pytest.raises(AuthError, match="wrong token"):
                await wire.connect("127.0.0.1", port, "guess", "fp", LIMITS, 5)
        assert results[0]["fingerprint"] == "fp"
        assert isinstance(results[1], AuthError)

    asyncio.run(main())
