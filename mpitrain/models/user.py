"""A user's own model, named ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: what
can be checked before MPI and TensorFlow start (:func:`precheck`), loading it (a file as
a module of its own, a module the way ``python -m`` would), and checking what its
builder returns; every problem is one UsageError naming the spec."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import UsageError
from ..config.model_names import is_file, split
from ..userfiles import not_regular, read_bounded, stat_mode
from .keras_import import import_keras
from .registry import USER_DEFAULTS, USER_SYNTHETIC, ModelSpec


def precheck(spec: str) -> None:
    """What can be checked of a user's spec without running its code (so before MPI
    and TensorFlow start): the function is named; the file exists and parses (syntax
    errors name the line) and defines the function; a module can be found.
    UsageError naming the spec otherwise. Loading and building it is checked later,
    collectively, by every rank (:mod:`mpitrain.run.session`)."""
    target, function = split(spec)
    if not function and is_file(target) and not stat_mode(Path(target).expanduser()):
        # a missing script (``mpitrain launch train.py``) or a model file: either way
        raise UsageError(f"{target}: no such file (give the path of your script, or of "
                         "your model's file as FILE.py:FUNCTION, relative to this "
                         "directory or absolute)")
    if not function or not target:
        raise UsageError(f"model {spec}: name the builder function too, as "
                         f"{target or 'FILE.py'}:{function or 'build'} (FILE.py:FUNCTION or "
                         "module:FUNCTION)")
    if not function.isidentifier():
        raise UsageError(f"model {spec}: {function!r} is not a Python function name")
    if is_file(target):
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


def from_callable(builder: Callable) -> ModelSpec:
    """The spec of a builder function (``mpitrain.fit``'s model), named
    ``SCRIPT.py:FUNCTION`` for a script's function, else ``module:FUNCTION``."""
    module = getattr(builder, "__module__", None) or "model"
    if module == "__main__" and sys.argv and sys.argv[0].endswith(".py"):
        module = str(Path(sys.argv[0]).resolve())
    name = f"{module}:{getattr(builder, '__qualname__', 'build')}"
    source = getattr(getattr(builder, "__code__", None), "co_filename", None)
    return ModelSpec(name, _checked(name, builder, source), f"your model {name}",
                     dict(USER_DEFAULTS), dict(USER_SYNTHETIC), source)


def user_spec(spec: str) -> ModelSpec:
    """The ModelSpec of a user's ``spec``, its module imported (once a process, as
    Python imports any module); UsageError naming the spec for any problem."""
    target, function = split(spec)
    if not function or not target:
        precheck(spec)  # raises: the spec names no function
    module = _import_file(spec, target) if is_file(target) else _import_module(spec, target)
    builder = getattr(module, function, None)
    if builder is None:
        raise UsageError(f"model {spec}: {target} has no function {function!r}; define "
                         f"def {function}(input_shape, num_classes) returning a keras.Model")
    if not callable(builder):
        raise UsageError(f"model {spec}: {function} is an object of type "
                         f"{type(builder).__name__}, not a function; define "
                         f"def {function}(input_shape, num_classes) returning a keras.Model")
    source = getattr(module, "__file__", None)
    return ModelSpec(spec, _checked(spec, builder, source), f"your model {spec}",
                     dict(USER_DEFAULTS), dict(USER_SYNTHETIC), source)


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
    imported = sys.modules.get(name)
    if imported is not None and _same_file(getattr(imported, "__file__", ""), str(path)):
        return imported  # this file, imported by an earlier run of this process
    loader_spec: Any = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its own helper modules, as `python FILE.py` would
    try:
        _run_import(spec, lambda: loader_spec.loader.exec_module(module), source=str(path))
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


def _run_import(spec: str, load, module: str = "", source: Optional[str] = None):
    """``load()``, its errors as one UsageError (except ``module`` itself not found)."""
    import_keras()  # before the user's code imports it, so that it loads the quick way
    try:
        return calling_user_code(spec, "importing it", load, source,
                                 passes=(SyntaxError, ModuleNotFoundError))
    except SyntaxError as e:
        raise UsageError(f"model {spec}: syntax error in {e.filename} line {e.lineno}: "
                         f"{e.msg}") from None
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise
        raise UsageError(f"model {spec}: importing it failed: {e} (install it, or fix the "
                         "import)") from None


def calling_user_code(spec: str, doing: str, call: Callable, source: Optional[str] = None,
                      hint: str = "", passes: tuple = ()):
    """``call()``, which runs the user's code: the one boundary where it is called. Any
    exception it raises, SystemExit included (argparse at import, ``sys.exit`` in a
    builder), becomes one UsageError naming ``spec``, what was being done (``doing``),
    the error and the line of the user's ``source`` file that raised, then ``hint``;
    KeyboardInterrupt goes on (the user's Ctrl-C). What the code prints meanwhile is
    held and printed once it returns; if it fails, only the last line it wrote to
    stderr is kept, in the message (argparse's usage error, say). Exceptions of the
    types in ``passes`` go on too (an import's SyntaxError, for its own message)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = call()
    except (UsageError, *passes):
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code: theirs to see
        raise UsageError(f"model {spec}: {doing} failed ({_what_failed(e, err.getvalue())}"
                         f"{_where(e, source)}){hint}") from None
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    return result


def blame_user_code(spec, error: BaseException) -> Optional[UsageError]:
    """The error to report for ``error``, raised while training ``spec`` (a ModelSpec),
    if the user's code raised it (a frame of its source file is in the traceback: the
    model's own layers, called while TensorFlow traces a step): one line naming the
    spec and the line, local to the rank it happened on. None otherwise (an error of
    mpitrain's, which stays an internal error with its traceback)."""
    source = getattr(spec, "source", None)
    if not source or not isinstance(error, Exception) or not any(
            _same_file(f.filename, source) for f in _frames(error)):
        return None
    return UsageError(f"model {spec.name}: your code failed in training "
                      f"({_what_failed(error, '')}{_where(error, source)})", everywhere=False)


def _checked(spec: str, builder: Callable, source: Optional[str] = None) -> Callable:
    """``builder`` with its result checked: a keras.Model with a (None, classes) output
    whose every trainable weight takes part in it (see :func:`_check_trainable`)."""
    def build(input_shape, num_classes):
        import keras

        model = calling_user_code(
            spec, f"building it for input {tuple(input_shape)} and {num_classes} classes",
            lambda: builder(tuple(input_shape), num_classes), source)
        if not isinstance(model, keras.Model):
            raise UsageError(f"model {spec}: returned {type(model).__name__}, not a "
                             "keras.Model; return keras.Sequential([...]) or "
                             "keras.Model(inputs, outputs)")
        # A real forward pass on 2 blank examples: it builds subclassed models too, and
        # checks what the trainer will see rather than a declared shape.
        import numpy as np

        batch = np.zeros((2,) + tuple(input_shape), np.float32)
        out = calling_user_code(spec, f"calling it on a batch of shape {batch.shape}",
                                lambda: model(batch, training=False), source,
                                f"; its input must be {tuple(input_shape)} per example")
        shape = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
        if not hasattr(out, "shape") or len(out.shape) != 2 or out.shape[1] != num_classes:
            shown = (f"(None, {', '.join(map(str, shape[1:]))})" if isinstance(shape, tuple)
                     else f"a {shape}")
            raise UsageError(f"model {spec}: its output is {shown}; expected (None, "
                             f"{num_classes}): one score per class for {num_classes} classes "
                             f"(end with Dense({num_classes}))")
        _check_trainable(spec, model, batch, source)
        return model
    return build


def _check_trainable(spec: str, model, batch, source: Optional[str]) -> None:
    """UsageError unless ``model`` has trainable weights and its output in training mode
    depends on every one of them: a gradient through one forward and backward pass of
    ``batch`` in training mode, as a step takes it (the model's state is put back
    after it: BatchNorm's statistics, Dropout's generators)."""
    import tensorflow as tf

    if not model.trainable_variables:
        raise UsageError(f"model {spec}: it has no trainable weights, so there is nothing to "
                         "train; build it from layers with weights (end with "
                         "Dense(num_classes))")
    saved = [(v, v.numpy()) for v in model.variables]

    def gradient():
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(tf.cast(model(batch, training=True), tf.float32))
        return tape.gradient(total, model.trainable_variables)
    try:
        grads = calling_user_code(spec, "a training step (training=True) on a batch of "
                                  f"shape {batch.shape}", gradient, source)
    finally:
        for variable, value in saved:
            variable.assign(value)
    unused = [v.path for v, g in zip(model.trainable_variables, grads) if g is None]
    if unused:
        raise UsageError(f"model {spec}: its output does not depend on {len(unused)} of its "
                         f"trainable weights ({', '.join(unused[:3])}"
                         f"{', ...' if len(unused) > 3 else ''}), which nothing would train; "
                         "use those layers in the output, or make them trainable=False")


def _what_failed(error: BaseException, stderr: str) -> str:
    """The error in words: ``ValueError: its first line``, or for a SystemExit the exit
    it asked for and the last line it printed to stderr (argparse's error, say)."""
    if not isinstance(error, SystemExit):
        return f"{type(error).__name__}: {_first_line(error)}"
    printed = [line.strip() for line in stderr.splitlines() if line.strip()]
    return (f"it called sys.exit({error.code!r})"
            + (f" after printing {printed[-1]!r}" if printed else ""))


def _frames(error: BaseException):
    import traceback

    return traceback.extract_tb(error.__traceback__)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _where(error: BaseException, source: Optional[str] = None) -> str:
    """' at FILE line N': the innermost frame of the user's ``source`` file in the
    traceback, else the innermost frame of code that is neither mpitrain's nor an
    installed package's nor Python's own, else the innermost frame."""
    frames = [f for f in _frames(error) if not f.filename.startswith("<")]
    mine = [f for f in frames if source and _same_file(f.filename, source)]
    theirs = [f for f in frames if not _library(f.filename)]
    for found in (mine, theirs, frames):
        if found:
            return f" at {found[-1].filename} line {found[-1].lineno}"
    return ""


def _library(filename: str) -> bool:
    """True for mpitrain's own files, installed packages' and the standard library's."""
    import sysconfig

    path = os.path.abspath(filename)
    roots = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             sysconfig.get_paths()["stdlib"])
    return any(path.startswith(root + os.sep) for root in roots) or \
        "site-packages" in path or "dist-packages" in path


def _first_line(error: BaseException) -> str:
    """The error's message in one line: its first, past Keras' "Exception encountered
    when calling X" heading and TensorFlow's {{function_node ...}} prefix."""
    text = re.sub(r"\x1b\[[0-9;]*m|\{\{function_node [^}]*\}\}\s*", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    while len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        lines.pop(0)
    return lines[0] if lines else ""
