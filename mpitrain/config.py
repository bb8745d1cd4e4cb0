"""The one typed configuration of a training run, in sections, validated in one place.

:class:`Config` holds what a run is (the model, the mode, how long, how big its
batches) and one section per concern: ``data``, ``optimizer``, ``sync`` (options of
the sync allreduce), ``asynchronous`` (of the async parameter server), ``transport``
(how gradients travel in either mode), ``checkpoint``, ``faults`` and ``telemetry``.
Every setting carries its help text and, where it is a command-line option, its flag
(:func:`mpitrain.settings.option`); the CLI builds its parser from them, one group per
section, the flags flat as ever. A setting's key is its flat name, the same for the
command line, ``mpitrain.fit``'s keywords and config.json (:meth:`Config.of`,
:meth:`Config.setting`, :meth:`Config.to_dict`), whatever section holds it.

Building a run's config happens once: :func:`resolve` fills what the command line left
to the model's defaults and validates the result (:meth:`Config.validate`: every value
checked, then each section's rules); a resumed run's is its saved config, validated
once as it is read (:func:`mpitrain.lifecycle.resumed_config`). A leaf.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .bounds import Bounds
from .errors import UsageError
from .settings import COUNT, MAX_SECONDS, SECONDS, Number, Setting, checked_value, option

OPTIMIZERS = ("sgd", "momentum", "adam")
DATASETS = ("auto", "mnist", "digits", "synthetic")
LR_SCALINGS = ("linear", "none")
LR_SCHEDULES = ("constant", "cosine")
ENGINES = ("mpi", "horovod")
#: values of --compression (see mpitrain.exchange.half)
COMPRESSIONS = ("none", "fp16")
OUTPUTS = ("logits", "probabilities")
#: values of --allreduce-wait (see mpitrain.comm.spins)
ALLREDUCE_WAITS = ("auto", "spin", "poll")
#: values of --compile (see mpitrain.models.replica.step_function)
COMPILERS = ("auto", "graph", "xla")
#: values of --overlap (see mpitrain.exchange.overlap)
OVERLAPS = ("auto", "on", "off")
#: values of --shared-memory (see mpitrain.comm.shared)
SHARED_MEMORY = ("auto", "on", "off")
#: values of --pipeline (see mpitrain.train.leases.Pipelining)
PIPELINES = ("auto", "on", "off")


@dataclass(frozen=True)
class DataSettings:
    """Where the examples come from (:mod:`mpitrain.data`)."""

    dataset: Optional[str] = option(
        "auto: MNIST if it can be found or downloaded, else scikit-learn's bundled "
        "8x8 digits upscaled to 28x28 (says so); mnist: MNIST or fail; digits: the "
        "bundled digits; synthetic: random ImageNet-shaped data",
        flag="--dataset", choices=DATASETS, accepts=("file",))
    path: Optional[str] = option(
        "your own data: an .npz with x_train, y_train, x_test, y_test; a directory of class "
        "sub-folders of PNG/JPEG images (train/ and test/ inside, or 10%% of each class held "
        "out); or CIFAR-10's python batches. Input shape and classes are inferred",
        flag="--data", key="data", metavar="PATH")
    data_dir: Optional[str] = option(
        "directory with MNIST (IDX files, gzipped or raw, or mnist.npz); "
        "default: $MPITRAIN_DATA_DIR, then the Keras cache, then download",
        flag="--data-dir", metavar="DIR")
    image_size: Optional[int] = option(
        "synthetic data and --data image folders: image height and width (AlexNet's is 224; "
        "32 or 64 for quick runs); images are resized to it",
        flag="--image-size", type=int, metavar="PX", number=Number(True, 8))
    synthetic_size: int = option(
        "synthetic data: training examples in an epoch (drawn from a pool of 64 random "
        "images per worker)", 1280, flag="--synthetic-size", type=int, metavar="N",
        number=COUNT)

    def check(self, run: "Config") -> None:
        if self.path and self.dataset != "file":  # resolve() makes it file
            raise UsageError(f"--data gives the dataset: drop --dataset {self.dataset}")
        if self.path and self.data_dir:
            raise UsageError("--data-dir tells where MNIST is and --data gives your own "
                             "data: drop one of them")


@dataclass(frozen=True)
class OptimizerSettings:
    """How the gradient becomes an update."""

    name: Optional[str] = option(
        "optimizer: sgd, momentum (SGD with momentum 0.9) or adam",
        flag="--optimizer", key="optimizer", choices=OPTIMIZERS)
    lr: Optional[float] = option(
        "learning rate for one worker; with --lr-scaling linear, sync mode multiplies "
        "it by the number of workers (the global batch grows by that factor)",
        flag="--lr", type=float, number=Number(False, 0, math.inf, above_low=True))
    scaling: str = option(
        "how the learning rate follows the worker count in sync mode",
        "linear", flag="--lr-scaling", key="lr_scaling", choices=LR_SCALINGS)
    schedule: Optional[str] = option(
        "constant, or cosine: decay the learning rate to 0 over the run's updates",
        flag="--lr-schedule", key="lr_schedule", choices=LR_SCHEDULES)
    clip_grad_norm: Optional[float] = option(
        "clip each update's gradient to this global L2 norm", flag="--clip-grad-norm",
        type=float, metavar="NORM", number=Number(False, 0, math.inf, above_low=True))


@dataclass(frozen=True)
class SyncSettings:
    """How sync workers average their gradients (:mod:`mpitrain.exchange`)."""

    allreduce: str = option(
        "sync gradient averaging engine: mpi (mpi4py, one fused in-place allreduce) or "
        "horovod (Horovod's allreduce over the workers, same fused buffer)", "mpi",
        flag="--allreduce", choices=ENGINES)
    horovod_timeline: bool = option(
        "with --allreduce horovod: write Horovod's timeline (Chrome trace JSON) to the "
        "run directory", False, flag="--horovod-timeline", action="store_true")
    allreduce_wait: str = option(
        "how a sync worker waits in the mpi allreduce: spin (inside MPI's blocking "
        "allreduce, the fastest when every rank has a core; a watchdog thread holds "
        "--timeout), poll (test, yield the core, then sleep: for hosts with more ranks "
        "than cores), or auto (spin only where every host has a core to spare for each "
        "of its workers, the cores other processes keep busy counted)",
        "auto", flag="--allreduce-wait", choices=ALLREDUCE_WAITS)
    overlap: str = option(
        "sync only: allreduce the gradient in buckets of --bucket-mb, each one started "
        "while back-propagation still computes the layers before it (as Horovod and "
        "PyTorch DDP do): on, off, or auto (on for the mpi engine when the gradient "
        "fills two buckets or more, without --compile xla)",
        "auto", flag="--overlap", choices=OVERLAPS)
    bucket_mb: float = option(
        "with --overlap: megabytes of gradient per allreduce bucket (PyTorch DDP's "
        "default, 25)", 25.0, flag="--bucket-mb", type=float, metavar="MB",
        number=Number(False, 0, 2**20, above_low=True))

    def check(self, run: "Config") -> None:
        if self.allreduce == "horovod" and run.async_mode:
            raise UsageError("--allreduce horovod is for sync training: Horovod has no "
                             "parameter-server mode (drop --async or use --allreduce mpi)")
        if self.horovod_timeline and self.allreduce != "horovod":
            raise UsageError("--horovod-timeline needs --allreduce horovod")
        if self.overlap == "on" and run.async_mode:
            raise UsageError("--overlap on overlaps the sync allreduce: drop --async "
                             "(async workers push whole gradients)")
        if self.overlap == "on" and run.compiler == "xla":
            raise UsageError("--overlap on hands each bucket to MPI from inside the "
                             "gradient step, which XLA cannot compile: use --compile "
                             "auto or graph, or --overlap off")


@dataclass(frozen=True)
class AsyncSettings:
    """The async parameter server's options (:mod:`mpitrain.train.asynchronous`)."""

    staleness: Optional[int] = option(
        "async only: bound on staleness (server updates between the version a gradient "
        "was computed at and its application). 0 = one worker computes at a time on the "
        "current weights (synchronous, one worker applied at a time); K = fast workers "
        "wait so no gradient is more than K updates old; default: unbounded",
        flag="--staleness", type=int, metavar="K", number=Number(True, 0))
    servers: int = option(
        "async only: parameter servers. Ranks 0..K-1 each own one contiguous share of the "
        "parameters (balanced by size), apply its updates and answer each worker's push "
        "with its weights; rank 0 also evaluates, checkpoints and writes. The workers are "
        "ranks K..N-1 (docs/architecture.md)", 1, flag="--servers", type=int, metavar="K",
        number=COUNT)
    pipeline: str = option(
        "async only: whether a worker computes its next gradient while its last push "
        "and the reply travel (hiding the round trip, but each gradient one of its own "
        "updates staler): auto (only where the wait for a reply is at least 0.3 "
        "of a step's compute, measured over the first steps), on, "
        "or off; a --staleness bound never pipelines", "auto", flag="--pipeline",
        choices=PIPELINES)

    def check(self, run: "Config") -> None:
        if self.staleness is not None and not run.async_mode:
            raise UsageError("--staleness bounds the async parameter server: add --async")
        if self.staleness is not None and self.pipeline == "on":
            raise UsageError("--pipeline on keeps two pushes in flight, which a "
                             "--staleness bound does not allow: drop one of them")
        if self.pipeline != "auto" and not run.async_mode:
            raise UsageError(f"--pipeline {self.pipeline} is for the async workers: add "
                             "--async")
        if self.servers > 1 and not run.async_mode:
            raise UsageError(f"--servers {self.servers} shards the async parameter "
                             "server; sync training has none (its workers allreduce): "
                             "add --async or drop --servers")


