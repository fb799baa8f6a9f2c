"""Every `ragkv ...` command line in a code block of docs/results still parses with the real parser (nothing runs),
and an eval command's mode keys still parse: results stay reproducible by the commands written beside them. A
sketch (a line with `...` or a shell variable `$X`) is not checked, and no script may sit in docs/results: the
diagnostics are commands (ragkv bench, ragkv report)."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from ragkv.cli.main import build_parser
from ragkv.eval.modes import parse_mode_key, split_mode_list

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*ragkv\s")


def documented_commands(text: str):
    """(line, argv after `ragkv`) of each command in a fenced code block, `\\` continuations joined."""
    inside, pending, first = False, None, 0
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("```"):
            inside, pending = not inside, None
            continue
        if not inside:
            continue
        if pending is None and not START.match(s):
            continue
        if pending is None:
            pending, first = "", no
        pending += " " + s.removesuffix("\\")
        if s.endswith("\\"):
            continue
        cmd, pending = pending.split(" #")[0], None
        if "..." in cmd or "$" in cmd:
            continue
        argv = shlex.split(cmd)
        yield first, argv[argv.index("ragkv") + 1:]


def _parse_error(parser, argv: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    if args.command == "eval" and args.modes:
        try:
            for key in split_mode_list(args.modes):
                parse_mode_key(key)
        except Exception as e:  # noqa: BLE001 - reported with the line
            return f"mode key: {e}"
    return None


def test_every_documented_command_parses():
    parser = build_parser({})  # no settings file: the flags as shipped
    checked, bad = 0, []
    for md in sorted(RESULTS.rglob("*.md")):
        for line, argv in documented_commands(md.read_text()):
            checked += 1
            error = _parse_error(parser, argv)
            if error:
                bad.append(f"{md.relative_to(RESULTS)}:{line}: ragkv {' '.join(argv)[:120]}\n    {error}")
    assert checked > 50, "the scan found too few commands: has the docs' layout changed?"
    assert not bad, "documented commands that no longer parse:\n" + "\n".join(bad)


def test_the_scan_catches_a_renamed_flag_and_a_bad_mode_key():
    parser = build_parser({})
    text = "```bash\nragkv eval --dataset musique \\\n  --no-such-flag 3\nragkv eval --modes blend:nope=1\n" \
           "ragkv report --paired a.jsonl --modes reuse   # a comment\nragkv eval ... --limit 8\n```\nragkv x\n"
    found = list(documented_commands(text))
    assert [line for line, _ in found] == [2, 4, 5]
    assert "unrecognized arguments" in _parse_error(parser, found[0][1])
    assert _parse_error(parser, found[1][1]).startswith("mode key")
    assert _parse_error(parser, found[2][1]) is None


@pytest.mark.parametrize("suffix", [".py", ".sh"])
def test_no_scripts_under_docs_results(suffix):
    assert not sorted(RESULTS.rglob(f"*{suffix}")), "docs hold results and the commands that made them"
