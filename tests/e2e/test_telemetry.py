"""Telemetry end to end: one short sync and one short async run under mpirun -np 3.

Checks the numbers against arithmetic, not just that files exist: every rank
sampled; MPI payload bytes equal steps x model size; time breakdowns add up to
the epoch wall time; the parameter server moves the most traffic and holds the
most memory.
"""

import json
from collections import defaultdict

import pytest

from conftest import TELEMETRY, read_rows

N_PARAMS = 7850  # LR: 784 x 10 + 10
HEADER_FLOATS = 8  # async messages carry an 8-float header
EPOCHS = int(TELEMETRY[TELEMETRY.index("--epochs") + 1])


@pytest.fixture(scope="module")
def runs(shared_run):
    # one launch (each run counts its own traffic and samples from its own start)
    return {name: shared_run(3, f"telemetry-{name}")[:2]
            for name in ("sync", "async", "async-mpi")}


def by_rank(rows, key="rank"):
    out = defaultdict(list)
    for r in rows:
        out[int(r[key])].append(r)
    return out


@pytest.mark.parametrize("name", ["sync", "async"])
def test_every_rank_sampled(runs, name):
    run_dir, _ = runs[name]
    samples = by_rank(read_rows(run_dir / "telemetry.csv"))
    assert sorted(samples) == [0, 1, 2]
    roles = {rank: rows[0]["role"] for rank, rows in samples.items()}
    assert roles == {0: "server", 1: "worker", 2: "worker"}
    for rank, rows in samples.items():
        assert all(float(r["rss_mb"]) > 50 for r in rows)
        assert all(float(r["cpu_percent"]) >= 0 for r in rows)
        # node-level columns only on the lowest rank of the host (no double counting)
        assert all((r["host_cpu_percent"] != "") == (rank == 0) for r in rows)


def test_sync_traffic_matches_arithmetic(runs):
    run_dir, row = runs["sync"]
    steps = int(row["steps"])  # per worker; each is one allreduce of the fused gradient
    comm = {(int(r["rank"]), r["kind"]): r for r in read_rows(run_dir / "comm.csv")}
    fused = (N_PARAMS + 1 + 2) * 4  # gradient + stop flag + one status slot per worker
    for worker in (1, 2):
        allreduce = comm[(worker, "allreduce")]
        assert int(allreduce["sent_msgs"]) == int(allreduce["recv_msgs"]) == steps
        assert int(allreduce["sent_bytes"]) == int(allreduce["recv_bytes"]) == steps * fused
    # rank 0 receives the weights once per evaluation (every epoch) from worker 1 only
    assert int(comm[(0, "pull")]["recv_bytes"]) == EPOCHS * N_PARAMS * 4
    assert int(comm[(1, "pull")]["sent_bytes"]) == EPOCHS * N_PARAMS * 4
    assert (2, "pull") not in comm
    # the starting position (step, clock offset, whether compression states follow: three
    # float64), then the initial weights
    assert int(comm[(0, "broadcast")]["sent_bytes"]) == 3 * 8 + N_PARAMS * 4


@pytest.mark.parametrize("name", ["async", "async-mpi"])
def test_async_traffic_matches_arithmetic(runs, name):
    """Whole messages through MPI (--shared-memory off), or, on one host (auto), only
    their headers, with the payloads counted as 'shared' by who wrote and who read
    them."""
    run_dir, row = runs[name]
    comm = {(int(r["rank"]), r["kind"]): r for r in read_rows(run_dir / "comm.csv")}
    header = HEADER_FLOATS * 4
    payload = N_PARAMS * 4
    through_mpi = header + (payload if name == "async-mpi" else 0)
    in_shared = 0 if name == "async-mpi" else payload
    pushes = 0
    for worker in (1, 2):
        push = comm[(worker, "push")]
        n = int(push["sent_msgs"])
        pushes += n
        assert int(push["sent_bytes"]) == n * through_mpi
        # the initial lease, then one reply per push; the last reply is header-only
        pull = comm[(worker, "pull")]
        assert int(pull["recv_msgs"]) == n + 1
        assert int(pull["recv_bytes"]) == n * through_mpi + header
        shared = comm.get((worker, "shared"), {"sent_bytes": 0, "recv_bytes": 0})
        assert int(shared["sent_bytes"]) == int(shared["recv_bytes"]) == n * in_shared
    assert pushes == int(row["pushes"]) == int(row["applied"])
    assert int(comm[(0, "push")]["recv_bytes"]) == pushes * through_mpi
    assert int(comm[(0, "pull")]["sent_bytes"]) == pushes * through_mpi + 2 * header
    shared = comm.get((0, "shared"), {"sent_bytes": 0, "recv_bytes": 0})
    assert int(shared["sent_bytes"]) == int(shared["recv_bytes"]) == pushes * in_shared


