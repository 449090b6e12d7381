"""`edgelite models [list|rm|gc]`: the exports this device and its nodes keep."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edgelite import paths
from edgelite.cli import options, runner
from edgelite.config import NodeConfig
from edgelite.errors import EdgeliteError


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", parents=parents, formatter_class=options.HelpFormatter,
                       help="list, remove and clean up the exports on this device and on nodes",
                       description="list: the exports here (DATA_DIR/models, ./models and each "
                                   "--dir) or, with --nodes, on those nodes; rm NAME|DIR: delete "
                                   "one (on a node, only one you pushed); gc: delete the deployed "
                                   "files nothing uses (a node also does it on its own for "
                                   "files unused for a week: node --set blob_idle_ttl_s=...).")
    p.add_argument("action", nargs="?", choices=["list", "rm", "gc"], default="list")
    p.add_argument("target", nargs="?", metavar="NAME|DIR",
                   help="with rm: the export's folder, or its name in the list")
    p.add_argument("--dir", type=Path, action="append", default=[], metavar="DIR",
                   help="another folder of exports to list (repeatable)")
    p.add_argument("--data-dir", type=Path, default=paths.home(),
                   help="the data folder of a node on this device (its models/ and blobs/; "
                        "$EDGELITE_HOME, else ~/.edgelite)")
    p.add_argument("--nodes", help="HOST:PORT,... : act on those nodes instead of this device "
                                   "(auto: the nodes with this token on the LAN)")
    p.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "rm" and not args.target:
        raise EdgeliteError("models rm needs the export's NAME or folder")
    if args.action != "rm" and args.target:
        raise EdgeliteError(f"models {args.action} takes no NAME (only rm does)")
    if args.nodes:
        return runner.run(_on_nodes(args))
    return _here(args)


def _folders(args: argparse.Namespace) -> list[Path]:
    return [args.data_dir.expanduser() / "models", Path("models"), *args.dir]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _here(args: argparse.Namespace) -> int:
    from edgelite.client import models

    data_dir = args.data_dir.expanduser()
    if args.action == "gc":
        files, freed = models.collect_local(data_dir)
        left = models.local_blobs(data_dir)
        kept = _kept(left.recent_files, left.recent_bytes) if left is not None else ""
        _say(args, {"deleted_files": files, "deleted_bytes": freed,
                    "kept_recent_files": left.recent_files if left is not None else 0},
             f"deleted {files} deployed files nothing used ({_mb(freed)}) in {data_dir / 'blobs'}{kept}")
        return 0
    found = models.local_models(_folders(args))
    if args.action == "rm":
        target = Path(args.target).expanduser()
        if not target.is_dir():
            named = [e for e in found if e.path.name == args.target]
            if len(named) != 1:
                where = ", ".join(str(f) for f in _folders(args))
                raise EdgeliteError(f"no export named {args.target} in {where}" if not named else
                                    f"{len(named)} exports are named {args.target}: give the "
                                    f"folder ({', '.join(str(e.path) for e in named)})")
            target = named[0].path
        freed = models.remove_local(target)
        _say(args, {"removed": str(target), "bytes": freed}, f"removed {target} ({_mb(freed)})")
        return 0
    blobs = models.local_blobs(data_dir)
    if args.json:
        print(json.dumps({"models": [{**asdict(e), "path": str(e.path)} for e in found],
                          "blobs": None if blobs is None else asdict(blobs)}))
        return 0
    if not found:
        print(f"no exports in {', '.join(str(f) for f in _folders(args))}")
    for e in found:
        print(f"{e.path.name:24} {_mb(e.bytes):>10}  {e.title} ({e.weights}, {e.compute}, "
              f"{e.layers} layers)  {e.path}")
    if blobs is not None:
        print(f"deployed files in {data_dir / 'blobs'}: {blobs.files} ({_mb(blobs.bytes)}), of "
              f"which nothing uses {blobs.unused_files} ({_mb(blobs.unused_bytes)}): "
              f"`edgelite models gc` deletes those{_kept(blobs.recent_files, blobs.recent_bytes)}")
    return 0


def _kept(files: int, size: int) -> str:
    """What gc keeps for now: files nothing uses but used within the grace time."""
    if not files:
        return ""
    hours = NodeConfig.blob_grace_s / 3600
    return (f"; {files} more ({_mb(size)}) nothing uses were used within the last {hours:g} h and are "
            f"kept until then (a deploy under way may want them)")


def _say(args: argparse.Namespace, data: dict[str, Any], line: str) -> None:
    print(json.dumps(data) if args.json else line)


async def _on_nodes(args: argparse.Namespace) -> int:
    from edgelite.client import models

    token = options.token(args, required=True)
    assert token is not None
    addrs = await options.found_nodes(args)
    if args.action == "gc":
        out = []
        for addr in addrs:
            files, freed = await models.collect_on_node(addr, token)
            out.append({"node": str(addr), "deleted_files": files, "deleted_bytes": freed})
            if not args.json:
                print(f"{addr}: deleted {files} deployed files nothing used ({_mb(freed)})")
        if args.json:
            print(json.dumps({"nodes": out}))
        return 0
    if args.action == "rm":  # on every node that has it; an error only when none had
        out, refused = [], []
        for addr in addrs:
            try:
                freed = await models.remove_on_node(addr, token, args.target)
            except EdgeliteError as exc:
                refused.append(str(exc))  # (it names the node)
                continue
            out.append({"node": str(addr), "removed": args.target, "bytes": freed})
            if not args.json:
                print(f"{addr}: removed {args.target} ({_mb(freed)}); its deployed files go "
                      f"when nothing uses them (`edgelite models gc --nodes ...` at once)")
        if not out:
            raise EdgeliteError(f"model {args.target} removed nowhere: " + "; ".join(refused))
        if args.json:
            print(json.dumps({"nodes": out, "refused": refused}))
        else:
            for line in refused:
                print(line)
        return 0
    states = [await models.node_models(addr, token) for addr in addrs]
    if args.json:
        print(json.dumps({"nodes": [{"node": str(s.node), "models": [asdict(x) for x in s.models],
                                     "blobs": asdict(s.blobs)} for s in states]}))
        return 0
    for s in states:
        b = s.blobs
        print(f"{s.node}: {len(s.models)} model folders; deployed files {b.files} "
              f"({_mb(b.bytes)}), of which nothing uses {b.unused_files} ({_mb(b.unused_bytes)})"
              f"{_kept(b.recent_files, b.recent_bytes)}")
        for x in s.models:
            mine = "yours" if x.yours else "another client's"
            print(f"  {x.name:24} {_mb(x.bytes):>10}  {x.title} ({x.weights}, {x.layers} layers), "
                  f"{mine}")
    return 0
