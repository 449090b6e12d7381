"""A model no device holds, split for real: edgelite against llama.cpp's RPC on the same GGUF.

    python scripts/bench_scale.py --cache DIR [--gguf FILE] [--llama-cpp BIN_DIR]
        [--nodes 3] [--node-mb 400] [--client-mb 400] [--tokens 128] [--rounds 3]
        [--context 2048] [--ports 7001,7002,...] [--matmulnbits-too] [--link 5,2,50]
        [--prompt-repeat 1]

The GGUF defaults to a 1 B Llama-shaped Q4_K_M in the cache (random weights: made with
scripts/random_models.py as F16, then llama.cpp's llama-quantize from --llama-cpp); it is
exported once (fast, its own width; the exporter measures what each layer holds once loaded).
Each round, edgelite: `--nodes` node processes on loopback with `--memory-mb NODE_MB`, and
`edgelite generate` planning over them (probe + HiGHS) with `--client-memory-mb CLIENT_MB`,
`--tokens` greedy tokens of PROMPT (`--prompt-repeat` times over: a long prompt), 1 thread
everywhere; llama.cpp (with --llama-cpp): as many
`ggml-rpc-server -t 1` and `llama-completion --rpc ... -ngl 99 -t 1 --temp 0 --ignore-eos`.
With --matmulnbits-too, each round also runs edgelite with `--no-matmul-kernel` (onnxruntime's
MatMulNBits instead of edgelite's MatMul4 and MatMul6): "edgelite_matmulnbits".
Fair by construction: the systems' order alternates by round (A B, then B A, ...); both get the
same context (`--context`: edgelite's --context, llama.cpp's -c); the load average is recorded
at each round's start; `--ports` pins the ports the node processes (and then the rpc-servers)
listen on, and nodes answer no discovery; every process's peak RSS is kept (llama.cpp's
client through /usr/bin/time), and llama.cpp's model load (its weight upload to the servers)
is reported apart from its decode.
With `--link DELAY_MS,JITTER_MS,MBPS` every link goes through the userspace link emulator
(edgelite.prober.emulator, a process of its own): edgelite's client to each node and each node
to each other (`--route`), llama.cpp's client to each rpc-server (its only links). The weights
are on the devices before the rounds for both, as after an earlier start: edgelite's nodes get
the layer files in their file cache, the rpc-servers run with their cache (`-c`) filled by one
load over loopback first, whose time is reported as `llama_cpp_first_upload_ms`.
Prints one JSON object: the plan, predicted against measured ms/token, decode tok/s, TTFT,
every process's peak RSS against its budget, medians, ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

PROMPT = "The history of the city begins in the early years of the twelfth century, when a"
RUN_TIMEOUT_S = 900.0
HWM = re.compile(r"^VmHWM:\s+(\d+) kB", re.M)
# the CLI in a process that reports its own peak RSS (MiB) on its last stderr line
CLIENT = ("import sys\nfrom edgelite.cli.main import main\nrc = main(sys.argv[1:])\n"
          "status = open('/proc/self/status').read()\n"
          "kb = int([x for x in status.splitlines() if x.startswith('VmHWM')][0].split()[1])\n"
          "sys.stderr.write(f'\\nPEAK_RSS_MIB {kb / 1024:.1f}\\n')\nsys.exit(rc)\n")


def peak_mib(pid: int) -> float:
    m = HWM.search(Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_for(cache: Path, llama_cpp: Path | None) -> Path:
    """The 1 B Q4_K_M GGUF in the cache, made when missing (F16 -> llama-quantize)."""
    out = cache / "llama-1b-q4_k_m.gguf"
    if out.is_file():
        return out
    if llama_cpp is None:
        raise SystemExit(f"{out} is missing: pass --llama-cpp BIN_DIR (to make it with llama-quantize)"
                         f" or --gguf FILE")
    sys.path.insert(0, str(Path(__file__).parent))
    import random_models

    f16 = random_models.build(cache, "1b", ["f16"])["f16"]
    subprocess.run([str(llama_cpp / "llama-quantize"), str(f16), str(out), "Q4_K_M"], check=True,
                   capture_output=True)
    return out


def export_for(gguf: Path, cache: Path) -> Path:
    """The GGUF's export (fast, its own width), made once; measured if an older exporter made it."""
    from edgelite import manifest as mf

    out = cache / f"ex-{gguf.stem.lower()}"
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", str(gguf), "--out", str(out)],
                       check=True)
    m = mf.load(out)
    if not all(e.resident_bytes for e in m.layers):
        from edgelite_export import resident

        mf.write(resident.measured(m), out)
    return out


