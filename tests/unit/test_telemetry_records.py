"""telemetry.node_summary: the per-node columns of runs.csv, and its cost in the hosts."""

from mpitrain.results import telemetry


def sample(t, rank, host, rss, cpu=None, rx=0, tx=0):
    row = {"time_s": t, "rank": rank, "host": host, "role": "worker", "cpu_percent": 50.0,
           "rss_mb": rss}
    if cpu is not None:  # the host's lowest rank samples the host
        row.update(host_cpu_percent=cpu, net_rx_bytes=rx, net_tx_bytes=tx)
    return row


def test_node_summary_by_hand():
    """Two hosts, ranks 0 and 1 on a, rank 2 on b; figures worked out by hand."""
    merged = {"telemetry": [
        sample(1.0, 0, "a", 100.0, cpu=40.0, rx=2**20, tx=0),
        sample(1.0, 1, "a", 200.0),
        sample(1.0, 2, "b", 300.0, cpu=10.0, rx=0, tx=3 * 2**20),
        sample(2.0, 0, "a", 110.0, cpu=60.0, rx=3 * 2**20, tx=2**20),
        sample(2.0, 1, "a", 220.0),
        sample(2.0, 2, "b", 330.0, cpu=30.0, rx=0, tx=5 * 2**20),
    ], "timing": [], "comm": [{"sent_bytes": 5}, {"sent_bytes": 7}, {"sent_bytes": 0}]}
    out = telemetry.node_summary(merged, ["a", "a", "b"])
    assert out == {
        "node0_host": "a", "node0_cpu_avg": 50.0, "node0_cpu_max": 60.0,
        "node0_rss_mb_avg": 105.0 + 210.0, "node0_rss_mb_max": 110.0 + 220.0,
        "node0_rx_mb": 3.0, "node0_tx_mb": 1.0,
        "node1_host": "b", "node1_cpu_avg": 20.0, "node1_cpu_max": 30.0,
        "node1_rss_mb_avg": 315.0, "node1_rss_mb_max": 330.0,
        "node1_rx_mb": 0.0, "node1_tx_mb": 5.0,
        "mpi_bytes": 12}


def test_node_summary_without_samples():
    """Sampling off (--sample-interval 0): the node columns are there, empty or zero."""
    out = telemetry.node_summary({"telemetry": [], "timing": [], "comm": []}, ["a", "b"])
    assert out["node1_host"] == "b" and out["node1_cpu_avg"] == "" and out["node1_rx_mb"] == ""
    assert out["node0_rss_mb_avg"] == 0 and out["mpi_bytes"] == 0


class CountedRows(list):
    """A list that counts the passes made over it."""

    passes = 0

    def __iter__(self):
        CountedRows.passes += 1
        return super().__iter__()


def test_node_summary_reads_the_samples_once_whatever_the_hosts():
    """Rank 0 summarises every host's samples at the end of a run: one pass over them,
    not one per host (quadratic in the hosts: seconds at a few hundred hosts)."""
    for hosts in (3, 64):
        names = [f"node{h}" for h in range(hosts)]
        rows = CountedRows(sample(float(t), h, names[h], 100.0, cpu=50.0)
                           for t in range(5) for h in range(hosts))
        CountedRows.passes = 0
        out = telemetry.node_summary({"telemetry": rows, "timing": [], "comm": []}, names)
        assert out[f"node{hosts - 1}_rss_mb_avg"] == 100.0
        assert CountedRows.passes <= 2, (hosts, CountedRows.passes)


def test_only_the_workers_lost_in_this_job_are_left_out_of_the_gather():
    """A run's lost workers include its earlier sessions' (for runs.csv), but a resumed
    run's ranks are new processes: the gather skips only the ranks whose lost process
    is this job's (rank 5, lost at -np 17, is a live worker of the -np 9 job resuming
    it; before, its telemetry was missing there)."""
    from mpitrain.train.asynchronous.recovery import lost_in_this_job

    pids = [100 + r for r in range(9)]  # this job's
    earlier = [{"rank": 5, "pid": 7005}, {"rank": 12, "pid": 7012},  # an -np 17 session's
               {"rank": 3}]  # recorded before losses carried their pid
    assert lost_in_this_job(earlier, pids) == []
    assert lost_in_this_job([*earlier, {"rank": 2, "pid": 102}], pids) == [2]
