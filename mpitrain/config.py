"""The one typed configuration of a training run, validated in one place.

Every field carries its own help text (``doc``) and, where it is a command-line
option, its flag; the CLI builds its parser from these fields, so a default or a
description lives in exactly one place. Fields left ``None`` take the model's
defaults (see :mod:`mpitrain.models`); :func:`resolve` fills them and
:meth:`Config.validate` checks the result against the world size.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import UsageError

MODES = ("single", "sync", "async")
OPTIMIZERS = ("sgd", "momentum", "adam")
DATASETS = ("auto", "mnist", "digits", "synthetic")
LR_SCALINGS = ("linear", "none")
LR_SCHEDULES = ("constant", "cosine")
ENGINES = ("mpi", "horovod")
#: values of --compression (see mpitrain.exchange.half)
COMPRESSIONS = ("none", "fp16")
OUTPUTS = ("logits", "probabilities")
#: values of --allreduce-wait (see mpitrain.comm.communicator.spins)
ALLREDUCE_WAITS = ("auto", "spin", "poll")
#: values of --compile (see mpitrain.models.replica.step_function)
COMPILERS = ("auto", "graph", "xla")
#: values of --overlap (see mpitrain.exchange.overlap)
OVERLAPS = ("auto", "on", "off")
#: values of --shared-memory (see mpitrain.comm.shared)
SHARED_MEMORY = ("auto", "on", "off")
#: values of --pipeline (see mpitrain.train.leases.Pipelining)
PIPELINES = ("auto", "on", "off")
#: the largest count a setting may hold (epochs, steps, batch...): steps travel in int32
MAX_COUNT = 2**31 - 1
#: the longest time a setting may give (--timeout...): past it a wait is no bound at all,
#: and twice it still fits the millisecond timeouts (int32) of poll(2) and MPI's waits
MAX_SECONDS = 1_000_000.0


@dataclass(frozen=True)
class Number:
    """The values a numeric setting accepts: finite, from ``low`` to ``high`` (``low``
    itself excluded with ``above_low``), whole where ``integral``; and ``off``, one more
    value that means off or auto (0 for --threads, --sample-interval)."""

    integral: bool
    low: float
    high: float = MAX_COUNT
    above_low: bool = False
    off: Optional[float] = None
    unit: str = ""
    off_means: str = "off"

    def normalized(self, value, label: str):
        """``value`` as an int or float if it is acceptable; UsageError naming ``label``."""
        number = _as_number(value, self.integral)
        if number is not None and (number == self.off or self._in_range(number)):
            return number
        raise UsageError(f"{label} must be {self.describe(value)} (got {value!r})")

    def _in_range(self, number) -> bool:
        above = number > self.low if self.above_low else number >= self.low
        return above and number <= self.high

    def describe(self, value=None) -> str:
        """What the setting accepts, in words; the upper bound too where it is not the
        largest count, or where ``value`` passes it."""
        unit = f" {self.unit}" if self.unit else ""
        kind = "integer" if self.integral else "number"
        if self.low == 0 and self.above_low or self.low == 1 and self.integral:
            what = f"a positive {kind}{unit}"
        elif self.low == 0:
            what = f"0 or a positive {kind}{unit}"
        else:
            what = f"{'an' if self.integral else 'a'} {kind}{unit} of at least {_shown(self.low)}"
        if self.off is not None:
            what = f"{_shown(self.off)} ({self.off_means}) or {what}"
        beyond = isinstance(value, numbers.Real) and not value <= self.high  # inf, NaN too
        if math.isfinite(self.high) and (self.high < MAX_COUNT or beyond):
            what += f", at most {_shown(self.high)}"
        return what


def _shown(bound: float) -> str:
    return f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"


def _as_number(value, integral: bool):
    """``value`` as a builtin int (``integral``: an integer, or a float with no fraction)
    or float, or None when it is no finite number (a string, a bool, None, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral) and integral:
        return int(value)
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        return None
    if not math.isfinite(value):
        return None
    if integral:
        return int(value) if value.is_integer() else None
    return value


