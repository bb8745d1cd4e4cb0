"""mpitrain/ is clean under ruff (ruff.toml: pyflakes, pycodestyle, bugbear) and mypy
(mypy.ini), both installed by setup.sh at the versions setup.py pins; a finding fails
the test with the tool's own report. mypy also checks that each null object keeps its
real twin's methods (:class:`mpitrain.train.context.ResultsWriter`, ``ConsoleOutput``)."""

import subprocess
import sys

from conftest import REPO


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_ruff_finds_nothing_in_mpitrain():
    result = run_tool("ruff", "check", "--no-cache", "mpitrain")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing_in_mpitrain():
    result = run_tool("mypy", "mpitrain")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
