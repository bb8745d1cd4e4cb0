"""The protocol module both training protocols share: the header's wire format, the
health sentinel, the silent-peer watchdog (with a fake communicator: pure logic; the
real one is exercised by the MPI tier and the fault tests) and the phase timer."""

import math
import time

import numpy as np
import pytest

from mpitrain.errors import CommTimeout
from mpitrain.train.leases import Liveness
from mpitrain.train.protocol import (AUX, SLOTS, VERSION, Header, PhaseTimer, SilentPeers,
                                     new_message, sentinel, slots_of, slots_word, stalled,
                                     write_version)


def test_a_header_round_trips_every_slot_bit_exact():
    header = Header(version=2**24 + 1, step=123456789, flags=1 | 8 | 64, loss=0.25,
                    elapsed=12.5, think=3e-4, extra=-7, aux=0xFFFFFFFE)
    msg = header.write(new_message(5))
    assert msg.dtype == np.float32 and msg.size == SLOTS + 5
    back = Header.read(msg)
    # versions above 2**24 and a full 32-bit CRC would not survive as float32 values
    assert (back.version, back.step, back.flags, back.extra, back.aux) == (
        2**24 + 1, 123456789, 1 | 8 | 64, -7, 0xFFFFFFFE)
    assert back.loss == 0.25 and back.elapsed == 12.5
    assert back.think == pytest.approx(3e-4)
    assert msg[VERSION].view(np.int32) == 2**24 + 1 and msg[SLOTS:].sum() == 0


def test_a_header_keeps_what_float32_cannot_hold_as_numpy_would():
    """A loss past float32's range travels as infinite and NaN as NaN: the health
    sentinel must still see a diverged worker (a float64 loss of 1e39 would make the
    struct packing raise)."""
    back = Header.read(Header(loss=1e39, elapsed=float("nan"), think=-1e40).write(new_message()))
    assert back.loss == math.inf and math.isnan(back.elapsed) and back.think == -math.inf
    float32 = Header.read(Header(loss=0.1).write(new_message())).loss
    assert float32 == float(np.float32(0.1)) != 0.1  # rounded to float32, like the slot


def test_the_header_leaves_the_payload_alone():
    msg = new_message(3)
    msg[SLOTS:] = [1.0, 2.0, 3.0]
    Header(step=4, aux=1).write(msg)
    assert list(msg[SLOTS:]) == [1.0, 2.0, 3.0] and Header.read(msg).aux == 1
    assert msg[AUX].view(np.int32) == 1


def test_a_header_to_several_servers_changes_only_its_version():
    header = Header(version=5, step=9, flags=256, loss=0.5, elapsed=2.0, think=1e-3, extra=3,
                    aux=slots_word(1, 2))
    msg = new_message(2)
    msg[SLOTS:] = [7.0, 8.0]
    write_version(header.write(msg), 2**31 - 1)
    assert Header.read(msg) == Header.read(header._replace(version=2**31 - 1)
                                           .write(new_message()))
    assert list(msg[SLOTS:]) == [7.0, 8.0]


def test_a_push_names_its_shared_slots_in_its_aux_slot():
    for push in range(2):
        for lease in range(3):
            word = slots_word(push, lease)
            assert slots_of(word) == (push, lease)
            assert slots_of(Header.read(Header(aux=word).write(np.zeros(SLOTS, np.float32))).aux) \
                == (push, lease)


def test_the_sentinel_is_not_finite_when_the_loss_or_the_gradient_is_not():
    assert sentinel(0.5, 3.0) == 0.5
    assert math.isnan(sentinel(0.5, float("nan")))
    assert math.isnan(sentinel(0.5, float("inf")))
    assert math.isinf(sentinel(float("inf"), 1.0))


class _Pending:
    def __init__(self, done=False):
        self.done = done

    def test(self):
        return self.done


