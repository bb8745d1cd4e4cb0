"""The bad-input tier: hostile but realistic input, in-process, many cases per second.

Every case must end in one ``mpitrain: error:`` line (a :class:`MpitrainError` whose
message is one line) and its exit code: 2 for usage errors, 1 for bad data, never a
traceback, a hang or a silent success. Properties (hypothesis) cover the classes of
bug behind issue #39's defects: numbers checked in one place whatever gives them (the
command line, ``mpitrain.fit``, a resumed run's edited config.json). The cases that
need ranks run under real mpirun in tests/e2e/test_bad_input_mpirun.py.
"""

import json
import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import fill, read_rows, write_cifar, write_image_folder
from mpitrain import api, data, models, userfiles
from mpitrain.cli import commands as cli
from mpitrain.data import decoding, memory, sources
from mpitrain.config import SETTINGS as ALL_SETTINGS, Config
from mpitrain.errors import EXIT_CANNOT_WRITE, DataError, ResultsError, UsageError, WriteError
from mpitrain.run.checkpoint import Checkpoint
from mpitrain.run.resume import resumed_config
from mpitrain.results.run_dir import CsvLog, RunResults
from unit.test_data import write_mnist

NUMERIC = [s for s in ALL_SETTINGS.values() if s.number]
#: anything a hostile user, a script or a hand-edited JSON file could put in a setting
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(),
                                                         max_size=1))
SETTINGS = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def one_line(error: Exception) -> str:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text
    return text


# ---- numbers: one check for every source -------------------------------------------------
@SETTINGS
@given(setting=st.sampled_from(NUMERIC), value=ANY_VALUE)
def test_a_numeric_setting_is_finite_in_range_and_whole_where_integral(setting, value):
    number = setting.number
    try:
        checked = Config.of(**{setting.key: value}).checked().setting(setting.key)
    except UsageError as e:
        assert one_line(e).startswith(f"{setting.label} must be ") and "(got " in str(e)
        return
    words = setting.field.metadata["accepts"]  # (--staleness: auto, none; None is none)
    if value is None and (setting.default is None or "none" in words) or \
            isinstance(value, str) and value in words:
        assert checked == value
        return
    assert type(checked) is (int if number.integral else float)
    assert math.isfinite(checked) and checked == value
    assert checked == number.off or number.low <= checked <= number.high


@SETTINGS
@given(setting=st.sampled_from([s for s in NUMERIC if s.flag]),
       value=st.one_of(st.floats(), st.integers(min_value=-2**40, max_value=2**40),
                       st.sampled_from(["inf", "-inf", "nan", "1e400", "0x10", "", "-0"])))
def test_the_command_line_refuses_what_the_config_refuses(setting, value):
    argv = ["lr", setting.flag, str(value)]
    if setting.key == "staleness":
        argv.append("--async")
    try:
        cli.parse_config(argv, world_size=3)
    except UsageError as e:
        assert one_line(e).startswith(setting.flag) or "argument" in str(e)


