"""The layout keeps its promises: the tools in mpitrain/tools train nothing. They load no
TensorFlow, no MPI and none of the training runtime (comm, session, trainers, replica,
telemetry), so ``mpitrain plot|report|sweep|check`` start in a second. And only
mpitrain/comm/ imports mpi4py: everything else talks to MPI through its verbs."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

TOOLS = ("plots", "report", "sweep", "preflight", "hostfile")
RUNTIME = ("tensorflow", "keras", "mpi4py", "mpitrain.comm", "mpitrain.session",
           "mpitrain.train", "mpitrain.exchange",
           "mpitrain.models.replica", "mpitrain.telemetry", "mpitrain.data", "mpitrain.lifecycle")


def test_tools_load_nothing_of_the_training_runtime():
    code = ("import sys\n"
            + "".join(f"import mpitrain.tools.{name}\n" for name in TOOLS)
            + f"print(sorted(m for m in {RUNTIME!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def mpi4py_importers(root: Path) -> list:
    """The .py files under ``root`` (paths relative to it) that import mpi4py anywhere:
    at module level, inside a function, or by name through importlib or __import__."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any("mpi4py" in imported(node) for node in ast.walk(ast.parse(path.read_text()))):
            found.append(path.relative_to(root).as_posix())
    return found


def imported(node: ast.AST) -> list:
    """The top-level packages that an import node imports (none for any other node)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module.split(".")[0]] if node.level == 0 and node.module else []
    by_name = (isinstance(node, ast.Call) and node.args
               and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
               and getattr(node.func, "attr", getattr(node.func, "id", None))
               in ("import_module", "__import__"))
    return [node.args[0].value.split(".")[0]] if by_name else []


def test_only_the_comm_package_imports_mpi4py():
    importers = mpi4py_importers(REPO / "mpitrain")
    assert importers, "no module of mpitrain imports mpi4py: the scan is broken"
    outside = [f"mpitrain/{p}" for p in importers if not p.startswith("comm/")]
    assert outside == [], f"only mpitrain/comm/ may import mpi4py; also imported by {outside}"


def test_the_import_rule_finds_every_form_of_import(tmp_path):
    (tmp_path / "comm").mkdir()
    sources = {"comm/runtime.py": "from mpi4py import MPI\n",
               "a.py": "def f():\n    import numpy, mpi4py.MPI\n",
               "b.py": "import importlib\nMPI = importlib.import_module('mpi4py.MPI')\n",
               "c.py": "mpi4py = __import__('mpi4py')\n",
               "clean.py": "import numpy\nfrom . import mpi4py_notes\n# import mpi4py\n"}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    assert mpi4py_importers(tmp_path) == ["a.py", "b.py", "c.py", "comm/runtime.py"]
