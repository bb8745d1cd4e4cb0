"""Shared test helpers: where the real MNIST is, and a bounded real ``mpirun``.

The suite runs three tests at a time (pytest-xdist, ``-n 3 --dist loadfile`` in
pytest.ini: a file's tests stay on one worker, so module fixtures such as the netns
cluster, the SLURM daemons or a reference run are made once): most end-to-end time
is process start-up, TensorFlow imports and waits, which overlap well. Every test
shares the machine: the watchdog and liveness tests' bounds hold with another
launch beside them (checked with a -np 4 LeNet run looping beside them).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import gzip
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from mpitrain.launch.watch import kill_tree

REPO = Path(__file__).resolve().parents[1]
LOCAL_HOSTFILE = REPO / "hostfiles" / "local"
#: the BatchNorm + Dropout test model as a model spec (tests/helpers/bn_model.py). A
#: path, not an import: importing it at collection would import Keras there, the slow
#: way (7 s of CPU in each pytest worker, against mpitrain.models.keras_import's 4 s)
BN_MODEL_SPEC = f"{REPO / 'tests' / 'helpers' / 'bn_model.py'}:build"


#: measured seconds per test (setup + call + teardown), for the order below; a run with
#: MPITRAIN_RECORD_DURATIONS=1 updates the entries of the tests it ran
DURATIONS = Path(__file__).with_name("durations.json")
_recorded: dict = {}


@pytest.hookimpl(trylast=True)  # after -m/-k have deselected
def pytest_collection_modifyitems(items):
    """Files in order of their selected tests' measured time, longest first, each file's
    tests in their own order. Under ``--dist loadfile`` a file runs on one worker and
    files are handed out in this order (with ``--no-loadscope-reorder``, pytest.ini's:
    else xdist re-sorts them by their number of tests), so that no long file is handed
    out last, leaving the other workers idle. Unknown tests count 0 s, but a file with an
    unmeasured slow test goes first: a new or renamed slow test may be long, and a short
    file handed out first costs nothing."""
    seconds = _measured_seconds()
    if seconds:
        longest_files_first(items, seconds)


def file_of(nodeid: str) -> str:
    """The file part of a pytest node id (``tests/e2e/test_cli.py::test_x[2]``)."""
    return nodeid.split("::")[0]


def longest_files_first(items, seconds: dict) -> None:
    """Sort ``items`` (having ``nodeid`` and ``keywords``) in place: files with a slow
    item not in ``seconds`` first, then by the sum of their items' ``seconds``, longest
    first, ties and each file's items in their original order."""
    per_file, first, unmeasured = {}, {}, set()
    for i, item in enumerate(items):
        name = file_of(item.nodeid)
        per_file[name] = per_file.get(name, 0.0) + seconds.get(item.nodeid, 0.0)
        first.setdefault(name, i)
        if item.nodeid not in seconds and "slow" in item.keywords:
            unmeasured.add(name)
    items.sort(key=lambda item: (file_of(item.nodeid) not in unmeasured,
                                 -per_file[file_of(item.nodeid)], first[file_of(item.nodeid)]))