@pytest.mark.parametrize("argv,line", [  # issue #39, items 6 and 7, and their neighbours
    (["--seed", "-1"], "--seed must be 0 or a positive integer (got -1)"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, at most "
                           "1,000,000 (got inf)"),
    (["--start-timeout", "inf"], "--start-timeout must be a number of seconds of at least 1, "
                                 "at most 1,000,000 (got inf)"),
    (["--start-timeout", "0.001"], "--start-timeout must be a number of seconds of at least "
                                   "1, at most 1,000,000 (got 0.001)"),  # issue 53, item 7
    (["--sample-interval", "inf"], "--sample-interval must be 0 (off) or a number of seconds "
                                   "of at least 0.01, at most 1,000,000 (got inf)"),
    (["--liveness-floor", "nan"], "--liveness-floor must be a positive number of seconds, at "
                                  "most 1,000,000 (got nan)"),
    (["--lr=-inf"], "--lr must be a positive number (got -inf)"),
    (["--lr", "1e400"], "--lr must be a positive number (got inf)"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a positive number (got nan)"),
    (["--epochs", "3000000000"], "--epochs must be a positive integer, at most 2,147,483,647 "
                                 "(got 3000000000)"),
    (["--threads", "100000"], "--threads must be 0 (auto) or a positive integer, at most "
                              "4,096 (got 100000)"),
    (["--image-size", "7"], "--image-size must be an integer of at least 8 (got 7)"),
])
def test_bad_numbers_on_the_command_line_are_usage_errors(argv, line, capsys):
    assert cli.main(["lr", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"mpitrain: error: {line}"]


@pytest.mark.parametrize("options,message", [
    (dict(epochs="5"), "fit(epochs=...) must be a positive integer (got '5')"),
    (dict(epochs=2.5), "fit(epochs=...) must be a positive integer (got 2.5)"),
    (dict(timeout=float("inf")), "fit(timeout=...) must be a positive number of seconds"),
    (dict(seed=-3), "fit(seed=...) must be 0 or a positive integer (got -3)"),
    (dict(quiet="yes"), "fit(quiet=...) is a switch: true or false (got 'yes')"),
    (dict(optimizer="rmsprop"), "fit(optimizer=...) must be one of sgd, momentum, nesterov, adam"),
    (dict(results_dir=3), "fit(results_dir=...) must be a non-empty path or name (got 3)"),
])
def test_fit_checks_its_options_as_the_command_line_does(options, message):
    x, y = [[0.0, 1.0]] * 4, [0, 1, 0, 1]
    with pytest.raises(UsageError) as error:
        api._config("lr", (x, y), (x, y), "sync", None, options)
    assert one_line(error.value).startswith(message)


def test_fit_takes_numpy_and_whole_numbers_as_plain_ones():
    x, y = [[0.0, 1.0]] * 4, [0, 1, 0, 1]
    cfg, *_ = api._config("lr", (x, y), (x, y), "sync", None,
                          dict(epochs=np.int64(3), batch_size=2.0, lr=np.float32(0.5)))
    assert (cfg.epochs, cfg.batch_size, cfg.optimizer.lr) == (3, 2, 0.5)
    assert (type(cfg.epochs), type(cfg.batch_size), type(cfg.optimizer.lr)) == (int, int, float)


# ---- a resumed run's config.json, edited --------------------------------------------------
def saved_run(tmp_path, **edits):
    """A run directory whose config.json holds a resolved LR config with ``edits``."""
    saved = cli.parse_config(["lr"], world_size=3).to_dict()
    saved.update(edits)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({"config": saved}))
    return run


@pytest.mark.parametrize("edits,message", [  # issue #39, item 10
    (dict(epochs="many"), "epochs in {run}/config.json must be a positive integer (got "
                          "'many'); fix the file or start a new run"),
    (dict(epochs=None), "epochs in {run}/config.json must be a positive integer (got None)"),
    (dict(batch_size=-4), "batch_size in {run}/config.json must be a positive integer"),
    (dict(lr=float("nan")), "lr in {run}/config.json must be a positive number"),
    (dict(world_size="3"), "world_size in {run}/config.json must be a positive integer"),
    (dict(async_mode="no"), "async_mode in {run}/config.json is a switch"),
    (dict(optimizer=7),
     "optimizer in {run}/config.json must be one of sgd, momentum, nesterov, adam"),
    (dict(results_dir=None), "results_dir in {run}/config.json must be a non-empty path"),
])
def test_a_resumed_config_is_checked_as_strictly_as_a_typed_one(tmp_path, edits, message):
    run = saved_run(tmp_path, **edits)
    with pytest.raises(UsageError) as error:
        resumed_config(Config.of(model="lr", resume=str(run)), {"resume"}, 3)
    assert one_line(error.value).startswith(f"--resume {run}: " + message.format(run=run))


def test_a_resumed_config_may_be_fixed_from_the_command_line(tmp_path):
    run = saved_run(tmp_path, epochs="many")
    cfg, _ = resumed_config(Config.of(model="lr", resume=str(run), epochs=40),
                            {"resume", "epochs"}, 3)
    assert cfg.epochs == 40


@SETTINGS
@given(key=st.sampled_from(list(ALL_SETTINGS)),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                       st.floats(allow_nan=False), st.text(max_size=6)))
def test_any_edit_of_a_resumed_config_resumes_or_is_one_line(tmp_path, key, value):
    run = saved_run(tmp_path, **{key: value})
    try:
        resumed_config(Config.of(model="lr", resume=str(run)), {"resume"}, 3)
    except UsageError as e:
        assert one_line(e).startswith(f"--resume {run}: ")


