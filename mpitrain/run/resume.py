"""Resuming a run (``--resume RUN_DIR``).

* :func:`resumed_config`: the configuration of a run being resumed, the saved one with
  only the settings that may change between sessions taken from the command line.
* :class:`Rescale`: a run resumed on a different number of ranks (a host was lost): how
  its batch and learning rate follow, and where in training it resumes
  (:func:`remap_position`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, TypeVar, cast

from ..config import SETTINGS, Config, scaled
from ..config.model_names import same_model
from ..data.shards import batches_per_epoch
from ..errors import UsageError
from ..results.run_dir import live_writer
from ..userfiles import read_bounded, read_json_object
from .checkpoint import Checkpoint, Geometry, Histograms, geometry

V = TypeVar("V")

#: settings a resumed run may change; every other one must match the saved run
RESUMABLE_CHANGES = ("epochs", "eval_every", "eval_examples", "checkpoint_every",
                     "checkpoint_steps", "quiet", "timeout", "start_timeout", "servers", "compiler",
                     "liveness_floor",
                     "sample_interval", "threads", "keep_cpu_binding", "data_dir", "resume",
                     "steps", "dry_run", "elastic_batch")


def saved_config(run_dir: Path) -> dict:
    """The ``config`` section of a run's config.json."""
    path = Path(run_dir) / "config.json"
    try:
        saved = json.loads(read_bounded(path, error=UsageError))["config"]
    except FileNotFoundError:
        raise UsageError(f"--resume {run_dir}: not a run directory (no config.json)") from None
    except UsageError as e:
        raise UsageError(f"--resume {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--resume {run_dir}: cannot read {path} ({e})") from None
    if not isinstance(saved, dict):
        raise UsageError(f"--resume {run_dir}: {path} holds no settings (its config is a "
                         f"{type(saved).__name__}); fix the file or start a new run")
    return saved


def refuse_a_live_writer(run_dir: Path) -> None:
    """UsageError if a job is still writing ``run_dir`` (its status.json says running and
    names a writer that runs here): two jobs would write one run directory, each
    overwriting the other's checkpoint, curve and status."""
    pid = live_writer(read_json_object(run_dir / "status.json"))
    if pid is not None:
        raise UsageError(f"--resume {run_dir}: that run is still training (pid {pid} writes "
                         f"it); stop it first (kill -TERM {pid}: it checkpoints) or wait "
                         "for it to end")


#: settings added or changed since a run's config.json may have been written, as such a
#: run trained (their defaults differ): no warm-up, no staleness compensation, the
#: optimizer's own momentum, no staleness bound (saved as null before auto)
TRAINED_BEFORE = {"warmup_epochs": 0.0, "staleness_compensation": "none",
                  "momentum_correction": "off", "staleness": "none"}


def resumed_config(cli: Config, explicit: set, world_size: int
                   ) -> Tuple[Config, Optional["Rescale"]]:
    """The configuration to resume ``cli.resume`` with, and how it was rescaled.

    Settings given explicitly on the command line must equal the saved run's,
    except those in RESUMABLE_CHANGES (more epochs, another timeout...);
    UsageError naming the first mismatch otherwise. On another number of ranks
    than the saved run's, the batch and learning rate follow :class:`Rescale`
    (returned, else None).
    """
    run_dir = Path(cast(str, cli.resume))  # (called for a --resume)
    saved = saved_config(run_dir)
    refuse_a_live_writer(run_dir)
    # older files: fewer keys; a setting added since takes what such a run trained with
    base = {**TRAINED_BEFORE, **{k: v for k, v in saved.items()
                                 if k in SETTINGS and (v is not None or k not in TRAINED_BEFORE)}}
    if not same_model(cli.model, str(base.get("model"))):
        raise UsageError(f"--resume {cli.resume}: that run trained {base.get('model')}, "
                         f"not {cli.model}")  # a user's model: the saved absolute spec loads
    for key in sorted(explicit):
        if key in RESUMABLE_CHANGES or key == "model":
            continue
        if cli.setting(key) != base.get(key):
            raise UsageError(f"--resume {cli.resume}: {SETTINGS[key].label} was "
                             f"{base.get(key)!r} in that run, not {cli.setting(key)!r}; "
                             "resume with the same setting")
    changes = {key: cli.setting(key) for key in RESUMABLE_CHANGES if key in explicit}
    changes["resume"] = cli.resume
    # the servers of the session that wrote the checkpoint (a resumed session may have
    # changed them); they stay unless --servers is given
    saved_cfg = Config.of(**base)
    saved_servers = _last_servers(run_dir, saved_cfg.asynchronous.servers)
    changes.setdefault("servers", saved_servers)
    original = _checked_saved(saved_cfg.replace(**changes), cli.resume)
    # the rules between settings hold at this job's size (another -np, other --servers)
    if original.world_size == world_size and original.asynchronous.servers == saved_servers:
        return _checked_saved(original, cli.resume, rules=True), None
    # another number of ranks, or of --servers: the workers are others
    rescale = Rescale.between(original.replace(servers=saved_servers), world_size,
                              original.asynchronous.servers)
    return _checked_saved(rescale.config.replace(**changes), cli.resume, rules=True), rescale


