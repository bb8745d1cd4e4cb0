"""A sync worker's link to rank 0 (train/sync.py ServerLink), with a fake communicator:
what its reports say. The protocol itself runs under real mpirun (tests/mpi, tests/e2e)."""

from types import SimpleNamespace

import numpy as np

from mpitrain.train.protocol import EVALUATE, FINAL, REPORT, SAVE, TAG_REPORT, Header
from mpitrain.train.sync import ServerLink


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sent:
    """A send that completed at once; keeps a copy of what it sent."""

    done = True

    def __init__(self, buf, tag, kind):
        self.buf, self.tag, self.kind = np.array(buf, copy=True), tag, kind

    def test(self) -> bool:
        return True


class FakeComm:
    def __init__(self):
        self.sent = []
        self.workers = SimpleNamespace(while_waiting=None)

    def irecv(self, *args):
        return SimpleNamespace(done=False, test=lambda: False)

    def isend(self, buf, dest, tag, kind, what):
        self.sent.append(Sent(buf, tag, kind))
        return self.sent[-1]

    def wait(self, pending, backoff=None):
        pass


class SlowStateReplica:
    """A large model: reading its state out takes ``seconds`` of the clock."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def state(self):
        self.clock.now += self.seconds
        return np.arange(4, dtype=np.float32)

    def rng_state(self):
        return np.zeros(0, np.uint32)


def test_a_report_is_timed_at_its_step_not_after_its_state_is_read_out():
    # the run's training time ends at the last update on every rank: the state read out
    # for the final evaluation and checkpoint is finish_s, as on the single rank
    clock, comm = FakeClock(), FakeComm()
    ctx = SimpleNamespace(comm=comm, worker_index=1, replica=SlowStateReplica(clock, 5.0))
    link = ServerLink(ctx, clock)
    clock.now = 7.0
    link.report(12, 0.5, EVALUATE | SAVE | FINAL)
    reports = [s for s in comm.sent if s.tag == TAG_REPORT]
    header = Header.read(reports[-1].buf)
    assert (header.step, header.flags & REPORT, header.elapsed) == (12, REPORT, 7.0)
    assert clock.now == 12.0  # (the state was read out, after the step's time was taken)
