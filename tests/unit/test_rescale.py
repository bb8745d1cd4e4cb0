"""Resuming on another number of ranks: batch, learning rate and position (pure logic)."""

import dataclasses
import json

import numpy as np
import pytest

from mpitrain.config import Config
from mpitrain.errors import UsageError
from mpitrain.run.checkpoint import Checkpoint, CheckpointMeta, Geometry, geometry
from mpitrain.run.resume import Rescale, remap_position, resumed_config

MNIST_TRAIN = 60000


def sync(world_size=4, **kw):
    return Config.of(**{"model": "lr", "world_size": world_size, "batch_size": 5, "lr": 0.05,
                     "epochs": 4, "optimizer": "sgd", "dataset": "mnist", **kw})


def checkpoint(step, cfg, rng=None):
    return Checkpoint(np.zeros(3, np.float32), {}, step, 12.5,
                      meta=CheckpointMeta.sync(geometry(cfg), rng or {}))


def test_sync_keeps_the_global_batch_where_it_divides():
    before = sync(4, batch_size=4)
    after = Rescale.between(before, 3)  # 2 workers x 6 = 12
    assert after.config.batch_size == 6 and after.config.global_batch == 12
    assert after.config.effective_lr == pytest.approx(before.effective_lr)
    assert "global batch 12 kept (per-worker batch 4 -> 6)" in after.rule
    assert after.as_dict()["to_workers"] == 2


def test_sync_scales_the_lr_where_the_batch_does_not_divide():
    before = sync(4)  # 3 x 5 = 15 over 2 workers: 8 each, 16
    after = Rescale.between(before, 3)
    assert after.config.batch_size == 8 and after.config.global_batch == 16
    assert after.config.effective_lr == pytest.approx(before.effective_lr * 16 / 15)
    assert "does not divide" in after.rule and "linear scaling" in after.rule
    unscaled = Rescale.between(sync(4, lr_scaling="none"), 3)
    assert unscaled.config.effective_lr == pytest.approx(0.05)
    assert "kept (--lr-scaling none)" in unscaled.rule


def test_sync_down_to_one_rank_trains_alone_with_the_whole_batch():
    after = Rescale.between(sync(4, batch_size=4), 1)
    assert after.config.mode == "single" and after.config.batch_size == 12
    assert after.config.effective_lr == pytest.approx(sync(4, batch_size=4).effective_lr)


def test_batches_per_epoch_keeps_the_steps_and_the_lr():
    before = sync(4, batches_per_epoch=100)
    after = Rescale.between(before, 2)
    assert after.config.batches_per_epoch == 100
    assert after.config.effective_lr == pytest.approx(before.effective_lr)


def test_async_keeps_batch_and_lr_and_needs_a_worker():
    before = sync(4, async_mode=True)
    after = Rescale.between(before, 3)
    assert (after.config.batch_size, after.config.optimizer.lr) == (5, 0.05)
    assert after.config.workers == 2
    with pytest.raises(UsageError, match="-np 1 cannot continue it"):
        Rescale.between(before, 1)


