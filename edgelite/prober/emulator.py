"""A userspace link emulator: a TCP + UDP proxy on loopback adding delay, jitter, loss and a
rate limit, so tests and the demo can put a known link between two nodes.

Each direction is a FIFO: a chunk leaves at max(previous departure, arrival + delay + jitter,
link free) with link free advanced by len * 8 / rate, so jitter never reorders a byte stream.
Loss applies to UDP datagrams only (TCP would retransmit; its effect shows as delay).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    delay_ms: float = 0.0  # one-way, each direction
    jitter_ms: float = 0.0  # uniform +- around the delay
    rate_mbps: float = 0.0  # 0 = unlimited
    loss: float = 0.0  # UDP drop probability, each direction


class _Pipe:
    """One direction: schedules chunks, then writes them in order."""

    def __init__(self, spec: LinkSpec, rng: random.Random) -> None:
        self.spec, self.rng = spec, rng
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        self.last_departure = 0.0
        self.link_free = 0.0

    def departure(self, size: int) -> float:
        s, now = self.spec, time.monotonic()
        delay = max(0.0, s.delay_ms + self.rng.uniform(-s.jitter_ms, s.jitter_ms)) / 1e3
        t = max(self.last_departure, now + delay)
        if s.rate_mbps > 0:
            start = max(now, self.link_free)
            self.link_free = start + size * 8 / (s.rate_mbps * 1e6)
            t = max(t, self.link_free + delay)
        self.last_departure = t
        return t

    async def pump(self, writer: asyncio.StreamWriter) -> None:
        while True:
            when, data = await self.queue.get()
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            if data is None:
                writer.write_eof() if writer.can_write_eof() else writer.close()
                return
            writer.write(data)
            await writer.drain()


class LinkEmulator:
    """Listens on 127.0.0.1:port (TCP and UDP) and forwards to target with the link applied."""

    def __init__(self, target: tuple[str, int], spec: LinkSpec, udp_target_port: int | None = None,
                 seed: int = 0, chunk: int = 16384) -> None:
        self.target, self.spec = target, spec
        self.udp_target = (target[0], udp_target_port or target[1])
        self.rng, self.chunk = random.Random(seed), chunk
        self.server: asyncio.Server | None = None
        self.udp: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task] = set()
        self.udp_proxy: _UdpProxy | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def start(self, port: int = 0) -> LinkEmulator:
        self.server = await asyncio.start_server(self._tcp, "127.0.0.1", port)
        loop = asyncio.get_running_loop()
        self.udp_proxy = _UdpProxy(self)
        try:
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: self.udp_proxy, local_addr=("127.0.0.1", self.port))
        except OSError:
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: self.udp_proxy, local_addr=("127.0.0.1", 0))
        return self

    @property
    def udp_port(self) -> int:
        assert self.udp is not None
        return self.udp.get_extra_info("sockname")[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.udp is not None:
            self.udp.close()
        if self.udp_proxy is not None:
            for up in self.udp_proxy.upstreams.values():
                up.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _own(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        a, b = _Pipe(self.spec, self.rng), _Pipe(self.spec, self.rng)
        jobs = [self._own(a.pump(up_w)), self._own(b.pump(writer)),
                self._own(self._feed(reader, a)), self._own(self._feed(up_r, b))]
        await asyncio.gather(*jobs, return_exceptions=True)
        for w in (writer, up_w):
            w.close()

    async def _feed(self, reader: asyncio.StreamReader, pipe: _Pipe) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(self.chunk):
                pipe.queue.put_nowait((pipe.departure(len(data)), data))
        pipe.queue.put_nowait((pipe.last_departure, None))


class _UdpProxy(asyncio.DatagramProtocol):
    """Client datagrams go to the target via one upstream socket per client address."""

    def __init__(self, emu: LinkEmulator) -> None:
        self.emu = emu
        self.transport: asyncio.DatagramTransport | None = None
        self.pipe_in = _Pipe(emu.spec, emu.rng)
        self.upstreams: dict[tuple[str, int], asyncio.DatagramTransport] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.emu.rng.random() < self.emu.spec.loss:
            return
        self.emu._own(self._forward(data, addr, self.pipe_in.departure(len(data))))

    async def _forward(self, data: bytes, addr: tuple[str, int], when: float) -> None:
        await asyncio.sleep(max(0.0, when - time.monotonic()))
        up = self.upstreams.get(addr)
        if up is None:
            loop = asyncio.get_running_loop()
            up, _ = await loop.create_datagram_endpoint(lambda: _UdpBack(self, addr),
                                                        remote_addr=self.emu.udp_target)
            self.upstreams[addr] = up
        up.sendto(data)


class _UdpBack(asyncio.DatagramProtocol):
    def __init__(self, proxy: _UdpProxy, client: tuple[str, int]) -> None:
        self.proxy, self.client = proxy, client
        self.pipe = _Pipe(proxy.emu.spec, proxy.emu.rng)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        emu = self.proxy.emu
        if emu.rng.random() < emu.spec.loss:
            return
        emu._own(self._back(data, self.pipe.departure(len(data))))

    async def _back(self, data: bytes, when: float) -> None:
        await asyncio.sleep(max(0.0, when - time.monotonic()))
        if self.proxy.transport is not None:
            self.proxy.transport.sendto(data, self.client)


class EmulatorProcess:
    """Link emulators in a process of their own, so that their timers do not share an event
    loop (and its hiccups) with the client they carry traffic for. Ends when closed."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, links: list[tuple[tuple[str, int], LinkSpec]], seed: int = 0,
                    timeout: float = 30.0) -> list[tuple[int, int]]:
        """One emulator per (target, spec), seeded seed, seed + 1, ...; their (TCP, UDP) ports."""
        import json
        import sys
        from dataclasses import asdict

        # (a session of its own: the terminal's Ctrl-C is the parent's to handle; the process
        # ends when the parent closes its stdin, or dies)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgelite.prober.emulator", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        spec = [{"target": list(t), "spec": asdict(s), "seed": seed + i}
                for i, (t, s) in enumerate(links)]
        self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError("the link emulator process exited before it was ready")
        return [tuple(p) for p in json.loads(line)]

    async def close(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the process ends at EOF on stdin
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _serve_from_stdin() -> None:
    import json
    import sys

    loop = asyncio.get_running_loop()
    spec = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    emus = [await LinkEmulator((s["target"][0], s["target"][1]), LinkSpec(**s["spec"]),
                               seed=s["seed"]).start() for s in spec]
    sys.stdout.write(json.dumps([[e.port, e.udp_port] for e in emus]) + "\n")
    sys.stdout.flush()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    for e in emus:
        await e.close()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        uvloop = None
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):  # (a parent that went: quietly)
        (uvloop.run if uvloop is not None else asyncio.run)(_serve_from_stdin())
