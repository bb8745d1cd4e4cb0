"""The async parameter server's memory is flat in the number of workers (issue 51): the
server's peak RSS with six workers against two, for AlexNet at 32x32 (27.5M parameters,
110 MB a message), large enough that a server keeping three messages a worker grew by
about 330 MB a worker (the code before the pools failed every case here: ratios 1.4 to
1.7). Measured by ``bench server_memory`` (this is its smoke too): the real server with
the real model, and workers that push zeros without TensorFlow as fast as MPI takes
them (every worker's message in flight at once, the pools' worst case; a server's memory
does not depend on how a gradient was computed), three ways: one server through MPI
(``--shared-memory off``: its receive and reply pools), in shared memory (the one-host
default), and two servers (``--servers 2``: both servers' memory). The pools' logic:
tests/unit/test_message_pool.py; the protocol with them under MPI and real workers:
tests/mpi/test_async_protocol.py."""

import pytest

from bench import server_memory
from conftest import read_rows

pytestmark = pytest.mark.slow


def test_the_servers_peak_memory_is_flat_from_two_to_six_workers(tmp_path):
    result = server_memory.main(["--workers", "2,6", "--image-size", "32"], out=tmp_path)
    rows = read_rows(tmp_path / "server_memory.csv")
    assert [(r["run"], r["workers"]) for r in rows] == [
        (run, workers) for run, _ in server_memory.RUNS for workers in ("2", "6")]
    assert all(float(r["message_mb"]) > 100 for r in rows)  # AlexNet's, not a smaller model's
    # a peak measured: the server holds the model's weights, a message's worth, and more
    assert all(float(r["server_peak_rss_mb"]) > float(r["message_mb"]) for r in rows)
    checks = result["checks"]
    assert len(checks) == len(server_memory.RUNS)
    for check in checks:  # each way's peak at six workers over its peak at two
        assert check["met"], f"{check['ratio']}: {check['value']} (bound {server_memory.BOUND})"
