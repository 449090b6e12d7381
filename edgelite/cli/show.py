"""`edgelite show MODEL`: what an export is (family, size, context, quantization, template) and
what the planner counts for it (memory a layer holds, its KV, the client's part)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import edgelite
from edgelite.cli import options
from edgelite.reply.tools import style_of

MIB = 1 << 20


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("show", parents=parents, formatter_class=options.HelpFormatter,
                       help="what an export is and what the planner counts for it",
                       description="Family, size, context, quantization, chat template and its "
                                   "check, and the memory the planner counts: each layer once "
                                   "loaded with its KV for --context positions, the client's "
                                   "embedding and head, a prompt chunk's scratch.")
    p.add_argument("model", help="the export's folder")
    p.add_argument("--context", type=int, default=2048, help="positions of KV each layer is counted with")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def describe(model: str, context: int) -> dict[str, Any]:
    m = edgelite.load_manifest(model)
    files = sum(e.bytes + sum(d.bytes for d in e.data) for e in m.files)
    v = m.verification
    style = style_of(m.chat_template)
    return {"name": m.name, "architecture": m.architecture, "layers": m.num_layers,
            "hidden_size": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "vocab": m.vocab_size, "context": m.max_positions,
            "weights": m.weights, "compute": m.compute, "source": m.quantization.get("source"),
            "tensor_kinds": m.quantization.get("weights") or {}, "files_bytes": files,
            "fingerprint": m.fingerprint,
            "chat_template": m.chat_template is not None,
            "tools": ("the template renders them" + (", calls in <tool_call> tags" if style.opening else "")
                      if style.native else "shown in a system message; calls as bare JSON"),
            "check": {k: v.get(k) for k in ("passed", "kld", "top1_agreement", "greedy_prefix", "steps")
                      if k in v},
            "planner_counts": edgelite.footprint(m, kv_tokens=context)}


def run(args: argparse.Namespace) -> int:
    d = describe(args.model, args.context)
    if args.json:
        print(json.dumps(d))
        return 0
    f = d["planner_counts"]
    layer = f["layer_bytes"]
    check = d["check"]
    kinds = ", ".join(f"{k} x{n}" for k, n in d["tensor_kinds"].items()) or "?"
    lines = [
        f"{d['name']}  ({d['architecture']}, {d['layers']} layers, hidden {d['hidden_size']}, "
        f"{d['heads']} heads / {d['kv_heads']} KV heads of {d['head_dim']}, vocabulary {d['vocab']:,}, "
        f"context {d['context']:,})",
        f"weights {d['weights']}, compute {d['compute']} (from {d['source'] or '?'}: {kinds}); "
        f"files {d['files_bytes'] / 1e6:,.1f} MB; fingerprint {d['fingerprint']}",
        f"chat template: {'yes' if d['chat_template'] else 'none (raw prompts only)'}; tools: {d['tools']}",
        "check against its source: " + (", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in check.items()) or "none recorded"),
        f"what the planner counts (KV {f['kv_dtype']} for {f['kv_tokens']:,} positions):",
        f"  each layer {min(layer) / MIB:.1f}-{max(layer) / MIB:.1f} MiB (loaded "
        f"{f['layers_resident_bytes'] / MIB / len(layer):.1f} on average, "
        f"{f['resident_over_weights']}x its weights, + KV {f['layers_kv_bytes'] / MIB / len(layer):.2f}); "
        f"all {len(layer)}: {(sum(layer) + f['range_bytes']) / MIB:,.0f} MiB",
        f"  each device's range of layers {f['range_bytes'] / MIB:.1f} MiB more, once; the client's "
        f"embedding and head {f['client_bytes'] / MIB:.0f} MiB; a {f['chunk']}-token prompt chunk "
        f"{f['scratch_bytes'] / MIB:.0f} MiB more on each device",
        "  each process's own (Python, onnxruntime: 60-90 MiB) on top: a node offers its "
        "--memory-mb less that",
    ]
    print("\n".join(lines))
    return 0
