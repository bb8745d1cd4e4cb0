"""Import TensorFlow and Keras the quick way: once per process, on every rank.

Every rank of every launch imports them, and the import is most of a short run's
CPU time (measured in docs/benchmarks.md, "Start-up"). Three things make it
cheaper, neither changing what a model or a training step can use:

* Packages Keras imports at start-up for features mpitrain never uses (its
  scikit-learn wrappers, its image-gallery plot) are hidden while it loads;
  Keras leaves those features unavailable, as it does when they are not
  installed. They stay importable afterwards (the digits dataset uses
  scikit-learn, the plots matplotlib).
* TensorFlow's generated op modules declare their type variables with strings
  (``TypeVar("TV_Abs_T", "_atypes.BFloat16", ...)``): thousands of forward references
  to about a hundred distinct names, each compiled on its own by ``typing``. While
  TensorFlow loads, each distinct string is compiled once.
* TensorFlow's and Keras' public API packages (``tensorflow._api.v2.*``, the
  ``keras.*`` packages outside ``keras.src``) are generated files that only
  re-export names from the modules that implement them. They load lazily: a name
  is bound, and what implements it imported, on its first use (``tf.data.Dataset``,
  ``keras.layers.Dense``); a package that does more than import (``tf.compat``'s)
  runs whole at its first use. The implementing modules that TensorFlow itself and
  Keras need still load at once, through their own imports.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
import typing

#: imported by Keras 3 at start-up for features mpitrain never uses
KERAS_OPTIONAL_IMPORTS = ("sklearn", "matplotlib")


#: what TensorFlow writes to stderr at import whatever TF_CPP_MIN_LOG_LEVEL says
#: (tensorflow/tensorflow#100442): dropped unless that level lets INFO through
IMPORT_NOTICES = (b"oneDNN custom operations are on",
                  b"WARNING: All log messages before absl::InitializeLog() is called")


def import_keras():
    """Import TensorFlow and Keras (once per process) and return keras.

    A first import of TensorFlow here loads it with ``TF_CPP_MIN_LOG_LEVEL=2`` and
    the oneDNN default that importing mpitrain set (``mpitrain/__init__.py``; a value
    the user set wins; TensorFlow reads both when it loads, so a process that
    imported it before keeps its own settings), and without :data:`IMPORT_NOTICES`."""
    if "keras" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        quiet = os.environ["TF_CPP_MIN_LOG_LEVEL"] not in ("", "0")
        notices = IMPORT_NOTICES if quiet and "tensorflow" not in sys.modules else ()
        _lazy_api_packages()
        with _hidden(KERAS_OPTIONAL_IMPORTS), _stderr_without(notices), \
                _forward_references_compiled_once():
            import tensorflow  # noqa: F401
            import keras  # noqa: F401
    return sys.modules["keras"]


def import_tensorflow():
    """Import TensorFlow as :func:`import_keras` does (once per process) and return it."""
    import_keras()
    return sys.modules["tensorflow"]


def onednn_enabled():
    """Whether this process's TensorFlow runs oneDNN's kernels (None if it cannot tell)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def onednn_hint(facts) -> str:
    """A note for ranks whose TensorFlow runs without oneDNN's kernels though the user did
    not turn them off ('' if none): their TensorFlow was imported before mpitrain.
    ``facts`` are the ranks' :func:`mpitrain.run.metadata.rank_facts`, in rank order."""
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").lower() in ("0", "false"):
        return ""
    off = [rank for rank, f in enumerate(facts) if f.get("onednn") is False]
    if not off:
        return ""
    return (f"TensorFlow runs without oneDNN's kernels on rank(s) {', '.join(map(str, off))}: "
            "it was imported before mpitrain; import mpitrain first, or set "
            "TF_ENABLE_ONEDNN_OPTS=1 (convolutional models train several times faster "
            "with them)")


