"""The user's model spec (FILE.py:FUNCTION, module:FUNCTION): the checks made before
MPI starts, loading and building with their one-line errors, the CLI (help, config,
--resume, check, sweep), all on real files written into tmp_path (no mocks)."""

import io
import json
import sys
from contextlib import redirect_stdout

import pytest

from mpitrain.cli import commands as cli
from mpitrain import models
from mpitrain.config import Config
from mpitrain.errors import UsageError
from mpitrain.run.resume import resumed_config
from mpitrain.launch.sweep import SweepPoint

CNN = '''
import keras

def build(input_shape, num_classes):
    L = keras.layers
    return keras.Sequential([keras.Input(input_shape), L.Conv2D(4, 3, activation="relu"),
                             L.Flatten(), L.Dense(num_classes)])
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def cnn(tmp_path):
    return write(tmp_path, "my_cnn.py", CNN)


# ---- before MPI: precheck runs none of the user's code --------------------------------
def test_precheck_accepts_a_good_file_and_runs_none_of_it(tmp_path):
    path = write(tmp_path, "boom.py", "raise RuntimeError('imported!')\ndef build(a, b): pass\n")
    models.precheck(f"{path}:build")  # would raise if the file were executed


@pytest.mark.parametrize("text,function,message", [
    (None, "build", r"no such file .*absent.py \(give the path"),
    ("def build(:\n    pass\n", "build", r"syntax error in .*bad.py line 1: "),
    ("x = 1\n\n\nif x:\n  y = (\n", "build", r"syntax error in .*bad.py line 5"),
    ("def other(a, b): pass\n", "build",
     r".*bad.py has no function 'build' \(it defines other\); define def build\(input_sha"),
    ("def build(a, b): pass\n", "", r"name the builder function too, as .*bad.py:build"),
    ("def build(a, b): pass\n", "2x", r"'2x' is not a Python function name"),
])
def test_precheck_errors_name_the_spec(tmp_path, text, function, message):
    path = tmp_path / ("absent.py" if text is None else "bad.py")
    if text is not None:
        path.write_text(text)
    spec = f"{path}:{function}" if function else str(path)
    with pytest.raises(UsageError, match=f"^model {spec}: {message}"):
        models.precheck(spec)


def test_a_missing_file_without_a_function_is_named_missing(tmp_path):
    """``mpitrain launch -np 4 train.py`` without a train.py: not a request for the
    builder function's name."""
    with pytest.raises(UsageError, match=r"^.*absent.py: no such file \(give the path of "
                                         r"your script, or of your model's file"):
        models.precheck(str(tmp_path / "absent.py"))


@pytest.mark.parametrize("text", [
    "from helpers import *\n",                       # may bind anything
    "build = lambda shape, classes: None\n",          # assigned, not def
    "from keras.applications import MobileNet as build\n",
    "if True:\n    def build(a, b): pass\n",          # nested in a statement
    "def __getattr__(name): return None\n",          # module __getattr__
])
def test_precheck_does_not_reject_names_bound_other_ways(tmp_path, text):
    models.precheck(f"{write(tmp_path, 'odd.py', text)}:build")


def test_precheck_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "netdefs.py", "def other(a, b): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match="no module named 'no_such_mod_q7'"):
        models.precheck("no_such_mod_q7.sub:build")
    with pytest.raises(UsageError, match="netdefs.py has no function 'build'"):
        models.precheck("netdefs:build")
    with pytest.raises(UsageError, match="neither a .py file nor a module name"):
        models.precheck("not-a-module:build")
    models.precheck("netdefs:other")
    models.precheck("json.decoder:JSONDecoder")  # a package's submodule: found


def test_bare_file_is_a_spec_that_asks_for_the_function(cnn):
    assert models.is_spec(str(cnn)) and models.is_spec("./m.py:build")
    assert not models.is_spec("lenet") and not models.is_spec("--async")
    with pytest.raises(UsageError, match="name the builder function too"):
        models.get(str(cnn))


# ---- loading and building ----------------------------------------------------------------
def test_import_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "crash.py", "import os\n\nvalue = 1 / 0\n")
    with pytest.raises(UsageError, match=r"importing it failed \(ZeroDivisionError: "
                                         r"division by zero at .*crash.py line 3\)"):
        models.get(f"{path}:build")
    assert not any(name.endswith("_crash") for name in sys.modules)  # not half-registered


def test_user_file_imports_its_own_helpers(tmp_path):
    write(tmp_path, "layers_helper_q7.py", "UNITS = 5\n")
    path = write(tmp_path, "uses_helper.py", CNN.replace(
        "import keras", "import keras\nfrom layers_helper_q7 import UNITS"))
    assert models.get(f"{path}:build").build((8, 8, 1), 3).output_shape == (None, 3)


def test_subclassed_model_is_built_by_the_check(tmp_path):
    path = write(tmp_path, "sub.py", '''