def _measured_seconds() -> dict:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of every child it has waited for:
    a test's real launches (mpirun reaps its ranks, subprocess reaps mpirun)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.user_properties.append(("cpu_start", _cpu_seconds()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's CPU seconds (setup to teardown, its processes included) go with its
    teardown report to the controller, for :func:`pytest_terminal_summary`."""
    outcome = yield
    if call.when == "teardown":
        start = dict(item.user_properties).get("cpu_start")
        if start is not None:
            outcome.get_result().user_properties.append(("cpu", _cpu_seconds() - start))


#: every test's CPU seconds; MPITRAIN_CPU_LEDGER=PATH writes them there (JSON), the
#: whole ledger behind the summary's by-file lines
_cpu_by_test: dict = {}


def pytest_runtest_logreport(report):
    cpu = dict(report.user_properties).get("cpu") if report.when == "teardown" else None
    if cpu is not None:
        _cpu_by_test[report.nodeid] = cpu
    if os.environ.get("MPITRAIN_RECORD_DURATIONS"):
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    ledger = os.environ.get("MPITRAIN_CPU_LEDGER")
    if ledger and _cpu_by_test and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(ledger).write_text(json.dumps({test: round(cpu, 2) for test, cpu
                                            in sorted(_cpu_by_test.items())}, indent=0))
    if _recorded and not os.environ.get("PYTEST_XDIST_WORKER"):
        seconds = _measured_seconds()
        seconds.update({name: round(s, 2) for name, s in _recorded.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


def pytest_terminal_summary(terminalreporter):
    """Where the suite's CPU went: the files that used most (their tests' own processes
    and real launches; module fixtures count in their first test's file). On two
    cores the suite's wall time is at least half its CPU time."""
    if not _cpu_by_test:
        return
    by_file: dict = {}
    for test, cpu in _cpu_by_test.items():
        by_file[file_of(test)] = by_file.get(file_of(test), 0.0) + cpu
    total = sum(by_file.values())
    terminalreporter.write_sep("=", f"CPU seconds by test file ({total:.0f} s in all)")
    for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}  {name}")


def session_dir(tmp_path_factory) -> Path:
    """This test session's temporary directory, the same for all its xdist workers
    (each worker's basetemp is a popen-gwN directory inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _flock(f, how):
    fcntl.flock(f, how)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


#: the emulated cluster (scripts/netns-cluster) is one per machine: fixed namespaces,
#: bridge and addresses, so whatever brings it up and down takes turns on this lock
NETNS_LOCK = Path("/var/tmp/mpitrain-netns-cluster.lock")


@contextlib.contextmanager
def netns_cluster_turn(timeout: float = 1800):
    """Hold the machine's emulated cluster (``NETNS_LOCK``) while inside; fails if
    another test kept it for ``timeout`` seconds."""
    with open(NETNS_LOCK, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the emulated cluster stayed busy for {timeout:.0f} s "
                                f"({NETNS_LOCK} held)")
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def mnist_dir() -> Path:
    """The real MNIST files the acceptance tests use (../shared/data/mnist by default)."""
    path = Path(os.environ.get("MPITRAIN_TEST_MNIST", REPO.parent / "shared" / "data" / "mnist"))
    if not (path / "train-images-idx3-ubyte.gz").is_file():
        pytest.fail(f"real MNIST not found at {path}; set MPITRAIN_TEST_MNIST to the folder "
                    "holding the IDX files")
    return path


@pytest.fixture
def mnist() -> Path:
    return mnist_dir()


def mnist_size(split: str = "train") -> int:
    """Examples in the real MNIST's ``split`` (train or test), from its IDX label file's
    header: expectations follow the files actually used (../shared/data/mnist holds a
    20,000-image training subset; another MPITRAIN_TEST_MNIST may hold all 60,000)."""
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(mnist_dir() / f"{prefix}-labels-idx1-ubyte.gz", "rb") as f:
        magic, count = struct.unpack(">II", f.read(8))
    assert magic == 2049, f"{prefix}-labels-idx1-ubyte.gz is not an IDX label file"
    return count


def mnist_shard(workers: int) -> int:
    """Training examples per worker on the real MNIST (equal shards, remainder dropped)."""
    return mnist_size("train") // workers


def dies_in_startup_cmd(launcher: list, python, where: str, rank: int, results: Path,
                        epochs: int = 2) -> list:
    """LAUNCHER PYTHON tests/helpers/dies_in_startup.py: async LR on every rank but
    ``rank``, which kills itself when the start-up reaches ``where``."""
    return [*launcher, python, REPO / "tests" / "helpers" / "dies_in_startup.py", where, rank,
            "lr", "--async", "--epochs", epochs, "--data-dir", mnist_dir(), "--results-dir",
            results]


def check_went_on_without(done: subprocess.CompletedProcess, results: Path, lost: int,
                          ranks: int, epochs: int = 2) -> dict:
    """The run of :func:`dies_in_startup_cmd` went on without rank ``lost`` on the other
    ``ranks``: one run, ok, every planned step, the loss on the console and in
    runs.csv; its row."""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [note] = [line for line in done.stdout.splitlines() if line.startswith("note: lost")]
    assert f"lost rank {lost} on " in note and "while the job started" in note and \
        f"without it, on {ranks} rank(s) ({ranks - 1} worker(s))" in note, note
    [row] = read_rows(results / "runs.csv")
    workers = ranks - 1
    assert (row["status"], row["np"], row["workers"]) == ("ok", str(ranks), str(workers)), row
    assert int(row["steps"]) == workers * epochs * -(-mnist_shard(workers) // 100), row
    assert f"rank {lost} on " in row["lost_workers"] and "while the job started" in \
        row["lost_workers"] and row["updates_short"] == "0", row
    assert float(row["test_accuracy"]) > 0.85, row
    assert [p.name for p in results.iterdir() if p.is_dir()] == [row["run"]]
    return row


def mpi_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("MPITRAIN_DATA_DIR", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_bounded(cmd, env=None, cwd=None) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own (see :func:`finish_bounded`)."""
    return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or mpi_env(),
                            cwd=cwd or REPO, start_new_session=True)


