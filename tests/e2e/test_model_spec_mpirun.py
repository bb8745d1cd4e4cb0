"""End-to-end: the user's own model, FILE.py:FUNCTION or module:FUNCTION, under real
mpirun on the real MNIST: it trains sync and async and beats chance by far, a module
loads from the working directory, resume works from another directory, and every bad
spec is one error line (printed once, by rank 0) with exit 2, never a hang, including
one that fails on a single rank only."""

import json
import sys

import pytest

from conftest import (MY_CNN, REPO, mpirun, mpirun_cmd, read_rows, run_bounded,
                      runs_in_one_launch)

def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("mpitrain: error")]


@pytest.fixture
def cnn(tmp_path):
    path = tmp_path / "my_cnn.py"
    path.write_text(MY_CNN)
    return path


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_user_file_trains_on_mnist(mode, shared_run):
    """60 steps per worker at -np 3 (measured: sync 88%, async 82%; chance is 10%),
    evaluated on a sample of 2,000 test examples (--eval-examples); the runs share a
    launch with other tests' (conftest.SHARED_RUNS)."""
    run_dir, run, _ = shared_run(3, f"my_cnn-{mode}")
    spec = f"{run_dir.parent.parent / 'my_cnn.py'}:build"  # where conftest wrote it
    assert (run["model"], run["mode"], run["status"]) == (spec, mode, "ok")
    assert float(run["test_accuracy"]) > 0.6, run
    assert run["run"].endswith(f"-my_cnn-build-{mode}-np3")
    meta = json.loads((run_dir / "config.json").read_text())
    assert meta["config"]["model"] == spec and meta["model"]["parameters"] == 13610
    assert (meta["config"]["optimizer"], meta["config"]["batch_size"]) == ("adam", 64)
    assert (meta["dataset"]["test_examples"], meta["dataset"]["test_split_size"]) == \
        (2000, 10000)
    # the async server's Adam keeps beta_1 0.9 less 2 workers' own momentum, 1 - 1/2
    assert run.get("server_momentum", "") == ("0.4" if mode == "async" else "")


