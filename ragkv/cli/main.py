"""`ragkv` command line: every subcommand is registered here, statically, from the modules of ragkv.cli."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from ragkv.cli import ask, bench, calibrate, eval as eval_cmds, finetune, generate, ingest, report, serve, store
from ragkv.errors import RagkvError
from ragkv.settings import SettingsError, load_settings, normalize_key, settings_path

COMMAND_MODULES = (generate, ask, bench, ingest, store, eval_cmds, calibrate, report, finetune, serve)


def build_parser(settings: dict | None = None) -> argparse.ArgumentParser:
    """The full parser; `settings` (default: the settings file) become the defaults of the flags they name."""
    parser = argparse.ArgumentParser(prog="ragkv", description="Reuse retrieved passages' KV caches at any "
                                     "position: Block-Attention, APE and CacheBlend behind one engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages (--log-level debug)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                        help="the least severe message logged (info: also the long prefills' admissions and ends)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    apply_settings(parser, load_settings() if settings is None else settings)
    return parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every leaf subcommand: ("ask",), ("bench", "ttft"), ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and path:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _commands(child, path + (name,))


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


def apply_settings(parser: argparse.ArgumentParser, settings: dict) -> None:
    """Top-level keys apply to every command with that flag, `[cmd]` / `[bench.ttft]` tables to one command;
    keys that no command takes are an error."""
    commands = dict(_commands(parser))
    tables = {k: v for k, v in settings.items() if isinstance(v, dict)}
    top = {normalize_key(k): v for k, v in settings.items() if not isinstance(v, dict)}
    known = set().union(*(_dests(p) for p in commands.values()))
    unknown = sorted(set(top) - known)
    scoped: dict[tuple[str, ...], dict] = {}
    for name, table in tables.items():
        for key, value in table.items():  # [bench] ttft = {...} and [bench.ttft] arrive alike as nested tables
            if isinstance(value, dict):
                scoped[(name, key)] = {normalize_key(k): v for k, v in value.items()}
            else:
                scoped.setdefault((name,), {})[normalize_key(key)] = value
    for path, values in scoped.items():
        if path not in commands:
            unknown.append(f"[{'.'.join(path)}] (no such command)")
            continue
        unknown += [f"{'.'.join(path)}.{k}" for k in sorted(set(values) - _dests(commands[path]))]
    if unknown:
        raise SettingsError(f"{settings_path()}: unknown setting(s) {', '.join(unknown)}; keys are flag names "
                            "(e.g. store, dtype, model) at the top level or in a [command] table")
    for path, p in commands.items():
        own = _dests(p)
        p.set_defaults(**{**{k: v for k, v in top.items() if k in own}, **scoped.get(path, {})})


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except SettingsError as e:
        print(f"ragkv: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    # below warning the messages are a diagnosis of a long run: each says when
    logging.basicConfig(level=level, format=("%(asctime)s " if level < logging.WARNING else "")
                        + "ragkv: %(levelname)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that left early shows here, in the handler below, not at exit
        return code
    except RagkvError as e:
        print(f"ragkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early (`ragkv ... | head`): stop quietly, as `cat` does
        with contextlib.suppress(OSError, ValueError, AttributeError):  # so the flush at exit cannot raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