@dataclass(frozen=True)
class TransportSettings:
    """How gradients and weights travel between ranks, in either mode."""

    compression: str = option(
        "gradients on the wire: none (float32) or fp16 (half the bytes, with error "
        "feedback: what a cast rounds away is added to the worker's next gradient); the "
        "sync allreduce and the async pushes", "none", flag="--compression",
        choices=COMPRESSIONS)
    shared_memory: str = option(
        "memory that ranks of one host share, instead of MPI messages. Sync, mpi engine, "
        "every worker on one host: the workers sum the gradient in it (each its chunk of "
        "every worker's buffer, bit-identical everywhere); auto: for overlapped buckets "
        "of 1 MB or more, without --compression; on: every bucket, overlapping as with "
        "--overlap on. Async: the workers on rank 0's host leave their gradients there "
        "and take their weights from there, only headers go through MPI; auto: where it "
        "can be mapped; on: every worker, which must share rank 0's host. off: always MPI",
        "auto", flag="--shared-memory", choices=SHARED_MEMORY)

    def check(self, run: "Config") -> None:
        if self.shared_memory != "on" or run.async_mode:
            return
        for clash, fix in (
                (run.sync.allreduce == "horovod",
                 "Horovod moves its own bytes: use --allreduce mpi"),
                (self.compression != "none", "it sums float32: drop --compression fp16"),
                (run.sync.overlap == "off", "it sums the overlapped buckets: drop --overlap off"),
                (run.compiler == "xla", "it sums the overlapped buckets, which XLA cannot "
                                        "compile: use --compile auto or graph")):
            if clash:
                raise UsageError(f"--shared-memory on is for the sync mpi engine's float32 "
                                 f"buckets; {fix}")


