"""The `ragkv` command line: the only layer where flags and the settings file become configs."""

from ragkv.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