# ---- files: regular files only, never a blocking read --------------------------------------
def fifo(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _fifo_in_a_class_folder(tmp_path):  # issue #39, item 1
    write_image_folder(tmp_path / "images", n=40, classes=2)
    return lambda: data.read_user_data(str(tmp_path / "images")), \
        fifo(tmp_path / "images" / "c1" / "pipe.png")


def _fifo_as_npz(tmp_path):
    return lambda: data.read_user_data(str(tmp_path / "x.npz")), fifo(tmp_path / "x.npz")


def _device_as_npz(tmp_path):
    (tmp_path / "zero.npz").symlink_to("/dev/zero")
    return lambda: data.read_user_data(str(tmp_path / "zero.npz")), tmp_path / "zero.npz"


def _fifo_as_idx(tmp_path):
    mnist = write_mnist(tmp_path / "mnist")
    victim = mnist / "train-labels-idx1-ubyte.gz"
    victim.unlink()
    return lambda: sources.read_mnist_dir(mnist), fifo(victim)


def _fifo_as_cifar_batch(tmp_path):
    cifar = write_cifar(tmp_path / "cifar", per_batch=4, n_test=4)
    (cifar / "data_batch_2").unlink()
    return lambda: data.read_user_data(str(cifar)), fifo(cifar / "data_batch_2")


def _directory_named_like_an_image(tmp_path):
    write_image_folder(tmp_path / "images", n=40, classes=2)
    (tmp_path / "images" / "c0" / "folder.png").mkdir()
    (tmp_path / "images" / "c0" / "folder.png" / "inner.png").write_bytes(b"")
    return lambda: data.read_user_data(str(tmp_path / "images")), \
        tmp_path / "images" / "c0" / "folder.png"


def _fifo_as_model_file(tmp_path):
    return lambda: models.precheck(f"{tmp_path}/m.py:build"), fifo(tmp_path / "m.py")


def _fifo_as_resumed_config(tmp_path):
    run = saved_run(tmp_path)
    (run / "config.json").unlink()
    return lambda: resumed_config(Config.of(model="lr", resume=str(run)), {"resume"}, 3), \
        fifo(run / "config.json")


def _fifo_as_checkpoint(tmp_path):
    return lambda: Checkpoint.load(tmp_path), fifo(tmp_path / "checkpoint.npz")


def _fifo_as_sweep_spec(tmp_path):
    from mpitrain.launch import sweep

    return lambda: sweep.load_spec(tmp_path / "s.toml"), fifo(tmp_path / "s.toml")


def _fifo_as_a_run_file_to_plot(tmp_path):
    from mpitrain.report.plots import plot_runs

    run = tmp_path / "run"
    run.mkdir()
    return lambda: plot_runs([run]), fifo(run / "config.json")


def _fifo_as_hostfile(tmp_path):
    from mpitrain.launch import hostfile

    return lambda: hostfile.read(tmp_path / "hosts"), fifo(tmp_path / "hosts")


@pytest.mark.timeout(60)  # a read that blocks fails here instead of hanging the suite
@pytest.mark.parametrize("make,error,kind", [
    (_fifo_in_a_class_folder, DataError, "a FIFO (named pipe)"),
    (_fifo_as_npz, DataError, "a FIFO (named pipe)"),
    (_device_as_npz, DataError, "a character device"),
    (_fifo_as_idx, DataError, "a FIFO (named pipe)"),
    (_fifo_as_cifar_batch, DataError, "a FIFO (named pipe)"),
    (_directory_named_like_an_image, DataError, "a directory"),
    (_fifo_as_model_file, UsageError, "a FIFO (named pipe)"),
    (_fifo_as_resumed_config, UsageError, "a FIFO (named pipe)"),
    (_fifo_as_checkpoint, ResultsError, "a FIFO (named pipe)"),
    (_fifo_as_sweep_spec, UsageError, "a FIFO (named pipe)"),
    (_fifo_as_a_run_file_to_plot, ResultsError, "a FIFO (named pipe)"),
    (_fifo_as_hostfile, UsageError, "a FIFO (named pipe)"),
])
def test_a_name_that_is_no_regular_file_is_refused_never_read(tmp_path, make, error, kind):
    read, culprit = make(tmp_path)
    with pytest.raises(error) as raised:
        read()
    assert f"{culprit}: is {kind}, not a regular file" in one_line(raised.value)


@pytest.mark.timeout(60)
def test_the_launcher_never_waits_on_a_fifo_in_a_run_directory(tmp_path):
    """mpitrain launch reads the run's status.json (and config.json) once a second: a FIFO
    in their place is nothing said yet, not a read that never returns."""
    from mpitrain.launch.watch import restartable
    from mpitrain.userfiles import read_json_object

    run = tmp_path / "run"
    assert read_json_object(fifo(run / "status.json")) is None and restartable(run)
    (run / "config.json").write_text('{"a": 1}')
    assert read_json_object(run / "config.json") == {"a": 1}


def test_a_small_file_read_whole_has_a_bound(tmp_path):
    run = saved_run(tmp_path)
    with open(run / "config.json", "ab") as f:
        f.truncate(userfiles.TEXT_LIMIT + 1)  # sparse: nothing is written
    with pytest.raises(UsageError, match=r"config.json: larger than 16 MiB"):
        resumed_config(Config.of(model="lr", resume=str(run)), {"resume"}, 3)


# ---- the user's code: whatever it raises (SystemExit too) is one line naming it --------------
HEAD = "import sys, keras\nimport tensorflow as tf\nL = keras.layers\n"
MODEL_FILES = {  # issue #39, items 4 and 5, and what the refusal of a softmax missed
    "no_weights": HEAD + (
        "def build(input_shape, num_classes):\n"
        "    i = keras.Input(input_shape)\n"
        "    o = L.Lambda(lambda t: keras.ops.reshape(t, (-1, 64))[:, :num_classes])(i)\n"
        "    return keras.Model(i, o)\n"),
    "exits_in_build": HEAD + "def build(input_shape, num_classes):\n    sys.exit('bye')\n",
    "parses_arguments_at_import": HEAD + (
        "import argparse\n"
        "argparse.ArgumentParser().add_argument('--foo', required=True)\n"
        "p = argparse.ArgumentParser(prog='train.py')\n"
        "p.add_argument('--foo', required=True)\n"
        "p.parse_args([])\n"
        "def build(input_shape, num_classes):\n    pass\n"),
    "exits_in_call": HEAD + (
        "class M(keras.Model):\n"
        "    def __init__(self, n):\n"
        "        super().__init__(); self.d = L.Dense(n)\n"
        "    def call(self, x, training=False):\n"
        "        if training:\n"
        "            raise SystemExit(3)\n"
        "        return self.d(L.Flatten()(x))\n"
        "def build(input_shape, num_classes):\n    return M(num_classes)\n"),
    "unused_layer": HEAD + (
        "class M(keras.Model):\n"
        "    def __init__(self, n):\n"
        "        super().__init__(name='mine')\n"
        "        self.d, self.spare = L.Dense(n, name='out'), L.Dense(n, name='spare')\n"
        "    def call(self, x, training=False):\n"
        "        x = L.Flatten()(x)\n"
        "        self.spare(x)  # built, never used in the output\n"
        "        return self.d(x)\n"
        "def build(input_shape, num_classes):\n    return M(num_classes)\n"),
    "nested_softmax_head": HEAD + (
        "def build(input_shape, num_classes):\n"
        "    head = keras.Sequential([L.Dense(num_classes), L.Softmax()])\n"
        "    return keras.Sequential([keras.Input(input_shape), L.Flatten(), head])\n"),
    "tf_nn_softmax": HEAD + (
        "def build(input_shape, num_classes):\n"
        "    return keras.Sequential([keras.Input(input_shape), L.Flatten(),\n"
        "                             L.Dense(num_classes, activation=tf.nn.softmax)])\n"),
    "ops_softmax": HEAD + (
        "def build(input_shape, num_classes):\n"
        "    i = keras.Input(input_shape)\n"
        "    return keras.Model(i, keras.ops.softmax(L.Dense(num_classes)(L.Flatten()(i))))\n"),
}


@pytest.mark.parametrize("name,line", [
    ("no_weights", "model {spec}: it has no trainable weights, so there is nothing to train; "
                   "build it from layers with weights (end with Dense(num_classes))"),
    ("exits_in_build", "model {spec}: building it for input (8, 8, 1) and 3 classes failed "
                       "(it called sys.exit('bye') at {path} line 5)"),
    ("parses_arguments_at_import",
     "model {spec}: importing it failed (it called sys.exit(2) after printing 'train.py: "
     "error: the following arguments are required: --foo' at {path} line 8)"),
    ("exits_in_call", "model {spec}: a training step (training=True) on a batch of shape "
                      "(2, 8, 8, 1) failed (it called sys.exit(3) at {path} line 9)"),
    ("unused_layer", "model {spec}: its output does not depend on 2 of its trainable weights "
                     "(mine/spare/kernel, mine/spare/bias), which nothing would train; use those "
                     "layers in the output, or make them trainable=False"),
    ("nested_softmax_head", "model {spec} ends in a softmax: pass --outputs probabilities"),
    ("tf_nn_softmax", "model {spec} ends in a softmax: pass --outputs probabilities"),
    ("ops_softmax", "model {spec} ends in a softmax: pass --outputs probabilities"),
])
def test_what_a_model_file_does_wrong_is_one_line_naming_it(tmp_path, capsys, name, line):
    from mpitrain.models.replica import Replica

    path = tmp_path / f"{name}.py"
    path.write_text(MODEL_FILES[name])
    spec = f"{path}:build"
    with pytest.raises(UsageError) as error:
        Replica(models.get(spec), (8, 8, 1), 3, "adam", 0.001)
    assert one_line(error.value).startswith(line.format(spec=spec, path=path))
    out = capsys.readouterr()
    assert "usage:" not in out.err and "Traceback" not in out.err  # argparse's text held


def test_a_softmax_model_trains_with_outputs_probabilities(tmp_path):
    from mpitrain.models.replica import Replica, ends_in_softmax

    for name in ("nested_softmax_head", "tf_nn_softmax", "ops_softmax"):
        (tmp_path / f"{name}.py").write_text(MODEL_FILES[name])
        replica = Replica(models.get(f"{tmp_path}/{name}.py:build"), (8, 8, 1), 3, "adam",
                          0.001, from_logits=False)
        assert ends_in_softmax(replica.model, (8, 8, 1))
    lenet = models.get("lenet").build((28, 28, 1), 10)
    assert not ends_in_softmax(lenet, (28, 28, 1))  # logits


def test_the_training_probe_leaves_the_model_as_it_was_built(tmp_path):
    """The probe's training-mode pass updates BatchNorm's statistics and Dropout's
    generator: both are put back, so the run starts from the model as built."""
    import numpy as np

    from conftest import BN_MODEL_SPEC
    from mpitrain.models.keras_import import import_keras

    import importlib.util

    keras = import_keras()
    keras.utils.set_random_seed(5)
    model = models.get(BN_MODEL_SPEC).build((8, 8, 1), 3)
    keras.utils.set_random_seed(5)
    found = importlib.util.spec_from_file_location("bn_unprobed", BN_MODEL_SPEC[:-6])
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)  # the same builder, without mpitrain's checks
    plain = module.build((8, 8, 1), 3)
    plain(np.zeros((2, 8, 8, 1), np.float32), training=False)
    assert len(model.variables) == len(plain.variables) > 4  # BatchNorm's and the RNG's
    for probed, built in zip(model.variables, plain.variables):
        np.testing.assert_array_equal(probed.numpy(), built.numpy())


