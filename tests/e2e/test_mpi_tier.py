"""Run the MPI-tier tests (tests/mpi) under real mpirun at several process counts."""


import pytest

from conftest import REPO, mpirun_cmd, run_bounded


@pytest.mark.parametrize("np_", [2, 4])  # 1: plain pytest; 4 covers the 3+ cases
def test_mpi_tier_at_process_count(np_):
    cmd = mpirun_cmd(np_, "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
                     str(REPO / "tests" / "mpi"), module="pytest")
    result = run_bounded(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "passed" in result.stdout and "failed" not in result.stdout