import keras

class Net(keras.Model):
    def __init__(self, classes):
        super().__init__()
        self.flat = keras.layers.Flatten()
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        return self.out(self.flat(x))

def build(input_shape, num_classes):
    return Net(num_classes)
''')
    model = models.get(f"{path}:build").build((6, 6, 1), 4)
    assert sum(int(v.shape.num_elements() if hasattr(v.shape, "num_elements") else
                   __import__("numpy").prod(v.shape)) for v in model.trainable_variables) \
        == 36 * 4 + 4


@pytest.mark.parametrize("body,message", [
    ("return keras.Model(i, [keras.layers.Dense(c)(keras.layers.Flatten()(i))] * 2)",
     r"its output is a list; expected \(None, 10\)"),
    ("return keras.Sequential([keras.Input((5,)), keras.layers.Dense(c)])",
     r"calling it on a batch of shape \(2, 28, 28, 1\) failed \(.*\); its input must be "
     r"\(28, 28, 1\) per example"),
    ("return keras.Model(i, keras.layers.Dense(c)(i))",
     r"its output is \(None, 28, 28, 10\); expected \(None, 10\).*Dense\(10\)"),
])
def test_build_errors_are_one_line(tmp_path, body, message):
    path = write(tmp_path, "shapes.py", "import keras\n\ndef build(s, c):\n"
                 "    i = keras.Input(s)\n    " + body + "\n")
    with pytest.raises(UsageError, match=message) as raised:
        models.get(f"{path}:build").build((28, 28, 1), 10)
    assert "\n" not in str(raised.value)


def test_builder_error_keeps_only_its_first_line(tmp_path):
    path = write(tmp_path, "raises.py", "def build(s, c):\n    raise ValueError('bad\\nworse')\n")
    with pytest.raises(UsageError, match=r"failed \(ValueError: bad at .*raises.py line 2\)$"):
        models.get(f"{path}:build").build((4,), 2)


def test_softmax_needs_outputs_probabilities(tmp_path):
    from mpitrain.models.replica import Replica

    path = write(tmp_path, "soft.py", CNN.replace("L.Dense(num_classes)",
                                                  "L.Dense(num_classes, activation='softmax')"))
    spec = models.get(f"{path}:build")
    with pytest.raises(UsageError, match="ends in a softmax: pass --outputs probabilities"):
        Replica(spec, (8, 8, 1), 3, "adam", 0.001)
    replica = Replica(spec, (8, 8, 1), 3, "adam", 0.001, from_logits=False)
    assert replica.n_params == 4 * 9 + 4 + 6 * 6 * 4 * 3 + 3


# ---- the command line ------------------------------------------------------------------
def test_help_of_a_spec_lists_every_training_option(cnn):
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser(f"{cnn}:build").parse_args([f"{cnn}:build", "--help"])
    text = out.getvalue()
    for option in ("--async", "--epochs", "--batch-size", "--outputs {logits,probabilities}",
                   "--resume RUN_DIR", "--steps N"):
        assert option in text
    assert "default for" in text and "adam" in text


def test_parse_config_records_both_forms_and_user_defaults(cnn, monkeypatch):
    monkeypatch.chdir(cnn.parent)
    cfg = cli.parse_config(["./my_cnn.py:build", "--async", "--steps", "3"], world_size=3)
    assert cfg.model == f"{cnn}:build" and cfg.model_given == "./my_cnn.py:build"
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.batch_size, cfg.epochs,
            cfg.optimizer.schedule, cfg.data.dataset, cfg.outputs) == (
        "adam", 0.001, 64, 5, "constant", "auto", "logits")
    assert {k: cfg.setting(k) for k in models.USER_DEFAULTS} == models.USER_DEFAULTS
    assert cli.parse_config(["./my_cnn.py:build", "--lr", "0.01"]).optimizer.lr == 0.01
    assert cli.parse_config(["lr"], world_size=1).model_given is None


def test_parse_config_imports_nothing(tmp_path):
    path = write(tmp_path, "boom.py", "raise RuntimeError('imported!')\ndef build(a, b): pass\n")
    assert cli.parse_config([f"{path}:build"], world_size=2).model == f"{path}:build"


def test_main_prints_one_line_and_exits_2(tmp_path, capsys):
    assert cli.main([f"{tmp_path}/nope.py:build", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mpitrain: error: model {tmp_path}/nope.py:build: no such file")


def test_run_directory_name_is_safe(cnn):
    assert models.run_name(f"{cnn}:build") == "my_cnn-build"
    assert models.run_name("my.pkg.nets:make_net") == "my.pkg.nets-make_net"
    assert models.run_name("./we ird/m&m.py:build") == "m_m-build"
    assert SweepPoint(f"{cnn}:build", "sync", 3, 1).key == "my_cnn-build-sync-np3-bsdefault-e1"


def test_check_options_may_follow_the_model(cnn):
    args = cli.parse_args(["check", f"{cnn}:build", "--no-launch", "-np", "3", "--async",
                           "--lr", "-0.5", "--hostfile", "h", "--epochs", "2"])
    assert args.training == [f"{cnn}:build", "--async", "--lr", "-0.5", "--epochs", "2"]
    assert (args.no_launch, args.np, args.hostfile) == (True, 3, "h")
    before = cli.parse_args(["check", "-np", "2", "--oversubscribe", "lr", "--async"])
    assert before.training == ["lr", "--async"] and (before.np, before.oversubscribe) == (2, True)
    with pytest.raises(UsageError, match="unrecognized arguments: --bogus"):
        cli.parse_args(["lr", "--bogus"])  # a training command knows all of its options


# ---- --resume: the saved, absolute spec is what loads -------------------------------------
def test_resume_from_another_directory_matches_by_file_and_function(cnn, tmp_path,
                                                                    monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = Config.of(model=f"{cnn}:build", model_given="./my_cnn.py:build", world_size=2,
                   optimizer="adam", lr=0.001, batch_size=64, epochs=1)
    (run_dir / "config.json").write_text(json.dumps({"config": saved.to_dict()}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # ./my_cnn.py does not exist here
    cfg = cli.parse_config(["./my_cnn.py:build", "--resume", str(run_dir), "--epochs", "3"])
    resumed, rescale = resumed_config(cfg, {"epochs", "resume"}, 2)
    assert rescale is None
    assert (resumed.model, resumed.model_given, resumed.epochs) == (
        f"{cnn}:build", "./my_cnn.py:build", 3)
    other = cli.parse_config(["./other.py:build", "--resume", str(run_dir)])
    with pytest.raises(UsageError, match=f"that run trained {cnn}:build, not "):
        resumed_config(other, {"resume"}, 2)
    with pytest.raises(UsageError, match="that run trained"):
        resumed_config(cli.parse_config(["lr", "--resume", str(run_dir)]), {"resume"}, 2)