def test_a_fit_builder_that_exits_is_one_line():
    def build(input_shape, num_classes):
        raise SystemExit("no GPU, bye")

    spec = models.from_callable(build)
    with pytest.raises(UsageError) as error:
        spec.build((4,), 2)
    assert one_line(error.value).startswith(
        f"model {spec.name}: building it for input (4,) and 2 classes failed (it called "
        f"sys.exit('no GPU, bye') at {__file__} line")


def test_an_error_of_the_users_code_in_a_training_step_is_blamed_on_it(tmp_path):
    """Code that runs eagerly (the probes) but not in TensorFlow's graph (a step): the
    error surfaces from the step, and is the user's, in one line with its line."""
    from mpitrain.models.replica import Replica

    path = tmp_path / "eager_only.py"
    path.write_text(HEAD + (
        "class M(keras.Model):\n"
        "    def __init__(self, n):\n"
        "        super().__init__(); self.d = L.Dense(n)\n"
        "    def call(self, x, training=False):\n"
        "        scale = float(tf.reduce_max(x).numpy()) + 1.0  # eager only\n"
        "        return self.d(L.Flatten()(x)) / scale\n"
        "def build(input_shape, num_classes):\n    return M(num_classes)\n"))
    spec = models.get(f"{path}:build")
    replica = Replica(spec, (8, 8, 1), 3, "sgd", 0.1)
    with pytest.raises(Exception) as raised:
        replica.grad(np.zeros((4, 8, 8, 1), np.float32), np.zeros(4, np.int32))
    blamed = models.blame_user_code(spec, raised.value)
    assert blamed is not None and not blamed.everywhere and blamed.exit_code == 2
    assert one_line(blamed).startswith(f"model {spec.name}: your code failed in training (")
    assert f"at {path} line 8)" in str(blamed)
    assert models.blame_user_code(models.get("lr"), raised.value) is None  # not a user's