def wait_while_running(proc: subprocess.Popen, ready, timeout: float = 300):
    """``ready()``'s first true value (looked at five times a second) while ``proc``
    runs. The test fails with the process's stderr if it ends first; if ``timeout``
    passes, its whole tree is killed and the test fails with what each process was
    doing (finish_bounded), so a launch that hangs is neither left running nor silent."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        assert proc.poll() is None, finish_bounded(proc, 30).stderr[-3000:]
        if time.monotonic() >= deadline:
            finish_bounded(proc, 0.1, why=f"not ready within {timeout:.0f} s")
        time.sleep(0.2)
    return value


def discovery_script(tmp_path: Path, hosts: str):
    """A host discovery script (mpitrain launch --host-discovery-script) printing what the
    file it returns holds, first ``hosts``: (that file, the script)."""
    listing, script = tmp_path / "hosts", tmp_path / "discover"
    listing.write_text(hosts)
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return listing, script


def finish_bounded(proc: subprocess.Popen, timeout: float,
                   why: str = "") -> subprocess.CompletedProcess:
    """Wait for ``proc``; kill its whole process group and fail (saying ``why``, by
    default that it hung for ``timeout`` s) if it has not ended by then."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = describe_tree(proc.pid)  # before the kill: what each process was doing
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a grandchild still holds the pipes
            out, err = "", "(output lost: the pipes stayed open after the kill)"
        why = why or f"hung for {timeout} s"
        pytest.fail(f"{why}: {' '.join(map(str, proc.args))}\n{out}\n{err}\n{state}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def describe_tree(pid: int) -> str:
    """A hung command's processes, one line each (pid, state, command line), and the
    Python stacks of those running Python when py-spy is installed: what a hang in CI
    leaves to diagnose it by."""
    import shutil

    import psutil

    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return "(the command's processes are gone)"
    lines, spy = ["processes left:"], shutil.which("py-spy")
    for p in processes:
        try:
            lines.append(f"  {p.pid} {p.status()} {' '.join(p.cmdline())[:200]}")
            if spy and "python" in p.name():
                dump = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True,
                                      text=True, timeout=30)
                lines.append(dump.stdout[-4000:])
        except (psutil.Error, subprocess.SubprocessError):
            continue
    return "\n".join(lines)


def wait_for(predicate, timeout: float, what: str):
    """``predicate()``'s first true value, polled every 0.2 s for at most ``timeout``
    seconds; the test fails naming ``what`` after that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def run_bounded(cmd, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the whole group and fail if it hangs."""
    return finish_bounded(start_bounded(cmd, env, cwd), timeout)


