"""Run the MPI-tier tests (tests/mpi) under real mpirun at several process counts."""


import pytest

from conftest import REPO, mpirun_cmd, run_bounded


# 1: plain pytest. The quick tier runs -np 3, where the 2+ and 3+ cases all run; -np 2
# (one worker) and 4 (oversubscribed) are in the whole suite.
@pytest.mark.parametrize("np_", [pytest.param(2, marks=pytest.mark.slow), 3,
                                 pytest.param(4, marks=pytest.mark.slow)])
def test_mpi_tier_at_process_count(np_):
    cmd = mpirun_cmd(np_, "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
                     str(REPO / "tests" / "mpi"), module="pytest")
    result = run_bounded(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "passed" in result.stdout and "failed" not in result.stdout
