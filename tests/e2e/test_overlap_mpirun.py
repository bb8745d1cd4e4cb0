"""--overlap from the command line: LeNet at -np 3 with its gradient in buckets of 50 KB,
allreduced while back-propagation runs (by MPI, or through the workers' shared memory:
--shared-memory on), against the whole gradient in one allreduce.
(The protocol at any process count: tests/mpi/test_sync_protocol.py; the plan and the
thread: tests/unit/test_overlap.py; the speed: python -m bench overlap.)"""

import csv

import numpy as np
import pytest

from conftest import final_weights, named_runs_in_one_launch

STEPS = 12


@pytest.mark.slow
def test_lenet_in_buckets_trains_the_same_weights_as_in_one_allreduce(mnist, tmp_path):
    runs = named_runs_in_one_launch(3, {f"{overlap}{compression}": [
        "lenet", "--data-dir", mnist, "--steps", STEPS, "--overlap", overlap,
        "--bucket-mb", "0.05", "--compression", compression, "--quiet"]
        for overlap in ("on", "off") for compression in ("none", "fp16")} | {
        "shared": ["lenet", "--data-dir", mnist, "--steps", STEPS, "--bucket-mb", "0.05",
                   "--shared-memory", "on", "--quiet"]}, tmp_path, timeout=600)
    # fp16: each value has its own error feedback and is summed by one rank in rank
    # order, whichever bucket carries it, so buckets change no bit there either
    assert final_weights(*runs["onfp16"]).tobytes() == final_weights(*runs["offfp16"]).tobytes()
    runs = {overlap: runs[f"{overlap}none"] for overlap in ("on", "off")} | {
        "shared": runs["shared"]}
    weights, allreduces = {}, {}
    for overlap, (run_dir, row) in runs.items():
        weights[overlap] = final_weights(run_dir, row)
        with open(run_dir / "comm.csv", newline="") as f:
            allreduces[overlap] = {(r["rank"], int(r["sent_msgs"]), int(r["sent_bytes"]))
                                   for r in csv.DictReader(f)
                                   if r["kind"] == ("shared" if overlap == "shared"
                                                    else "allreduce")}
    # two workers: each bucket's sum is one addition, as in the one allreduce, whether
    # MPI or the workers themselves (through the memory they share) add
    assert np.array_equal(weights["on"], weights["off"])
    assert np.array_equal(weights["shared"], weights["off"])
    # --shared-memory on: every bucket and the status tail summed through shared memory
    assert allreduces["shared"] == allreduces["on"]
    assert runs["shared"][1]["status"] == "ok"
    # the same bytes; LeNet's 247 KB in 50 KB buckets: 2 buckets and the status tail a step
    assert {(rank, n // STEPS, b) for rank, n, b in allreduces["off"]} == \
        {(rank, n // 3 // STEPS, b) for rank, n, b in allreduces["on"]}
    assert {n for _, n, _ in allreduces["on"]} == {3 * STEPS}