def _last_servers(run_dir: Path, first: int) -> int:
    """--servers of the run's last session: its newest resumed-*.json's, else ``first``
    (config.json's)."""
    for path in sorted(run_dir.glob("resumed-*.json"), reverse=True):
        try:
            return int(json.loads(path.read_text())["config"]["servers"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # (unreadable, or written before --servers existed)
    return first


def _checked_saved(cfg: Config, run_dir, rules: bool = False) -> Config:
    """A resumed run's settings (its config.json's, with this session's changes) checked
    as strictly as typed ones (:meth:`Config.checked`), and with ``rules`` validated
    (:meth:`Config.validate`, at this job's size): the file may have been edited."""
    path = Path(run_dir) / "config.json"
    try:
        checked = cfg.checked(lambda s: f"{s.key} in {path}", complete=True)
        return checked.validate() if rules else checked
    except UsageError as e:
        raise UsageError(f"--resume {run_dir}: {e}; fix the file or start a new run") \
            from None


@dataclass(frozen=True)
class Rescale:
    """A run resumed on ``config.world_size`` ranks instead of ``original.world_size``.

    Sync keeps the global batch (workers x per-worker batch) by changing the
    per-worker batch: exactly where it divides, else to the nearest batch, and
    the learning rate then follows the run's scaling rule (the global batch's ratio,
    or its square root; unchanged under ``--lr-scaling none``). Under
    ``--elastic-batch per-worker`` it keeps the per-worker batch instead, and the
    learning rate follows the scaling rule for the workers there are (as Horovod's
    elastic users scale it in a reset callback). With
    ``--batches-per-epoch`` the steps per epoch are kept instead (the batch follows
    the shard) and so is the learning rate. Async keeps batch and learning rate (every update is one
    worker's batch either way); the remaining updates are shared by the workers
    there are. Always relative to the run's first session, so rescaling twice
    does not compound roundings. :func:`remap_position` moves a checkpoint's position.
    """

    original: Config
    config: Config
    rule: str  # one line for the console and the run's records

    @classmethod
    def between(cls, original: Config, world_size: int,
                servers: Optional[int] = None) -> "Rescale":
        """``original`` continued on ``world_size`` ranks, ``servers`` of them parameter
        servers (async; default: as many as before)."""
        servers = original.asynchronous.servers if servers is None else servers
        moved = original.replace(world_size=world_size, servers=servers)
        if moved.async_mode and world_size < servers + 1:
            raise UsageError(f"--resume: an async run needs its parameter server(s) and a "
                             f"worker; -np {world_size} cannot continue it with --servers "
                             f"{servers} (use -np {servers + 1} or more)")
        how = f"-np {original.world_size} -> {world_size} ({original.workers} -> " \
              f"{moved.workers} workers)"
        if servers != original.asynchronous.servers:
            how = f"--servers {original.asynchronous.servers} -> {servers}, {how}"
        if original.async_mode:
            return cls(original, moved, f"{how}: batch {original.batch_size} per worker and "
                       f"lr {original.effective_lr:g} kept; the workers share the updates left")
        if original.batches_per_epoch:
            kept = cls._with_effective_lr(moved, original.effective_lr)
            return cls(original, kept, f"{how}: {original.batches_per_epoch} batches per "
                       f"epoch kept (the batch follows the shard), lr "
                       f"{original.effective_lr:g} kept")
        if original.sync.elastic_batch == "per-worker":
            return cls(original, moved, f"{how}: batch {original.batch_size} per worker kept "
                       f"(--elastic-batch per-worker), global batch {original.global_batch} "
                       f"-> {moved.global_batch}, lr {original.effective_lr:g} -> "
                       f"{moved.effective_lr:g} ({original.optimizer.scaling} scaling)")
        target = original.global_batch
        batch = max(1, round(target / moved.workers))
        moved = moved.replace(batch_size=batch)
        ratio = moved.global_batch / target
        lr = original.effective_lr * scaled(original.optimizer.scaling, ratio)
        moved = cls._with_effective_lr(moved, lr)
        if ratio == 1:
            rule = f"global batch {target} kept (per-worker batch {original.batch_size} -> " \
                   f"{batch}), lr {lr:g} kept"
        else:
            rule = f"global batch {target} does not divide by {moved.workers}: per-worker " \
                   f"batch {original.batch_size} -> {batch}, global batch " \
                   f"{moved.global_batch}, lr {original.effective_lr:g} -> {lr:g} " + \
                   (f"({original.optimizer.scaling} scaling)"
                    if original.optimizer.scaling != "none" else "kept (--lr-scaling none)")
        return cls(original, moved, f"{how}: {rule}")

    @staticmethod
    def _with_effective_lr(cfg: Config, effective_lr: float) -> Config:
        """``cfg`` with --lr set so that its effective (scaled) learning rate is this."""
        return cfg.replace(lr=effective_lr * cast(float, cfg.optimizer.lr) / cfg.effective_lr)

    def as_dict(self) -> dict:
        o, n = self.original, self.config
        return {"from_np": o.world_size, "to_np": n.world_size, "from_workers": o.workers,
                "to_workers": n.workers, "batch_size": [o.batch_size, n.batch_size],
                "effective_lr": [o.effective_lr, n.effective_lr], "rule": self.rule}


def remap_position(ckpt: Checkpoint, cfg: Config, train_size: int,
                   original: Optional[Config] = None) -> Checkpoint:
    """``ckpt`` with its position in ``cfg``'s units, when it was written on another
    number of ranks or batch size (its ``geometry``; one without is in the units of
    the run's first session, ``original``, default ``cfg``). For sync, the step of the
    same epoch after which as many examples were trained on (rounded down); for async
    the updates done are spread over ``cfg``'s workers. The optimizer state carries
    over as it is (it holds no per-rank entries); the sync workers' compression
    residuals only to the same workers."""
    was = ckpt.meta.geometry or geometry(original or cfg)
    old_workers = cfg.replace(world_size=was.world_size, servers=was.servers).workers
    if old_workers == cfg.workers and was.batch_size == cfg.batch_size:
        if was.servers == cfg.asynchronous.servers:
            return ckpt
        # the same workers at other ranks: the worker of index i was rank was.servers + i
        return _moved_workers(ckpt, cfg.asynchronous.servers - was.servers, geometry(cfg))
    if cfg.async_mode:
        done = sum(ckpt.worker_steps.values()) or ckpt.step
        share, left = divmod(done, cfg.workers)
        first = cfg.asynchronous.servers  # the first worker's rank
        steps = {first + i: share + (1 if i < left else 0) for i in range(cfg.workers)}
        meta = dataclasses.replace(
            ckpt.meta, geometry=geometry(cfg),
            extra_steps={},  # the plan starts over: total_steps each, minus done
            updates_short=0,  # (and with it what a lost worker left undone)
            staleness=_fold_staleness(_shifted(ckpt.meta.staleness, first - was.servers),
                                      first, cfg.workers))
        return dataclasses.replace(ckpt, worker_steps=steps, meta=meta)
    old_per_epoch = batches_per_epoch(train_size // old_workers, was.batch_size)
    new_per_epoch = batches_per_epoch(train_size // cfg.workers, cast(int, cfg.batch_size))
    epoch, within = divmod(ckpt.step, old_per_epoch)
    # the same examples of the epoch trained on: with a streamed shard set exactly those
    # of the first steps (mpitrain.data.order), so less than a step is repeated
    seen = within * old_workers * was.batch_size
    step = epoch * new_per_epoch + min(new_per_epoch - 1,
                                       seen // (cfg.workers * cast(int, cfg.batch_size)))
    meta = dataclasses.replace(ckpt.meta, geometry=geometry(cfg), rng={
        r: row for r, row in ckpt.meta.rng.items() if r < cfg.world_size})
    # (a compressing worker's residual is its own gradients' rest: another number of
    # workers starts from zero residuals, as a new run does)
    return dataclasses.replace(ckpt, step=step, meta=meta, codecs={})


def _fold_staleness(by_rank: Histograms, first: int, n_workers: int) -> Histograms:
    """Staleness counts of ranks that are gone go to the nearest worker there is (ranks
    ``first``..``first + n_workers - 1``), so the run's histogram (the sum over workers)
    stays whole."""
    out: Histograms = {}
    for rank, counts in by_rank.items():
        into = out.setdefault(min(max(rank, first), first + n_workers - 1), {})
        for s, c in counts.items():
            into[s] = into.get(s, 0) + c
    return out


def _shifted(by_rank: Dict[int, V], offset: int) -> Dict[int, V]:
    """``by_rank`` (worker rank -> anything) with every rank + offset."""
    return {rank + offset: value for rank, value in by_rank.items()}


def _moved_workers(ckpt: Checkpoint, offset: int, new_geometry: Geometry) -> Checkpoint:
    """``ckpt`` with every worker's counts ``offset`` ranks on (another --servers at the
    same number of workers: the same workers, numbered after the servers)."""
    meta = dataclasses.replace(ckpt.meta, geometry=new_geometry,
                               staleness=_shifted(ckpt.meta.staleness, offset),
                               extra_steps=_shifted(ckpt.meta.extra_steps, offset))
    steps = {rank + offset: n for rank, n in ckpt.worker_steps.items()}
    return dataclasses.replace(ckpt, worker_steps=steps, meta=meta)