def mpirun_cmd(np_: int, *args, hostfile: Path = LOCAL_HOSTFILE, module="mpitrain",
               python=sys.executable, flags=()) -> list:
    """``mpirun -q FLAGS -np N -hostfile HOSTFILE PYTHON -m MODULE ARGS``; with ``module``
    None, the first of ``args`` is the script to run."""
    run = ["-m", module] if module else []
    return ["mpirun", "-q", *flags, "-np", np_, "-hostfile", hostfile, python, *run, *args]


def horovod_python() -> Path:
    """The interpreter of the Horovod environment setup.sh builds (TensorFlow 2.18 +
    Horovod 0.28.1; $MPITRAIN_HOROVOD_PYTHON overrides). Skips where the set-up was
    told not to build it; fails in CI otherwise, so a missing build step shows."""
    path = Path(os.environ.get("MPITRAIN_HOROVOD_PYTHON", REPO / ".venv-horovod/bin/python"))
    if path.is_file():
        return path
    message = f"no Horovod environment at {path} (bash setup.sh builds it)"
    if os.environ.get("CI") and not os.environ.get("MPITRAIN_NO_HOROVOD"):
        pytest.fail(message)
    pytest.skip(message)


def mpirun(np_: int, *args, timeout: float = 300, env=None, **kw) -> subprocess.CompletedProcess:
    """``mpirun -q -np N -hostfile hostfiles/local python -m mpitrain ARGS`` (bounded)."""
    return run_bounded(mpirun_cmd(np_, *args, **kw), timeout, env=env)


