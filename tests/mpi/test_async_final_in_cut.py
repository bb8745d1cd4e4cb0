"""--servers K: a pipelined worker's FINAL push that comes while rank 0 drains for a cut
(an evaluation point), under real MPI. Needs two servers and two workers (-np 4: the
whole suite's MPI tier); skips below."""

import time

import pytest

from mpitrain.comm import Role
from mpitrain.train import asynchronous
from mpitrain.train.evaluation import Stopwatch
from test_async_protocol import comm, context, replica, run_sharded, slowed  # noqa: F401 (fixtures)

NEEDS_TWO_WORKERS = "two servers and two workers: runs under mpirun -np 4+ (test_mpi_tier)"


def first_step_late(ctx, seconds: float):
    """``ctx`` whose worker sleeps ``seconds`` before its first gradient only."""
    calls = []
    inner = slowed(ctx, 0.0)
    real = inner.replica._overrides["grad_at"]

    def grad_at(*args):
        if not calls:
            time.sleep(seconds)
        calls.append(1)
        return real(*args)

    inner.replica._overrides["grad_at"] = grad_at
    return inner


@pytest.mark.parametrize("shared_memory", ["on", "off"])
def test_a_final_push_while_a_cut_drains_ends_the_worker(comm, replica, shared_memory):
    """Rank 2 runs its 16 steps (pipelined) while rank 3 sleeps before its first:
    rank 0 starts draining for the cut at update 16 after update 14 (its own lease and
    rank 3's are owed), rank 2's push 15 comes in as the cut's extra (its next push
    was sent before it waits for an answer) and that push, 16, is FINAL. Rank 0 once
    left rank 2 among the extras after it: the cut was never made, rank 2's FINAL push
    was taken again from its completed receive (applied twice) and the run hung until
    --timeout. Now the cut is made once rank 3's pushes are in, with rank 2 at its last
    step, and both servers applied every push once. Whether the messages lie in memory
    rank 0 shares or travel whole."""
    if comm.size != 4:
        pytest.skip(NEEDS_TWO_WORKERS)
    ctx = context(comm, replica, 16, servers=2, eval_every=1, pipeline="on",
                  shared_memory=shared_memory)
    if comm.rank == 3:
        ctx = first_step_late(ctx, 3.0)
    positions = []
    if ctx.role is Role.SERVER:  # (record each cut's worker positions)
        server = asynchronous.Server(ctx, Stopwatch())
        cut = server.peers.cut

        def recording(where, own, then):
            positions.append(dict(where))
            cut(where, own, then)
        server.peers.cut = recording
        try:
            summary = server.run()
        finally:
            comm.servers = 1
    else:
        server, summary = run_sharded(ctx)
    counts = comm.allgather_objects(
        {r: w.applied for r, w in server.accounts.items()} if server else summary.steps)
    assert counts[0] == counts[1] == {2: 16, 3: 16}, counts
    assert counts[2] == counts[3] == 16
    if ctx.role is Role.SERVER:
        assert positions and positions[0][2] == 16, positions  # (it came while draining)
        assert server.version == 32
    comm.barrier()
