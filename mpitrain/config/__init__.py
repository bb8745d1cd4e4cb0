"""The one typed configuration of a training run, in sections, validated in one place.

:class:`Config` holds what a run is (the model, the mode, how long, how big its
batches) and one section per concern: ``data``, ``optimizer``, ``sync`` (options of
the sync allreduce), ``asynchronous`` (of the async parameter server), ``transport``
(how gradients travel in either mode), ``checkpoint``, ``faults`` and ``telemetry``.
Every setting carries its help text and, where it is a command-line option, its flag
(:func:`mpitrain.config.settings.option`); the CLI builds its parser from them, one group per
section, the flags flat as ever. A setting's key is its flat name, the same for the
command line, ``mpitrain.fit``'s keywords and config.json (:meth:`Config.of`,
:meth:`Config.setting`, :meth:`Config.to_dict`), whatever section holds it.

Building a run's config happens once: :func:`resolve` fills what the command line left
to the model's defaults and validates the result (:meth:`Config.validate`: every value
checked, then each section's rules); a resumed run's is its saved config, validated
once as it is read (:func:`mpitrain.run.resume.resumed_config`). A leaf.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, cast

from ..errors import UsageError
from .settings import COUNT, Number, Setting, checked_value, option
from .sections import (COMPILERS, OUTPUTS, WARMED_UP, WARMUP_FRACTION, WARMUP_MAX_EPOCHS,
                       AsyncSettings, CheckpointSettings, DataSettings, FaultSettings,
                       OptimizerSettings, SyncSettings, TelemetrySettings, TransportSettings,
                       staleness_bound)


def _section(kind, title: str):
    return field(default_factory=kind, metadata={"section": title})


@dataclass(frozen=True)
class Config:
    """Settings of one training run; identical on every rank."""

    model: str = option("model to train: a registered name, or the user's FILE.py:FUNCTION "
                        "(its path made absolute) or module:FUNCTION", "lr")
    model_given: Optional[str] = option("the model as given on the command line (a "
                                        "relative FILE path as typed)")
    async_mode: bool = option(
        "asynchronous parameter-server training (rank 0 applies each worker's "
        "gradient as it arrives); default is synchronous allreduce",
        False, flag="--async", action="store_true")
    epochs: Optional[int] = option(
        "passes over the whole training set (each worker passes once over its shard)",
        flag="--epochs", type=int, metavar="N", number=COUNT)
    batch_size: Optional[int] = option(
        "examples per step PER WORKER; the global batch is workers x this",
        flag="--batch-size", type=int, metavar="B", number=COUNT)
    batches_per_epoch: Optional[int] = option(
        "instead of --batch-size: the batch size that gives each worker this many steps "
        "per epoch (batch = ceil(shard / K)); 1 = full-shard batches",
        flag="--batches-per-epoch", type=int, metavar="K", number=COUNT)
    steps: Optional[int] = option(
        "stop after this many steps per worker (smoke runs); default: run all epochs",
        flag="--steps", type=int, metavar="N", number=COUNT)
    dry_run: bool = option("smoke mode: one epoch of at most 2 steps, results written as "
                           "usual", False, flag="--dry-run", action="store_true")
    eval_every: int = option("evaluate on the test set every N epochs (and at the end)",
                             1, flag="--eval-every", type=int, metavar="N", number=COUNT)
    eval_examples: int = option(
        "evaluate on N examples of the test split, the same ones at every evaluation and "
        "for every --seed (a fixed random sample): quicker evaluations of a larger model, "
        "at the price of a less precise accuracy; 0 = the whole split", 0,
        flag="--eval-examples", type=int, metavar="N",
        number=Number(True, 1, off=0, off_means="the whole split"))
    seed: int = option("random seed for initial weights, shuffling and synthetic data",
                       42, flag="--seed", type=int, number=Number(True, 0))
    outputs: str = option(
        "what the model's last layer outputs: logits (no activation; recommended) or "
        "probabilities (it ends in a softmax); the loss and evaluation follow",
        "logits", flag="--outputs", choices=OUTPUTS)
    compiler: str = option(
        "how the training steps are compiled: graph (tf.function), xla (TensorFlow's "
        "XLA fuses each step's kernels, after a compilation of seconds per batch shape, "
        "but runs its own, not oneDNN's: slower for convolutional models on CPUs where "
        "oneDNN runs; a model it cannot compile falls back to graph), or "
        "auto (graph, but the update is one fused pass in C over a flat copy of the "
        "weights, the async server's optimizer, assigned in the next gradient step; "
        "docs/architecture.md, \"XLA only on request\")", "auto",
        flag="--compile", choices=COMPILERS)
    threads: int = option(
        "TensorFlow intra-op threads per rank; 0 = the host's cores divided among "
        "the worker ranks on that host (at least 1)", 0, flag="--threads", type=int,
        number=Number(True, 1, 4096, off=0, off_means="auto"))
    keep_cpu_binding: bool = option(
        "keep the CPU binding the launcher gave each rank; by default mpitrain lets "
        "every rank use all the host's CPUs (Open MPI binds each rank to one core at "
        "-np 1 and 2, which would leave a core idle) and sizes thread pools itself",
        False, flag="--keep-cpu-binding", action="store_true")
    results_dir: str = option("where run directories and runs.csv are written",
                              "results", flag="--results-dir", metavar="DIR")
    quiet: bool = option("print only errors and the final summary", False,
                         flag="--quiet", action="store_true")
    resume: Optional[str] = option(
        "continue the run in RUN_DIR from its last checkpoint (same settings; you may "
        "change --epochs and other non-training settings), appending to its results",
        flag="--resume", metavar="RUN_DIR")
    #: derived: the job's size (filled by resolve())
    world_size: int = option("number of MPI ranks", 1, number=COUNT)

    data: DataSettings = _section(DataSettings, "data")
    optimizer: OptimizerSettings = _section(OptimizerSettings, "optimizer")
    sync: SyncSettings = _section(SyncSettings, "sync training")
    asynchronous: AsyncSettings = _section(AsyncSettings, "async training")
    transport: TransportSettings = _section(TransportSettings, "gradients on the wire")
    checkpoint: CheckpointSettings = _section(CheckpointSettings, "checkpoints")
    faults: FaultSettings = _section(FaultSettings, "stalls and faults")
    telemetry: TelemetrySettings = _section(TelemetrySettings, "telemetry")

    def __getattr__(self, name: str):
        where = SETTINGS.get(name)  # a setting's key: say which section holds it
        if where is not None and where.section:
            raise AttributeError(f"Config has no attribute {name!r}: it is "
                                 f"cfg.{where.section}.{where.name}")
        raise AttributeError(name)

    # ---- by key: the flat view the command line, fit() and config.json have ------------
    @classmethod
    def of(cls, **settings) -> "Config":
        """The config of these settings by key (``epochs=3, staleness=2, data=PATH``);
        the others at their defaults. TypeError for a key no setting has."""
        top: Dict[str, Any] = {}
        sections: Dict[str, Dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in settings.items():
            where = SETTINGS.get(key)
            if where is None:
                raise TypeError(f"no setting {key!r}")
            (sections[where.section] if where.section else top)[where.name] = value
        return cls(**top, **{name: SECTIONS[name](**values)
                             for name, values in sections.items()})

    def setting(self, key: str):
        """The value of the setting ``key``."""
        where = SETTINGS[key]
        return getattr(getattr(self, where.section) if where.section else self, where.name)

    def replace(self, **settings) -> "Config":
        """This config with the settings given by key changed."""
        return Config.of(**{**self.settings(), **settings})

    def settings(self) -> Dict[str, object]:
        """Every setting's value by key, flat."""
        return {key: self.setting(key) for key in SETTINGS}

    def to_dict(self) -> dict:
        """All settings by key, with the derived ones, for config.json: flat, so that a
        run directory of any mpitrain resumes whatever section a setting moves to."""
        return {**self.settings(), "mode": self.mode, "workers": self.workers,
                "effective_lr": self.effective_lr, "global_batch": self.global_batch,
                "max_steps": self.max_steps}

    # ---- derived ----------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """single (one rank), sync or async."""
        if self.world_size == 1:
            return "single"
        return "async" if self.async_mode else "sync"

    @property
    def workers(self) -> int:
        """Ranks that compute gradients: all of them at -np 1, else every rank but the
        servers (rank 0, or ranks 0..K-1 with --servers K)."""
        return 1 if self.world_size == 1 else self.world_size - self.asynchronous.servers

    @property
    def max_steps(self) -> Optional[int]:
        """Cap on steps per worker, from --steps or --dry-run."""
        if self.dry_run:
            return 2 if self.steps is None else min(self.steps, 2)
        return self.steps

    @property
    def lr_scale(self) -> float:
        """The factor sync mode scales --lr by: the global batch over one worker's batch
        (the workers), as --lr-scaling says; 1 in the other modes."""
        return scaled(self.optimizer.scaling, self.workers) if self.mode == "sync" else 1.0

    @property
    def staleness_bound(self) -> Optional[int]:
        """The async servers' staleness bound (--staleness as it applies to this many
        workers: :func:`.sections.staleness_bound`); None: unbounded, or not async."""
        if self.mode != "async":
            return None
        return staleness_bound(self.asynchronous.staleness, self.workers)

    @property
    def effective_lr(self) -> float:
        """The learning rate the optimizer uses at its peak (:attr:`lr_scale` x --lr)."""
        return cast(float, self.optimizer.lr) * self.lr_scale  # (set in a resolved config)

    @property
    def warmup(self) -> float:
        """Epochs of gradual warm-up: --warmup-epochs, or by default a fifth of the run
        (at most 5) where the rate of an optimizer in WARMED_UP is scaled up, else none."""
        if self.optimizer.warmup_epochs is not None:
            return self.optimizer.warmup_epochs
        if self.lr_scale <= 1.0 or self.optimizer.name not in WARMED_UP:
            return 0.0
        return min(WARMUP_MAX_EPOCHS, WARMUP_FRACTION * cast(int, self.epochs))

    @property
    def global_batch(self) -> int:
        """Examples consumed by one synchronous update."""
        return cast(int, self.batch_size) * (self.workers if self.mode == "sync" else 1)

    # ---- checks -----------------------------------------------------------------------
    def checked(self, label: Optional[Callable[[Setting], str]] = None,
                complete: bool = False) -> "Config":
        """This config with every value checked for its type and range and made a plain
        int, float, bool or str; UsageError naming the first bad one (``label`` names a
        setting in the message; default: its flag). Settings left None for the model's
        defaults pass, unless ``complete`` (a resolved config: every setting a run needs
        is given). The one check of what the command line, ``mpitrain.fit`` and a
        resumed run's config.json give."""
        label = label or (lambda s: s.label)
        needed = ("epochs", "lr", "optimizer") + (
            ("batch_size",) if self.batches_per_epoch is None or self.batch_size is not None
            else ())
        values = self.settings()
        return Config.of(**{
            key: (checked_value(s, values[key], label(s))
                  if values[key] is not None or s.default is not None
                  or complete and key in needed else None)
            for key, s in SETTINGS.items()})

    def validate(self, label: Optional[Callable[[Setting], str]] = None) -> "Config":
        """This config :meth:`checked` (complete) and the rules between settings kept (the
        options of one mode not given in the other, options that exclude each other),
        section by section, then the mode against the job's size; UsageError naming the
        first bad setting. The one validation of a run's config."""
        cfg = self.checked(label, complete=True)
        for section in (cfg.data, cfg.asynchronous, cfg.sync, cfg.transport):
            section.check(cfg)  # the sections with rules; the others take any values
        if cfg.async_mode and cfg.world_size < 2:
            raise UsageError("--async needs a parameter server and at least one worker: "
                             "run with mpirun -np 2 or more")
        servers = cfg.asynchronous.servers
        if servers > 1 and servers >= cfg.world_size:
            raise UsageError(f"--servers {servers} leaves no worker at -np "
                             f"{cfg.world_size}: run with -np {servers + 1} or "
                             "more, or fewer --servers")
        return cfg