def read_rows(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rows_so_far(path: Path) -> list:
    """The rows of a CSV a running job is writing: none while the job has only made
    its run folder (a poll must not fail in the moment before the file appears)."""
    return read_rows(path) if path.is_file() else []


def status_once_ended(run_dir: Path, bound: float = 30.0) -> dict:
    """A run's status.json once it says the run ended (or as it is after ``bound``
    seconds): when rank 0 was killed, its witness writes it after the process is gone."""
    deadline = time.monotonic() + bound
    while True:
        status = json.loads((Path(run_dir) / "status.json").read_text())
        if status["status"] != "running" or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def runs_in_one_launch(np_: int, runs, workdir: Path, timeout: float = 900,
                       **kw) -> subprocess.CompletedProcess:
    """Run several ``mpitrain`` command lines (lists of arguments) one after another in
    one ``mpirun -np N`` (tests/helpers/cli_runs.py): each rank imports TensorFlow once
    for all of them. Its exit code is the first non-zero one of a run, else 0. ``kw``:
    as for mpirun_cmd."""
    spec = workdir / f"runs-np{np_}.json"
    spec.write_text(json.dumps([[str(arg) for arg in run] for run in runs]))
    return run_bounded(mpirun_cmd(np_, REPO / "tests" / "helpers" / "cli_runs.py", spec,
                                  module=None, **kw), timeout)


def in_one_launch(np_: int, runs, workdir: Path, timeout: float = 900, **kw):
    """:func:`runs_in_one_launch`, failing the test if any run fails."""
    result = runs_in_one_launch(np_, runs, workdir, timeout, **kw)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def named_runs_in_one_launch(np_: int, runs: dict, out: Path, launch: Optional[dict] = None,
                             **kw) -> dict:
    """``runs`` ({name: ``mpitrain`` arguments}) in one launch (in_one_launch), each with
    ``--results-dir out/name``: {name: (its run directory, its runs.csv row)}. The
    launch's stdout goes to ``launch["stdout"]`` if given."""
    result = in_one_launch(np_, [[*args, "--results-dir", out / name]
                                 for name, args in runs.items()], out, **kw)
    if launch is not None:
        launch["stdout"] = result.stdout
    found = {}
    for name in runs:
        row = read_rows(out / name / "runs.csv")[-1]
        found[name] = (out / name / row["run"], row)
    return found


def final_weights(run_dir: Path, row: dict):
    """The trained weights in a finished run's final checkpoint (the run must be ok)."""
    assert row["status"] == "ok", row
    with np.load(run_dir / "checkpoint.npz") as ckpt:
        return ckpt["weights"].copy()


#: The LR accuracy runs the acceptance tests compare (default LR, LR_ACCURACY_EPOCHS on
#: the real MNIST), by process count. The first test that asks for one at some -np runs
#: all of that -np's in one launch (in_one_launch); a test asking for another must add
#: it here.
LR_ACCURACY_EPOCHS = 15
LR_ACCURACY_RUNS = {
    1: [()],
    2: [()],
    3: [(), ("--async",), ("--async", "--staleness", "0"), ("--compression", "fp16"),
        ("--compression", "powersgd"), ("--compression", "topk"),
        ("--async", "--staleness", "0", "--compression", "topk"),
        ("--async", "--compression", "fp16"),
        ("--async", "--staleness", "0", "--compression", "fp16")],
    4: [(), ("--async",), ("--async", "--servers", "2")],
}


def once_per_session(tmp_path_factory, name: str, make):
    """``make(directory)``'s JSON-able result, made once in the whole test session, also
    across the xdist workers (under a file lock; the first caller makes it in
    ``directory``, the others read what it wrote)."""
    shared = session_dir(tmp_path_factory) / "shared"
    shared.mkdir(exist_ok=True)
    found = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a") as lock, _flock(lock, fcntl.LOCK_EX):
        if not found.is_file():
            found.write_text(json.dumps(make(shared / name)))
    return json.loads(found.read_text())


@pytest.fixture(scope="session")
def lr_accuracy(tmp_path_factory):
    """``lr_accuracy(np, *options)``: test accuracy of a default LR run on the real
    MNIST (LR_ACCURACY_EPOCHS), run once in the whole session (:func:`once_per_session`,
    all of one -np's runs in one launch): the sync and async accuracy tests compare
    against the same sync runs."""
    def accuracy(np_: int, *options) -> float:
        assert options in LR_ACCURACY_RUNS[np_], f"add {options} to LR_ACCURACY_RUNS[{np_}]"
        return once_per_session(tmp_path_factory, f"lr-accuracy-np{np_}",
                                lambda out: lr_runs(np_, out))[" ".join(options)]

    return accuracy


def lr_runs(np_: int, results: Path) -> dict:
    """Every LR_ACCURACY_RUNS[np_] run in one launch: {options: test accuracy}."""
    options = LR_ACCURACY_RUNS[np_]
    results.mkdir()
    found = named_runs_in_one_launch(np_, {str(i): ["lr", "--data-dir", mnist_dir(), "--quiet",
                                                    "--epochs", LR_ACCURACY_EPOCHS, *extra]
                                           for i, extra in enumerate(options)}, results)
    return {" ".join(extra): float(found[str(i)][1]["test_accuracy"])
            for i, extra in enumerate(options)}


#: A user's model file (FILE.py:build) for the shared runs below and the model-spec tests
MY_CNN = """
import keras

def build(input_shape, num_classes):
    L = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        L.Conv2D(8, 3, activation="relu"),
        L.MaxPooling2D(2),
        L.Flatten(),
        L.Dense(num_classes),
    ])
"""

#: Short runs several test files check, by process count: {np: {name: the ``mpitrain``
#: arguments, {cnn} standing for the MY_CNN file}}; each gets the real MNIST's
#: --data-dir. The first test that asks for one at some -np runs all of that -np's in
#: one launch (:func:`shared_run`), so each rank starts TensorFlow once for all of them.
#: Telemetry's two come first: their memory and traffic are checked, and a run's samples
#: and counts start with the run.
TELEMETRY = ["lr", "--epochs", "2", "--sample-interval", "0.2", "--quiet"]
SHARED_RUNS = {
    1: {"dry": ["lr", "--dry-run"]},
    2: {"dry": ["lr", "--dry-run"], "async-dry": ["lr", "--async", "--dry-run"]},
    3: {"telemetry-sync": TELEMETRY, "telemetry-async": [*TELEMETRY, "--async"],
        "telemetry-async-mpi": [*TELEMETRY, "--async", "--shared-memory", "off"],
        "dry": ["lr", "--dry-run"], "async-dry": ["lr", "--async", "--dry-run"],
        "my_cnn-sync": ["{cnn}:build", "--steps", "60", "--eval-examples", "2000", "--quiet"],
        "my_cnn-async": ["{cnn}:build", "--async", "--steps", "60", "--eval-examples", "2000",
                         "--quiet"],
        "fp16-sync": ["lr", "--compression", "fp16", "--steps", "10", "--quiet"],
        "fp16-async": ["lr", "--async", "--compression", "fp16", "--steps", "10", "--quiet"],
        "powersgd-sync": ["lr", "--compression", "powersgd", "--compression-warmup-steps", "0",
                          "--steps", "10", "--quiet"],
        "topk-sync": ["lr", "--compression", "topk", "--compression-warmup-steps", "0",
                      "--steps", "10", "--quiet"],
        "powersgd-async": ["lr", "--async", "--compression", "powersgd", "--steps", "10",
                           "--quiet"],
        "topk-async": ["lr", "--async", "--compression", "topk", "--steps", "10", "--quiet"]},
    4: {"dry": ["lr", "--dry-run"], "async-dry": ["lr", "--async", "--dry-run"]},
}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(np, name)``: (run directory, runs.csv row, the launch's stdout) of
    SHARED_RUNS[np][name], on the real MNIST; made once per session, all of one -np's
    runs in one launch (:func:`once_per_session`, :func:`in_one_launch`)."""
    def run(np_: int, name: str):
        assert name in SHARED_RUNS[np_], f"add {name!r} to SHARED_RUNS[{np_}]"
        made = once_per_session(tmp_path_factory, f"shared-np{np_}",
                                lambda out: _shared_launch(np_, out))
        run_dir, row = made["runs"][name]
        return Path(run_dir), row, made["stdout"]

    return run


def _shared_launch(np_: int, out: Path) -> dict:
    out.mkdir()
    cnn = out / "my_cnn.py"
    cnn.write_text(MY_CNN)
    launch: dict = {}
    found = named_runs_in_one_launch(np_, {
        name: [arg.format(cnn=cnn) for arg in args] + ["--data-dir", mnist_dir()]
        for name, args in SHARED_RUNS[np_].items()}, out, launch)
    return {"runs": {name: (str(d), row) for name, (d, row) in found.items()}, **launch}


# ---- small file systems: full and read-only disks -------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(kib, read_only=False)``: a directory with a tmpfs of ``kib`` KiB mounted on
    it (a disk that fills up, or a read-only one), unmounted after the test. Skips where
    mounting is not permitted (not root, a container without CAP_SYS_ADMIN)."""
    mounted = []

    def mount(kib: int, read_only: bool = False) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        options = f"size={kib}k" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'})"
                        ": the full and read-only disk cases need one (run as root)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path, leave_kib: int) -> Path:
    """Fill the file system of ``directory`` but ``leave_kib`` KiB with a filler file."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(bytes(max(0, free - leave_kib * 1024)))
    return filler


# ---- the user's own data, made by the tests: small and learnable ----------------------
def learnable_images(n: int, seed: int, size: int = 32, channels: int = 3, classes: int = 10):
    """uint8 images whose class k is a bright band at rows 3k..3k+2 on noise (and, in
    colour, in channel k % 3), with their labels: learnable in a few dozen steps."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 90, (n, size, size, channels)).astype(np.uint8)
    for i, k in enumerate(y):
        x[i, 3 * k:3 * k + 3, :, k % channels] = 255
    return x, y


def write_cifar(directory: Path, per_batch: int = 100, n_test: int = 200) -> Path:
    """A CIFAR-10 python-batches directory (data_batch_1..5, test_batch, batches.meta)."""
    directory.mkdir(parents=True, exist_ok=True)

    def dump(name, x, y):
        rows = x.transpose(0, 3, 1, 2).reshape(len(x), -1)  # CIFAR's channel-first rows
        with open(directory / name, "wb") as f:
            pickle.dump({b"data": rows, b"labels": [int(v) for v in y]}, f)
    for b in range(1, 6):
        dump(f"data_batch_{b}", *learnable_images(per_batch, b))
    dump("test_batch", *learnable_images(n_test, 99))
    with open(directory / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"class{k}".encode() for k in range(10)]}, f)
    return directory


