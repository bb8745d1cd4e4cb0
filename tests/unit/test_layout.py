"""The layout keeps its promises: every import follows the layer table of
docs/architecture.md (ALLOWED below is that table); what runs outside the training job
(mpitrain/launch/) and the offline reports (mpitrain/report/) train nothing: they load no
TensorFlow, no MPI and none of the training runtime (comm, session, trainers, replica,
telemetry), so ``mpitrain launch|plot|report|sweep|check`` start in a second. Only
mpitrain/comm/ imports mpi4py: everything else talks to MPI through its verbs. The
package root holds only the public surface and leaves, and no two modules share a name."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

OUTSIDE_THE_JOB = ("report.plots", "report.run_files", "report.run_figures", "report.markdown",
                   "launch.job", "launch.watch", "launch.sweep", "launch.preflight",
                   "launch.hostfile", "launch.dialect", "launch.probe", "launch.membership",
                   "launch.discovery", "launch.command", "launch.changes")
RUNTIME = ("tensorflow", "keras", "mpi4py", "mpitrain.comm", "mpitrain.run.session",
           "mpitrain.train", "mpitrain.exchange", "mpitrain.models.replica",
           "mpitrain.results.telemetry", "mpitrain.data")
#: the package root: the public surface (the package, ``python -m mpitrain``,
#: ``mpitrain.fit``) and the leaves every layer may use
ROOT_MODULES = {"__init__.py", "__main__.py", "api.py", "atomic.py", "errors.py",
                "userfiles.py"}


def test_the_root_holds_the_public_surface_and_leaves_only():
    assert {p.name for p in (REPO / "mpitrain").glob("*.py")} == ROOT_MODULES


def test_no_two_modules_share_a_name():
    names = [p.name for p in (REPO / "mpitrain").rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_tools_load_nothing_of_the_training_runtime():
    code = ("import sys\n"
            + "".join(f"import mpitrain.{name}\n" for name in OUTSIDE_THE_JOB)
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


#: the leaves: they import nothing of mpitrain but one another (__version__: the
#: package's version string)
LEAVES = {"config", "atomic", "errors", "userfiles", "kernels", "launch.dialect",
          "results.schema", "__version__"}
#: the I/O modules of the run
IO = {"data", "results", "run.checkpoint", "run.signals", "run.console"}
#: the layer table of docs/architecture.md: what each part of mpitrain may import besides
#: itself (the entry points, ENTRY, may import anything)
ALLOWED = {
    **{leaf: LEAVES for leaf in LEAVES},
    "comm": LEAVES,
    **{io: LEAVES for io in IO},
    "run.checkpoint": LEAVES | {"data"},
    "run.resume": LEAVES | {"data", "run.checkpoint", "results"},
    "models": LEAVES,
    "exchange": LEAVES | {"comm"},
    "train": LEAVES | {"comm", "exchange", "models", "run.checkpoint", "run.signals", "data"},
    "run.session": LEAVES | IO | {"comm", "exchange", "models", "train", "run.resume",
                                  "run.startup", "run.metadata", "launch.preflight"},
    "run.startup": LEAVES | {"comm", "train"},
    "run.metadata": LEAVES | IO | {"comm", "models", "train", "launch.preflight"},
    "horovod": LEAVES | IO | {"comm", "exchange", "models", "train"},
    "report.run_files": LEAVES,
    "report.run_figures": LEAVES | {"report.run_files"},
    "report.plots": LEAVES | {"report.run_files", "report.run_figures"},
    "report.markdown": LEAVES | {"report.plots", "report.run_files"},
    "launch.hostfile": LEAVES,
    "launch.preflight": LEAVES | {"launch.hostfile"},
    "launch.sweep": LEAVES | {"launch.hostfile", "launch.preflight", "report.markdown"},
    "launch.watch": LEAVES | {"results", "run.checkpoint", "run.signals"},
    "launch.probe": LEAVES | {"launch.hostfile", "launch.watch"},
    "launch.discovery": LEAVES | {"launch.hostfile", "launch.watch"},
    "launch.membership": LEAVES | {"launch.hostfile", "launch.probe", "results",
                                   "launch.discovery"},
    "launch.changes": LEAVES | {"results", "run.checkpoint"},
    "launch.job": LEAVES | {"launch.watch", "launch.hostfile", "launch.preflight", "results",
                            "run.checkpoint", "run.signals", "run.resume", "launch.probe",
                            "launch.membership", "launch.discovery", "launch.changes"},
    "launch.command": LEAVES | {"launch.job", "launch.discovery", "launch.membership",
                                "launch.probe", "launch.preflight", "results"},
}
ENTRY = {"", "__main__", "cli", "api"}


def import_edges(root: Path) -> list:
    """(importer, imported) of every import of one mpitrain module by another under
    ``root`` (the package directory), as dotted names relative to the package ('' for
    the package itself): at module level, inside functions and for type checking alike."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = []
    for name, path in sorted(modules.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, package, root.name):
                # a module, a compiled extension (``_half``) or a name of a package
                parent = target.rpartition(".")[0]
                resolved = target if (target in modules or _compiled(root, target)
                                      or target == "__version__") else parent
                if resolved != name:
                    edges.append((name, resolved))
    return edges