@dataclass(frozen=True)
class CheckpointSettings:
    """When rank 0 saves the run (:class:`mpitrain.lifecycle.Checkpoint`)."""

    every: int = option(
        "rank 0 saves a checkpoint (weights, optimizer state, position) every N epochs "
        "and at the end, into the run directory", 1, flag="--checkpoint-every",
        key="checkpoint_every", type=int, metavar="N", number=COUNT)
    steps: Optional[int] = option(
        "also save a checkpoint every N steps (each worker's steps; async: every N x "
        "workers server updates), so a restart loses at most N steps", None,
        flag="--checkpoint-steps", key="checkpoint_steps", type=int, metavar="N",
        number=COUNT)


@dataclass(frozen=True)
class FaultSettings:
    """How long ranks wait for each other (:mod:`mpitrain.bounds`)."""

    timeout: float = option(
        "seconds any rank waits for another before the job is aborted with the "
        "stalled rank named", 300.0, flag="--timeout", type=float, metavar="S",
        number=SECONDS)
    start_timeout: float = option(
        "seconds a rank waits for every rank of the job to start MPI: a rank that never "
        "does (it exited before, e.g. under a wrapper script, or is stuck before it) "
        "ends the job with an error naming this", 120.0,
        flag="--start-timeout", type=float, metavar="S", number=SECONDS)
    liveness_floor: float = option(
        "the least time a silent worker gets before rank 0 counts it as lost: async "
        "under mpirun --enable-recovery drops it and goes on, sync names it and ends "
        "the job (its bound is 20x its measured interval between messages, at least "
        "this, at most --timeout)", 10.0,
        flag="--liveness-floor", type=float, metavar="S", number=SECONDS)

    @property
    def bounds(self) -> Bounds:
        """Every wait derived from these (see :mod:`mpitrain.bounds`)."""
        return Bounds(self.timeout, self.start_timeout)


