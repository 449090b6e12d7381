"""edgelite: one LLM split across several phones, as a pipeline of ONNX stages.

The public API (everything a program needs; the CLI is built on it):

    async with edgelite.connect("models/smollm2-135m", nodes=["a:7070", "b:7070"],
                                token="...") as llm:
        print(llm.plan)
        async for piece in llm.chat([{"role": "user", "content": "Hi"}], max_tokens=64):
            print(piece.text, end="")

- `connect(model, nodes=None, token=None, ...)`: an LLM (local, or planned and deployed on nodes;
  nodes="auto": the cluster's nodes that answer on the LAN)
- `discover(token)`: the cluster's nodes on the LAN (UDP broadcast, answers checked by HMAC)
- `probe(nodes, token, manifest=None)`: measure devices and links
- `plan(manifest, cluster)`: place layers on devices (pure; reads only the manifest)
- `footprint(manifest)`: what the planner counts for the model's pieces (memory, KV, scratch)
- `status(addrs, token)`: what runs where: each node's plans, sessions and memory
- `run_node(token, data_dir, NodeConfig(...))`: a node serving inside this process
- typed data: `Plan`, `Stage`, `NodeAddr`, `Manifest`; configs; errors (`EdgeliteError`, ...)

Names load on first use, so `import edgelite` stays cheap.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# onnxruntime (1.29 and later, Linux and Android wheels) uploads usage telemetry and keeps a
# device id file unless this is set before it loads. Phones pooled in private stay private:
# edgelite opts out (ORT_DISABLE_TELEMETRY=0 in the environment opts back in).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.3.0"  # (pyproject.toml reads it from here)

_EXPORTS = {
    "connect": "edgelite.client.llm", "LLM": "edgelite.client.llm",
    "Reply": "edgelite.client.llm", "Piece": "edgelite.reply.loop",
    "PlanOptions": "edgelite.client.llm",
    "discover": "edgelite.net.discovery", "probe": "edgelite.prober.cluster",
    "status": "edgelite.client.status", "footprint": "edgelite.planner.spec",
    "cluster_spec": "edgelite.prober.cluster", "plan": "edgelite.planner.solve",
    "Plan": "edgelite.planner.model", "Stage": "edgelite.planner.model",
    "Node": "edgelite.node.server", "run_node": "edgelite.node.server",
    "NodeAddr": "edgelite.ids", "PlanId": "edgelite.ids", "SessionId": "edgelite.ids",
    "Manifest": "edgelite.manifest", "load_manifest": "edgelite.manifest",
    "ClientConfig": "edgelite.config", "GenerationConfig": "edgelite.config",
    "NodeConfig": "edgelite.config", "RuntimeConfig": "edgelite.config",
    "DiscoveryConfig": "edgelite.config",
    "ProbeConfig": "edgelite.net.linkprobe",
    "EdgeliteError": "edgelite.errors", "NodeError": "edgelite.errors",
    "NodeUnavailable": "edgelite.errors", "PlanInfeasible": "edgelite.errors",
    "ManifestError": "edgelite.errors", "ModelFileError": "edgelite.errors",
    "MissingDependency": "edgelite.errors",
}
_RENAMED = {"load_manifest": "load"}
__all__ = [
    "LLM", "ClientConfig", "DiscoveryConfig", "EdgeliteError", "GenerationConfig", "Manifest",
    "ManifestError", "MissingDependency", "ModelFileError", "Node", "NodeAddr", "NodeConfig",
    "NodeError", "NodeUnavailable", "Piece", "Plan", "PlanId", "PlanInfeasible", "PlanOptions",
    "ProbeConfig", "Reply", "RuntimeConfig", "SessionId", "Stage", "cluster_spec", "connect",
    "discover", "footprint", "load_manifest", "plan", "probe", "run_node", "status",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgelite' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from edgelite.client.llm import LLM, PlanOptions, Reply, connect
    from edgelite.config import ClientConfig, GenerationConfig, NodeConfig, RuntimeConfig
    from edgelite.errors import (
        EdgeliteError,
        ManifestError,
        MissingDependency,
        ModelFileError,
        NodeError,
        NodeUnavailable,
        PlanInfeasible,
    )
    from edgelite.ids import NodeAddr, PlanId, SessionId
    from edgelite.manifest import Manifest
    from edgelite.manifest import load as load_manifest
    from edgelite.net.linkprobe import ProbeConfig
    from edgelite.node.server import Node, run_node
    from edgelite.planner.model import Plan, Stage
    from edgelite.planner.solve import plan
    from edgelite.prober.cluster import cluster_spec, probe
    from edgelite.reply.loop import Piece