@pytest.mark.slow
def test_module_spec_and_resume_from_another_directory(cnn, mnist, tmp_path):
    """module:FUNCTION from the working directory (as python -m), then the same run
    resumed as ./FILE.py:FUNCTION from a directory where that path does not exist."""
    package = tmp_path / "mynets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "small.py").write_text(MY_CNN)
    res = tmp_path / "res"
    first = run_bounded(mpirun_cmd(1, "mynets.small:build", "--steps", "30", "--data-dir",
                                   mnist, "--results-dir", res, "--quiet"), 300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = read_rows(res / "runs.csv")[0]
    assert run["model"] == "mynets.small:build" and float(run["test_accuracy"]) > 0.5
    assert run["run"].endswith("-mynets.small-build-single-np1")

    relative = run_bounded(mpirun_cmd(2, "./my_cnn.py:build", "--steps", "4", "--data-dir",
                                      mnist, "--results-dir", res, "--quiet"), 300,
                           cwd=tmp_path)
    assert relative.returncode == 0, relative.stderr[-3000:]
    run_dir = res / read_rows(res / "runs.csv")[-1]["run"]
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["model"], config["model_given"]) == (f"{cnn}:build", "./my_cnn.py:build")
    resumed = run_bounded(mpirun_cmd(2, "./my_cnn.py:build", "--resume", run_dir, "--steps",
                                     "8", "--data-dir", mnist, "--quiet"), 300, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_rows(res / "runs.csv")
    assert (rows[-1]["run"], rows[-1]["steps"], rows[-1]["resumed"]) == (
        run_dir.name, "8", "True")


SOFTMAX = MY_CNN.replace("L.Dense(num_classes)", "L.Dense(num_classes, activation='softmax')")


# (slow: a variant of the user-file run the quick tier has; its own mpirun)
@pytest.mark.slow
def test_outputs_probabilities_trains_a_softmax_model(tmp_path, mnist):
    (tmp_path / "soft.py").write_text(SOFTMAX)
    result = mpirun(2, f"{tmp_path}/soft.py:build", "--outputs", "probabilities", "--steps",
                    "40", "--data-dir", mnist, "--results-dir", tmp_path / "res", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note:" not in result.stdout  # it does end in a softmax
    run = read_rows(tmp_path / "res" / "runs.csv")[0]
    assert float(run["test_accuracy"]) > 0.5 and float(run["test_loss"]) < 2.0, run


BAD_FILES = {
    "soft.py": SOFTMAX,
    "syntax.py": "import keras\n\ndef build(shape, classes)\n    return None\n",
    "nofunc.py": "def make(shape, classes):\n    return None\n",
    "notcallable.py": "build = 3\n",
    "wrongtype.py": "def build(shape, classes):\n    return 'a model'\n",
    "rank1.py": ("import os\nimport keras\n\ndef build(shape, classes):\n"
                 "    if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
                 "        raise ValueError('too big for rank 1')\n"
                 "    return keras.Sequential([keras.Input(shape), keras.layers.Flatten(),"
                 " keras.layers.Dense(classes)])\n"),
    "rank2.py": ("import os\nif os.environ['OMPI_COMM_WORLD_RANK'] == '2':\n"
                 "    raise ImportError('only rank 2 cannot import this')\n"
                 "def build(shape, classes):\n    return None\n"),
}


def write_bad_files(directory):
    for name, text in BAD_FILES.items():
        (directory / name).write_text(text)


# the quick tier: one error every rank finds before TensorFlow starts, and one rank's
# own; the other kinds under mpirun in the slow tier (each message: tests/unit)
@pytest.mark.parametrize("spec,message", [
    ("{tmp}/absent.py:build", "model {tmp}/absent.py:build: no such file {tmp}/absent.py"),
    pytest.param("{tmp}/syntax.py:build", "syntax error in {tmp}/syntax.py line 3",
                 marks=pytest.mark.slow),
    pytest.param("{tmp}/nofunc.py:build",
                 "{tmp}/nofunc.py has no function 'build' (it defines make)",
                 marks=pytest.mark.slow),
    pytest.param("no_such_module_q7:build", "model no_such_module_q7:build: no module named",
                 marks=pytest.mark.slow),
    ("{tmp}/rank2.py:build", "rank 2 on"),  # fails on one rank only: agreed on, rank named
])
def test_bad_spec_is_one_line_exit_2(spec, message, tmp_path, mnist):
    write_bad_files(tmp_path)
    spec = spec.format(tmp=tmp_path)
    result = mpirun(3, spec, "--dry-run", "--data-dir", mnist, "--results-dir",
                    tmp_path / "res", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert message.format(tmp=tmp_path) in lines[0] and f"model {spec}" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "res" / "runs.csv").exists()


#: specs that fail only once the model is built, on every rank (TensorFlow starts on
#: each): all in one launch (tests/helpers/cli_runs.py runs them one after another, each
#: through the CLI's entry point); tests/unit/test_model_spec.py checks each in-process
BUILT_BAD_SPECS = {
    "{tmp}/notcallable.py:build": "build is an object of type int, not a function",
    "{tmp}/wrongtype.py:build": "returned str, not a keras.Model",
    "{tmp}/soft.py:build": "ends in a softmax: pass --outputs probabilities",
    "{tmp}/rank1.py:build": "rank 1 on",  # one rank fails building, the others do not
}


@pytest.mark.slow
def test_bad_specs_that_fail_when_built_are_one_line_each(tmp_path, mnist):
    write_bad_files(tmp_path)
    specs = [spec.format(tmp=tmp_path) for spec in BUILT_BAD_SPECS]
    result = runs_in_one_launch(3, [[spec, "--dry-run", "--data-dir", mnist, "--results-dir",
                                     tmp_path / "res"] for spec in specs], tmp_path, 300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == len(specs), result.stderr  # one each, printed once
    for line, spec, message in zip(lines, specs, BUILT_BAD_SPECS.values()):
        assert message.format(tmp=tmp_path) in line and f"model {spec}" in line, line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "res" / "runs.csv").exists()


def test_check_a_user_model(cnn, mnist, tmp_path):
    base = [sys.executable, "-m", "mpitrain", "check", "-np", "2", f"{cnn}:build"]
    quick = run_bounded(base + ["--no-launch"], 60)
    assert quick.returncode == 0, quick.stderr
    assert "rank 1: worker" in quick.stdout
    job = run_bounded(base + ["--hostfile", REPO / "hostfiles" / "local", "--data-dir", mnist],
                      300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "preflight ok: 2 rank(s)" in job.stdout


@pytest.mark.slow  # the message itself: tests/unit/test_model_spec.py, in-process
def test_check_names_a_wrong_output(mnist, tmp_path):
    (tmp_path / "seven.py").write_text(MY_CNN.replace("L.Dense(num_classes)", "L.Dense(7)"))
    bad = run_bounded([sys.executable, "-m", "mpitrain", "check", "-np", "2", "--hostfile",
                       REPO / "hostfiles" / "local", f"{tmp_path}/seven.py:build",
                       "--data-dir", mnist], 300)
    assert bad.returncode == 2
    assert "its output is (None, 7); expected (None, 10)" in error_lines(bad)[0]
