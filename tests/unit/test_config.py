"""Config validation and CLI parsing: every bad setting is one UsageError line."""

import dataclasses
import json
import math
import platform
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from mpitrain import models
from mpitrain.config.bounds import Bounds
from mpitrain.cli.commands import (build_parser, explicit_settings, parse_config,
                                   user_model_in)
from mpitrain.config import Config, resolve
from mpitrain.errors import UsageError
from mpitrain.run.resume import resumed_config
from mpitrain.config.settings import MAX_SECONDS
from mpitrain.train.leases import Liveness

LR_DEFAULTS = models.get("lr").defaults


def resolved(world_size=1, **kw):
    return resolve(Config.of(**kw), LR_DEFAULTS, world_size)


def test_model_defaults_fill_unset_fields():
    cfg = resolved()
    assert (cfg.epochs, cfg.batch_size, cfg.optimizer.lr, cfg.optimizer.name) == (
        30, 100, 0.05, "nesterov")
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
    from mpitrain.launch.preflight import check_launch

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
    assert sync4.effective_lr == pytest.approx(0.15)
    assert resolved(4, lr_scaling="none").effective_lr == pytest.approx(0.05)
    assert resolved(4, async_mode=True).effective_lr == pytest.approx(0.05)


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
    assert explicit_settings(build_parser(user_model_in(argv)).parse_args(argv)) == given


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
    assert d["mode"] == "sync" and d["workers"] == 3 and d["effective_lr"] == pytest.approx(0.15)


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
    # the default bound, where it binds, is one too; unbounded, the pipeline may run
    with pytest.raises(UsageError, match=r"which the default --staleness bound \(4 with more "
                                         r"than 5 workers\) does not allow: add --staleness "
                                         r"none, or drop --pipeline on"):
        resolved(7, async_mode=True, pipeline="on")
    assert resolved(7, async_mode=True, pipeline="on", staleness="none").staleness_bound \
        is None
    assert resolved(6, async_mode=True, pipeline="on").staleness_bound is None
    with pytest.raises(UsageError, match="--pipeline off is for the async workers: add --async"):
        resolved(3, pipeline="off")
    assert resolved(3, async_mode=True, staleness=2, pipeline="off").asynchronous.pipeline \
        == "off"


@pytest.mark.parametrize("world_size,given,bound", [
    (3, None, None), (6, None, None), (7, None, 4), (17, None, 4), (65, "auto", 4),
    (17, "none", None), (17, 0, 0), (17, 12, 12), (3, 4, 4)])
def test_the_staleness_bound_auto_binds_past_five_workers(world_size, given, bound):
    """--staleness auto (the default) bounds at 4 where more than 5 workers could pass it
    (at most 5 then compute at once), else not at all; none: never; K: K."""
    kw = {} if given is None else {"staleness": given}
    cfg = resolved(world_size, async_mode=True, **kw)
    assert cfg.staleness_bound == bound
    assert cfg.asynchronous.staleness == ("auto" if given is None else given)


def test_the_staleness_setting_takes_a_bound_or_a_word():
    for bad in ("x", -1, 2.5, True):
        with pytest.raises(UsageError, match=r"--staleness must be auto, none, or 0 or a "
                                             r"positive integer \(got "):
            resolved(3, async_mode=True, staleness=bad)
    # None is none (as config.json and mpitrain.fit had it before auto)
    assert resolved(17, async_mode=True, staleness=None).staleness_bound is None
    # sync: no bound, and none can be given
    assert resolved(17).staleness_bound is None
    for given in (3, "none"):
        with pytest.raises(UsageError, match="--staleness bounds the async parameter server"):
            resolved(3, staleness=given)


# ---- sections, keys, one build -----------------------------------------------------------
def test_settings_live_in_sections_and_keep_their_flat_keys():
    cfg = resolved(3, async_mode=True, staleness=2, lr=0.1, data_dir="d", checkpoint_steps=5)
    assert (cfg.asynchronous.staleness, cfg.optimizer.lr, cfg.data.data_dir,
            cfg.checkpoint.steps) == (2, 0.1, "d", 5)
    assert cfg.setting("staleness") == 2 and cfg.setting("checkpoint_steps") == 5
    assert cfg.replace(staleness=1, epochs=4).asynchronous.staleness == 1
    with pytest.raises(AttributeError, match="it is cfg.asynchronous.staleness"):
        cfg.staleness  # noqa: B018 - a key is no attribute: the message says where it lives
    with pytest.raises(TypeError, match="no setting 'epoch'"):
        Config.of(epoch=3)


def test_help_lists_the_flat_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        parse_config(["lr", "--help"])
    blocks = {block.split("\n", 1)[0]: block for block in
              capsys.readouterr().out.split("\n\n")}
    for heading, flag in (("sync training options:", "--overlap"),
                          ("async training options:", "--staleness"),
                          ("stalls and faults options:", "--timeout")):
        assert f"\n  {flag} " in blocks[heading], (heading, flag)