def write_image_folder(directory: Path, n: int = 300, size: int = 20, classes: int = 4,
                       split: bool = False, suffix: str = ".png") -> Path:
    """Class sub-folders of grayscale images (under train/ and test/ if ``split``)."""
    from PIL import Image

    x, y = learnable_images(n, 7, size, 1, classes)
    for i, (image, label) in enumerate(zip(x, y)):
        part = ("test" if i % 5 == 0 else "train") if split else ""
        folder = directory / part / f"c{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[..., 0], "L").save(folder / f"{i}{suffix}")
    return directory


def synthetic_shard(rank: int, shard: int, workers: int):
    """A Dataset of random LR-shaped examples, seeded by ``rank``: ``shard`` training
    examples (this worker's shard of ``shard x workers``) and 20 test examples."""
    from mpitrain.data import Dataset

    rng = np.random.default_rng(rank)
    return Dataset("synthetic", "test", 10, (28, 28, 1), shard * max(1, workers),
                   x_train=rng.random((shard, 28, 28, 1), dtype=np.float32),
                   y_train=rng.integers(0, 10, shard).astype(np.int32),
                   x_test=rng.random((20, 28, 28, 1), dtype=np.float32),
                   y_test=rng.integers(0, 10, 20).astype(np.int32))


#: The benchmarks' smoke runs in three files, so that three pytest workers can share
#: it: the comparisons with other engines (tests/e2e/test_bench_smoke_engines.py), those
#: on the emulated cluster, which take turns with tests/e2e/test_netns.py to bring it up
#: and down (tests/e2e/test_bench_smoke_cluster.py), and every other one
#: (tests/e2e/test_bench.py).
ENGINE_COMPARISONS = ("engines", "async_engines", "ddp", "horovod_api")
ON_THE_EMULATED_CLUSTER = ("netns", "compression", "servers")
#: benchmarks whose smoke another test file runs, beside what it checks of the same setup:
#: {name: (the file, how it runs the benchmark)}
SMOKED_ELSEWHERE = {"mpis": ("tests/e2e/test_mpis.py", '"bench", "mpis", "--quick"'),
                    "server_memory": ("tests/e2e/test_server_memory.py",
                                      "server_memory.main("),
                    "elastic": ("tests/e2e/test_netns.py", "elastic.main(")}


def bench(names, *args, timeout=1500):
    """``python -m bench NAMES --quick ARGS``: (its output directory, summary.md's text)."""
    # the benchmarks read MNIST from MPITRAIN_DATA_DIR: the same copy the tests use
    result = run_bounded([sys.executable, "-m", "bench", ",".join(names), "--quick", *args],
                         timeout, env=mpi_env(MPITRAIN_DATA_DIR=str(mnist_dir())))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = Path(result.stdout.split("summary: ")[-1].split()[0])
    text = summary.read_text()
    # every benchmark ran to its end ("ran to completion: failed" is what a crash leaves)
    assert f"Minutes per benchmark: {names[0]} " in text and "failed:" not in text
    for name in names:
        assert f"| {name} |" in text, f"{name}: no check in summary.md"
    return summary.parent, text