@dataclass(frozen=True)
class TelemetrySettings:
    """What every rank samples about its host (:mod:`mpitrain.telemetry`)."""

    sample_interval: float = option(
        "seconds between telemetry samples (CPU, memory, network) on every rank; 0 = off",
        1.0, flag="--sample-interval", type=float, metavar="S",
        number=Number(False, 0.01, MAX_SECONDS, off=0, unit="of seconds"))


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
        "docs/benchmarks.md section 13)", "auto",
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
        top: Dict[str, object] = {}
        sections: Dict[str, Dict[str, object]] = {name: {} for name in SECTIONS}
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
    def effective_lr(self) -> float:
        """The learning rate the optimizer uses (linear scaling in sync mode)."""
        if self.mode == "sync" and self.optimizer.scaling == "linear":
            return self.optimizer.lr * self.workers
        return self.optimizer.lr

    @property
    def global_batch(self) -> int:
        """Examples consumed by one synchronous update."""
        return self.batch_size * (self.workers if self.mode == "sync" else 1)

    # ---- checks -----------------------------------------------------------------------
    def checked(self, label: Callable[[Setting], str] = None,
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

    def validate(self, label: Callable[[Setting], str] = None) -> "Config":
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
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)
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


def settings_with_flags() -> List[Setting]:
    """The settings that are command-line options, in --help's order."""
    return [s for s in SETTINGS.values() if s.flag]


def resolve(cfg: Config, defaults: dict, world_size: int) -> Config:
    """Fill the settings left None from the model's ``defaults`` and validate: the one
    build of a run's config from what was given (the command line, ``mpitrain.fit``).

    ``defaults`` maps keys (epochs, batch_size, lr, optimizer, dataset...) to the
    model's choices. The result is the same on every rank.
    """
    cfg = cfg.checked()
    filled = {key: value for key, value in defaults.items() if cfg.setting(key) is None}
    if cfg.data.path and cfg.data.dataset in (None, "auto"):
        filled["dataset"] = "file"  # the model's default dataset does not apply
    if cfg.batches_per_epoch is not None:
        if cfg.batch_size is not None:
            raise UsageError("give --batch-size or --batches-per-epoch, not both")
        filled.pop("batch_size", None)  # derived from the data size by the session
    return cfg.replace(world_size=world_size, **filled).validate()