def _opt(doc: str, default=None, *, flag: Optional[str] = None,
         number: Optional[Number] = None, accepts: tuple = (), **cli):
    """A config field with its help text; ``cli`` holds extra argparse keywords;
    ``number``: the values a numeric field accepts; ``accepts``: values a field with
    ``choices`` also takes besides them (set by :func:`resolve`, never typed)."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "cli": cli,
                                            "number": number, "accepts": accepts})


#: integers from 1 (counts: epochs, steps, batch...)
COUNT = Number(True, 1)
#: a positive number of seconds, a real bound
SECONDS = Number(False, 0, MAX_SECONDS, above_low=True, unit="of seconds")


@dataclass(frozen=True)
class Config:
    """Settings of one training run; identical on every rank."""

    model: str = _opt("model to train: a registered name, or the user's FILE.py:FUNCTION "
                      "(its path made absolute) or module:FUNCTION", "lr", flag=None)
    model_given: Optional[str] = _opt("the model as given on the command line (a relative "
                                      "FILE path as typed)", flag=None)
    async_mode: bool = _opt(
        "asynchronous parameter-server training (rank 0 applies each worker's "
        "gradient as it arrives); default is synchronous allreduce",
        False, flag="--async", action="store_true")
    allreduce: str = _opt(
        "sync gradient averaging engine: mpi (mpi4py, one fused in-place allreduce) or "
        "horovod (Horovod's allreduce over the workers, same fused buffer)", "mpi",
        flag="--allreduce", choices=ENGINES)
    horovod_timeline: bool = _opt(
        "with --allreduce horovod: write Horovod's timeline (Chrome trace JSON) to the "
        "run directory", False, flag="--horovod-timeline", action="store_true")
    compression: str = _opt(
        "gradients on the wire: none (float32) or fp16 (half the bytes, with error "
        "feedback: what a cast rounds away is added to the worker's next gradient); the "
        "sync allreduce and the async pushes", "none", flag="--compression",
        choices=COMPRESSIONS)
    allreduce_wait: str = _opt(
        "how a sync worker waits in the mpi allreduce: spin (inside MPI's blocking "
        "allreduce, the fastest when every rank has a core; a watchdog thread holds "
        "--timeout), poll (test, yield the core, then sleep: for hosts with more ranks "
        "than cores), or auto (spin only where every host has a core to spare for each "
        "of its ranks, its load average counted)",
        "auto", flag="--allreduce-wait", choices=ALLREDUCE_WAITS)
    compiler: str = _opt(
        "how the training steps are compiled: graph (tf.function), xla (TensorFlow's "
        "XLA fuses each step's kernels, after a compilation of seconds per batch shape, "
        "but runs its own, not oneDNN's: slower for convolutional models on CPUs where "
        "oneDNN runs; a model it cannot compile falls back to graph), or "
        "auto (graph, but models of 10M parameters or more update a flat copy of their "
        "weights in one fused pass in C, the async server's optimizer, and assign it: "
        "their memory-bound update takes half the time of XLA's)", "auto",
        flag="--compile", choices=COMPILERS)
    overlap: str = _opt(
        "sync only: allreduce the gradient in buckets of --bucket-mb, each one started "
        "while back-propagation still computes the layers before it (as Horovod and "
        "PyTorch DDP do): on, off, or auto (on for the mpi engine when the gradient "
        "fills two buckets or more, without --compile xla)",
        "auto", flag="--overlap", choices=OVERLAPS)
    bucket_mb: float = _opt(
        "with --overlap: megabytes of gradient per allreduce bucket (PyTorch DDP's "
        "default, 25)", 25.0, flag="--bucket-mb", type=float, metavar="MB",
        number=Number(False, 0, 2**20, above_low=True))
    shared_memory: str = _opt(
        "memory that ranks of one host share, instead of MPI messages. Sync, mpi engine, "
        "every worker on one host: the workers sum the gradient in it (each its chunk of "
        "every worker's buffer, bit-identical everywhere); auto: for overlapped buckets "
        "of 1 MB or more, without --compression; on: every bucket, overlapping as with "
        "--overlap on. Async: the workers on rank 0's host leave their gradients there "
        "and take their weights from there, only headers go through MPI; auto: where it "
        "can be mapped; on: every worker, which must share rank 0's host. off: always MPI",
        "auto", flag="--shared-memory", choices=SHARED_MEMORY)
    staleness: Optional[int] = _opt(
        "async only: bound on staleness (server updates between the version a gradient "
        "was computed at and its application). 0 = one worker computes at a time on the "
        "current weights (synchronous, one worker applied at a time); K = fast workers "
        "wait so no gradient is more than K updates old; default: unbounded",
        flag="--staleness", type=int, metavar="K", number=Number(True, 0))
    servers: int = _opt(
        "async only: parameter servers. Ranks 0..K-1 each own one contiguous share of the "
        "parameters (balanced by size), apply its updates and answer each worker's push "
        "with its weights; rank 0 also evaluates, checkpoints and writes. The workers are "
        "ranks K..N-1 (docs/architecture.md)", 1, flag="--servers", type=int, metavar="K",
        number=COUNT)
    pipeline: str = _opt(
        "async only: whether a worker computes its next gradient while its last push "
        "and the reply travel (hiding the round trip, but each gradient one of its own "
        "updates staler): auto (only where the wait for a reply is at least 0.3 "
        "of a step's compute, measured over the first steps: LR yes, LeNet no), on, "
        "or off; a --staleness bound never pipelines", "auto", flag="--pipeline",
        choices=PIPELINES)
    epochs: Optional[int] = _opt(
        "passes over the whole training set (each worker passes once over its shard)",
        flag="--epochs", type=int, metavar="N", number=COUNT)
    batch_size: Optional[int] = _opt(
        "examples per step PER WORKER; the global batch is workers x this",
        flag="--batch-size", type=int, metavar="B", number=COUNT)
    batches_per_epoch: Optional[int] = _opt(
        "instead of --batch-size: the batch size that gives each worker this many steps "
        "per epoch (batch = ceil(shard / K)); 1 = full-shard batches",
        flag="--batches-per-epoch", type=int, metavar="K", number=COUNT)
    lr: Optional[float] = _opt(
        "learning rate for one worker; with --lr-scaling linear, sync mode multiplies "
        "it by the number of workers (the global batch grows by that factor)",
        flag="--lr", type=float, number=Number(False, 0, math.inf, above_low=True))
    lr_scaling: str = _opt(
        "how the learning rate follows the worker count in sync mode",
        "linear", flag="--lr-scaling", choices=LR_SCALINGS)
    lr_schedule: Optional[str] = _opt(
        "constant, or cosine: decay the learning rate to 0 over the run's updates",
        flag="--lr-schedule", choices=LR_SCHEDULES)
    optimizer: Optional[str] = _opt(
        "optimizer: sgd, momentum (SGD with momentum 0.9) or adam",
        flag="--optimizer", choices=OPTIMIZERS)
    outputs: str = _opt(
        "what the model's last layer outputs: logits (no activation; recommended) or "
        "probabilities (it ends in a softmax); the loss and evaluation follow",
        "logits", flag="--outputs", choices=OUTPUTS)
    seed: int = _opt("random seed for initial weights, shuffling and synthetic data",
                     42, flag="--seed", type=int, number=Number(True, 0))
    dataset: Optional[str] = _opt(
        "auto: MNIST if it can be found or downloaded, else scikit-learn's bundled "
        "8x8 digits upscaled to 28x28 (says so); mnist: MNIST or fail; digits: the "
        "bundled digits; synthetic: random ImageNet-shaped data",
        flag="--dataset", choices=DATASETS, accepts=("file",))
    data: Optional[str] = _opt(
        "your own data: an .npz with x_train, y_train, x_test, y_test; a directory of class "
        "sub-folders of PNG/JPEG images (train/ and test/ inside, or 10%% of each class held "
        "out); or CIFAR-10's python batches. Input shape and classes are inferred",
        flag="--data", metavar="PATH")
    image_size: Optional[int] = _opt(
        "synthetic data and --data image folders: image height and width (AlexNet's is 224; "
        "32 or 64 for quick runs); images are resized to it",
        flag="--image-size", type=int, metavar="PX", number=Number(True, 8))
    synthetic_size: int = _opt(
        "synthetic data: training examples in an epoch (drawn from a pool of 64 random "
        "images per worker)", 1280, flag="--synthetic-size", type=int, metavar="N",
        number=COUNT)
    data_dir: Optional[str] = _opt(
        "directory with MNIST (IDX files, gzipped or raw, or mnist.npz); "
        "default: $MPITRAIN_DATA_DIR, then the Keras cache, then download",
        flag="--data-dir", metavar="DIR")
    results_dir: str = _opt("where run directories and runs.csv are written",
                            "results", flag="--results-dir", metavar="DIR")
    eval_every: int = _opt("evaluate on the test set every N epochs (and at the end)",
                           1, flag="--eval-every", type=int, metavar="N", number=COUNT)
    steps: Optional[int] = _opt(
        "stop after this many steps per worker (smoke runs); default: run all epochs",
        flag="--steps", type=int, metavar="N", number=COUNT)
    dry_run: bool = _opt("smoke mode: one epoch of at most 2 steps, results written as usual",
                         False, flag="--dry-run", action="store_true")
    quiet: bool = _opt("print only errors and the final summary", False,
                       flag="--quiet", action="store_true")
    threads: int = _opt(
        "TensorFlow intra-op threads per rank; 0 = the host's cores divided among "
        "the worker ranks on that host (at least 1)", 0, flag="--threads", type=int,
        number=Number(True, 1, 4096, off=0, off_means="auto"))
    checkpoint_every: int = _opt(
        "rank 0 saves a checkpoint (weights, optimizer state, position) every N epochs "
        "and at the end, into the run directory", 1, flag="--checkpoint-every", type=int,
        metavar="N", number=COUNT)
    checkpoint_steps: Optional[int] = _opt(
        "also save a checkpoint every N steps (each worker's steps; async: every N x "
        "workers server updates), so a restart loses at most N steps", None,
        flag="--checkpoint-steps", type=int, metavar="N", number=COUNT)
    resume: Optional[str] = _opt(
        "continue the run in RUN_DIR from its last checkpoint (same settings; you may "
        "change --epochs and other non-training settings), appending to its results",
        flag="--resume", metavar="RUN_DIR")
    clip_grad_norm: Optional[float] = _opt(
        "clip each update's gradient to this global L2 norm", flag="--clip-grad-norm",
        type=float, metavar="NORM", number=Number(False, 0, math.inf, above_low=True))
    sample_interval: float = _opt(
        "seconds between telemetry samples (CPU, memory, network) on every rank; 0 = off",
        1.0, flag="--sample-interval", type=float, metavar="S",
        number=Number(False, 0.01, MAX_SECONDS, off=0, unit="of seconds"))
    keep_cpu_binding: bool = _opt(
        "keep the CPU binding the launcher gave each rank; by default mpitrain lets "
        "every rank use all the host's CPUs (Open MPI binds each rank to one core at "
        "-np 1 and 2, which would leave a core idle) and sizes thread pools itself",
        False, flag="--keep-cpu-binding", action="store_true")
    timeout: float = _opt(
        "seconds any rank waits for another before the job is aborted with the "
        "stalled rank named", 300.0, flag="--timeout", type=float, metavar="S",
        number=SECONDS)
    start_timeout: float = _opt(
        "seconds a rank waits for every rank of the job to start MPI: a rank that never "
        "does (it exited before, e.g. under a wrapper script, or is stuck before it) "
        "ends the job with an error naming this", 120.0,
        flag="--start-timeout", type=float, metavar="S", number=SECONDS)
    liveness_floor: float = _opt(
        "the least time a silent worker gets before rank 0 counts it as lost: async "
        "under mpirun --enable-recovery drops it and goes on, sync names it and ends "
        "the job (its bound is 20x its measured interval between messages, at least "
        "this, at most --timeout)", 10.0,
        flag="--liveness-floor", type=float, metavar="S", number=SECONDS)

    # ---- derived, filled by resolve() -------------------------------------------------
    world_size: int = _opt("number of MPI ranks", 1, number=COUNT)

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
        return 1 if self.world_size == 1 else self.world_size - self.servers

    @property
    def max_steps(self) -> Optional[int]:
        """Cap on steps per worker, from --steps or --dry-run."""
        if self.dry_run:
            return 2 if self.steps is None else min(self.steps, 2)
        return self.steps

    @property
    def effective_lr(self) -> float:
        """The learning rate the optimizer uses (linear scaling in sync mode)."""
        if self.mode == "sync" and self.lr_scaling == "linear":
            return self.lr * self.workers
        return self.lr

    @property
    def global_batch(self) -> int:
        """Examples consumed by one synchronous update."""
        return self.batch_size * (self.workers if self.mode == "sync" else 1)

    def checked(self, label: Callable[[dataclasses.Field], str] = None,
                complete: bool = False) -> "Config":
        """This config with every value checked for its type and range and made a plain
        int, float, bool or str; UsageError naming the first bad one (``label`` names a
        field in the message; default: its flag). Fields left None for the model's
        defaults pass, unless ``complete`` (a resolved config: every setting a run needs
        is given). The one check of what the command line, ``mpitrain.fit`` and a
        resumed run's config.json give."""
        label = label or flag_of
        needed = ("epochs", "lr", "optimizer") + (
            ("batch_size",) if self.batches_per_epoch is None or self.batch_size is not None
            else ())
        return dataclasses.replace(self, **{
            f.name: _checked_value(f, getattr(self, f.name), label(f))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None or f.default is not None
            or complete and f.name in needed})

    def validate(self) -> "Config":
        """This config :meth:`checked` (complete) with consistent settings; UsageError
        naming the first bad setting."""
        cfg = self.checked(complete=True)
        cfg._check_consistent()
        return cfg

    def _check_consistent(self) -> None:
        if self.staleness is not None:
            if not self.async_mode:
                raise UsageError("--staleness bounds the async parameter server: add --async")
            if self.pipeline == "on":
                raise UsageError("--pipeline on keeps two pushes in flight, which a "
                                 "--staleness bound does not allow: drop one of them")
        if self.pipeline != "auto" and not self.async_mode:
            raise UsageError(f"--pipeline {self.pipeline} is for the async workers: add "
                             "--async")
        if self.allreduce == "horovod":
            if self.async_mode:
                raise UsageError("--allreduce horovod is for sync training: Horovod has no "
                                 "parameter-server mode (drop --async or use --allreduce mpi)")
        elif self.horovod_timeline:
            raise UsageError("--horovod-timeline needs --allreduce horovod")
        if self.shared_memory == "on" and not self.async_mode:
            for clash, fix in (
                    (self.allreduce == "horovod",
                     "Horovod moves its own bytes: use --allreduce mpi"),
                    (self.compression != "none", "it sums float32: drop --compression fp16"),
                    (self.overlap == "off", "it sums the overlapped buckets: drop --overlap off"),
                    (self.compiler == "xla", "it sums the overlapped buckets, which XLA cannot "
                                             "compile: use --compile auto or graph")):
                if clash:
                    raise UsageError(f"--shared-memory on is for the sync mpi engine's float32 "
                                     f"buckets; {fix}")
        if self.overlap == "on":
            if self.async_mode:
                raise UsageError("--overlap on overlaps the sync allreduce: drop --async "
                                 "(async workers push whole gradients)")
            if self.compiler == "xla":
                raise UsageError("--overlap on hands each bucket to MPI from inside the "
                                 "gradient step, which XLA cannot compile: use --compile "
                                 "auto or graph, or --overlap off")
        if self.async_mode and self.world_size < 2:
            raise UsageError(
                "--async needs a parameter server and at least one worker: "
                "run with mpirun -np 2 or more")
        if self.servers > 1:
            if not self.async_mode:
                raise UsageError(f"--servers {self.servers} shards the async parameter "
                                 "server; sync training has none (its workers allreduce): "
                                 "add --async or drop --servers")
            if self.servers >= self.world_size:
                raise UsageError(f"--servers {self.servers} leaves no worker at -np "
                                 f"{self.world_size}: run with -np {self.servers + 1} or "
                                 "more, or fewer --servers")

    def to_dict(self) -> dict:
        """All settings, including derived ones, for config.json."""
        out = dataclasses.asdict(self)
        out.update(mode=self.mode, workers=self.workers, effective_lr=self.effective_lr,
                   global_batch=self.global_batch, max_steps=self.max_steps)
        return out


