"""Config validation and CLI parsing: every bad setting is one UsageError line."""

import dataclasses
import platform

import pytest

from mpitrain import models
from mpitrain.cli import explicit_settings, parse_config
from mpitrain.config import Config, resolve
from mpitrain.errors import UsageError

LR_DEFAULTS = models.get("lr").defaults


def resolved(world_size=1, **kw):
    return resolve(Config(**kw), LR_DEFAULTS, world_size)


def test_model_defaults_fill_unset_fields():
    cfg = resolved()
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.optimizer) == (30, 100, 0.5, "sgd")
    assert resolved(epochs=3).epochs == 3


@pytest.mark.parametrize("field,value,flag", [
    ("epochs", 0, "--epochs"), ("epochs", -2, "--epochs"),
    ("batch_size", 0, "--batch-size"), ("batch_size", -5, "--batch-size"),
    ("eval_every", 0, "--eval-every"), ("steps", 0, "--steps"),
    ("lr", -0.1, "--lr"), ("lr", float("nan"), "--lr"),
    ("threads", -1, "--threads"), ("timeout", 0.0, "--timeout"),
    ("start_timeout", -1.0, "--start-timeout"),
])
def test_bad_values_name_their_flag(field, value, flag):
    with pytest.raises(UsageError, match=flag):
        resolved(**{field: value})


def test_async_needs_two_ranks():
    with pytest.raises(UsageError, match="--async needs a parameter server"):
        resolved(world_size=1, async_mode=True)
    assert resolved(world_size=2, async_mode=True).mode == "async"


@pytest.mark.parametrize("argv,np_,pattern", [
    (["lr", "--servers", "2"], 4, "--servers 2 shards the async parameter server; sync "
     "training has none"),
    (["lr", "--async", "--servers", "4"], 4, "--servers 4 leaves no worker at -np 4: run "
     "with -np 5 or more"),
    (["lr", "--async", "--servers", "0"], 4, "--servers must be"),
])
def test_servers_usage_errors_are_one_line(argv, np_, pattern):
    with pytest.raises(UsageError, match=pattern) as info:
        parse_config(argv, world_size=np_)
    assert "\n" not in str(info.value)
    assert parse_config(["lr", "--async", "--servers", "3"], world_size=4).workers == 1


def test_check_launch_names_every_server():
    from mpitrain.tools.preflight import check_launch

    assert check_launch(4, None, False, True, 2)[:3] == [
        f"rank 0: parameter server 1/2 on {platform.node()}",
        f"rank 1: parameter server 2/2 on {platform.node()}",
        f"rank 2: worker on {platform.node()}"]
    assert check_launch(3, None, False, True)[0] == f"rank 0: parameter server on " \
        f"{platform.node()}"


def test_modes_and_linear_lr_scaling():
    assert resolved(1).mode == "single"
    sync4 = resolved(4)
    assert (sync4.mode, sync4.workers, sync4.global_batch) == ("sync", 3, 300)
    assert sync4.effective_lr == pytest.approx(1.5)
    assert resolved(4, lr_scaling="none").effective_lr == pytest.approx(0.5)
    assert resolved(4, async_mode=True).effective_lr == pytest.approx(0.5)


def test_dry_run_caps_steps():
    assert resolved(dry_run=True).max_steps == 2
    assert resolved(steps=7).max_steps == 7
    assert resolved().max_steps is None


def test_cli_parses_into_config():
    cfg = parse_config(["lr", "--epochs", "3", "--batch-size", "50", "--seed", "7"])
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.seed) == ("lr", 3, 50, 7)


@pytest.mark.parametrize("argv,given", [
    (["lr", "--resume", "RUN", "--epoch", "5"], {"resume", "epochs"}),  # abbreviated
    (["lr", "--epochs=5", "--asy", "--batch-size", "4", "--dry-run"],
     {"epochs", "async_mode", "batch_size", "dry_run"}),
    (["lr", "--epochs", "30"], {"epochs"}),  # the default value, given: still explicit
    (["lr"], set()),
])
def test_explicit_settings_are_what_argparse_parsed(argv, given):
    """--resume compares the settings given with the saved run's: an abbreviated or
    ``--flag=value`` option is given as much as a whole one (it was dropped before)."""
    assert explicit_settings(argv) == given


@pytest.mark.parametrize("argv,pattern", [
    (["nosuchmodel"], "invalid choice: 'nosuchmodel'"),
    (["lr", "--batch-size", "x"], "invalid int value"),
    (["lr", "--optimizer", "rmsprop"], "invalid choice"),
    (["lr", "--no-such-flag"], "unrecognized arguments"),
    (["lr", "--epochs", "0"], "--epochs must be a positive integer"),
])
def test_cli_usage_errors(argv, pattern):
    with pytest.raises(UsageError, match=pattern) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_config_is_immutable_and_serialisable():
    cfg = resolved(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3
    d = cfg.to_dict()
    assert d["mode"] == "sync" and d["workers"] == 3 and d["effective_lr"] == pytest.approx(1.5)


def test_horovod_missing_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"Horovod is not installed in this environment "
                       r"\(TensorFlow 2\.\d+.*TensorFlow 2\.16-2\.18.*bash setup\.sh builds it "
                       r"into \.venv-horovod.*tensorflow-cpu==2\.18\.1.*HOROVOD_WITH_TENSORFLOW=1"
                       r".*horovod==0\.28\.1") as error:
        parse_config(["lr", "--allreduce", "horovod"], world_size=3)
    assert "\n" not in str(error.value)


def test_horovod_options():
    with pytest.raises(UsageError, match="Horovod has no parameter-server mode"):
        resolved(3, allreduce="horovod", async_mode=True)
    with pytest.raises(UsageError, match="--horovod-timeline needs --allreduce horovod"):
        resolved(3, horovod_timeline=True)


@pytest.mark.parametrize("settings,message", [
    (dict(overlap="on", async_mode=True), "--overlap on overlaps the sync allreduce: drop --async"),
    (dict(overlap="on", compiler="xla"), "XLA cannot compile: use --compile auto or graph"),
    (dict(bucket_mb=0.0),
     r"--bucket-mb must be a positive number, at most 1,048,576 \(got 0.0\)"),
])
def test_overlap_options(settings, message):
    with pytest.raises(UsageError, match=message):
        resolved(3, **settings)
    # auto never refuses: it leaves overlap off where it cannot apply
    resolved(3, **{**settings, "overlap": "auto", "bucket_mb": 25.0})


def test_pipeline_options():
    with pytest.raises(UsageError, match="--pipeline on keeps two pushes in flight, which a "
                                         "--staleness bound does not allow"):
        resolved(3, async_mode=True, staleness=2, pipeline="on")
    with pytest.raises(UsageError, match="--pipeline off is for the async workers: add --async"):
        resolved(3, pipeline="off")
    assert resolved(3, async_mode=True, staleness=2, pipeline="off").pipeline == "off"
