"""A user's own model, named ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: what
can be checked before MPI and TensorFlow start (:func:`precheck`), loading it (a file as
a module of its own, a module the way ``python -m`` would), and checking what its
builder returns; every problem is one UsageError naming the spec."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import stat
import sys
from pathlib import Path
from typing import Callable, Dict

from ..errors import UsageError
from ..userfiles import not_regular, read_bounded, stat_mode
from .keras_import import import_keras
from .registry import USER_DEFAULTS, ModelSpec


def is_spec(name: str) -> bool:
    """True for ``FILE.py:FUNCTION`` / ``module:FUNCTION`` (a user's model), not a name.

    A bare ``FILE.py`` or path counts too, so that it gets the error saying to add
    ``:FUNCTION`` rather than "invalid choice"."""
    return (":" in name or name.endswith(".py") or "/" in name) and not name.startswith("-")


def _split(spec: str):
    """(target, function) of a spec; function is '' when the spec names none."""
    target, colon, function = spec.rpartition(":")
    return (target, function) if colon else (spec, "")


def precheck(spec: str) -> None:
    """What can be checked of a user's spec without running its code (so before MPI
    and TensorFlow start): the function is named; the file exists and parses (syntax
    errors name the line) and defines the function; a module can be found.
    UsageError naming the spec otherwise. Loading and building it is checked later,
    collectively, by every rank (:mod:`mpitrain.session`)."""
    target, function = _split(spec)
    if not function or not target:
        raise UsageError(f"model {spec}: name the builder function too, as "
                         f"{target or 'FILE.py'}:{function or 'build'} (FILE.py:FUNCTION or "
                         "module:FUNCTION)")
    if not function.isidentifier():
        raise UsageError(f"model {spec}: {function!r} is not a Python function name")
    if _is_file(target):
        path = _model_file(spec, target)
        _precheck_source(spec, path, function)
        return
    if not all(part.isidentifier() for part in target.split(".")):
        raise UsageError(f"model {spec}: {target!r} is neither a .py file nor a module name")
    top = target.split(".")[0]
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does
    found = importlib.util.find_spec(top)
    if found is None:
        raise UsageError(f"model {spec}: no module named {top!r} (run from the directory "
                         "that holds it, install it, or give the file as FILE.py:FUNCTION)")
    if "." not in target and found.origin and found.origin.endswith(".py"):
        _precheck_source(spec, Path(found.origin), function)


def _precheck_source(spec: str, path: Path, function: str) -> None:
    import ast

    try:
        tree = ast.parse(read_bounded(path, error=lambda m: UsageError(f"model {spec}: {m}")),
                         str(path))
    except SyntaxError as e:
        raise UsageError(f"model {spec}: syntax error in {e.filename} line {e.lineno}: "
                         f"{e.msg}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"model {spec}: cannot read {path} ({e})") from None
    bound, dynamic = set(), False
    for node in tree.body:  # top-level names only; a star import or __getattr__ may add any
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                dynamic |= alias.name == "*"
                bound.add((alias.asname or alias.name).split(".")[0])
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    bound.add(sub.id)
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    bound.add(sub.name)
    if function not in bound and not dynamic and "__getattr__" not in bound:
        defined = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
        raise UsageError(f"model {spec}: {path} has no function {function!r} (it defines "
                         f"{', '.join(defined) or 'no functions'}); define "
                         f"def {function}(input_shape, num_classes) returning a keras.Model")


def same_model(given: str, saved: str) -> bool:
    """Whether ``given`` (a resumed run's command line) names the run's ``saved`` model:
    equal names, or user specs of the same file name and function (the saved, absolute
    path is what is loaded, so resuming from another directory works)."""
    if given == saved or not (is_spec(given) and is_spec(saved)):
        return given == saved
    return run_name(given) == run_name(saved)


def canonical(name: str) -> str:
    """A spec with its file made absolute (a resumed run finds it from anywhere)."""
    if not is_spec(name):
        return name
    target, function = _split(name)
    if _is_file(target):
        target = str(Path(target).expanduser().resolve())
    return f"{target}:{function}" if function else target


def run_name(name: str) -> str:
    """A file-name-safe label for run directories: ``lr``, ``my_model-build``."""
    if not is_spec(name):
        return name
    target, function = _split(name)
    stem = Path(target).stem if _is_file(target) else target
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{stem}-{function}" if function else stem)


def _is_file(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


_LOADED: Dict[str, ModelSpec] = {}


def from_callable(builder: Callable) -> str:
    """Make a builder function (``mpitrain.fit``'s model) loadable by :func:`get` in
    this process; returns its name, ``SCRIPT.py:FUNCTION`` for a script's function."""
    module = getattr(builder, "__module__", None) or "model"
    if module == "__main__" and sys.argv and sys.argv[0].endswith(".py"):
        module = str(Path(sys.argv[0]).resolve())
    name = f"{module}:{getattr(builder, '__qualname__', 'build')}"
    _LOADED[name] = ModelSpec(name, _checked(name, builder), f"your model {name}",
                              dict(USER_DEFAULTS))
    return name


def user_spec(spec: str) -> ModelSpec:
    if spec not in _LOADED:
        target, function = _split(spec)
        if not function or not target:
            precheck(spec)  # raises: the spec names no function
        module = _import_file(spec, target) if _is_file(target) else _import_module(spec, target)
        builder = getattr(module, function, None)
        if builder is None:
            raise UsageError(f"model {spec}: {target} has no function {function!r}; define "
                             f"def {function}(input_shape, num_classes) returning a keras.Model")
        if not callable(builder):
            raise UsageError(f"model {spec}: {function} is an object of type "
                             f"{type(builder).__name__}, not a function; define "
                             f"def {function}(input_shape, num_classes) returning a keras.Model")
        _LOADED[spec] = ModelSpec(spec, _checked(spec, builder), f"your model {spec}",
                                  dict(USER_DEFAULTS))
    return _LOADED[spec]


def _model_file(spec: str, target: str) -> Path:
    """The path of a spec's file; UsageError if it is missing or no regular file."""
    path = Path(target).expanduser()
    mode = stat_mode(path)
    if not mode:
        raise UsageError(f"model {spec}: no such file {path} (give the path of your "
                         "model's .py file, relative to this directory or absolute)")
    if not stat.S_ISREG(mode):
        raise UsageError(f"model {spec}: {not_regular(path, mode)}")
    return path


def _import_file(spec: str, target: str):
    path = _model_file(spec, target)
    name = f"mpitrain_user_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its own helper modules, as `python FILE.py` would
    try:
        _run_import(spec, lambda: loader_spec.loader.exec_module(module))
    except UsageError:
        del sys.modules[name]
        raise
    return module


def _import_module(spec: str, target: str):
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does
    try:
        return _run_import(spec, lambda: importlib.import_module(target), target)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        raise UsageError(f"model {spec}: no module named {e.name!r} (run from the directory "
                         "that holds it, or install it)") from None


def _run_import(spec: str, load, module: str = ""):
    """``load()``, its errors as one UsageError (except ``module`` itself not found)."""
    import_keras()  # before the user's code imports it, so that it loads the quick way
    try:
        return load()
    except SyntaxError as e:
        raise UsageError(f"model {spec}: syntax error in {e.filename} line {e.lineno}: "
                         f"{e.msg}") from None
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise
        raise UsageError(f"model {spec}: importing it failed: {e} (install it, or fix the "
                         "import)") from None
    except Exception as e:  # noqa: BLE001 - the user's code: any error is theirs to see
        raise UsageError(f"model {spec}: importing it failed ({type(e).__name__}: "
                         f"{_first_line(e)}{_where(e)})") from None


def _checked(spec: str, builder: Callable) -> Callable:
    """``builder`` with its result checked: a keras.Model with a (None, classes) output."""
    def build(input_shape, num_classes):
        import keras

        try:
            model = builder(tuple(input_shape), num_classes)
        except Exception as e:  # noqa: BLE001 - the user's code
            raise UsageError(f"model {spec}: building it for input {tuple(input_shape)} and "
                             f"{num_classes} classes failed ({type(e).__name__}: "
                             f"{_first_line(e)})") from None
        if not isinstance(model, keras.Model):
            raise UsageError(f"model {spec}: returned {type(model).__name__}, not a "
                             "keras.Model; return keras.Sequential([...]) or "
                             "keras.Model(inputs, outputs)")
        # A real forward pass on 2 blank examples: it builds subclassed models too, and
        # checks what the trainer will see rather than a declared shape.
        import numpy as np

        batch = np.zeros((2,) + tuple(input_shape), np.float32)
        try:
            out = model(batch, training=False)
        except Exception as e:  # noqa: BLE001 - the user's code
            raise UsageError(f"model {spec}: calling it on a batch of shape {batch.shape} "
                             f"failed ({type(e).__name__}: {_first_line(e)}); its input must "
                             f"be {tuple(input_shape)} per example") from None
        shape = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
        if not hasattr(out, "shape") or len(out.shape) != 2 or out.shape[1] != num_classes:
            shown = (f"(None, {', '.join(map(str, shape[1:]))})" if isinstance(shape, tuple)
                     else f"a {shape}")
            raise UsageError(f"model {spec}: its output is {shown}; expected (None, "
                             f"{num_classes}): one score per class for {num_classes} classes "
                             f"(end with Dense({num_classes}))")
        return model
    return build


def _where(error: BaseException) -> str:
    """' at FILE line N': the innermost frame of the user's code that raised."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename != __file__ and not f.filename.startswith("<")]
    return f" at {frames[-1].filename} line {frames[-1].lineno}" if frames else ""


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""
