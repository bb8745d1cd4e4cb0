"""--overlap from the command line: LeNet at -np 3 with its gradient in buckets of 50 KB,
allreduced while back-propagation runs, against the whole gradient in one allreduce.
(The protocol at any process count: tests/mpi/test_sync_protocol.py; the plan and the
thread: tests/unit/test_overlap.py; the speed: python -m bench overlap.)"""

import csv

import numpy as np
import pytest

from conftest import named_runs_in_one_launch

STEPS = 12


@pytest.mark.slow
def test_lenet_in_buckets_trains_the_same_weights_as_in_one_allreduce(mnist, tmp_path):
    runs = named_runs_in_one_launch(3, {overlap: [
        "lenet", "--data-dir", mnist, "--steps", STEPS, "--overlap", overlap,
        "--bucket-mb", "0.05", "--quiet"] for overlap in ("on", "off")}, tmp_path, timeout=600)
    weights, allreduces = {}, {}
    for overlap, (run_dir, row) in runs.items():
        assert row["status"] == "ok", row
        with np.load(run_dir / "checkpoint.npz") as ckpt:
            weights[overlap] = ckpt["weights"].copy()
        with open(run_dir / "comm.csv", newline="") as f:
            allreduces[overlap] = {(r["rank"], int(r["sent_msgs"]), int(r["sent_bytes"]))
                                   for r in csv.DictReader(f) if r["kind"] == "allreduce"}
    # two workers: each bucket's sum is one addition, as in the one allreduce
    assert np.array_equal(weights["on"], weights["off"])
    # the same bytes; LeNet's 247 KB in 50 KB buckets: 2 buckets and the status tail a step
    assert {(rank, n // STEPS, b) for rank, n, b in allreduces["off"]} == \
        {(rank, n // 3 // STEPS, b) for rank, n, b in allreduces["on"]}
    assert {n for _, n, _ in allreduces["on"]} == {3 * STEPS}
