"""Rich views. Each function reads state (plan JSON, probe JSON, stats) and returns a renderable;
none owns or changes state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

# (good below, fair below) per link metric; for bandwidth higher is better
QUALITY = {"latency_ms": (10.0, 30.0), "jitter_ms": (2.0, 10.0), "loss": (0.005, 0.02),
           "bandwidth_mbps": (50.0, 10.0)}
FORMATS = {"latency_ms": "{:.2f}", "bandwidth_mbps": "{:.0f}", "jitter_ms": "{:.2f}", "loss": "{:.1%}"}

REDIRECTED_WIDTH = 160  # columns of tables written to a file or a pipe


def quality(metric: str, v: float) -> str:
    """A colour for a link metric: green good, yellow fair, red poor."""
    good, fair = QUALITY[metric]
    if math.isnan(v):
        return "red"
    if metric == "bandwidth_mbps":
        return "green" if v >= good else "yellow" if v >= fair else "red"
    return "green" if v < good else "yellow" if v < fair else "red"


def plan_view(out: dict[str, Any]) -> Group:
    """The plan as a table with a bar of each stage's predicted ms, then the objective's terms."""
    t = Table(title=f"plan ({out['objective']}, {out['solver']}: {out['status']}, "
                    f"{out['solve_ms']:.0f} ms)")
    for col in ("stage", "device", "layers", "compute ms", "hop in ms", "predicted"):
        t.add_column(col, justify="right" if "ms" in col else "left")
    worst = max((s["compute_ms"] + s["hop_in_ms"] for s in out["stages"]), default=0.0) or 1.0
    for i, s in enumerate(out["stages"]):
        bar = "█" * max(1, round(20 * (s["compute_ms"] + s["hop_in_ms"]) / worst))
        t.add_row(str(i + 1), s["device"], f"{s['first_layer']}-{s['last_layer']}",
                  f"{s['compute_ms']:.2f}", f"{s['hop_in_ms']:.2f}", f"[cyan]{bar}[/cyan]")
    p = out["predicted_ms"]
    summary = Text(f"objective {p['total']:.2f} ms = compute {p['compute']:.2f} + data "
                   f"{p['data']:.2f} + QoS {p['qos']:.2f} + complexity {p['complexity']:.2f}; "
                   f"expected {out['expected_ms_per_token']:.2f} ms/token (compute + data + "
                   f"embedding and head on the client; QoS and complexity are what the planner "
                   f"charges for jittery or lossy links and for each extra stage, not time)")
    if "with_nodes_ms_per_token" not in out:
        return Group(t, summary)
    return Group(t, summary, Text(only_client(out), style="yellow"))


def only_client(out: dict[str, Any]) -> str:
    """Why a plan keeps every layer on the client although there are nodes."""
    alone, other = out["expected_ms_per_token"], out["with_nodes_ms_per_token"]
    if other is None:
        return ("the plan runs every layer on this device: no node can hold a layer "
                "(their free memory is too small)")
    if other < alone:  # faster on average, but the objective prices more than the average
        return (f"the plan runs every layer on this device: predicted {alone:.2f} ms/token alone vs "
                f"{other:.2f} ms/token at best with the nodes, whose links' jitter and loss and the "
                f"extra stages (the objective's QoS and complexity terms) outweigh the "
                f"{alone - other:.2f} ms they would save")
    return (f"the plan runs every layer on this device: predicted {alone:.2f} ms/token alone vs "
            f"{other:.2f} ms/token at best with the nodes (their links and speed cost more than "
            f"they save)")


def probe_view(result: dict[str, Any]) -> Group:
    """One matrix per link metric, each cell coloured by quality; then one line per device."""
    names = [d["name"] for d in result["devices"]]
    cells = {(r["src"], r["dst"]): r for r in result["links"]}
    parts: list[Any] = []
    if len(names) < 2:
        parts.append(Text("no links: one device (give --nodes to measure the links to them)"))
    for metric, fmt in FORMATS.items() if len(names) > 1 else ():
        t = Table(title=metric)
        t.add_column("from \\ to")
        for n in names:
            t.add_column(n, justify="right")
        for a in names:
            row = []
            for b in names:
                r = cells.get((a, b))
                if r is None:
                    row.append("-")
                elif not r["reachable"]:
                    row.append("[red]unreachable[/red]")
                else:
                    row.append(f"[{quality(metric, r[metric])}]{fmt.format(r[metric])}[/]")
            t.add_row(a, *row)
        parts.append(t)
    for d in result["devices"]:
        if not d.get("reachable", True):
            parts.append(Text(f"{d['name']}: unreachable ({d.get('reason', '')})", "red"))
            continue
        mem = d.get("memory_budget_bytes") or d.get("memory_available_bytes") or 0
        speed = (f"{d['flops'] / 1e9:.1f} GFLOP/s ({d.get('flops_source', '?')})" if d.get("flops")
                 else "speed not measured (it is measured with --model, or on nodes)")
        parts.append(Text(f"{d['name']}: {speed}, {mem / 2**20:.0f} MiB for the plan"))
    return Group(*parts)


def footer(gen: dict[str, Any], stages: list[dict[str, Any]], health: dict[str, str]) -> Text:
    """One line under the reply: speed, time to first token, per-stage ms, link health."""
    t = Text()
    t.append(f"{gen.get('decode_tok_s', 0.0):.1f} tok/s", "bold green")
    t.append(f" · TTFT {gen.get('ttft_ms', 0.0):.0f} ms · {gen.get('tokens', 0)} tokens")
    if gen.get("reused_tokens"):
        t.append(f" · {gen['reused_tokens']} prompt tokens from the KV store")
    if "acceptance" in gen:
        t.append(f" · drafts {gen['acceptance']:.0%} accepted, {gen['tokens_per_step']:.2f} tokens/step")
    if stages:
        t.append(" · stages ")
        t.append(" | ".join(f"{s['name']} {s['ms_per_run']:.1f} ms" for s in stages))
    if health:
        t.append(" · links ")
        for name, state in health.items():
            t.append("● ", "green" if state == "ok" else "red")
            t.append(f"{name} ")
    return t


def stats_view(gen: dict[str, Any], nodes: list[dict[str, Any]]) -> Table:
    t = Table(title="stats")
    for col in ("node", "sessions", "KV MiB", "KV budget MiB", "runs", "ms/run", "bad frames"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for s in nodes:
        t.add_row(str(s.get("node")), str(s["sessions"]), f"{s['kv_bytes'] / 2**20:.1f}",
                  f"{s['kv_budget_bytes'] / 2**20:.0f}", str(s["runs"]), f"{s['ms_per_run']:.2f}",
                  str(s.get("bad_frames", 0)))
    t.caption = (f"last reply: {gen.get('tokens', 0)} tokens, TTFT {gen.get('ttft_ms', 0):.0f} ms, "
                 f"{gen.get('decode_tok_s', 0):.1f} tok/s")
    return t


def node_panel(name: str, addr: str, stats: dict[str, Any], peers: list[str]) -> Panel:
    """The live panel of `edgelite node`."""
    t = Table.grid(padding=(0, 2))
    t.add_column(justify="right", style="bold")
    t.add_column()
    t.add_row("sessions", str(stats["sessions"]))
    t.add_row("KV memory", f"{stats['kv_bytes'] / 2**20:.1f} of {stats['kv_budget_bytes'] / 2**20:.0f} MiB")
    t.add_row("runs/s", f"{stats.get('runs_per_s', 0.0):.1f}")
    t.add_row("ms per run", f"{stats['ms_per_run']:.2f}")
    t.add_row("stages", ", ".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in stats["stages"]) or "-")
    t.add_row("peers", ", ".join(peers) or "-")
    t.add_row("bad frames", str(stats.get("bad_frames", 0)))
    return Panel(t, title=f"edgelite node {name}", subtitle=addr)


@contextmanager
def transfer_bars(console: Console, title: str) -> Iterator[Callable[[str, int, int], None]]:
    """Progress bars, one per node, fed by callbacks (name, bytes sent, bytes in all)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn(f"{title} {{task.description}}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=console, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def update(name: str, sent: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bars.add_task(name, total=total)
            bars.update(tasks[name], completed=sent, total=total)

        yield update


@contextmanager
def step_bar(console: Console, title: str) -> Iterator[Callable[[str, int, int], None]]:
    """One progress bar fed by callbacks (what just finished, steps done, steps in all)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn(title), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def update(what: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=what)

        yield update


def console(stderr: bool = False, **kw: Any) -> Console:
    """A console for stdout (or stderr); where that is not a terminal (a file, a pipe) as wide
    as REDIRECTED_WIDTH, so that tables are not cut at 80 columns."""
    out = Console(stderr=stderr, **kw)
    return out if out.is_terminal else Console(stderr=stderr, width=REDIRECTED_WIDTH, **kw)


def stderr_console() -> Console:
    return console(stderr=True)


@contextmanager
def connect_bars(console: Console, live: bool) -> Iterator[Callable[[str, str, int, int], None] | None]:
    """Progress while connecting: one bar for probing, one per node for the deploy. Yields the
    callback `edgelite.connect(progress=...)` takes (None when not `live`)."""
    if not live:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[detail]}"),
                  console=console, transient=True) as bars:
        tasks: dict[tuple[str, str], Any] = {}

        def update(phase: str, what: str, done: int, total: int) -> None:
            key = (phase, "" if phase == "probe" else what)
            if key not in tasks:
                tasks[key] = bars.add_task(f"{phase} {key[1]}".strip(), total=total, detail="")
            detail = (f"{done}/{total} {what}" if phase == "probe"
                      else f"{done / 1e6:.1f}/{total / 1e6:.1f} MB")
            bars.update(tasks[key], completed=done, total=total, detail=detail)

        yield update


def explain_plan(console: Console, plan: Any, probed: dict[str, Any] | None = None) -> None:
    """Show a probed plan (on stderr for generate/chat), each node by its --name and address;
    nothing for a local run or a --split."""
    shown = labelled_plan(plan, probed)
    if shown is not None:
        console.print(plan_view(shown))


def labelled_plan(plan: Any, probed: dict[str, Any] | None) -> dict[str, Any] | None:
    """A probed plan's JSON with each node named by `labeller`; None for a local run or a
    --split (nothing was predicted)."""
    if plan is None or plan.predicted is None:
        return None
    shown = plan.to_json()
    label = labeller(probed)
    for st in shown["stages"]:
        st["device"] = label(st["device"])
    return shown


def labeller(probed: dict[str, Any] | None) -> Callable[[str], str]:
    """A display name for a node address: "name (host:port)" with the name the node gave
    (`edgelite node --name`, else its host name); the address alone when the probe has none."""
    names = {d["addr"]: d["node"] for d in (probed or {}).get("devices", [])
             if d.get("addr") and d.get("node")}
    return lambda addr: f"{names[addr]} ({addr})" if addr in names else addr


def unreachable(console: Console, probed: dict[str, Any] | None) -> None:
    """One line per node the probe could not reach (the plan leaves it out), with the reason."""
    if probed is None:
        return
    gone = [d for d in probed["devices"] if not d.get("reachable", True)]
    for d in gone:
        console.print(Text(f"left out of the plan: {d['reason']}", style="yellow"))
    if gone and len(gone) == len(probed["devices"]) - 1:
        console.print(Text("no node could be reached: every layer runs on this device",
                           style="yellow"))