class _FakeComm:
    """The two things SilentPeers uses: the bound and a wait_any that reports which
    pending completed (or None after its timeout)."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.waited = []

    def wait_any(self, pendings, backoff, timeout, tested=False):
        self.waited.append(timeout)
        for i, p in enumerate(pendings):
            if p.done:
                return i
        time.sleep(timeout)
        return None

    def name(self, rank):
        return f"rank {rank} on host{rank}"


def test_silent_peers_returns_the_peer_whose_message_arrived():
    watch = SilentPeers(_FakeComm(timeout=5.0), [1, 2])
    assert watch.first({1: _Pending(), 2: _Pending(done=True)}, None) == 2


def test_silent_peers_never_waits_past_the_oldest_silence_and_names_it():
    comm = _FakeComm(timeout=0.2)
    watch = SilentPeers(comm, [1, 2])
    time.sleep(0.05)
    watch.heard(2)
    assert watch.first({1: _Pending(), 2: _Pending()}, None, wake_every=5.0) is None
    assert comm.waited[0] <= 0.16  # what the oldest silence (rank 1's) had left
    assert watch.overdue([1, 2]) == 1
    error = stalled(comm, 1, "sent nothing for 0.2 s", waiting=[2])
    assert isinstance(error, CommTimeout)
    assert str(error) == ("rank 1 on host1 sent nothing for 0.2 s while rank 2 on host2 kept "
                          "waiting for it; it is stalled or dead (raise --timeout if its "
                          "steps are legitimately that slow)")


def test_a_peer_silent_past_its_liveness_bound_is_lost_unless_its_message_came():
    watch = SilentPeers(_FakeComm(timeout=300.0), [1, 2, 3])
    live = Liveness(timeout=300.0, floor=0.01)
    for peer in (1, 2, 3):
        live.observe(peer, 0.0001)
    time.sleep(0.03)
    watch.heard(3)
    # 1 and 2 are past the 0.01 s floor; 1's message has come (not read yet)
    lost = watch.lost({1: _Pending(done=True), 2: _Pending(), 3: _Pending()}, live)
    assert lost is not None and lost[0] == 2 and "past its liveness bound" in lost[1]
    assert watch.lost({1: _Pending(done=True), 3: _Pending()}, live) is None
    dead = watch.lost({3: _Pending()}, live, alive=lambda peer: False)
    assert dead is not None and dead[1].startswith("its process died")


def test_silent_peers_wakes_up_early_when_asked_and_then_nobody_is_overdue():
    comm = _FakeComm(timeout=10.0)
    watch = SilentPeers(comm, [1])
    assert watch.first({1: _Pending()}, None, wake_every=0.01) is None
    assert comm.waited == [0.01] and watch.overdue([1]) is None


def test_the_phase_timer_charges_every_second_to_one_phase(monkeypatch):
    """On a fake clock (a loaded host can stall a real one between two lines)."""
    from mpitrain.train import protocol

    now = [10.0]
    monkeypatch.setattr(protocol, "_now", lambda: now[0])
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: now[0])
    timer = PhaseTimer(default="compute")
    now[0] += 0.02  # outside any block: the default phase
    with timer("comm"):
        now[0] += 0.03
    with timer("wait"):
        now[0] += 0.01
    timer.end_epoch(1)
    row = timer.rows[0]
    assert (row["compute_s"], row["comm_s"], row["wait_s"]) == pytest.approx((0.02, 0.03, 0.01))
    assert row["compute_s"] + row["comm_s"] + row["wait_s"] == pytest.approx(row["wall_s"],
                                                                            abs=1e-9)
    with timer("comm"):
        now[0] += 0.005
    timer.end_epoch(2)  # a new epoch starts from zero
    assert timer.rows[1]["wall_s"] == pytest.approx(0.005)


def test_a_collective_splits_its_time_into_moving_data_and_waiting(monkeypatch):
    """The run's fastest collective is the data moving; the rest of each is waiting
    (on a fake clock: the arithmetic, not the machine's sleeps, is under test)."""
    from mpitrain.train import protocol

    now = [50.0]
    monkeypatch.setattr(protocol, "_now", lambda: now[0])
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: now[0])
    timer = PhaseTimer()
    for late in (0.05, 0.01, 0.03):  # seconds of one rank arriving late, or nobody (0.01)
        with timer.collective():
            now[0] += late
    timer.end_epoch(1)
    row = timer.rows[0]
    fastest = row["comm_s"] / 3
    assert fastest == pytest.approx(0.01)  # the middle call's
    assert row["wait_s"] == pytest.approx(0.09 - 3 * fastest)
    assert row["comm_s"] + row["wait_s"] + row["compute_s"] == pytest.approx(row["wall_s"],
                                                                            abs=1e-5)
    with timer.collective():  # an epoch's split uses the fastest of the run so far
        now[0] += 0.03
    timer.end_epoch(2)
    assert timer.rows[1]["comm_s"] == pytest.approx(fastest, abs=1e-5)
    assert timer.rows[1]["wait_s"] == pytest.approx(0.03 - fastest, abs=1e-5)
    timer.end_epoch(3)  # no collective: nothing moved
    assert timer.rows[2]["comm_s"] == 0.0
    with timer.collective() as call:  # a compression's computing inside the call: codec
        now[0] += 0.05
        call.codec = 0.02
    timer.end_epoch(4)
    row = timer.rows[3]
    assert row["codec_s"] == pytest.approx(0.02) and row["wait_s"] == pytest.approx(
        0.03 - fastest, abs=1e-5)
    assert row["comm_s"] + row["wait_s"] + row["codec_s"] == pytest.approx(0.05, abs=1e-5)
