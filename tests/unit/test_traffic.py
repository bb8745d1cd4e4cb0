"""The traffic table (mpitrain.comm.traffic): exact whenever read, however it was added."""

from mpitrain.comm.traffic import Traffic


def test_collectives_kept_as_running_totals_are_exact_when_read():
    traffic = Traffic()
    for _ in range(3):
        traffic.add_exchanged("allreduce", 100, 0.25)
    traffic.add_sent("push", 40)
    traffic.add_recv("pull", 60)
    traffic.wait_seconds["push"] += 1.0  # a poll adds its wait this way
    assert traffic.sent_bytes["allreduce"] == traffic.recv_bytes["allreduce"] == 300
    assert traffic.sent_msgs["allreduce"] == traffic.recv_msgs["allreduce"] == 3
    traffic.add_exchanged("allreduce", 100, 0.25)  # after a read: folded in at the next
    assert traffic.rows() == [
        {"kind": "allreduce", "sent_bytes": 400, "sent_msgs": 4, "recv_bytes": 400,
         "recv_msgs": 4, "wait_s": 1.0},
        {"kind": "pull", "sent_bytes": 0, "sent_msgs": 0, "recv_bytes": 60, "recv_msgs": 1,
         "wait_s": 0.0},
        {"kind": "push", "sent_bytes": 40, "sent_msgs": 1, "recv_bytes": 0, "recv_msgs": 0,
         "wait_s": 1.0}]
