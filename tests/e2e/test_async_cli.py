"""End-to-end async mode under real mpirun: smoke runs, results, bad input, accuracy."""

import os

import pytest

from conftest import mpirun, read_rows


def last_run(results_dir):
    return read_rows(results_dir / "runs.csv")[-1]


# -np 4 in the whole suite, with test_cli's dry run at -np 4 (one launch)
@pytest.mark.parametrize("np_", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_async_dry_run(np_, shared_run):
    run_dir, run, _ = shared_run(np_, "async-dry")
    workers = np_ - 1
    assert (run["mode"], run["workers"], run["status"]) == ("async", str(workers), "ok")
    # every worker pushes 2 gradients; each is applied exactly once
    assert run["pushes"] == run["applied"] == run["steps"] == str(2 * workers)
    hist = read_rows(run_dir / "staleness.csv")
    assert sorted({row["worker"] for row in hist}) == [str(r) for r in range(1, np_)]
    assert sum(int(row["count"]) for row in hist) == 2 * workers
    curve = read_rows(run_dir / "curve.csv")
    assert curve[0]["step"] == "0" and curve[-1]["step"] == str(2 * workers)
    assert float(run["server_updates_per_s"]) > 0 and float(run["worker_steps_per_s"]) > 0
    # LR's Nesterov momentum, less what the workers' asynchrony adds (1 - 1/N)
    assert float(run["server_momentum"]) == pytest.approx(max(0.0, 0.9 - (1 - 1 / workers)),
                                                          abs=1e-6)
    # the async server applies every update: it keeps the launcher's priority
    # (train/priority.py), also after the sync run before it in this process lowered it
    # for that run (the shared launch)
    assert run["server_nice"] == str(os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.slow  # quick: the bound itself, in tests/mpi under test_mpi_tier
def test_async_staleness_bound_recorded(mnist, tmp_path):
    result = mpirun(3, "lr", "--async", "--staleness", "1", "--steps", "20",
                    "--data-dir", mnist, "--results-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = last_run(tmp_path)
    assert run["staleness_bound"] == "1" and int(run["staleness_max"]) <= 1


@pytest.mark.parametrize("args,pattern", [
    (["--async", "--staleness", "-1"],
     "--staleness must be auto, none, or 0 or a positive integer"),
    (["--staleness", "2"], "--staleness bounds the async parameter server: add --async"),
])
def test_async_usage_errors(args, pattern):
    result = mpirun(3, "lr", *args, timeout=60)
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.startswith("mpitrain: error")]
    assert len(lines) == 1 and pattern in lines[0]


#: How far default async (unbounded staleness) LR may land from sync's accuracy. Its
#: gradients' staleness, so its accuracy, follows the interleaving of the ranks, which
#: the host's load sets: at -np 3, sync's 0.9161 every time, async's 0.9138-0.9175 in
#: 6 runs beside other jobs here and 0.9053 once in a CI run beside the quick benchmarks.
ASYNC_TOLERANCE = 0.015


@pytest.mark.slow
def test_async_accuracy_close_to_sync(lr_accuracy):
    """Async LR at -np 3 and 4 within ASYNC_TOLERANCE of sync, and with --servers 2
    within it of one server with as many workers; --staleness 0 (every gradient fresh,
    so no interleaving to vary) within 0.5 pp."""
    accuracy = lr_accuracy
    found = {}
    for np_ in (3, 4):
        found[f"sync{np_}"] = sync = accuracy(np_)
        found[f"async{np_}"] = accuracy(np_, "--async")
        assert abs(found[f"async{np_}"] - sync) <= ASYNC_TOLERANCE, found
    # two parameter servers and two workers (-np 4) against one and two (-np 3)
    found["servers2_4"] = accuracy(4, "--async", "--servers", "2")
    assert abs(found["servers2_4"] - found["async3"]) <= ASYNC_TOLERANCE, found
    found["ssp0_3"] = accuracy(3, "--async", "--staleness", "0")
    print("LR test accuracy:", found)
    assert abs(found["ssp0_3"] - found["sync3"]) <= 0.005, found
