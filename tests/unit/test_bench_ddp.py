"""bench ddp's handling of a PyTorch DDP run that fails: a worker killed by a signal
(as gloo's transport aborts a process on a broken connection) is run once more, any
other failure ends the benchmark, and the error names what failed. A stand-in
interpreter plays torchrun (its report of a failed worker, then a result), so the
retry logic runs without PyTorch; the DDP runs themselves are smoked in
tests/e2e/test_bench_smoke_engines.py."""

import json
import subprocess
import sys

import pytest

from bench import ddp

#: torchrun's report when a worker aborts (from a CI run's output): the worker it
#: terminated afterwards first, the root cause last
REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
bench.torch_ddp FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 1038)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 1038
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 1039)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 1039
======================================================
"""

RESULT = {"epochs": 3, "epoch_s": [2.0, 1.0, 1.0], "train_s": 4.0, "eval_s": 0.1,
          "test_accuracy": 0.9, "steps_per_epoch": 10, "parameters": 61706}

#: a stand-in for torchrun's interpreter: fails as FAILURES[i] says on its i-th call
#: (stderr, exit code), then writes RESULT to --json-out
FAKE = """#!{python}
import json, sys
from pathlib import Path
calls = Path({calls!r})
n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
failures = {failures!r}
if n < len(failures):
    sys.stderr.write("terminate called after throwing an instance of 'gloo::IoException'\\n"
                     "  what():  Connection reset by peer\\n" + failures[n][0])
    sys.exit(failures[n][1])
out = sys.argv[sys.argv.index("--json-out") + 1]
Path(out).write_text(json.dumps({result!r}))
"""


def fake_python(tmp_path, failures):
    script = tmp_path / "python"
    script.write_text(FAKE.format(python=sys.executable, calls=str(tmp_path / "calls"),
                                  failures=failures, result=RESULT))
    script.chmod(0o755)
    return str(script)


def calls(tmp_path):
    return int((tmp_path / "calls").read_text())


def test_the_root_cause_signal_is_read_from_torchruns_report():
    done = subprocess.CompletedProcess([], 1, "", "Traceback ...\n" + REPORT)
    assert ddp.killed_by(done) == 6
    assert ddp.killed_by(subprocess.CompletedProcess([], 1, "", "ValueError: bad\n")) == 0


def test_the_error_lines_keep_the_abort_and_drop_traceback_frames():
    lines = ddp.error_lines('  File "run.py", line 3, in main\nfindfont: Font family\n'
                            "terminate called after throwing\n" + REPORT)
    assert lines[0] == "terminate called after throwing"
    assert not any(l.lstrip().startswith(("File ", "findfont")) for l in lines)
    assert "  exitcode  : -6 (pid: 1039)  (SIGABRT)" in lines


def test_a_worker_killed_by_a_signal_is_run_once_more(tmp_path, capsys):
    python = fake_python(tmp_path, [(REPORT, 1)])
    measured = ddp.ddp_side(python, "lenet", 2, quick=True, compute_steps=0)
    assert calls(tmp_path) == 2
    assert measured["epoch_time_s"] == pytest.approx(4.0 / 3)
    printed = capsys.readouterr().out
    assert "killed by signal 6" in printed and "running it once more" in printed
    assert "gloo::IoException" in printed


def test_a_second_death_ends_the_benchmark_naming_it(tmp_path):
    python = fake_python(tmp_path, [(REPORT, 1), (REPORT, 1)])
    with pytest.raises(RuntimeError, match="killed by signal 6") as failed:
        ddp.ddp_side(python, "lenet", 2, quick=True, compute_steps=0)
    assert calls(tmp_path) == 2 and "what():  Connection reset by peer" in str(failed.value)


def test_a_failure_without_a_signal_is_not_retried(tmp_path):
    python = fake_python(tmp_path, [("ValueError: no such model\n", 1)])
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\)"):
        ddp.ddp_side(python, "lenet", 2, quick=True, compute_steps=0)
    assert calls(tmp_path) == 1
