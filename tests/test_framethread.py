"""The thread that carries steps (net/framethread.py), on real sockets: a connection closed
outside it is dropped without the thread spinning, and the others go on."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest

from edgelite.config import WireLimits
from edgelite.net import messages as m
from edgelite.net.frames import pack
from edgelite.net.framethread import FrameThread
from edgelite.net.schema import Message

pytestmark = pytest.mark.unit


class Recorder(FrameThread):
    def __init__(self) -> None:
        super().__init__("test-frames", WireLimits(), 5.0, 5.0, 5.0)
        self.frames: list[str] = []
        self.closed: list[str] = []
        self.got = threading.Event()

    def on_frame(self, sock: socket.socket, msg: Message, t_in: float) -> None:
        self.frames.append(msg.session)  # type: ignore[attr-defined]
        self.got.set()

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        self.closed.append(reason)
        self.got.set()


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        server, _ = srv.accept()
    return client, server


def _step(session: str) -> bytes:
    return pack(m.Forward(plan_id="p", session=session, step=0, start=0,
                          hidden=np.zeros((1, 1, 4), np.float32)))


def _wait(t: Recorder, what: str) -> None:
    assert t.got.wait(5), f"no {what} within 5 s"
    t.got.clear()


def test_a_connection_closed_outside_the_thread_is_dropped_and_the_others_go_on() -> None:
    async def main() -> None:
        t = Recorder()
        t.start()
        a_client, a_server = _pair()
        b_client, b_server = _pair()
        try:
            await t.submit(lambda: t.add(a_server, "in"))
            await t.submit(lambda: t.add(b_server, "in"))
            a_client.sendall(_step("a"))
            _wait(t, "frame")
            assert t.frames == ["a"]
            a_server.close()  # by someone else, while the thread still waits on it
            t.call(lambda: None)  # (a wake-up: the thread polls again at once)
            _wait(t, "close")
            assert t.closed == ["closed outside the thread"]
            cpu0, wall0 = os.times().user + os.times().system, time.monotonic()
            await asyncio.sleep(0.5)
            busy = (os.times().user + os.times().system - cpu0) / (time.monotonic() - wall0)
            assert busy < 0.3, f"the thread spins: {busy:.0%} of a core while idle"
            b_client.sendall(_step("b"))
            _wait(t, "frame")
            assert t.frames == ["a", "b"] and t.thread.is_alive() and t.failures == 0
        finally:
            await t.stop()
            for s in (a_client, b_client, b_server):
                s.close()

    asyncio.run(main())
