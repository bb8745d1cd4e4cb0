"""bench scale's pure parts: the growth exponent, a timed launch's costs from its ranks'
moments, the emulated cluster's hostfile, each model's runs, and docs/scaling.md's
generated block kept section by section."""

import json

import pytest

from bench.scale import (BEGIN, END, cluster_hostfile, exponent, growth_rows,
                         launch_moments, longer_checks, model_runs, write_docs)


def test_the_exponent_is_the_slope_on_the_logs():
    assert exponent([(3, 2.0), (9, 6.0), (33, 22.0)]) == 1.0  # linear
    assert exponent([(3, 9.0), (9, 81.0)]) == 2.0  # quadratic
    assert exponent([(3, 5.0), (33, 5.0)]) == 0.0  # flat
    # noise around a line: least squares over every point (numpy.polyfit's 0.9622), not
    # the two ends' 0.9420
    assert exponent([(2, 2.2), (4, 3.8), (8, 8.4), (16, 15.6)]) == 0.96
    assert exponent([(3, 1.0)]) is None and exponent([(3, 1.0), (3, 2.0)]) is None
    assert exponent([(3, 0.0), (5, 1.0)]) is None  # a log needs a positive value


def test_launch_costs_sit_once_per_np_and_run_costs_per_mode():
    rows = [{"np": n, "run": run, "startup_s": float(n) if run == "sync" else "",
             "gather_s": 0.01 * n * n} for n in (3, 9) for run in ("sync", "async")]
    fits = {f["cost"]: f["exponent"] for f in growth_rows(rows)}
    assert fits == {"startup_s": 1.0, "gather_s (sync)": 2.0, "gather_s (async)": 2.0}


def test_a_launch_s_costs_come_from_every_rank_s_moments(tmp_path):
    began = 100.0
    moments = [  # rank: its Python up, trainer entries (and the CPU seconds at the first),
        # gathers (start, end) of two runs
        {"python": 101.0, "train": [130.0, 140.0], "train_cpu": 4.0,
         "gather": [[138.0, 138.5], [150.0, 150.2]]},
        {"python": 102.5, "train": [131.0, 141.0], "train_cpu": 5.0,
         "gather": [[137.0, 138.5], [149.0, 150.2]]},
        {"python": 101.5, "train": [133.0, 142.0], "train_cpu": 6.0,
         "gather": [[138.1, 138.5], [149.5, 150.3]]}]
    for rank, m in enumerate(moments):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(m))
    costs = launch_moments(tmp_path, 3, began, ended=151.0)
    assert costs == {"spawn_s": 2.5, "startup_s": 33.0, "startup_cpu_s": 5.0,
                     # run 1: rank 2 came last, 0.1 s after rank 0; run 2: rank 0 came last
                     "gather_wait_s": [0.1, 0.0], "gather_s": [0.4, 0.2], "exit_s": 0.7}
    with pytest.raises(RuntimeError, match="moments of 3 rank"):
        launch_moments(tmp_path, 4, began, 151.0)


def test_the_cluster_hostfile_leaves_node0_to_rank_0(tmp_path):
    assert cluster_hostfile(tmp_path, 8).read_text() == "node0 slots=1\n" + "".join(
        f"node{i} slots=1\n" for i in range(1, 9))
    assert "node8 slots=2\n" in cluster_hostfile(tmp_path, 16).read_text()


def test_resnet_trains_on_mnist_and_adam_models_show_the_warm_up_they_do_without():
    runs = model_runs("resnet", 4, quick=False)
    assert set(runs) == {"resnet-sync", "resnet-async-auto", "resnet-async-sqrt",
                         "resnet-async-none", "resnet-sync-warmup"}
    # where the default staleness bound binds, async without it too
    assert model_runs("resnet", 8, quick=False)["resnet-async-unbounded"][-3:] == [
        "--async", "--staleness", "none"]
    assert all(args[:3] == ["resnet", "--epochs", "2"] and "mnist" in args
               for args in runs.values())
    assert runs["resnet-sync-warmup"][-2:] == ["--warmup-epochs", "0.4"]  # a fifth of 2
    lenet = model_runs("lenet", 2, quick=False)
    assert "lenet-sync-warmup" in lenet and "lenet-sync-before" not in lenet
    assert "--async" in lenet["lenet-async-before"]
    # the old defaults: unbounded (LR's pipelined async would be refused under the bound)
    assert all(runs[-2:] == ["--staleness", "none"]
               for runs in (lenet["lenet-async-before"],
                            model_runs("lr", 16, quick=False)["lr-async-before"]))
    lr = model_runs("lr", 16, quick=False)
    assert {"lr-sync-before", "lr-async-before"} <= set(lr) and "lr-sync-warmup" not in lr
    # LR's default before Nesterov momentum, sync and async, and in the old defaults
    assert lr["lr-sync-sgd"][-4:] == lr["lr-async-sgd"][-4:] == ["--optimizer", "sgd", "--lr",
                                                                 "0.5"]
    assert "--async" in lr["lr-async-sgd"]
    assert all("sgd" in lr[f"lr-{mode}-before"] for mode in ("sync", "async"))
    assert "--async" not in lr["lr-sync-before"]
    assert set(model_runs("lr", 2, quick=True)) == {"lr-sync", "lr-async-auto"}


def test_the_docs_keep_the_sections_not_measured_again(tmp_path):
    page = tmp_path / "scaling.md"
    page.write_text(f"intro\n{BEGIN}\n### lr\n\nold lr\n\n### lenet\n\nold lenet\n{END}\nouter\n")
    write_docs(page, {"lr": "### lr\n\nnew lr\n", "ranks": "### ranks\n\nnew ranks\n"})
    assert page.read_text() == (f"intro\n{BEGIN}\n### lr\n\nnew lr\n\n### lenet\n\nold lenet\n"
                                f"\n### ranks\n\nnew ranks\n{END}\nouter\n")


def test_longer_sync_runs_judge_epochs_to_target_where_equal_epochs_fall_short():
    lenet = model_runs("lenet", 16, quick=False)
    assert lenet["lenet-sync-longer"][:3] == ["lenet", "--epochs", "3"]  # 1.5 x 2
    assert lenet["lenet-sync-longer"][3:] == lenet["lenet-sync"][3:]
    assert model_runs("lr", 8, quick=False)["lr-sync-longer"][:3] == ["lr", "--epochs", "5"]
    assert "lenet-sync-longer" not in model_runs("lenet", 4, quick=False)

    def row(mode, workers, gap, reached):
        return {"model": "lenet", "mode": mode, "workers": workers, "vs_2_workers_pp": gap,
                "epoch_to_target": reached}
    rows = [row("sync", 2, 0.0, 2), row("sync", 8, -0.5, ""), row("sync (longer)", 8, "", 2),
            row("sync", 16, -1.2, ""), row("sync (longer)", 16, "", 3)]
    found = longer_checks(rows)  # 8 workers are within 1 pp: nothing to judge there
    assert [(c["ratio"], c["value"], c["met"]) for c in found] == [
        ("lenet sync 16 workers: epochs to target / 2 workers'", 1.5, False)]
    rows[-1]["epoch_to_target"] = ""  # never reached: not met
    assert [c["met"] for c in longer_checks(rows)] == [False]
    rows[-1]["epoch_to_target"] = 2
    assert [(c["value"], c["met"]) for c in longer_checks(rows)] == [(1.0, True)]