class Links:
    """The userspace link emulator in a process of its own: one link (spec, a dict of LinkSpec's
    fields) to each target port; `ports` are (tcp, udp) to reach each target through its link."""

    def __init__(self, targets: list[int], spec: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "edgelite.prober.emulator"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([{"target": ["127.0.0.1", t], "spec": spec, "seed": i}
                                          for i, t in enumerate(targets)]) + "\n")
        self.proc.stdin.flush()
        self.ports = [tuple(p) for p in json.loads(self.proc.stdout.readline())]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # (it ends at EOF on its stdin)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def linked(nodes: list[int], spec: dict) -> tuple[Links, list[str], list[str]]:
    """Links from the client to each node and between each pair: the emulator, the client's
    addresses of the nodes, and the --route flags for node-to-node traffic."""
    n = len(nodes)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    links = Links(nodes + [nodes[j] for _, j in pairs], spec)
    addrs = [f"127.0.0.1:{tcp}" for tcp, _ in links.ports[:n]]
    routes = [f"--route={addrs[i]}>{addrs[j]}=127.0.0.1:{tcp}/{udp}"
              for (i, j), (tcp, udp) in zip(pairs, links.ports[n:], strict=True)]
    return links, addrs, routes


def edgelite_round(model: Path, n: int, node_mb: float, client_mb: float, tokens: int,
                   context: int, extra: tuple[str, ...] = (), ports: list[int] | None = None,
                   link: dict | None = None, prompt: str = PROMPT) -> dict:
    from edgelite import manifest as mf
    from edgelite.cli.demo import seed
    from edgelite.cli.localnodes import TOKEN, start_node

    homes = [Path(tempfile.mkdtemp()) for _ in range(n)]  # (each gets the model's blobs: removed after)
    if link is not None:
        for home in homes:
            seed(mf.load(model), home)
    nodes = [start_node(home, threads=1, memory_mb=node_mb, extra=(*extra, "--discovery-port", "0"),
                        port=ports[i] if ports else 0) for i, home in enumerate(homes)]
    links, addrs, routes = (linked([x.port for x in nodes], link) if link is not None
                            else (None, [x.addr for x in nodes], []))
    try:
        res = subprocess.run(
            [sys.executable, "-c", CLIENT, "generate", "--model", str(model), "--json", "--raw",
             "--nodes", ",".join(addrs), *routes, "--token", TOKEN, "--threads", "1",
             "--no-spin", "--client-memory-mb", str(client_mb), "--max-tokens", str(tokens),
             "--kv-store-mb", "0", "--context", str(context), *extra, prompt],
            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        node_peaks = [round(peak_mib(x.proc.pid), 1) for x in nodes]
    finally:
        if links is not None:
            links.close()
        for x in nodes:
            x.kill()
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    peak = re.search(r"PEAK_RSS_MIB ([\d.]+)", res.stderr)
    if res.returncode != 0:
        err = res.stderr.strip().splitlines()
        return {"error": next((ln for ln in err if ln.startswith("error")), err[-1] if err else "?"),
                "node_peak_rss_mib": node_peaks,
                "client_peak_rss_mib": float(peak.group(1)) if peak else None}
    out = json.loads(res.stdout)
    plan = out.get("plan") or {}
    return {"tokens": len(out["token_ids"]), "token_ids": out["token_ids"],
            "prompt_tokens": out.get("prompt_tokens"),
            "decode_tok_s": out["decode_tok_s"],
            "ttft_ms": out["ttft_ms"], "measured_ms_per_token": out["decode_ms_per_token"],
            "predicted_ms_per_token": plan.get("expected_ms_per_token"),
            "plan": [(s["device"], s["first_layer"], s["last_layer"]) for s in plan.get("stages", [])],
            "max_chunk": plan.get("max_chunk", 0),
            "node_peak_rss_mib": node_peaks,
            "client_peak_rss_mib": float(peak.group(1)) if peak else None}


def llama_round(bin_dir: Path, gguf: Path, n: int, tokens: int, context: int,
                ports: list[int] | None = None, link: dict | None = None,
                cache: Path | None = None, prompt: str = PROMPT) -> dict:
    """One llama.cpp run; with `link`, through the emulator, its servers using their file cache
    in `cache` (filled by an earlier run)."""
    ports = ports or [free_port() for _ in range(n)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    if cache is not None:
        env["LLAMA_CACHE"] = str(cache)
    servers = [subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(p),
                                 "-t", "1", *(["-c"] if cache is not None else [])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env) for p in ports]
    links: Links | None = None
    try:
        deadline = time.monotonic() + 30
        for p in ports:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", p), 1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        reach = ports
        if link is not None:
            links = Links(ports, link)
            reach = [tcp for tcp, _ in links.ports]
        t0 = time.perf_counter()
        res = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", str(bin_dir / "llama-completion"),
                              "-m", str(gguf), "--rpc", ",".join(f"127.0.0.1:{p}" for p in reach),
                              "-ngl", "99", "-t", "1", "-c", str(context), "-n", str(tokens), "--temp", "0",
                              "--ignore-eos", "-no-cnv", "-p", prompt], capture_output=True, text=True,
                             env=env, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        peaks = [round(peak_mib(s.pid), 1) for s in servers]
    finally:
        if links is not None:
            links.close()
        for s in servers:
            s.kill()
            s.wait()
    text = res.stderr + res.stdout
    ev = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs.*?([\d.]+) tokens per second", text.split(
        "prompt eval time")[-1]) if "prompt eval time" in text else None
    pe = re.search(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", text)
    load = re.search(r"load time =\s+([\d.]+) ms", text)
    client = re.search(r"PEAK_RSS_KB (\d+)", text)
    client_mib = round(int(client.group(1)) / 1024, 1) if client else None
    if res.returncode != 0 or ev is None or pe is None:
        return {"error": (text.strip().splitlines() or ["?"])[-1], "rpc_server_peak_rss_mib": peaks,
                "client_peak_rss_mib": client_mib}
    return {"tokens": int(ev.group(2)), "decode_tok_s": float(ev.group(3)),
            "ttft_ms": float(pe.group(1)), "prompt_tokens": int(pe.group(2)), "wall_s": round(wall, 2),
            "load_ms": float(load.group(1)) if load else None,  # (its weight upload: apart from decode)
            "rpc_server_peak_rss_mib": peaks, "client_peak_rss_mib": client_mib}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--llama-cpp", type=Path,
                    help="llama.cpp's build/bin (ggml-rpc-server, llama-completion)")
    ap.add_argument("--context", type=int, default=2048, help="edgelite generate --context")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--node-mb", type=float, default=400)
    ap.add_argument("--client-mb", type=float, default=400)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--matmulnbits-too", action="store_true",
                    help="each round also edgelite with --no-matmul-kernel")
    ap.add_argument("--ports", default="", help="comma-separated ports for the nodes (and rpc-servers)")
    ap.add_argument("--link", default="", help="DELAY_MS,JITTER_MS,MBPS: every link emulated so")
    ap.add_argument("--prompt-repeat", type=int, default=1, help="the prompt this many times over")
    args = ap.parse_args()
    prompt = " ".join([PROMPT] * args.prompt_repeat)
    link = None
    if args.link:
        delay, jitter, rate = (float(x) for x in args.link.split(","))
        link = {"delay_ms": delay, "jitter_ms": jitter, "rate_mbps": rate, "loss": 0.0}
    ports = [int(p) for p in args.ports.split(",") if p] or None
    if ports is not None and len(ports) != args.nodes:
        raise SystemExit(f"--ports names {len(ports)} ports for {args.nodes} nodes")
    args.cache.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or gguf_for(args.cache, args.llama_cpp)
    model = export_for(gguf, args.cache)
    runs: dict[str, list[dict]] = {"edgelite": [], "llama_cpp_rpc": []}
    sides: dict[str, tuple[str, ...]] = {"edgelite": ()}
    if args.matmulnbits_too:
        sides["edgelite_matmulnbits"] = ("--no-matmul-kernel",)
    order: list[str] = [*sides, *(["llama_cpp_rpc"] if args.llama_cpp is not None else [])]
    loads: list[dict] = []
    first_upload: dict | None = None
    cache = Path(tempfile.mkdtemp()) if link is not None and args.llama_cpp is not None else None
    if cache is not None:  # (the rpc-servers' cache filled by one load over loopback)
        assert args.llama_cpp is not None
        first_upload = llama_round(args.llama_cpp, gguf, args.nodes, 2, args.context, ports, None, cache)
    for r in range(args.rounds):
        for side in (order if r % 2 == 0 else order[::-1]):  # (A B, then B A: neither always first)
            loads.append({"round": r, "side": side, "loadavg_1m": round(os.getloadavg()[0], 2)})
            if side == "llama_cpp_rpc":
                assert args.llama_cpp is not None
                runs[side].append(llama_round(args.llama_cpp, gguf, args.nodes, args.tokens, args.context,
                                              ports, link, cache, prompt))
            else:
                runs.setdefault(side, []).append(edgelite_round(
                    model, args.nodes, args.node_mb, args.client_mb, args.tokens, args.context,
                    sides[side], ports, link, prompt))
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)

    def med(side: str, key: str) -> float | None:
        vals = [r[key] for r in runs[side] if key in r and r[key] is not None]
        return round(statistics.median(vals), 2) if vals else None

    summary: dict = {"gguf": str(gguf), "gguf_mb": round(gguf.stat().st_size / 1e6, 1),
                     "export_mb": round(sum(p.stat().st_size for p in model.iterdir()) / 1e6, 1),
                     "node_budget_mib": args.node_mb, "client_budget_mib": args.client_mb,
                     "nodes": args.nodes, "context": args.context, "order": "alternating by round",
                     "link": link, "llama_cpp_first_upload_ms": (first_upload or {}).get("load_ms"),
                     "loadavg": loads}
    for side in sides:
        summary[side] = {k: med(side, k) for k in ("decode_tok_s", "ttft_ms", "measured_ms_per_token",
                                                    "predicted_ms_per_token")}
        ok = [r for r in runs[side] if "error" not in r]
        if ok:
            summary[side]["max_node_peak_rss_mib"] = max(max(r["node_peak_rss_mib"]) for r in ok)
            summary[side]["max_client_peak_rss_mib"] = max(r["client_peak_rss_mib"] or 0 for r in ok)
            p, mm = summary[side]["predicted_ms_per_token"], summary[side]["measured_ms_per_token"]
            if p and mm:
                summary[side]["predicted_over_measured"] = round(p / mm, 3)
    if "edgelite_matmulnbits" in summary:
        e, b = summary["edgelite"], summary["edgelite_matmulnbits"]
        summary["ratio_matmul4_over_matmulnbits"] = {
            k: round(e[k] / b[k], 3) for k in ("decode_tok_s", "ttft_ms") if e.get(k) and b.get(k)}
    if runs["llama_cpp_rpc"]:
        summary["llama_cpp_rpc"] = {k: med("llama_cpp_rpc", k) for k in ("decode_tok_s", "ttft_ms")}
        good = [r for r in runs["llama_cpp_rpc"] if "error" not in r]
        if good:
            summary["llama_cpp_rpc"]["max_rpc_server_peak_rss_mib"] = max(
                max(r["rpc_server_peak_rss_mib"]) for r in good)
            summary["llama_cpp_rpc"]["max_client_peak_rss_mib"] = max(
                r["client_peak_rss_mib"] or 0 for r in good)
            summary["llama_cpp_rpc"]["load_ms"] = med("llama_cpp_rpc", "load_ms")
        e, c = summary["edgelite"], summary["llama_cpp_rpc"]
        summary["ratio_edgelite_over_llama_cpp"] = {
            k: round(e[k] / c[k], 3) for k in ("decode_tok_s", "ttft_ms") if e.get(k) and c.get(k)}
    print(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