# ---- results: a write that fails is one line, recorded where there is room -----------------
def lr_metadata(world_size=3, mode="sync"):
    """config.json's sections for an LR run, as the session writes them."""
    from mpitrain.config import resolve

    cfg = resolve(Config.of(async_mode=mode == "async"), models.get("lr").defaults, world_size)
    return {"config": cfg.to_dict(),
            "dataset": {"name": "mnist", "input_shape": [28, 28, 1], "num_classes": 10}}


def test_a_disk_that_fills_up_is_one_line_and_the_run_is_recorded(tmpfs):  # item 9
    disk = tmpfs(512)
    results = RunResults(disk, "lr-sync-np3")
    results.write_json("config.json", lr_metadata())
    results.add_curve_row({"epoch": 0, "step": 0, "test_accuracy": 0.1})
    curve = (results.dir / "curve.csv").read_bytes()
    fill(disk, leave_kib=8)
    with pytest.raises(WriteError) as error:
        results.save_checkpoint(Checkpoint(np.ones(100_000, np.float32), {}, 5, 1.0))
    line = one_line(error.value)
    assert line == (f"cannot write {results.dir}/checkpoint.npz: no space left on the device "
                    "(ENOSPC); free space there or pass another --results-dir; what was "
                    "written is intact")
    assert error.value.exit_code == EXIT_CANNOT_WRITE == 74
    # the reserve freed by the failure holds the record of it; what was written is intact
    results.set_status("failed", line, restartable=False)
    results.add_run_row({"model": "lr", "status": "failed", "reason": line})
    assert json.loads((results.dir / "status.json").read_text())["restartable"] is False
    assert read_rows(disk / "runs.csv")[0]["reason"] == line
    assert (results.dir / "curve.csv").read_bytes() == curve
    assert not (results.dir / "checkpoint.npz").exists()
    assert sorted(p.name for p in results.dir.iterdir()) == ["config.json", "curve.csv",
                                                             "status.json"]


