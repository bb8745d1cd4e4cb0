"""comm.processes.PeerProcesses: the other ranks' processes on this host, seen
directly. A stand-in communicator (hosts, pids, names) with real processes."""

import os
import subprocess
import sys

import pytest

from mpitrain.comm import PeerProcesses
from mpitrain.errors import CommTimeout


class Ranks:
    """What PeerProcesses reads of a Comm: this rank, every rank's host and pid."""

    def __init__(self, pids, hosts):
        self.rank, self.size, self.host = 1, len(pids), "here"
        self.pids, self.hosts = pids, hosts
        self.world_ranks = list(range(len(pids)))

    def name(self, rank):
        return f"rank {rank} on {self.hosts[rank]}"


def test_the_watch_names_a_server_that_died_and_only_one_on_this_host():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ranks = Ranks([server.pid, os.getpid()], ["here", "here"])
        check = PeerProcesses(ranks, [0]).watch(0, "the parameter server")
        check()  # alive: nothing to say
        server.kill()
        server.wait()
        with pytest.raises(CommTimeout, match=rf"rank 1 on here stops: the parameter server, "
                                              rf"rank 0 on here \(pid {server.pid}\), has died"):
            check()
    finally:
        server.kill()
    elsewhere = Ranks([server.pid, os.getpid()], ["there", "here"])
    assert PeerProcesses(elsewhere, [0]).watch(0, "the parameter server") is None


def test_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ranks = Ranks([child.pid, os.getpid()], ["here", "here"])
    processes = PeerProcesses(ranks, [0])
    assert processes.alive(1)  # itself: never watched, so taken as alive
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not processes.alive(0)
    child.wait()


def test_a_rank_mpi_reported_dead_is_not_alive_on_any_host(monkeypatch):
    """Under ULFM (Open MPI 5, --with-ft ulfm) MPI names the dead ranks wherever they ran
    (comm.pending.FAILED_RANKS): the async server drops them at once, as it does a
    process gone on its own host."""
    from mpitrain.comm import pending

    elsewhere = Ranks([os.getpid(), os.getpid(), os.getpid()], ["here", "here", "there"])
    processes = PeerProcesses(elsewhere)
    assert processes.alive(0) and processes.alive(2)
    monkeypatch.setattr(pending, "FAILED_RANKS", pending.FAILED_RANKS)
    pending.FAILED_RANKS.add(2)
    try:
        assert not processes.alive(2) and processes.alive(0)
    finally:
        pending.FAILED_RANKS.discard(2)