def test_sync_position_is_the_same_fraction_of_the_same_epoch():
    before, after = sync(4), Rescale.between(sync(4), 3)
    per_epoch_before = -(-MNIST_TRAIN // 3 // 5)  # 4000
    per_epoch_after = -(-MNIST_TRAIN // 2 // 8)  # 3750
    step = 2 * per_epoch_before + per_epoch_before // 2  # half-way through epoch 3
    rng = {0: [1, 2], 1: [3, 4], 3: [5, 6]}
    saved = dataclasses.replace(checkpoint(step, before, rng=rng),
                                codecs={w: np.ones(2, np.float32) for w in (1, 2, 3)})
    moved = remap_position(saved, after.config, MNIST_TRAIN)
    assert moved.step == 2 * per_epoch_after + per_epoch_after // 2
    assert moved.meta.geometry == Geometry(world_size=3, batch_size=8, servers=1)
    assert sorted(moved.meta.rng) == [0, 1]  # rank 3 is gone
    assert moved.codecs == {}  # residuals of three workers: two start from zero
    assert moved.wall_time_s == 12.5  # the clock continues


def test_a_checkpoint_in_this_sessions_units_is_left_alone():
    cfg = sync(4)
    ckpt = checkpoint(123, cfg)
    assert remap_position(ckpt, cfg, MNIST_TRAIN) is ckpt
    legacy = Checkpoint(np.zeros(3, np.float32), {}, 123, 1.0)  # no geometry: the original's
    assert remap_position(legacy, cfg, MNIST_TRAIN) is legacy
    after = Rescale.between(cfg, 3)
    assert remap_position(legacy, after.config, MNIST_TRAIN, original=cfg).step != 123


def test_async_position_spreads_the_updates_done_over_the_workers_left():
    before = sync(4, async_mode=True)
    after = Rescale.between(before, 3).config
    meta = CheckpointMeta.asynchronous(
        geometry(before), staleness={1: {0: 2}, 3: {0: 1, 2: 4}}, retired_staleness={},
        extra_steps={1: 5}, updates_short=3, lost_workers=[])
    ckpt = Checkpoint(np.zeros(3, np.float32), {}, 1001, 3.0,
                      worker_steps={1: 400, 2: 300, 3: 301}, meta=meta)
    moved = remap_position(ckpt, after, MNIST_TRAIN)
    assert moved.worker_steps == {1: 501, 2: 500} and moved.step == 1001
    assert moved.meta.extra_steps == {} and moved.meta.updates_short == 0
    assert moved.meta.staleness == {1: {0: 2}, 2: {0: 1, 2: 4}}
    assert moved.meta.geometry == geometry(after)


def test_a_resumed_async_run_shares_the_steps_left_with_a_worker_back():
    """Rank 3 was lost at step 40 of 100 (its 60 went to ranks 1 and 2), and the run
    stopped with 1 at 70 and 2 at 66 to take rank 3's host back: the 124 steps left
    are shared by all three, rank 3 included (before, it had none left and stopped at
    once, leaving its host idle)."""
    from mpitrain.train.asynchronous.accounts import WorkerAccount, restore
    from mpitrain.train.leases import Quotas

    meta = CheckpointMeta.asynchronous(
        geometry(sync(4, async_mode=True)), staleness={}, retired_staleness={},
        extra_steps={1: 30, 2: 30, 3: -60}, updates_short=0, lost_workers=[
            {"rank": 3, "host": "c", "update": 120, "step": 40, "reason": "died"}])
    ckpt = Checkpoint(np.zeros(3, np.float32), {}, 176, 3.0,
                      worker_steps={1: 70, 2: 66, 3: 40}, meta=meta)
    accounts, quotas = {r: WorkerAccount(r) for r in (1, 2, 3)}, Quotas((1, 2, 3), 100)
    lost = restore(accounts, quotas, ckpt)
    assert lost[0]["rank"] == 3 and [w.steps for w in accounts.values()] == [70, 66, 40]
    assert quotas.of == {1: 70 + 42, 2: 66 + 41, 3: 40 + 41}  # 124 = 42 + 41 + 41
    assert sum(quotas.of.values()) == 300 and quotas.short == 0


def test_resumed_config_rescales_from_the_first_session(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": sync(4).to_dict()}))
    cli_cfg = Config.of(model="lr", resume=str(run))
    same, none = resumed_config(cli_cfg, {"resume"}, 4)
    assert none is None and same.world_size == 4
    fewer, rescale = resumed_config(cli_cfg, {"resume"}, 3)
    assert fewer.world_size == 3 and fewer.batch_size == 8 and fewer.resume == str(run)
    assert rescale.original.world_size == 4


def test_a_run_another_job_still_writes_is_not_resumed(tmp_path):
    """Issue 53 item 3: ``--resume RUN`` while RUN trains had both jobs write one run
    directory. A status.json that says running, written by a process that runs here,
    refuses the resume; once that process is gone, the run resumes."""
    import subprocess
    import sys

    from mpitrain.results.run_dir import process_identity

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": sync(4).to_dict()}))
    cli_cfg = Config.of(model="lr", resume=str(run))
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        status = {"status": "running", "writer": {**process_identity(), "pid": writer.pid}}
        (run / "status.json").write_text(json.dumps(status))
        with pytest.raises(UsageError, match=rf"that run is still training \(pid "
                                             rf"{writer.pid} writes it\); stop it first"):
            resumed_config(cli_cfg, {"resume"}, 4)
        # a writer on another host (another boot) cannot be told: not refused
        other = {**status, "writer": {**status["writer"], "boot_id": "another-host"}}
        (run / "status.json").write_text(json.dumps(other))
        assert resumed_config(cli_cfg, {"resume"}, 4)[0].world_size == 4
        (run / "status.json").write_text(json.dumps(status))
    finally:
        writer.kill()
        writer.wait()
    assert resumed_config(cli_cfg, {"resume"}, 4)[0].world_size == 4  # its writer is gone


def test_elastic_batch_per_worker_keeps_the_batch_and_scales_the_lr():
    before = sync(4, batch_size=4, elastic_batch="per-worker")  # 3 workers, global 12
    after = Rescale.between(before, 5)  # 4 workers
    assert after.config.batch_size == 4 and after.config.global_batch == 16
    assert after.config.effective_lr == pytest.approx(before.effective_lr * 4 / 3)
    assert "batch 4 per worker kept (--elastic-batch per-worker), global batch 12 -> 16" \
        in after.rule and "(linear scaling)" in after.rule
    root = Rescale.between(sync(4, batch_size=4, elastic_batch="per-worker",
                                lr_scaling="sqrt"), 2)  # 3 workers -> 1
    assert root.original.effective_lr == pytest.approx(0.05 * 3 ** 0.5)
    assert root.config.effective_lr == pytest.approx(0.05) and "(sqrt scaling)" in root.rule
    with pytest.raises(UsageError, match="--elastic-batch is for sync runs"):
        sync(3, async_mode=True, elastic_batch="per-worker").validate()
