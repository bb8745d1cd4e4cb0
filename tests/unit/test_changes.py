"""mpitrain.launch.changes: the rows of membership.csv, for the changes no launcher test
below runs through (tests/unit/test_membership.py's launches record a failure and a
stop to grow)."""

from mpitrain.launch.changes import MEMBERSHIP_CSV, ChangeLog
from mpitrain.results.run_dir import read_csv

LOST = {"rank": 3, "host": "c", "pid": 7, "update": 420, "step": 140, "wall_time_s": 12.5,
        "reason": "its process died"}


def test_each_lost_async_worker_is_one_row_once(tmp_path):
    """An async job that goes on without a worker: one row per worker, the first time
    status.json lists it (later statuses repeat it), at the server's update then."""
    changes = ChangeLog()
    assert changes.workers_lost({"status": "running"}, tmp_path, 4) == []
    assert changes.workers_lost({"lost_workers": [LOST]}, tmp_path, 4) == [LOST]
    assert changes.workers_lost({"lost_workers": [LOST]}, tmp_path, 4) == []
    other = {**LOST, "rank": 2, "pid": 9, "host": "b"}
    assert changes.workers_lost({"lost_workers": [LOST, other]}, tmp_path, 4) == [other]
    first, second = read_csv(tmp_path / MEMBERSHIP_CSV)
    assert {k: first[k] for k in ("change", "hosts_out", "hosts_in", "np_before",
                                  "np_after", "step", "wall_time_s", "downtime_s", "why")} \
        == {"change": "worker lost", "hosts_out": "c", "hosts_in": "", "np_before": "4",
            "np_after": "3", "step": "420", "wall_time_s": "12.5", "downtime_s": "0",
            "why": "rank 3: its process died"}
    assert (second["np_before"], second["np_after"], second["hosts_out"]) == ("3", "2", "b")
    # the job restarted on its 4 ranks to take them back: a row from 2 to 4
    changes.began("grow", "host(s) b, c answer", tmp_path, 4, ["a"], None)
    changes.running({"status": "running"}, 4, ["a", "b", "c"])
    grow = read_csv(tmp_path / MEMBERSHIP_CSV)[-1]
    assert (grow["np_before"], grow["np_after"], grow["hosts_in"]) == ("2", "4", "b c")
    # lost in the new attempt: counted from its 4 ranks
    again = {**LOST, "pid": 70}
    assert changes.workers_lost({"lost_workers": [LOST, other, again]}, tmp_path, 4) == [again]
    assert read_csv(tmp_path / MEMBERSHIP_CSV)[-1]["np_after"] == "3"


def test_a_change_the_launch_did_not_survive_keeps_its_row(tmp_path):
    """A failure after which the launch gave up (the hosts left too few): its row at the
    end, with no downtime; a run with no checkpoint yet has no row; a file that cannot
    be written is said once at the end, and the launch goes on."""
    changes, said = ChangeLog(), []
    changes.began("failure", "a rank was killed", tmp_path, 4, ["a", "b"],
                  {"status": "failed", "step": 90})
    changes.close(said.append)
    (row,) = read_csv(tmp_path / MEMBERSHIP_CSV)
    assert (row["change"], row["np_after"], row["downtime_s"], row["step"],
            row["steps_lost"], row["hosts_out"]) == ("failure", "0", "", "", "", "a b")
    changes.began("failure", "again", None, 4, None, None)
    changes.close(said.append)
    assert len(read_csv(tmp_path / MEMBERSHIP_CSV)) == 1 and said == []
    changes.workers_lost({"lost_workers": [LOST]}, tmp_path / "gone", 4)
    changes.close(said.append)
    assert len(said) == 1 and said[0].startswith(f"cannot write {tmp_path / 'gone'}")