def test_an_append_the_disk_cuts_short_is_undone(tmpfs):
    disk = tmpfs(256)
    log = CsvLog(disk / "curve.csv", ["a", "b"])
    log.append({"a": 1, "b": 2})
    before = (disk / "curve.csv").read_bytes()
    fill(disk, leave_kib=0)
    with pytest.raises(OSError):
        log.append({"a": "x" * 20_000, "b": 3})  # fills the file's last page, then fails
    assert (disk / "curve.csv").read_bytes() == before


@pytest.mark.parametrize("how,line", [
    ("read-only", "cannot write {disk}: read-only file system (EROFS); pass a --results-dir "
                  "on a writable file system"),  # issue #39, item 8
    ("full", "cannot write {disk}/{{run}}: no space left on the device (ENOSPC); free space "
             "there or pass another --results-dir; what was written is intact"),
])
def test_a_results_dir_that_cannot_be_written_is_one_line(tmpfs, how, line):
    disk = tmpfs(256, read_only=how == "read-only")
    if how == "full":
        fill(disk, leave_kib=0)
    with pytest.raises(WriteError) as error:
        RunResults(disk, "lr-sync-np3")
    assert re.fullmatch(re.escape(line.format(disk=disk)).replace(r"\{run\}", r"[^/ ]+"),
                        one_line(error.value))
    assert [p.name for p in disk.iterdir()] in ([], ["filler"])  # no empty run left


