"""MPI-tier tests of the start-up's regroup (mpitrain.comm.regroup): they pass at ANY
process count (tests/e2e/test_mpi_tier.py runs them under mpirun -np 2, 3, 4).

No rank dies here (the tier's ranks are pytest processes): rank 1 reports the last rank
lost, as a rank that saw it die would, and the last rank plays dead (takes no part).
The deaths themselves: tests/e2e/test_recovery.py and test_mpis.py.
"""

import numpy as np
import pytest

from mpitrain.comm import Comm, StartupWatch, go_on_without
from mpitrain.comm.regroup import survivable
from mpitrain.errors import RanksLost

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def comm():
    return Comm.world(timeout=TIMEOUT)


def test_a_run_goes_on_with_its_servers_and_a_worker():
    assert survivable([0, 1, 3], servers=1)
    assert not survivable([1, 2], servers=1)  # the server lost
    assert not survivable([0], servers=1)  # no worker left
    assert not survivable([0, 2, 3], servers=2)  # a parameter server of a share lost
    assert survivable([0, 1, 3], servers=2)


def test_the_ranks_not_lost_agree_and_go_on_without_the_lost_one(comm):
    if comm.size < 3:
        pytest.skip("needs a server, a worker that goes on and one left out: runs under "
                    "mpirun -np 3+ (test_mpi_tier)")
    left_out = comm.size - 1
    watch = StartupWatch(comm)
    comm.startup_check = watch.check
    if comm.rank == left_out:  # dead: rank 0 tells it nothing
        comm.startup_check = None
        watch.close()
        return
    if comm.rank == 1:  # it saw the loss itself
        lost = RanksLost("rank 1 saw it", lost=[left_out])
    else:  # the others hear of it while they wait (for a message that never comes)
        never = comm.irecv(np.zeros(1), comm.size - 1 - comm.rank, 999, "control", "nothing")
        with pytest.raises(RanksLost) as raised:
            comm.wait(never)
        comm.cancel(never)
        lost = raised.value
        assert (lost.lost == [left_out]) if comm.rank == 0 else lost.decided is not None
    going_on = go_on_without(comm, watch, lost, servers=1)
    assert comm.startup_check is None and watch.pending is None
    assert going_on.size == comm.size - 1 and going_on.world_ranks == list(range(left_out))
    assert going_on.rank == comm.rank and (going_on.workers is None) == (comm.rank == 0)
    assert going_on.allgather_objects(comm.rank) == list(range(left_out))
