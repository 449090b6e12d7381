"""Flags shared by several commands, and their translation into the library's config objects.

Defaults come from the config dataclasses (stated once, there); `--help` shows them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from edgelite.client.llm import PlanOptions
from edgelite.config import ClientConfig, DiscoveryConfig, GenerationConfig, KVStoreConfig, RuntimeConfig
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr, parse_nodes
from edgelite.net.routes import parse_routes
from edgelite.planner.model import OBJECTIVES
from edgelite.planner.solve import SOLVERS


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default (when it has one and its text does not say it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, d = action.help or "", action.default
        quiet = d is None or d is False or d == argparse.SUPPRESS
        if action.option_strings and not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


def model_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, type=Path, help="folder written by edgelite-export")
    p.add_argument("--threads", type=thread_count, default=RuntimeConfig.threads,
                   help="onnxruntime threads")
    p.add_argument("--no-spin", action="store_true",
                   help="idle onnxruntime threads sleep at once (when processes share cores)")
    p.add_argument("--no-invariant", action="store_true",
                   help="this device's layers compute a decode step with one-row kernels "
                        "(slightly faster at long contexts; the reply may then depend on "
                        "chunking and the KV store)")
    kv_dtype_flag(p)
    attention_flag(p)
    kv_store_flags(p, "$EDGELITE_HOME/kv, EDGELITE_HOME defaulting to ~/.edgelite")


def kv_dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", choices=("auto", "float32", "float16", "int8"),
                   default=RuntimeConfig.kv_dtype,
                   help="what this device's KV cache holds: float16 halves the memory each "
                        "position of context costs, int8 about quarters it (with the attention "
                        "kernel); neither with --no-invariant; auto: float16 for fast-mode "
                        "exports, float32 for fp32 and exact ones (and with --no-invariant)")


def attention_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-attention-kernel", action="store_true",
                   help="attention in onnxruntime's own operators rather than edgelite's kernel "
                        "(built for this device at first use): decode slower at long contexts, "
                        "a long prompt faster with several threads")
    p.add_argument("--no-matmul-kernel", action="store_true",
                   help="4-bit and Q6_K products in onnxruntime's MatMulNBits rather than edgelite's "
                        "MatMul4/MatMul6 (used where the CPU has AVX-512 VNNI): more memory, slower decode")


def kv_dtype(args: argparse.Namespace) -> str:
    """--kv-dtype, checked against --no-invariant."""
    dtype = getattr(args, "kv_dtype", RuntimeConfig.kv_dtype)
    if dtype in ("float16", "int8") and getattr(args, "no_invariant", False):
        raise EdgeliteError(f"--kv-dtype {dtype} needs the invariant attention: drop --no-invariant")
    return dtype


def kv_store_flags(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument("--kv-store", type=Path, metavar="DIR",
                   help=f"where this device keeps conversations' KV on disk (default: {where})")
    p.add_argument("--kv-store-mb", type=float, default=KVStoreConfig.budget_bytes / 2**20,
                   help="disk for stored KV; the least recently used goes first (0: off)")


def kv_store_config(args: argparse.Namespace) -> KVStoreConfig:
    mb = getattr(args, "kv_store_mb", KVStoreConfig.budget_bytes / 2**20)
    if mb < 0:
        raise EdgeliteError(f"--kv-store-mb must be 0 (off) or more, not {mb:g}")
    path = getattr(args, "kv_store", None)
    return KVStoreConfig(dir=None if path is None else str(path), budget_bytes=int(mb * 2**20))


def generation_flags(p: argparse.ArgumentParser) -> None:
    g = GenerationConfig
    p.add_argument("--max-tokens", type=int, default=g.max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=g.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=g.top_p,
                   help="sample from the most likely tokens up to this total probability")
    p.add_argument("--seed", type=int, default=g.seed, help="sampling seed (default: a fresh one)")
    p.add_argument("--top-k", type=int, default=g.top_k, help="sample from the K likeliest tokens (0: all)")
    p.add_argument("--min-p", type=float, default=g.min_p,
                   help="sample only tokens at least this fraction as likely as the likeliest")
    p.add_argument("--repetition-penalty", type=float, default=g.repetition_penalty,
                   help="divide the logits of tokens already in the prompt or reply (1: none)")
    p.add_argument("--presence-penalty", type=float, default=g.presence_penalty,
                   help="subtracted from the logits of tokens the reply used (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=g.frequency_penalty,
                   help="subtracted per use from the logits of tokens the reply used (OpenAI's)")
    p.add_argument("--response-format", default=g.response_format,
                   choices=["text", "json_object", "json_schema"],
                   help="json_object: the reply is one JSON object (each token is chosen among "
                        "those that keep it one; it ends when the object does); json_schema: "
                        "one that --json-schema accepts")
    p.add_argument("--json-schema", type=Path, metavar="FILE",
                   help="the JSON schema of --response-format json_schema (a subset: type, "
                        "properties, required, items, enum)")
    p.add_argument("--speculate", default=g.speculate, metavar="lookup|DIR|off",
                   help="speculative decoding: verify drafts of the next tokens in one step "
                        "(the output is the same): lookup drafts from the prompt and the reply, "
                        "DIR is a draft model's export with the same tokenizer (default: off)")
    p.add_argument("--draft-tokens", type=draft_tokens, default=g.draft_tokens, metavar="K|auto",
                   help="drafts per step (default auto: chosen each step from the acceptance "
                        "rate and the measured step times)")


def draft_tokens(text: str) -> int:
    """argparse type for --draft-tokens: auto (0) or 1-15."""
    if text == "auto":
        return 0
    try:
        k = int(text)
    except ValueError:
        k = -1
    if not 1 <= k <= 15:
        raise argparse.ArgumentTypeError(f"{text!r}: auto or 1-15")
    return k


def route_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--route", action="append", metavar="SRC>DST=HOST:PORT[/UDP]",
                   help="how node SRC reaches node DST when not at DST's --nodes address "
                        "(e.g. through a link emulator); repeatable")


def planning_flags(p: argparse.ArgumentParser) -> None:
    o = PlanOptions
    route_flag(p)
    p.add_argument("--allow-local", action="store_true",
                   help="when --nodes are given and none can be used, answer on this device "
                        "alone (else that is an error)")
    p.add_argument("--client-memory-mb", type=mebibytes,
                   help="the most this process may hold, in MiB (what it holds already counts; "
                        "default: the device's free memory)")
    p.add_argument("--context", type=int, default=o.context, metavar="TOKENS",
                   help="KV room each layer is planned with, in tokens (default: %(default)s; "
                        "a longer session is refused where a node has no room left)")
    p.add_argument("--objective", choices=OBJECTIVES, default=o.objective,
                   help="latency: ms per token of one reply; throughput: the slowest stage")
    p.add_argument("--solver", choices=SOLVERS, default=o.solver,
                   help="auto: HiGHS when installed, else the exact DP")
    p.add_argument("--no-client-first", action="store_true",
                   help="the client need not hold layer 0")


def nodes_flags(p: argparse.ArgumentParser, default: str = "run locally") -> None:
    p.add_argument("--nodes", help=f"HOST:PORT,... of stage nodes, or auto: the nodes with this "
                                   f"token that answer on the LAN (default: {default})")
    d = DiscoveryConfig
    p.add_argument("--broadcast", default=",".join(d.broadcast), metavar="ADDR,...",
                   help="with --nodes auto: where the question goes")
    p.add_argument("--discovery-port", type=port_number, default=d.port,
                   help="with --nodes auto: the UDP port nodes answer on")


def cluster_flags(p: argparse.ArgumentParser) -> None:
    nodes_flags(p)
    p.add_argument("--split", help="layer ranges per node, e.g. 0-9,10-19,20-29 "
                                   "(default: probe and plan)")
    p.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    planning_flags(p)


def thread_count(text: str) -> int:
    """argparse type for --threads: 1 or more."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (1 or more)")
    return n