def test_a_config_json_of_the_layout_before_sections_resumes(tmp_path):
    """config.json keeps its flat keys: a run directory written before the settings were
    sectioned (this file is one, from 022e3fc) resumes with the same settings; so does an
    older one that lacks settings added since (they take their defaults)."""
    saved = json.loads((Path(__file__).parent / "config_before_sections.json").read_text())
    for missing in ((), ("liveness_floor", "start_timeout", "checkpoint_steps")):
        run = tmp_path / f"run{len(missing)}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps(
            {"config": {k: v for k, v in saved["config"].items() if k not in missing}}))
        cfg, rescale = resumed_config(Config.of(model="lr", resume=str(run)), {"resume"}, 3)
        assert rescale is None
        expect = {k: v for k, v in saved["config"].items() if k not in missing}
        assert {k: v for k, v in cfg.to_dict().items() if k in expect and k != "resume"} == \
            {k: v for k, v in expect.items() if k != "resume"}
        assert cfg.asynchronous.staleness == 2 and cfg.faults.timeout == 200.0
        assert cfg.faults.liveness_floor == (10.0 if missing else 12.0)
        # settings added since, whose defaults changed the training: as it trained
        assert (cfg.optimizer.warmup_epochs, cfg.asynchronous.compensation) == (0.0, "none")


def test_the_command_line_gives_the_configs_and_errors_it_gave_before_sections():
    """config_before_sections.json's "cli" cases, written by 4e59ec8 (the flat config,
    which the session resolved again at the job's size): for each argv and size, the
    settings a run got (config.json's, all derived keys included) or the error line.
    Every model's defaults at -np 1-4, every option given, abbreviated flags, every rule
    between options alone and values out of range: the sections change none of them."""
    saved = json.loads((Path(__file__).parent / "config_before_sections.json").read_text())
    assert len(saved["cli"]) == 73
    for case in saved["cli"]:
        try:
            cfg = parse_config(case["argv"], world_size=case["world_size"])
            # with --batches-per-epoch the session derives the batch from the data
            got = {"settings": cfg.settings()} if cfg.batch_size is None else \
                {"config": cfg.to_dict()}
        except UsageError as e:
            got = {"error": str(e)}
        assert {"argv": case["argv"], "world_size": case["world_size"], **got} == \
            since_large_batch_defaults(case)


def since_large_batch_defaults(case: dict) -> dict:
    """A saved case as the large-batch and async defaults changed it, and nothing else: the
    new settings at their defaults (--staleness auto, PowerSGD's and top-k's,
    --eval-examples, --elastic-batch, --stream), the data tool, lr's cosine
    schedule and Nesterov momentum at a tenth of the rate, and the derived warm-up (its rule:
    test_the_warm_up_and_the_scaling_follow_the_rule)."""
    case = json.loads(json.dumps(case))
    kind = "config" if "config" in case else "settings" if "settings" in case else None
    if kind is None:  # an error; --staleness takes auto and none besides a number now
        case["error"] = case["error"].replace("--staleness must be 0 or",
                                              "--staleness must be auto, none, or 0 or")
        case["error"] = case["error"].replace("'launch')", "'launch', 'data')")  # a tool since
        return case
    values, argv = case[kind], case["argv"]
    values.update(staleness_compensation="auto", dc_lambda=2.0, momentum_correction="on",
                  compression_rank=2, compression_warmup=100, compression_ratio=0.01,
                  compression_min_size=1024, eval_examples=0, elastic_batch="global",
                  stream=False)
    if values.get("staleness") is None:  # (not given: now auto, which stays in the config)
        values["staleness"] = "auto"
    if argv[0] == "lr" and "--lr-schedule" not in argv:
        values["lr_schedule"] = "cosine"
    if argv[0] == "lr" and "--lr" not in argv:  # (no case gives lr --optimizer)
        scale = values["effective_lr"] / values["lr"] if "effective_lr" in values else None
        values.update(optimizer="nesterov", lr=values["lr"] / 10)
        if scale is not None:
            values["effective_lr"] = values["lr"] * scale
    # the default warm-up is fixed in the config as it is built
    values["warmup_epochs"] = parse_config(argv, world_size=case["world_size"]).warmup
    return case