#: the sections of a Config: attribute -> its dataclass
SECTIONS: Dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(Config)
                             if "section" in f.metadata}
#: the heading of each section's options in --help ('' : the run's own)
SECTION_TITLES = {"": "training", **{f.name: f.metadata["section"]
                                     for f in dataclasses.fields(Config)
                                     if "section" in f.metadata}}
#: every setting by key, in the order --help lists them
SETTINGS: Dict[str, Setting] = {
    s.key: s for s in
    [Setting.of(f) for f in dataclasses.fields(Config) if "section" not in f.metadata]
    + [Setting.of(f, name) for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)]}


def scaled(rule: str, ratio: float) -> float:
    """The learning rate's factor for a global batch ``ratio`` times the reference batch,
    by --lr-scaling ``rule`` (linear, sqrt or none)."""
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def settings_with_flags() -> List[Setting]:
    """The settings that are command-line options, in --help's order."""
    return [s for s in SETTINGS.values() if s.flag]


def resolve(cfg: Config, defaults: dict, world_size: int) -> Config:
    """Fill the settings left None from the model's ``defaults`` and validate: the one
    build of a run's config from what was given (the command line, ``mpitrain.fit``).

    ``defaults`` maps keys (epochs, batch_size, lr, optimizer, dataset...) to the
    model's choices; --warmup-epochs left to its default becomes the epochs it gives.
    The result is the same on every rank.
    """
    cfg = cfg.checked()
    filled = {key: value for key, value in defaults.items() if cfg.setting(key) is None}
    if cfg.data.path and cfg.data.dataset in (None, "auto"):
        filled["dataset"] = "file"  # the model's default dataset does not apply
    if cfg.batches_per_epoch is not None:
        if cfg.batch_size is not None:
            raise UsageError("give --batch-size or --batches-per-epoch, not both")
        filled.pop("batch_size", None)  # derived from the data size by the session
    cfg = cfg.replace(world_size=world_size, **filled).validate()
    # the default warm-up, fixed in the run's config: a resumed run (which may be given
    # more --epochs) goes on with the warm-up it started with
    return cfg if cfg.optimizer.warmup_epochs is not None else \
        cfg.replace(warmup_epochs=cfg.warmup)
