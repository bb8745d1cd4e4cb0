"""The async parameter server's memory is flat in the number of workers (issue 51): rank
0's peak RSS, from the run's telemetry, at -np 7 (six workers) against -np 3 (two), for
AlexNet at 32x32 (27.5M parameters, 110 MB a message), large enough that a server
keeping three messages a worker grew by about 330 MB a worker (the code before the
pools failed every case here: ratios 1.4 to 1.7). One launch per process count, each
of three runs: one server in shared memory (the one-host default), two servers
(``--servers 2``: both servers' memory), and one server through MPI (``--shared-memory
off``: its receive and reply pools). The pools' logic: tests/unit/test_message_pool.py;
the protocol with them under MPI: tests/mpi/test_async_protocol.py."""

import pytest

from conftest import named_runs_in_one_launch, read_rows

pytestmark = pytest.mark.slow

#: rank 0's peak RSS with six workers over its peak with two, at most
BOUND = 1.25
COMMON = ["alexnet", "--async", "--image-size", "32", "--batch-size", "8", "--steps", "4",
          "--sample-interval", "0.1", "--quiet"]
RUNS = {"one-server": [], "two-servers": ["--servers", "2"],
        "through-mpi": ["--shared-memory", "off"]}


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """{(run, np, rank): that rank's peak rss_mb in the run's telemetry.csv}."""
    out, found = tmp_path_factory.mktemp("server-memory"), {}
    hostfile = out / "hostfile"  # (seven ranks on this machine: hostfiles/local has 4 slots)
    hostfile.write_text("localhost slots=7\n")
    for np_ in (3, 7):
        (out / f"np{np_}").mkdir()
        runs = named_runs_in_one_launch(np_, {name: [*COMMON, *args]
                                              for name, args in RUNS.items()},
                                        out / f"np{np_}", timeout=1200, hostfile=hostfile)
        for name, (run_dir, row) in runs.items():
            assert row["status"] == "ok", row
            for sample in read_rows(run_dir / "telemetry.csv"):
                key = (name, np_, int(sample["rank"]))
                found[key] = max(found.get(key, 0.0), float(sample["rss_mb"]))
    return found


@pytest.mark.parametrize("run", list(RUNS))
def test_the_servers_peak_memory_is_flat_from_two_to_six_workers(peaks, run):
    servers = 2 if run == "two-servers" else 1
    for rank in range(servers):
        two, six = peaks[(run, 3, rank)], peaks[(run, 7, rank)]
        assert six <= BOUND * two, (f"{run}: rank {rank}'s peak RSS {six:.0f} MB with "
                                    f"{7 - servers} workers, {two:.0f} MB with "
                                    f"{3 - servers}: more than {BOUND}x")
