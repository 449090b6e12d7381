"""edgelite command line: one subcommand per step of the user's work (a thin shell over the
library: every command calls the public API in `edgelite`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from edgelite import __version__, heap
from edgelite.cli import chat, demo, generate, models, node, options, plan, probe, ps, push, serve, show
from edgelite.errors import EdgeliteError

COMMANDS = (generate, chat, demo, serve, plan, probe, node, push, models, ps, show)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more log lines (-vv: debug)")
    p = argparse.ArgumentParser(prog="edgelite", parents=[common],
                                formatter_class=options.HelpFormatter,
                                description="Run one LLM across several phones.")
    p.add_argument("--version", action="version", version=f"edgelite {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub, [common])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verbose = min(getattr(args, "verbose", 0), 2)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][verbose]
    # (without -v a warning is a line for the user, e.g. in the middle of a chat: no time
    # stamp nor logger name)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
                        if verbose else "%(levelname)s: %(message)s")
    heap.give_back_large_blocks()  # loading a model frees large buffers: back to the system
    try:
        return args.func(args)
    except EdgeliteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (a line end: the shell's prompt does not follow the text on its line)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.write("\n")
            sys.stdout.flush()
        return 130


if __name__ == "__main__":
    sys.exit(main())