def mebibytes(text: str) -> float:
    """argparse type for a memory budget in MiB: a positive number."""
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 < mb < 2**40:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory budget in MiB (a positive number)")
    return mb


def port_number(text: str) -> int:
    """argparse type for --port: 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0: any free port)")
    return port


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (sorted)."""
    try:
        values = tuple(sorted(int(x) for x in text.split(",") if x.strip()))
    except ValueError as exc:
        raise EdgeliteError(f"{flag} {text!r}: expected positive integers, e.g. 128,256,512") from exc
    if not values or values[0] < 1:
        raise EdgeliteError(f"{flag} {text!r}: expected positive integers, e.g. 128,256,512")
    return values


def config_overrides(items: list[str], cls: type) -> dict[str, Any]:
    """`--set NAME=VALUE` flags as fields of a config dataclass (numbers and true/false only)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        f = fields.get(name.strip())
        kind = type(f.default) if f is not None else None
        if not eq or kind not in (int, float, bool):
            settable = sorted(k for k, v in fields.items() if type(v.default) in (int, float, bool))
            raise EdgeliteError(f"--set {item!r}: expected NAME=VALUE, NAME one of "
                                f"{', '.join(settable)}")
        try:
            if kind is bool:
                if text.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value: Any = text.strip().lower() in ("true", "1")
            else:
                value = kind(text)
        except ValueError as exc:
            raise EdgeliteError(f"--set {item!r}: {text!r} is not a {kind.__name__}") from exc
        if kind is not bool and value < 0:
            raise EdgeliteError(f"--set {item!r}: must not be negative")
        out[name.strip()] = value
    return out


def token(args: argparse.Namespace, required: bool = False) -> str | None:
    value = getattr(args, "token", None) or os.environ.get("EDGELITE_TOKEN")
    if required and not value:
        raise EdgeliteError("the cluster token is needed: --token or EDGELITE_TOKEN "
                            "(each node prints it when it starts)")
    return value


def discovery_config(args: argparse.Namespace) -> DiscoveryConfig:
    where = tuple(a.strip() for a in getattr(args, "broadcast", "").split(",") if a.strip())
    return DiscoveryConfig(port=getattr(args, "discovery_port", DiscoveryConfig.port),
                           broadcast=where or DiscoveryConfig.broadcast)


def client_config(args: argparse.Namespace) -> ClientConfig:
    return ClientConfig(discovery=discovery_config(args))


def nodes(args: argparse.Namespace, default: str | None = None) -> list[NodeAddr] | str:
    """--nodes as addresses, or "auto" (found when connecting)."""
    text = getattr(args, "nodes", None) or default
    if text is not None and text.strip() == "auto":
        return "auto"
    return parse_nodes(text) if text else []


async def found_nodes(args: argparse.Namespace) -> list[NodeAddr]:
    """--nodes as addresses, looking for them on the LAN when it says auto (none without it)."""
    from edgelite.client.llm import node_addrs

    return await node_addrs(nodes(args), token(args), client_config(args))


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(threads=args.threads, allow_spinning=not getattr(args, "no_spin", False),
                         invariant=not getattr(args, "no_invariant", False),
                         attention_kernel=not getattr(args, "no_attention_kernel", False),
                         matmul_kernel=not getattr(args, "no_matmul_kernel", False),
                         kv_dtype=kv_dtype(args), kv_store=kv_store_config(args))


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The generation flags, checked at once (serve refuses bad defaults before it starts)."""
    from edgelite.reply.loop import check

    spec = getattr(args, "speculate", "off")
    if getattr(args, "draft_tokens", 0) and spec == "off":
        raise EdgeliteError("--draft-tokens goes with --speculate lookup or --speculate DIR (without "
                            "them nothing is drafted)")
    return check(GenerationConfig(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed,
                            speculate=spec if spec in ("off", "lookup") else "draft",
                            draft_tokens=getattr(args, "draft_tokens", 0),
                            top_k=getattr(args, "top_k", 0), min_p=getattr(args, "min_p", 0.0),
                            repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                            presence_penalty=getattr(args, "presence_penalty", 0.0),
                            frequency_penalty=getattr(args, "frequency_penalty", 0.0),
                            response_format=getattr(args, "response_format", "text"),
                            json_schema=schema_text(args)))


