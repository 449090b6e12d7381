"""A measuring user's time to first token while strangers flood the cluster.

    python scripts/bench_flood.py --model DIR [--requests 20] [--flood 400]

Two node processes on loopback and `edgelite serve --http` over them (layers split between the
nodes, 1 thread each). A measuring user sends `--requests` streamed chat requests one after
another over HTTP and times each one's first token, in three phases:
- quiet;
- a pre-auth flood: `--flood` connections from 127.0.0.2 to each node and to the HTTP port that
  never authenticate nor send a request, those closed opened again every SWEEP_S;
- a prompt flood: 4 clients post ~1 MB prompts over HTTP, each `--prompt-rate` a second;
- hostile requests (issue 62): 2 workers for `--hostile-s` seconds, each sending in turn a
  500-value enum schema, a 3,000-value one, a wide anyOf near 32 KB, a non-ASCII enum, 300 KB
  of tool-call arguments with tools, and a prompt holding a lone UTF-16 surrogate.
Prints one JSON object: each phase's TTFT p50 and p99, the ratios to the quiet phase, what the
floods got (HTTP statuses: no 500 may be among them), and whether the gateway kept both nodes
(its node-loss counter stays 0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

FLOOD_SOURCE = "127.0.0.2"  # the strangers' address (loopback too)
BIG_PROMPT_CHARS = 1_000_000
FLOOD_CLIENTS = 4
SWEEP_S = 0.2  # each flood thread re-opens what was closed this often (the flooder shares our CPU)


def ttft_ms(port: int, prompt: str) -> float:
    """One streamed chat request: ms until its first piece of text."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                       "stream": True, "temperature": 0})
    t0 = time.perf_counter()
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        first = None
        for line in r:
            if (first is None and line.startswith(b"data: {") and b'"content"' in line
                    and b'"content":""' not in line):  # (the first text, not the role chunk)
                first = (time.perf_counter() - t0) * 1e3
            if line.startswith(b"data: [DONE]"):
                break
        if first is None:
            raise RuntimeError("no text came")
        return first
    finally:
        c.close()


class Flood:
    """Threads that keep doing something hostile until stopped; `counts` says what they got."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def run(self, fn, n: int) -> None:  # type: ignore[no-untyped-def]
        for i in range(n):
            t = threading.Thread(target=fn, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def preauth_flood(ports: list[int], per_port: int) -> Flood:
    """per_port connections to each port from FLOOD_SOURCE, held open; re-opened when closed."""
    f = Flood()

    def hold(_: int) -> None:
        socks: list[tuple[socket.socket, int]] = []
        for port in ports:
            for _ in range(per_port // 8):
                socks.append((_open(port), port))
        while not f.stop.is_set():
            for i, (s, port) in enumerate(socks):
                s.setblocking(False)
                try:
                    gone = s.recv(4096) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:  # closed by the far end: again
                    s.close()
                    socks[i] = (_open(port), port)
                    f.count("reopened")
            time.sleep(SWEEP_S)
        for s, _ in socks:
            s.close()

    def _open(port: int) -> socket.socket:
        s = socket.socket()
        s.bind((FLOOD_SOURCE, 0))
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            f.count("opened")
        except OSError:
            f.count("refused")
        return s

    f.run(hold, 8)
    return f


def prompt_flood(port: int, rate: float) -> Flood:
    """FLOOD_CLIENTS clients posting ~1 MB prompts, each at most `rate` a second (0: as fast
    as they can: then the flooders, on this machine's cores, take CPU from everyone)."""
    f = Flood()
    big = json.dumps({"messages": [{"role": "user", "content": "x " * (BIG_PROMPT_CHARS // 2)}],
                      "max_tokens": 8})

    def post(_: int) -> None:
        while not f.stop.is_set():
            if rate:
                f.stop.wait(1 / rate)
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                c.request("POST", "/v1/chat/completions", big, {"Content-Type": "application/json"})
                f.count(f"HTTP {c.getresponse().status}")
            except OSError:
                f.count("error")
            finally:
                c.close()

    f.run(post, FLOOD_CLIENTS)
    return f


def _hostile_bodies() -> dict[str, bytes]:
    """Each hostile request kind's body (JSON text as sent)."""
    ask = [{"role": "user", "content": "Answer in JSON."}]

    def schema(prop: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": prop}, "required": ["x"]}}}

    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(6)}}
                      for i in range(60)]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}}}}]
    bodies = {
        "enum_500": {"messages": ask, "max_tokens": 16, "response_format": schema(
            {"enum": [f"value number {i}" for i in range(500)]})},
        "enum_3000": {"messages": ask, "max_tokens": 16, "response_format": schema(
            {"enum": [f"value number {i}" for i in range(3000)]})},
        "wide_anyof": {"messages": ask, "max_tokens": 16, "response_format": schema(wide)},
        "non_ascii_enum": {"messages": ask, "max_tokens": 16, "response_format": schema(
            {"enum": ["café", "naïve", "日本", "中国", "😀"]})},
        "tool_arguments": {"messages": [*ask, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(
                {"a": "\U0001f600" * 75_000})}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "tools": tools, "max_tokens": 8},
    }
    out = {k: json.dumps(v).encode() for k, v in bodies.items()}
    out["lone_surrogate"] = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 8}'
    return out