def test_a_killed_attempt_is_recorded_by_the_launcher(tmp_path):
    """After a kill -9, rank 0 never wrote the end of its run: mpitrain launch records
    the attempt as failed, in status.json and in a runs.csv row (also found in #39).
    Whether the attempt has its row is runs.csv's to say, not status.json's: rank 0 can
    be killed before it wrote the attempt's first status (status.json is still the
    previous attempt's, ended and recorded) or after its row but before saying so."""
    from mpitrain.launch.watch import restartable
    from mpitrain.results.lost_run import record_lost_attempt
    from mpitrain.results.run_dir import append_run_row, run_rows

    run = tmp_path / "20261126-lr-sync-np3"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(lr_metadata()))
    (run / "status.json").write_text(json.dumps({"status": "running", "launch_attempt": "t"}))
    assert record_lost_attempt(run, "the job ended (mpirun exit 137) before rank 0 ...", False,
                               "t", rows_before=0)
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["launch_attempt"]) == ("failed", "t")
    row, = read_rows(tmp_path / "runs.csv")
    assert (row["run"], row["model"], row["mode"], row["np"], row["global_batch"],
            row["status"], row["reason"]) == (run.name, "lr", "sync", "3", "200", "failed",
                                              "the job ended (mpirun exit 137) before rank 0 ...")
    assert not record_lost_attempt(run, "again", False, "t", rows_before=0)  # it has its row
    assert run_rows(run) == 1 and restartable(run)
    # the next attempt, rank 0 killed while it recorded its failure: its status written,
    # its row pending
    (run / "status.json").write_text(json.dumps({"status": "failed", "reason": "rank 2 died",
                                                 "runs_csv": "pending", "launch_attempt": "u"}))
    assert record_lost_attempt(run, "the job ended (mpirun exit 137) ...", True, "u", 1)
    assert [(r["status"], r["reason"], r["resumed"]) for r in read_rows(
        tmp_path / "runs.csv")][1] == ("failed", "rank 2 died", "True")
    assert json.loads((run / "status.json").read_text())["runs_csv"] == "written"
    # the next, rank 0 killed before it said running: status.json is attempt u's, ended
    # and recorded, yet attempt v has no row
    assert record_lost_attempt(run, "the job ended (mpirun exit 137) before ...", True, "v", 2)
    assert [(r["status"], r["reason"]) for r in read_rows(tmp_path / "runs.csv")][2] == (
        "failed", "the job ended (mpirun exit 137) before ...")
    status = json.loads((run / "status.json").read_text())
    assert (status["status"], status["launch_attempt"]) == ("failed", "v")
    # the next, rank 0 killed after its row but before it said so: no second row
    (run / "status.json").write_text(json.dumps({"status": "failed", "reason": "rank 1 died",
                                                 "runs_csv": "pending", "launch_attempt": "w"}))
    append_run_row(tmp_path / "runs.csv", {"run": run.name, "status": "failed"})
    assert not record_lost_attempt(run, "the job ended ...", True, "w", rows_before=3)
    assert run_rows(run) == 4
    (run / "status.json").write_text(json.dumps({"status": "failed", "restartable": False}))
    assert not restartable(run)


# ---- labels, classes and memory: checked before anything is allocated ------------------------
def write_npz(path, y_train, y_test=(0, 1), x_dtype=np.uint8):
    y_train = np.asarray(y_train)
    np.savez(path, x_train=np.zeros((len(y_train), 4, 4), x_dtype), y_train=y_train,
             x_test=np.zeros((len(y_test), 4, 4), x_dtype), y_test=np.asarray(y_test))
    return str(path)


@pytest.mark.parametrize("labels,line", [  # issue #39, items 2 and 3, and a single class
    ([0, 1, 10**9], "{path}: y_train has labels up to 1,000,000,000 but only 3 distinct "
                    "labels; classes are 0..K-1, K at most 100,000: relabel them 0..2 "
                    "(np.unique(y, return_inverse=True)[1])"),
    ([0, 1, 2**32 + 3], "{path}: y_train has labels up to 4,294,967,299 but only 3 distinct"),
    ([0, 1, 2**31], "{path}: y_train has labels up to 2,147,483,648 but only 3 distinct"),
    (np.array([0, 1, 1e30]), "{path}: y_train has labels up to 1,000,000,000,000,000,019,884,"),
    ([0, 0, 0], "{path}: every training label is 0: one class is nothing to classify (every "
                "prediction would be right); give examples of two classes or more"),
    ([1, 1, 1], "{path}: every training label is 1: one class is nothing to classify"),
])
def test_labels_are_checked_before_they_become_int32(tmp_path, labels, line):
    path = write_npz(tmp_path / "d.npz", labels, y_test=[0, 1] if max(labels) else [0])
    with pytest.raises(DataError) as error:
        data.read_user_data(path)
    assert one_line(error.value).startswith(line.format(path=path))