def schema_text(args: argparse.Namespace) -> str:
    """--json-schema FILE's text ("" without it); it goes with --response-format json_schema."""
    path = getattr(args, "json_schema", None)
    fmt = getattr(args, "response_format", "text")
    if (path is None) != (fmt != "json_schema"):
        raise EdgeliteError("--json-schema FILE and --response-format json_schema go together")
    if path is None:
        return ""
    try:
        return path.read_text()
    except OSError as exc:
        raise EdgeliteError(f"--json-schema {path}: {exc.strerror or exc}") from None


def draft_folder(args: argparse.Namespace) -> Path | None:
    """--speculate DIR: the draft model's folder."""
    spec = getattr(args, "speculate", "off")
    if spec in ("off", "lookup"):
        return None
    if not (Path(spec) / "manifest.json").is_file():
        raise EdgeliteError(f"--speculate {spec!r}: off, lookup, or a draft model's export folder "
                            f"(no manifest.json there)")
    return Path(spec)


def client_memory(args: argparse.Namespace) -> int | None:
    mb = getattr(args, "client_memory_mb", None)
    return None if mb is None else int(mb * 2**20)


def plan_options(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(objective=args.objective, solver=args.solver,
                       client_first=not args.no_client_first,
                       client_memory_bytes=client_memory(args), context=args.context,
                       allow_local=args.allow_local)


def parse_split(text: str) -> list[tuple[int, int]]:
    """FIRST-LAST,... (checked against the model when the plan is made)."""
    ranges = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or not (b or a).isdigit():
            raise EdgeliteError(f"--split entry {part!r} is not FIRST-LAST")
        ranges.append((int(a), int(b or a)))
    return ranges


def connect_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What `edgelite.connect` takes, from the generate/chat/serve flags."""
    given = nodes(args)
    return {"nodes": given, "token": token(args, required=bool(given)),
            "split": parse_split(args.split) if getattr(args, "split", None) else None,
            "planning": plan_options(args), "routes": parse_routes(getattr(args, "route", None)),
            "runtime": runtime_config(args), "client": client_config(args),
            "generation": generation_config(args), "draft": draft_folder(args)}