@pytest.mark.parametrize("np_,optimizer,scaling,epochs,given,lr,warmup", [
    (1, "sgd", "linear", 10, None, 0.5, 0.0),  # one worker: nothing scaled, no warm-up
    (3, "sgd", "linear", 10, None, 1.0, 2.0),  # x2; a fifth of the epochs
    (17, "sgd", "linear", 30, None, 8.0, 5.0),  # x16; at most 5 epochs (Goyal et al.)
    (17, "adam", "linear", 3, None, 0.016, 0.0),  # adam: no warm-up by default...
    (17, "adam", "linear", 3, 0.5, 0.016, 0.5),  # ...unless asked for
    (17, "sgd", "sqrt", 3, None, 2.0, 0.6),  # x sqrt(16)
    (17, "sgd", "none", 3, None, 0.5, 0.0),  # nothing scaled up: no warm-up
    (17, "sgd", "linear", 3, 0.0, 8.0, 0.0),  # --warmup-epochs 0: none
    (5, "momentum", "linear", 3, 2.5, 2.0, 2.5)])
def test_the_warm_up_and_the_scaling_follow_the_rule(np_, optimizer, scaling, epochs, given,
                                                     lr, warmup):
    base = 0.001 if optimizer == "adam" else 0.5
    argv = ["lr", "--optimizer", optimizer, "--lr", str(base), "--lr-scaling", scaling,
            "--epochs", str(epochs)] + ([] if given is None else ["--warmup-epochs", str(given)])
    cfg = parse_config(argv, world_size=np_)
    assert cfg.effective_lr == pytest.approx(lr)
    assert cfg.warmup == pytest.approx(warmup)
    async_cfg = parse_config(argv + ["--async"], world_size=max(2, np_))
    assert async_cfg.effective_lr == base  # async applies one worker's gradient at a time


def test_async_options_are_refused_in_sync_mode():
    with pytest.raises(UsageError, match="--staleness-compensation dc is for the async"):
        parse_config(["lr", "--staleness-compensation", "dc"], world_size=3)
    with pytest.raises(UsageError, match="--dc-lambda sets delay compensation, not "
                                         "--staleness-compensation sqrt: use dc"):
        parse_config(["lr", "--async", "--staleness-compensation", "sqrt", "--dc-lambda",
                      "1"], world_size=3)
    cfg = parse_config(["lr", "--async", "--staleness-compensation", "dc", "--dc-lambda",
                        "0.5"], world_size=3)
    assert (cfg.asynchronous.compensation, cfg.asynchronous.dc_lambda) == ("dc", 0.5)


def test_a_value_typed_with_resume_is_checked_as_typed():
    """Named by its flag, not as a bad value of the run's config.json (as it was)."""
    with pytest.raises(UsageError, match=r"^--epochs must be a positive integer \(got 0\)$"):
        parse_config(["lr", "--resume", "RUN", "--epochs", "0"])


def test_a_run_with_batches_per_epoch_resumes(tmp_path):
    """Its config.json holds the batch the session derived beside --batches-per-epoch:
    the resumed run is that config, validated as read, not built again from the command
    line's rules (which refuse the two given together, and refused the resume)."""
    cfg = parse_config(["lr", "--batches-per-epoch", "5"], world_size=3)
    (tmp_path / "config.json").write_text(json.dumps(
        {"config": cfg.replace(batch_size=6000).to_dict()}))  # as the session derives it
    resumed, _ = resumed_config(parse_config(["lr", "--resume", str(tmp_path), "--epochs", "40"]),
                                {"resume", "epochs"}, 3)
    assert (resumed.batches_per_epoch, resumed.batch_size, resumed.epochs) == (5, 6000, 40)
    with pytest.raises(UsageError, match="give --batch-size or --batches-per-epoch, not both"):
        parse_config(["lr", "--batches-per-epoch", "5", "--batch-size", "4"], world_size=3)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(peer=st.floats(min_value=1e-3, max_value=MAX_SECONDS),
       start=st.floats(min_value=1e-3, max_value=MAX_SECONDS),
       floor=st.floats(min_value=1e-3, max_value=MAX_SECONDS),
       interval=st.floats(min_value=0, max_value=MAX_SECONDS), buckets=st.integers(1, 64))
def test_the_bounds_keep_their_order(peer, start, floor, interval, buckets):
    """The order mpitrain.config.bounds states: the rank that can name the culprit gives up
    first."""
    b = Bounds(peer, start)
    liveness = Liveness(b.peer, floor)
    liveness.observe(1, interval)
    assert max(liveness.bound(1), liveness.bound(2)) <= b.peer < b.workers \
        < b.bucket_thread(buckets) < b.bucket_thread(buckets + 1)
    assert b.keepalive < b.peer < b.reply
    assert b.horovod_stall_check == b.peer < b.horovod_stall_shutdown == b.workers
    assert max(b.start, b.peer) < b.check_job


def test_the_bounds_are_the_multiples_of_timeout_they_were():
    b = resolved(3, timeout=300.0).faults.bounds
    assert (b.peer, b.workers, b.reply, b.keepalive, b.bucket_thread(2), b.check_job) == (
        300.0, 1.5 * 300 + 2, 600.0, 150.0, (1.5 * 300 + 2) * 3 + 10, 300.0 + 120.0)
