"""ruff's pyflakes rules (undefined names, unused or shadowed imports, ...) find nothing in the package, the tests
and the scripts: `.ci/run` runs the suite, so a finding fails CI. `ruff check` alone prints where."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: `pip install -e .[test]` (scripts/setup.sh) installs it")
    return [exe]


def test_pyflakes_rules_find_nothing():
    out = subprocess.run(_ruff() + ["check", "--output-format", "concise", "ragkv", "tests", "scripts"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"ruff found problems (run `ruff check` to see them):\n{out.stdout}{out.stderr}"


def test_the_lint_catches_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return undefined_name\n")
    out = subprocess.run(_ruff() + ["check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "F821" in out.stdout
