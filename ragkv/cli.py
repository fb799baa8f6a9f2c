"""`ragkv` command line: one subcommand module each under ragkv.commands (and the subsystems)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ragkv.errors import RagkvError

# Modules that each register their subcommands with `register(subparsers)`.
SUBCOMMANDS = [
    "ragkv.commands.generate",
    "ragkv.commands.ask",
    "ragkv.commands.bench",
    "ragkv.commands.ingest",
    "ragkv.store.commands",
    "ragkv.eval.commands",
    "ragkv.train.commands",
    "ragkv.serve.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragkv", description="Reuse retrieved passages' KV caches at any "
                                     "position: Block-Attention, APE and CacheBlend behind one engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="ragkv: %(levelname)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RagkvError as e:
        print(f"ragkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