def request_flood(port: int, workers: int, kinds: list[str] | None = None) -> Flood:
    """`workers` clients sending each hostile request kind (of `kinds`: all) in turn."""
    f = Flood()
    bodies = [(k, b) for k, b in _hostile_bodies().items() if not kinds or k in kinds]

    def send(w: int) -> None:
        i = w
        while not f.stop.is_set():
            kind, body = bodies[i % len(bodies)]
            i += 1
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                f.count(f"{kind} HTTP {r.status}")
            except OSError:
                f.count(f"{kind} error")
            finally:
                c.close()

    f.run(send, workers)
    return f


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                     if ln and not ln.startswith("#"))}


def main() -> None:
    from edgelite import manifest as mf
    from edgelite.cli.localnodes import TOKEN, start_node, start_serve

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--flood", type=int, default=400)
    ap.add_argument("--prompt-rate", type=float, default=10.0,
                    help="~1 MB prompts a second per flooding client (4 of them; 0: unbounded). "
                         "At 50 Mbit/s, a phone's Wi-Fi, one takes 160 ms to send")
    ap.add_argument("--hostile-s", type=float, default=20.0, help="the hostile requests' phase")
    ap.add_argument("--hostile-workers", type=int, default=2)
    ap.add_argument("--hostile-kinds", default="", help="comma-separated kinds (default: all)")
    args = ap.parse_args()
    n = mf.load(args.model).num_layers
    tmp = Path(tempfile.mkdtemp())  # (the nodes' folders and the log: removed at the end)
    nodes = [start_node(tmp / f"n{i}", threads=1) for i in range(2)]
    log = open(tmp / "serve.log", "w")
    proc, found = start_serve(["--model", str(args.model), "--nodes", ",".join(x.addr for x in nodes),
                               "--split", f"0-{n // 2 - 1},{n // 2}-{n - 1}", "--token", TOKEN,
                               "--http", "127.0.0.1:0", "--no-native", "--threads", "1"], log,
                              r"listening on http://[\d.]+:(\d+)/v1")
    port = int(found.group(1))
    out: dict = {"model": str(args.model), "requests": args.requests, "flood": args.flood,
                 "prompt_rate_per_client": args.prompt_rate}
    try:
        deadline = time.monotonic() + 60
        while metrics(port).get("edgelite_up") != 1.0:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway never came up")
            time.sleep(0.2)
        for i in range(3):  # warm up
            ttft_ms(port, f"warm up {i}")
        phases = {}
        for phase in ("quiet", "preauth_flood", "prompt_flood", "hostile_requests"):
            flood = None
            if phase == "preauth_flood":
                flood = preauth_flood([x.port for x in nodes] + [port], args.flood)
            elif phase == "prompt_flood":
                flood = prompt_flood(port, args.prompt_rate)
            elif phase == "hostile_requests":
                flood = request_flood(port, args.hostile_workers,
                                      [k for k in args.hostile_kinds.split(",") if k] or None)
            time.sleep(1.0 if flood else 0.0)
            end = time.monotonic() + (args.hostile_s if phase == "hostile_requests" else 0.0)
            times = []
            while len(times) < args.requests or time.monotonic() < end:  # (bounded: the phase's time)
                times.append(ttft_ms(port, f"{phase} question {len(times)}: what is 2 plus 2?"))
            if flood is not None:
                flood.end()
                out[f"{phase}_got"] = flood.counts
            phases[phase] = {"requests": len(times), "p50_ms": round(statistics.median(times), 1),
                             "p99_ms": round(sorted(times)[max(0, round(0.99 * len(times)) - 1)], 1)}
        out["ttft"] = phases
        q = phases["quiet"]["p99_ms"]
        out["p99_over_quiet"] = {p: round(v["p99_ms"] / q, 2) for p, v in phases.items()}
        m = metrics(port)
        out["node_losses"] = m.get("edgelite_node_losses_total")
        out["kept_both_nodes"] = out["node_losses"] == 0
        out["http_500s"] = sum(v for got in (out.get(f"{p}_got", {}) for p in phases)
                               for k, v in got.items() if k.endswith("HTTP 500"))
    finally:
        proc.kill()
        proc.wait(10)
        for x in nodes:
            x.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