def flag_of(f: dataclasses.Field) -> str:
    """How messages name a config field: its flag (``--epochs``), else its name."""
    return f.metadata.get("flag") or f.name.replace("_", " ")


def _checked_value(f: dataclasses.Field, value, label: str):
    """``value`` of field ``f`` as a plain int, float, bool or str, if it is one the field
    accepts (see :class:`Number`, the field's choices); UsageError naming ``label``."""
    meta = f.metadata
    if meta.get("number"):
        return meta["number"].normalized(value, label)
    choices = meta["cli"].get("choices")
    if choices:
        if isinstance(value, str) and value in choices + meta["accepts"]:
            return value
        raise UsageError(f"{label} must be one of {', '.join(choices)} (got {value!r})")
    if meta["cli"].get("action") == "store_true":
        if isinstance(value, bool):
            return value
        raise UsageError(f"{label} is a switch: true or false (got {value!r})")
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise UsageError(f"{label} must be a non-empty path or name (got {value!r})")


def fields_with_flags():
    """The config fields that are command-line options, in declaration order."""
    return [f for f in dataclasses.fields(Config) if f.metadata.get("flag")]


def resolve(cfg: Config, defaults: dict, world_size: int) -> Config:
    """Fill the fields left None from the model's ``defaults`` and validate.

    ``defaults`` maps field names (epochs, batch_size, lr, optimizer, dataset) to
    the model's choices. The result is the same on every rank.
    """
    cfg = cfg.checked()
    filled = {name: value for name, value in defaults.items()
              if getattr(cfg, name, None) is None}
    if cfg.data:
        if cfg.dataset not in (None, "auto", "file"):
            raise UsageError(f"--data gives the dataset: drop --dataset {cfg.dataset}")
        if cfg.data_dir:
            raise UsageError("--data-dir tells where MNIST is and --data gives your own "
                             "data: drop one of them")
        filled["dataset"] = "file"  # the model's default dataset does not apply
    if cfg.batches_per_epoch is not None:
        if cfg.batch_size is not None:
            raise UsageError("give --batch-size or --batches-per-epoch, not both")
        filled.pop("batch_size", None)  # derived from the data size by the session
    return dataclasses.replace(cfg, world_size=world_size, **filled).validate()