@pytest.mark.parametrize("name", ["sync", "async"])
def test_timing_rows_cover_the_run(runs, name):
    """Each rank's timing rows (an epoch's seconds, split into compute, comm and wait:
    PhaseTimer keeps the split whole by construction) cover the run's training: the
    rows of the ranks whose clock is the run's (sync: each worker, whose last report
    ends the run; async: the server) add up to the run's wall time, and no rank's to
    more than the run and its finish (a timer restarted at each step, or before the
    set-up, fails)."""
    run_dir, row = runs[name]
    rows = read_rows(run_dir / "timing.csv")
    workers = [r for r in rows if r["role"] == "worker"]
    assert sorted({int(r["rank"]) for r in workers}) == [1, 2]
    assert {float(r["epoch"]) for r in workers} == {1.0, 2.0}
    assert all(float(r["compute_s"]) > 0 for r in workers)
    server = [r for r in rows if r["role"] == "server"]
    assert server and all(float(r["wait_s"]) > 0 for r in server)
    wall, finish = float(row["wall_time_s"]), float(row["finish_s"])
    totals = {rank: sum(float(r["wall_s"]) for r in ranks) for rank, ranks in by_rank(rows).items()}
    # (the clocks start and stop at nearby moments, not the same ones: a set-up step
    # apart at the start, the final weights' send at the end)
    for rank in ([1, 2] if name == "sync" else [0]):
        assert totals[rank] >= 0.8 * wall - 0.05, (rank, totals, wall)
    for rank, total in totals.items():
        assert total <= 1.1 * (wall + finish) + 0.1, (rank, totals, wall, finish)


@pytest.mark.parametrize("name", ["sync", "async"])
def test_wall_time_ends_at_the_last_update_and_finish_counts_the_rest(runs, name):
    # in both modes (and like TensorFlow's own timings) the run's wall time is its
    # training time; the final evaluation and checkpoint are finish_s, after it
    run_dir, row = runs[name]
    last = read_rows(run_dir / "curve.csv")[-1]  # the final evaluation, of the last update
    ahead = float(row["wall_time_s"]) - float(last["wall_time_s"])
    rounding = 0.0006  # runs.csv keeps 3 decimals, curve.csv 4
    if name == "sync":  # the final report's clock, on both
        assert abs(ahead) <= rounding
    else:  # evaluated at the last update; the run ends after its last replies are sent
        assert -rounding <= ahead < 1.0
    assert float(row["finish_s"]) > 0


def test_runs_csv_has_resource_columns(runs):
    _, row = runs["sync"]
    for column in ("node0_host", "node0_cpu_avg", "node0_cpu_max", "node0_rss_mb_avg",
                   "node0_rss_mb_max", "node0_rx_mb", "node0_tx_mb", "mpi_bytes"):
        assert row[column] != "", column
    assert float(row["node0_rss_mb_max"]) >= float(row["node0_rss_mb_avg"]) > 100
    assert int(row["mpi_bytes"]) > 0


def test_tensorboard_events_written(runs):
    run_dir, _ = runs["sync"]
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100


def test_async_parameter_server_carries_most(runs):
    """What the reports observed: the PS moves the most traffic and holds the most memory."""
    run_dir, _ = runs["async"]
    moved = defaultdict(int)
    for r in read_rows(run_dir / "comm.csv"):
        moved[int(r["rank"])] += int(r["sent_bytes"]) + int(r["recv_bytes"])
    assert max(moved, key=moved.get) == 0
    # rank 0 serves both workers: their traffic together, each about half of it (the
    # reports: 3x a worker's with three)
    assert moved[0] == pytest.approx(moved[1] + moved[2], rel=0.01)
    assert moved[1] == pytest.approx(moved[2], rel=0.05)
    peak = defaultdict(float)
    for r in read_rows(run_dir / "telemetry.csv"):
        peak[int(r["rank"])] = max(peak[int(r["rank"])], float(r["rss_mb"]))
    assert max(peak, key=peak.get) == 0, dict(peak)
    meta = json.loads((run_dir / "config.json").read_text())
    assert meta["config"]["mode"] == "async" and len(meta["ranks"]) == 3
