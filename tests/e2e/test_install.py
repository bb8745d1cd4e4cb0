"""A fresh install, as a new user makes it, on the Pythons the package supports.

Each case makes an empty venv with that Python, ``pip install``s this source tree
packed as a source distribution (not editable: what a user gets; pip builds it for
that Python, the float16 extension included), and trains LR under
``mpirun -np 3`` from a directory outside the tree, so the installed package is
what runs. pip picks
the newest TensorFlow with wheels for that Python (3.13: 2.20+). Python 3.13
is what today's Debian stable ships; 3.10 is the oldest supported (tomllib
fallback). A missing interpreter skips, except 3.13 in CI.

Both environments are installed at the same time (mostly downloading and
unpacking TensorFlow), with ``pip --no-compile``: Python compiles the modules a
rank imports on first use instead of pip compiling every file up front.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import (REPO, finish_bounded, mpirun_cmd, read_rows, run_bounded,
                      start_bounded)

pytestmark = pytest.mark.slow


def candidates(version: str):
    """python3.X on PATH, then pyenv's installs of 3.X (its shims run only when selected)."""
    yield shutil.which(f"python{version}")
    pyenv = shutil.which("pyenv")
    if pyenv:
        listed = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True)
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        for installed in listed.stdout.split():
            if installed.startswith(version + "."):
                yield os.path.join(root, "versions", installed, "bin", f"python{version}")


VERSIONS = ("3.13", "3.10")


def interpreter(version: str):
    """A python``version`` with venv and ensurepip, or None."""
    for found in candidates(version):
        if found and subprocess.run([found, "-c", "import venv, ensurepip"],
                                    capture_output=True).returncode == 0:
            return found
    return None


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """{version: (venv, pip's CompletedProcess) or None if that Python is missing}:
    this tree packed once as a source distribution (a wheel would hold this Python's
    build of the C extension), every venv made, then the pip installs of it run side
    by side (bounded), each building the extension for its own Python."""
    dist = tmp_path_factory.mktemp("sdist")
    packed = run_bounded([sys.executable, "setup.py", "-q", "sdist", "-d", dist], timeout=300,
                         cwd=REPO)  # once: two builds in one tree would collide
    assert packed.returncode == 0, packed.stderr[-3000:]
    source, = dist.glob("mpitrain-*.tar.gz")
    started = {}
    for version in VERSIONS:
        python = interpreter(version)
        if python is None:
            continue
        venv = tmp_path_factory.mktemp(f"py{version}") / "venv"
        made = run_bounded([python, "-m", "venv", venv], timeout=120)
        assert made.returncode == 0, made.stderr
        started[version] = (venv, start_bounded([venv / "bin/python", "-m", "pip", "install",
                                                 "-q", "--no-compile", source]))
    done = {version: (venv, finish_bounded(pip, 1200)) for version, (venv, pip)
            in started.items()}
    return {version: done.get(version) for version in VERSIONS}


@pytest.mark.parametrize("version", VERSIONS)
def test_fresh_install_trains_under_mpirun(mnist, tmp_path, version, installs):
    if installs[version] is None:
        message = f"no python{version} with venv on this machine"
        if version == "3.13" and os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    venv, pip = installs[version]
    assert pip.returncode == 0, pip.stderr[-3000:]

    work = tmp_path / "elsewhere"  # not the source tree: the installed package runs
    work.mkdir()
    built = run_bounded([venv / "bin/python", "-c",
                         "from mpitrain.kernels import half; print(half._half is not None)"],
                        timeout=60, cwd=work)
    assert built.stdout.strip() == "True", built.stderr  # pip built the float16 extension
    cmd = mpirun_cmd(3, "lr", "--steps", "60", "--compression", "fp16", "--data-dir", mnist,
                     "--results-dir", work / "results", "--quiet", python=venv / "bin/python")
    result = run_bounded(cmd, timeout=300, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    row = read_rows(work / "results/runs.csv")[-1]
    assert row["status"] == "ok" and int(row["steps"]) == 60
    assert float(row["test_accuracy"]) > 0.8  # LR on MNIST after 60 sync steps: ~0.88
    meta = json.loads((work / "results" / row["run"] / "config.json").read_text())
    versions = meta["versions"]
    assert versions["python"].startswith(version + ".")
    major, minor = (int(part) for part in versions["tensorflow"].split(".")[:2])
    if version == "3.13":
        assert (major, minor) >= (2, 20)  # the first TensorFlow with 3.13 wheels
    print(f"python {versions['python']}: tensorflow {versions['tensorflow']}, keras "
          f"{versions['keras']}, numpy {versions['numpy']}; test accuracy "
          f"{row['test_accuracy']}", file=sys.stderr)
