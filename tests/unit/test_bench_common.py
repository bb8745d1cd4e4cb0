"""The benchmarks' pure helpers: steady-state epochs and compute time from a run's
timing.csv, peak memory by role from its telemetry.csv, a CSV as a Markdown table
(what summary.md and docs/benchmarks.md are written from), and how repeated rounds
are summarised."""

import csv
from pathlib import Path

import pytest

from bench.common import first_epoch_seconds, markdown_table, steady_epoch_seconds
from bench.compression import spread
from bench.ddp import checks_of
from bench.engines import compute_seconds, median_round
from bench.scaling import peak_rss

COLUMNS = ["epoch", "rank", "host", "role", "wall_s", "compute_s", "comm_s", "wait_s"]


def write_timing(run_dir, rows):
    with open(run_dir / "timing.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)


def test_the_steady_state_is_the_epochs_between_the_first_and_the_last(tmp_path):
    write_timing(tmp_path, [
        [1, 0, "vm", "server", 9.0, 0.1, 0, 8.9],
        [1, 1, "vm", "worker", 4.0, 3.8, 0.1, 0.1],  # tracing, the first evaluation
        [1, 2, "vm", "worker", 4.2, 3.9, 0.1, 0.2],
        [2, 0, "vm", "server", 9.0, 0.1, 0, 8.9],
        [2, 1, "vm", "worker", 2.9, 2.7, 0.1, 0.1],
        [2, 2, "vm", "worker", 3.1, 2.8, 0.1, 0.2],
        [3, 0, "vm", "server", 9.0, 0.1, 0, 8.9],
        [3, 1, "vm", "worker", 3.0, 2.8, 0.1, 0.1],
        [3, 2, "vm", "worker", 3.0, 2.8, 0.1, 0.1],
        [4, 1, "vm", "worker", 5.0, 2.8, 2.1, 0.1],  # the final report
        [4, 2, "vm", "worker", 5.0, 2.8, 2.1, 0.1],
    ])
    assert steady_epoch_seconds(tmp_path) == pytest.approx(3.0)
    assert steady_epoch_seconds(tmp_path, ("server",)) == pytest.approx(9.0)
    assert first_epoch_seconds(tmp_path) == pytest.approx(4.1)  # what the warm-up adds: 1.1
    # the workers' compute over the whole run: the floor of an engine's epoch time
    assert compute_seconds(tmp_path) == pytest.approx((3.8 + 2.7 + 2.8 + 2.8 + 3.9 + 2.8
                                                       + 2.8 + 2.8) / 2)


def test_a_run_too_short_for_a_steady_state_is_an_error(tmp_path):
    write_timing(tmp_path, [[1, 0, "vm", "single", 4.0, 4.0, 0, 0],
                            [2, 0, "vm", "single", 3.0, 3.0, 0, 0]])
    with pytest.raises(RuntimeError, match="3 epochs or more"):
        steady_epoch_seconds(tmp_path, ("single",))


def test_a_csv_becomes_a_markdown_table(tmp_path):
    path = tmp_path / "engines.csv"
    path.write_text("model,engine,epoch_time_s\nlr,mpi,0.43\nlenet,mwms,\n")
    assert markdown_table(path) == ["| model | engine | epoch_time_s |",
                                    "| --- | --- | --- |",
                                    "| lr | mpi | 0.43 |",
                                    "| lenet | mwms |  |"]
    (tmp_path / "empty.csv").write_text("")
    assert markdown_table(tmp_path / "empty.csv") == []


def test_peak_memory_by_role_from_the_telemetry(tmp_path):
    header = ["time_s", "rank", "host", "role", "cpu_percent", "rss_mb", "host_cpu_percent"]
    rows = [[0.5, 0, "vm", "server", 50, 610.5, 90], [0.5, 1, "vm", "worker", 99, 580, ""],
            [1.0, 0, "vm", "server", 40, 640.25, 95], [1.0, 1, "vm", "worker", 98, 575, ""],
            [1.0, 2, "vm", "worker", 97, "", ""]]  # a sample without memory: skipped
    with open(tmp_path / "telemetry.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    assert peak_rss(tmp_path) == (640.25, 580.0)


def test_a_side_of_several_rounds_keeps_its_median_run_whole():
    runs = [{"epoch_time_s": t, "test_accuracy": a}
            for t, a in ((6.2, 0.1), (5.3, 0.2), (5.5, 0.3))]
    kept = median_round(runs)
    assert (kept["epoch_time_s"], kept["test_accuracy"]) == (5.5, 0.3)  # one run's numbers
    assert kept["rounds_s"] == "6.200 5.300 5.500"  # every round, in order
    assert median_round(runs[:1])["epoch_time_s"] == 6.2
    assert median_round(runs[:2])["epoch_time_s"] == 5.3  # even: the faster middle one


def test_repeated_accuracies_print_their_mean_and_range():
    rows = [{"test_accuracy": a} for a in (0.9556, 0.9583, 0.9585)]
    assert spread(rows) == "95.75% (95.56-95.85%)"


def test_the_ddp_comparison_judges_two_workers_scaling_and_lenet_accuracy():
    ours = {1: {"epoch_time_s": 6.0, "steady_epoch_s": 5.0, "wall_s": 20.0,
                "test_accuracy": 0.981},
            2: {"epoch_time_s": 3.6, "steady_epoch_s": 3.2, "first_epoch_s": 4.4,
                "wall_s": 18.0, "test_accuracy": 0.982, "steps_per_epoch": 160,
                "compute_step_s": 0.016}}
    theirs = {1: {"epoch_time_s": 5.0, "steady_epoch_s": 4.5, "wall_s": 12.0,
                  "test_accuracy": 0.986},
              2: {"epoch_time_s": 4.0, "steady_epoch_s": 3.6, "first_epoch_s": 4.8,
                  "wall_s": 10.0, "test_accuracy": 0.979, "steps_per_epoch": 160,
                  "compute_step_s": 0.02}}
    checks = {c["ratio"]: c for c in checks_of("lenet", ours, theirs, quick=False)}
    whole = checks["lenet: mpitrain / DDP epoch time, 2 workers, whole run"]
    assert whole["value"] == 0.9 and whole["met"]  # <= 0.9
    steady = checks["lenet: mpitrain / DDP epoch time, 2 workers, steady state"]
    assert steady["value"] == pytest.approx(3.2 / 3.6, abs=1e-3) and steady["met"]
    assert checks["lenet: mpitrain scaling 1 -> 2 workers (epoch time at 1 / at 2), whole "
                  "run"]["value"] == pytest.approx(6.0 / 3.6, abs=1e-3)
    scaling = checks["lenet: scaling 1 -> 2 workers, mpitrain's / DDP's, whole run"]
    assert scaling["value"] == pytest.approx((6.0 / 3.6) / (5.0 / 4.0), abs=2e-3)
    assert scaling["met"]
    # steady: 5.0 / 3.2 = 1.5625 against 4.5 / 3.6 = 1.25
    assert checks["lenet: scaling 1 -> 2 workers, mpitrain's / DDP's, steady state"]["met"]
    accuracy = checks["lenet: test accuracy, mpitrain - DDP, 2 workers (pp)"]
    assert accuracy["value"] == pytest.approx(0.3) and accuracy["met"]
    assert checks["lenet: compute-only step, TensorFlow (mpitrain) / PyTorch, 2 workers at "
                  "once"]["value"] == 0.8
    # the exchange's share: a steady step (3.2 s / 160 = 20 ms) over the compute alone
    assert checks["lenet: mpitrain steady sync step / its compute-only step, 2 workers"][
        "value"] == 1.25
    # the warm-up each side's first epoch carries
    assert checks["lenet: mpitrain first epoch - steady epoch, 2 workers (s)"]["value"] == 1.2
    assert checks["lenet: DDP first epoch - steady epoch, 2 workers (s)"]["value"] == 1.2
    # slower than 0.9x: short; synthetic labels' accuracy is not judged
    ours[2]["epoch_time_s"] = 3.7
    checks = {c["ratio"]: c for c in checks_of("resnet", ours, theirs, quick=False)}
    assert checks["resnet: mpitrain / DDP epoch time, 2 workers, whole run"]["met"] is False
    assert checks["resnet: test accuracy, mpitrain - DDP, 2 workers (pp)"]["met"] is None
    # a smoke run has no steady state and judges nothing
    for side in (ours, theirs):
        for m in side.values():
            m["steady_epoch_s"] = None
    checks = checks_of("lenet", ours, theirs, quick=True)
    assert all(c["met"] is None for c in checks)
    assert not [c for c in checks if "steady" in c["ratio"]]


def test_a_tf_cluster_failing_in_tensorflow_is_started_again_a_bounded_number_of_times(
        monkeypatch, capsys):
    """tf_baselines starts the cluster again (new ports, one note line each) while it
    fails in TensorFlow's runtime, at most CLUSTER_STARTS times; a failure of its own is
    never retried."""
    from bench import tf_baselines as tfb

    assert tfb.not_ours(1, "InternalError: 2 root error(s) found.")
    assert tfb.not_ours(1, "UnknownError: Could not start gRPC server")
    assert tfb.not_ours(-11, "no output")  # SIGSEGV in TensorFlow's native code
    assert not tfb.not_ours(1, "Failure: optimizer counted 39 updates, expected 40")
    assert not tfb.not_ours(1, "ValueError: bad shape")

    def fake_launcher(outcomes):
        class Launcher:  # one cluster start per instance: raises or returns its outcome
            def __init__(self, args, argv):
                self.outcome, self.logdir = outcomes.pop(0), Path("/nonexistent")

            def run(self, deadline):
                if isinstance(self.outcome, Exception):
                    raise self.outcome
                return dict(self.outcome)

            def cleanup(self):
                pass
        return Launcher

    theirs = tfb.ClusterFailure("chief failed (exit status 1): InternalError: ...", True)
    ours = tfb.ClusterFailure("chief failed (exit status 1): Failure: diverged", False)
    monkeypatch.setattr(tfb, "Launcher", fake_launcher([theirs, {"wall_time_s": 1.0}]))
    assert tfb.run_cluster(None, [], 0.0) == {"wall_time_s": 1.0, "cluster_starts": 2}
    assert capsys.readouterr().err.count("tf_baselines: note: the cluster failed") == 1
    monkeypatch.setattr(tfb, "Launcher", fake_launcher([theirs] * tfb.CLUSTER_STARTS))
    with pytest.raises(tfb.ClusterFailure):
        tfb.run_cluster(None, [], 0.0)
    monkeypatch.setattr(tfb, "Launcher", fake_launcher([ours, {"wall_time_s": 1.0}]))
    with pytest.raises(tfb.ClusterFailure, match="diverged"):
        tfb.run_cluster(None, [], 0.0)