@SETTINGS
@given(labels=st.lists(st.one_of(st.integers(-2**63, 2**63 - 1),
                                 st.floats(allow_nan=True, allow_infinity=True)),
                       min_size=1, max_size=6))
def test_any_labels_load_as_classes_or_are_one_line(tmp_path, labels):
    try:
        y = np.asarray(labels)
    except OverflowError:
        return
    path = write_npz(tmp_path / "h.npz", y, y_test=y[:1])
    try:
        ds = data.read_user_data(path)
    except DataError as e:
        one_line(e)
        return
    assert 2 <= ds.num_classes <= decoding.MAX_CLASSES and ds.y_train.dtype == np.int32
    assert np.array_equal(ds.y_train, y.astype(np.int64))


def test_data_that_cannot_fit_is_refused_before_it_is_read(tmp_path):
    path = write_npz(tmp_path / "d.npz", [0, 1] * 50)
    budget = data.MemoryBudget(available=3 * 4000, ranks=3, host="node1")
    with pytest.raises(DataError) as error:
        data.read_user_data(path, budget=budget)
    assert one_line(error.value) == (
        f"--data {path}: the arrays this rank reads need 8.8 KiB of memory on each rank, "
        "but node1 has 11.7 KiB available for its 3 rank(s); data larger than memory is not "
        "supported: train on a subset, or on more hosts")
    assert data.read_user_data(path, budget=data.MemoryBudget(3 * 10_000, 3)).train_size == 100


def test_images_that_cannot_fit_are_refused_before_they_are_decoded(tmp_path):
    write_image_folder(tmp_path / "images", n=40, classes=2)
    with pytest.raises(DataError) as error:
        data.read_user_data(str(tmp_path / "images"), image_size=60000)
    assert one_line(error.value).startswith(
        f"--data {tmp_path}/images: 36 train and 4 test image(s) of 60000x60000x1 need ")
    assert str(error.value).endswith("stream it (--stream), pass a smaller --image-size, or "
                                     "pack it into a shard set (mpitrain data pack)")


def test_synthetic_data_that_cannot_fit_is_a_usage_error():  # issue #39, item 13
    shape = {**models.get("alexnet").synthetic, "image_size": 60000, "n_train": 1280}
    with pytest.raises(UsageError) as error:
        sources.check_synthetic(shape, data.SPLITS, data.MemoryBudget(20 * 2**30, 3, "vm"))
    assert one_line(error.value) == (
        "--image-size 60000, --synthetic-size 1,280: the synthetic data (128 random "
        "60000x60000x3 images and 1,536 labels) need 5.0 TiB of memory on each rank, but vm "
        "has 20.0 GiB available for its 3 rank(s); use a smaller --image-size or "
        "--synthetic-size")
    assert not error.value.everywhere  # agreed on by data.load, every rank at once
    sources.check_synthetic({**shape, "image_size": 224}, data.SPLITS,
                         data.MemoryBudget(20 * 2**30, 3))


def test_available_memory_is_what_this_host_can_give():
    import psutil

    assert 0 < memory.available_memory() <= psutil.virtual_memory().total


def test_fit_arrays_that_are_not_arrays_are_one_line():
    class Hostile:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("no\nway")

    y = [0, 1]
    for x, message in (([[1.0], [2.0, 3.0]], "fit(): x_train cannot be made an array "
                                             "(ValueError: setting an array element"),
                       (Hostile(), "fit(): x_train cannot be made an array (RuntimeError: "
                                   "no); give numpy arrays")):
        with pytest.raises(UsageError) as error:
            api._config("lr", (x, y), ([[1.0]], [0]), "sync", None, {})
        assert one_line(error.value).startswith(message)