@contextlib.contextmanager
def _stderr_without(notices):
    """Inside the block, lines written to file descriptor 2 (by C++ too) that contain one
    of ``notices`` are dropped; every other line is passed on as it comes, so a crash's
    last words still reach the terminal."""
    try:
        terminal = os.dup(2) if notices else None
    except OSError:  # no stderr to filter (a daemon's closed descriptor)
        terminal = None
    if terminal is None:
        yield
        return
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pass_on():
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not any(notice in line for notice in notices):
                    os.write(terminal, line)

    forwarder = threading.Thread(target=pass_on, name="stderr-filter", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # closes the pipe's last write end: the forwarder sees EOF
        forwarder.join()
        os.close(terminal)


def is_api_package(name: str) -> bool:
    """True for a generated TensorFlow or Keras API package (re-exports only)."""
    return name.startswith("tensorflow._api.v2.") or (
        name.startswith("keras.") and not name.startswith("keras.src"))


def loads_lazily(name: str, tensorflow_dirs) -> bool:
    """True for an API package that may load lazily. Not ``tf.distribute``, ``tf.lite``
    and what is inside them: a real package of TensorFlow has their name
    (``tensorflow/lite``). Their modules import from it by that name (``import
    tensorflow.distribute.experimental.rpc.kernels...``), which works only while
    ``import tensorflow`` runs, before it binds ``tf.distribute`` to the API."""
    top = name.split(".")[3] if name.startswith("tensorflow._api.v2.") else ""
    return is_api_package(name) and not (
        top and any(os.path.isdir(os.path.join(d, top)) for d in tensorflow_dirs))


class _LazyApiFinder(importlib.abc.MetaPathFinder):
    """Finds API packages as the path finder would, with a lazy loader."""

    def find_spec(self, name, path, target=None):
        if not is_api_package(name):  # first: it stays asked first about every import
            return None
        tensorflow = getattr(sys.modules.get("tensorflow"), "__file__", None)
        if not loads_lazily(name, [os.path.dirname(tensorflow)] if tensorflow else []):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LazyLoader(spec.loader)
        return spec


class _LazyLoader(importlib.abc.Loader):
    """Creates the module empty; it runs on the first use of a name it lacks.

    Unlike :class:`importlib.util.LazyLoader`, the module may replace itself in
    sys.modules while it runs (TF 1's modules in ``tf.compat.v1`` put a deprecation
    wrapper there; the wrapped module is this one)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__class__ = _LazyModule  # its __spec__, __path__... are set already


#: One module runs at a time (a module that runs may use another lazy one: reentrant).
_RUNNING = threading.RLock()


class _LazyModule(types.ModuleType):
    def __dir__(self):
        """Its names bound or not yet bound (``vars()`` holds only the bound ones)."""
        with _RUNNING:  # (a module that ran whole is a plain module: no longer here)
            return sorted(set(self.__dict__) | set(_reexports(self)))

    def __getattr__(self, name):
        with _RUNNING:
            if type(self) is _LazyModule and name not in self.__dict__:  # not bound yet
                binding = _reexports(self).get(name)  # (another thread may have bound it)
                if binding is not None:
                    binding(self.__dict__)
                else:  # a name it lacks after running: AttributeError
                    self.__class__ = types.ModuleType
                    self.__spec__.loader.loader.exec_module(self)
        return getattr(self, name)


def _reexports(module) -> dict:
    """{name: a function that binds it in a namespace} when the module's source is nothing but
    imports (every generated API package outside ``tf.compat``); else {}, and the module
    runs whole. Binding one name at a time imports only what is used: ``tf.nn`` also
    re-exports TF 1's RNN cell wrappers, and running it whole loads all of the legacy
    ``tf.keras`` (a noticeable share of a rank's start-up: docs/architecture.md,
    "Importing TensorFlow the quick way")."""
    spec = module.__spec__
    plan = getattr(spec, "_mpitrain_reexports", None)
    if plan is None:
        plan = spec._mpitrain_reexports = _plan(spec)
    return plan


def _plan(spec) -> dict:
    try:
        tree = ast.parse(spec.loader.loader.get_source(spec.name) or "")
    except (ImportError, OSError, SyntaxError):
        return {}
    plan = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", None):
            return {}
        for alias in node.names:
            if alias.name == "*":
                return {}
            bound = alias.asname or alias.name.split(".")[0]
            if isinstance(node, ast.ImportFrom) and node.module == spec.name:
                plan[bound] = _submodule(f"{spec.name}.{alias.name}", bound)
            else:
                statement = (ast.ImportFrom(module=node.module, names=[alias], level=0)
                             if isinstance(node, ast.ImportFrom) else ast.Import(names=[alias]))
                plan[bound] = _statement(statement, spec.origin or spec.name)
    return plan


def _statement(node, filename):
    code = compile(ast.fix_missing_locations(ast.Module([node], [])), filename, "exec")
    return lambda namespace: exec(code, namespace)


def _submodule(name, bound):
    """``from package import sub`` inside the package itself: the import machinery
    would ask the package for ``sub`` first, and that is the name being bound."""
    def bind(namespace):
        namespace[bound] = importlib.import_module(name)
    return bind


def _lazy_api_packages() -> None:
    """API packages load lazily from now on in this process, also those a lazy package
    imports when it runs (``tf.__internal__.distribute`` runs on a worker's first
    update; its ``combinations``, a test helper, stays unloaded)."""
    if not any(isinstance(f, _LazyApiFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyApiFinder())


@contextlib.contextmanager
def _forward_references_compiled_once():
    """Inside the block, ``typing.ForwardRef(text)`` compiles each distinct ``text`` once.
    The cache is a ``compile`` in the typing module's globals, which ``ForwardRef``
    finds before the builtin; it goes after the block. Sharing is safe: a code object
    is immutable, and a string that does not compile raises as before (not cached)."""
    if "compile" in vars(typing):  # someone else's: leave it alone
        yield
        return
    typing.compile = functools.lru_cache(maxsize=None)(compile)
    try:
        yield
    finally:
        del typing.compile


@contextlib.contextmanager
def _hidden(names):
    """``import NAME`` raises ImportError inside the block for each of ``names`` not yet
    imported (Keras handles that as 'not installed'); importable again afterwards."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            del sys.modules[name]
