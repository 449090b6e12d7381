"""`edgelite push DIR --to HOST:PORT`: copy an export to a phone running `edgelite node`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edgelite.cli import options, runner, views
from edgelite.ids import NodeAddr


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("push", parents=parents, formatter_class=options.HelpFormatter,
                       help="copy an export to a phone over the LAN (resumable, sha256-checked)")
    p.add_argument("model", type=Path, help="the export folder (written by edgelite-export)")
    p.add_argument("--to", required=True, metavar="HOST:PORT",
                   help="the phone's `edgelite node` (it keeps the model in DATA_DIR/models/NAME)")
    p.add_argument("--name", help="NAME on the phone (default: the folder's name)")
    p.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgelite.client.push import push

    token = options.token(args, required=True)
    assert token is not None
    to = NodeAddr.parse(args.to)
    console = views.stderr_console()

    async def go() -> Any:
        with views.connect_bars(console, live=console.is_terminal) as bars:
            show = None if bars is None else (
                lambda what, done, total: bars("push", what, done, total))
            return await push(args.model, to, token, args.name, progress=show)

    done = runner.run(go())
    print(f"pushed {done.files} files ({done.bytes / 1e6:.1f} MB, {done.sent / 1e6:.1f} MB sent now) "
          f"to {to}: {done.path}")
    print(f"on that phone: edgelite chat --model {done.path} --nodes ...")
    return 0