def _targets(node: ast.AST, package: str, top: str) -> list:
    """What ``node`` imports of the package ``top``, relative to it ('a.b', 'a.b.NAME')."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [n.partition(".")[2] for n in names if n.split(".")[0] == top]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".") if package else []
        base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
        module = ".".join(base)
    elif node.module and node.module.split(".")[0] == top:
        module = node.module.partition(".")[2]
    else:
        return []
    return [f"{module}.{a.name}".lstrip(".") for a in node.names]


def _compiled(root: Path, target: str) -> bool:
    return (root / (target.replace(".", "/") + ".c")).exists()


def unit(module: str) -> str:
    """The part of the layer table ``module`` belongs to: the longest that names it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ALLOWED or ".".join(parts[:n]) in ENTRY:
            return ".".join(parts[:n])
    return module


def test_every_import_follows_the_layer_table():
    edges = import_edges(REPO / "mpitrain")
    assert len(edges) > 100, "too few imports found: the scan is broken"
    unknown = sorted({unit(m) for edge in edges for m in edge} - set(ALLOWED) - ENTRY)
    assert unknown == [], f"parts of mpitrain missing from the layer table: {unknown}"
    wrong = sorted(f"{a} imports {b}" for a, b in edges
                   if unit(a) not in ENTRY and unit(b) != unit(a)
                   and unit(b) not in ALLOWED[unit(a)])
    assert wrong == [], "imports against docs/architecture.md's layer table:\n" + "\n".join(wrong)


def test_the_layer_scan_resolves_every_form_of_import(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    sources = {"__init__.py": "__version__ = '1'\nfrom .a import f\n",
               "a.py": "from . import sub, _c\nfrom .sub.b import g\n",
               "_c.c": "", "sub/__init__.py": "from .. import __version__\n",
               "sub/b.py": "def g():\n    import pkg.a\n    from ..a import f\n"}
    for name, text in sources.items():
        (root / name).write_text(text)
    assert sorted(import_edges(root)) == [
        ("", "a"), ("a", "_c"), ("a", "sub"), ("a", "sub.b"), ("sub", "__version__"),
        ("sub.b", "a"), ("sub.b", "a")]


def import_cycles(edges) -> list:
    """The import cycles among ``edges`` ((importer, imported) pairs): each a sorted list of
    the modules that import one another round a loop (the strongly connected components
    of more than one module, Tarjan's algorithm)."""
    graph: dict = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle anywhere in mpitrain, inside a package or across two: at module
    level, inside functions and for type checking alike (a cycle hidden in a function
    is still two modules that cannot be read, or changed, one without the other)."""
    cycles = import_cycles(import_edges(REPO / "mpitrain"))
    assert cycles == [], "modules that import one another round a loop: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_scan_finds_every_loop():
    edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("f", "a")]
    assert import_cycles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert import_cycles([("a", "b"), ("b", "c"), ("a", "c")]) == []


MODULE_LINES, CLASS_LINES = 500, 250
REASON = "Why one "  # how a docstring starts the reason it is over the size


def oversized(root: Path) -> list:
    """(what, lines) of every module over MODULE_LINES and class over CLASS_LINES lines
    under ``root`` whose docstring (the module's, or the class's) gives no reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        name = str(path.relative_to(root.parent))
        classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        reasons = [ast.get_docstring(tree) or ""] + [ast.get_docstring(c) or "" for c in classes]
        lines = source.count("\n")
        if lines > MODULE_LINES and not any(REASON in doc for doc in reasons):
            found.append((name, lines))
        for node in classes:
            length = node.end_lineno - node.lineno + 1
            if length > CLASS_LINES and REASON not in (ast.get_docstring(node) or ""):
                found.append((f"{name}:{node.name}", length))
    return found


def test_every_long_module_and_class_says_why():
    """docs/architecture.md's size rule: a module over ~500 lines or a class over ~250 is
    split at a seam, or its docstring says why it is not ("Why one ...")."""
    assert oversized(REPO / "mpitrain") == []


def test_the_size_scan_finds_a_long_class_without_a_reason(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(CLASS_LINES))
    (package / "a.py").write_text(f'class Long:\n    """Long."""\n{body}')
    (package / "b.py").write_text(f'class Long:\n    """{REASON}class: a reason."""\n{body}')
    assert oversized(package) == [("pkg/a.py:Long", CLASS_LINES + 2)]
