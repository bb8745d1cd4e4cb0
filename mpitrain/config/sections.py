"""The sections of a run's :class:`mpitrain.config.Config`, one dataclass per concern,
and the values their choices take. Each setting carries its help text and flag
(:func:`mpitrain.config.settings.option`); a section's ``check`` holds its rules between
settings, called by :meth:`mpitrain.config.Config.validate`. A leaf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from .bounds import Bounds
from ..errors import UsageError
from .settings import COUNT, MAX_SECONDS, SECONDS, Number, option

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam")
DATASETS = ("auto", "mnist", "digits", "synthetic")
LR_SCALINGS = ("linear", "sqrt", "none")
#: values of --staleness-compensation (see mpitrain.train.asynchronous.compensation)
COMPENSATIONS = ("auto", "none", "inverse", "sqrt", "dc")
#: the optimizers whose scaled learning rate is warmed up by default: those whose step
#: is the rate times the gradient (Goyal et al.'s setting). Adam's is not: it already
#: bounds each parameter's step by the rate, and warming it up cost accuracy at 16 workers
#: (docs/scaling.md, "Sync: a global batch that grows with the cluster")
WARMED_UP = ("sgd", "momentum", "nesterov")
#: the warm-up of a scaled learning rate by default: this fraction of the run's epochs...
WARMUP_FRACTION = 0.2
#: ...and at most this many epochs (Goyal et al.'s five)
WARMUP_MAX_EPOCHS = 5.0
LR_SCHEDULES = ("constant", "cosine")
ENGINES = ("mpi", "horovod")
#: values of --compression (see mpitrain.exchange: fp16, powersgd, topk)
COMPRESSIONS = ("none", "fp16", "powersgd", "topk")
#: the compressions that work per variable, with error feedback (their options below)
PER_VARIABLE = ("powersgd", "topk")
#: PowerSGD's defaults: the rank of its factors, and the sync steps exchanged exact first
#: (the early gradients are large and change fast: a short run loses accuracy without)
POWERSGD_RANK, POWERSGD_WARMUP = 2, 100
#: top-k's default share of each variable's values sent a step (Lin et al.'s DGC sends
#: 0.1%, after a warm-up that lowers the share step by step)
TOPK_RATIO = 0.01
#: variables of fewer values travel whole under powersgd and topk (biases and small
#: layers: what compressing them saves is less than the work)
COMPRESSION_MIN_SIZE = 1024
OUTPUTS = ("logits", "probabilities")
#: values of --allreduce-wait (see mpitrain.comm.spins)
ALLREDUCE_WAITS = ("auto", "spin", "poll")
#: values of --compile (see mpitrain.models.steps.step_function)
COMPILERS = ("auto", "graph", "xla")
#: values of --overlap (see mpitrain.exchange.overlap)
OVERLAPS = ("auto", "on", "off")
#: values of --elastic-batch: what a sync run keeps when it resumes on another number of
#: workers (see mpitrain.run.resume.Rescale)
ELASTIC_BATCHES = ("global", "per-worker")
#: values of --shared-memory (see mpitrain.comm.shared)
SHARED_MEMORY = ("auto", "on", "off")
#: values of --pipeline (see mpitrain.train.leases.Pipelining)
PIPELINES = ("auto", "on", "off")
#: the words --staleness takes besides a bound
STALENESS_WORDS = ("auto", "none")
#: --staleness auto's bound where more workers could exceed it: LeNet (Adam) at 8 and 16
#: workers kept sync's accuracy under bounds up to 4 in every run, not always under 6, and
#: lost it unbounded (docs/scaling.md, "Async: gradients that are N updates old")
AUTO_STALENESS = 4


def int_or_word(text: str):
    """A command-line value that is an integer or a word (checked later, with the
    setting's own message): the integer where it is one."""
    try:
        return int(text)
    except ValueError:
        return text


def staleness_bound(staleness: Union[int, str, None], workers: int) -> Optional[int]:
    """The bound a --staleness value sets for ``workers`` workers: None for none (and
    for a run from before auto, which saved None), AUTO_STALENESS for auto where more
    than AUTO_STALENESS + 1 workers could exceed it."""
    if staleness == "auto":
        return AUTO_STALENESS if workers > AUTO_STALENESS + 1 else None
    return None if staleness in (None, "none") else int(staleness)


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
        "out); CIFAR-10's python batches; or a shard set (mpitrain data pack), or a glob of "
        "its training shards, streamed rather than loaded. Input shape and classes are "
        "inferred",
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
    stream: bool = option(
        "--data image folders: decode each worker's images as it trains instead of "
        "loading the folder (for folders larger than memory; a shard set always streams)",
        False, flag="--stream", action="store_true")

    def check(self, run) -> None:  # run: the whole Config
        if self.path and self.dataset != "file":  # resolve() makes it file
            raise UsageError(f"--data gives the dataset: drop --dataset {self.dataset}")
        if self.stream and not self.path:
            raise UsageError("--stream streams an image folder given with --data: add it, "
                             "or drop --stream")
        if self.path and self.data_dir:
            raise UsageError("--data-dir tells where MNIST is and --data gives your own "
                             "data: drop one of them")


@dataclass(frozen=True)
class OptimizerSettings:
    """How the gradient becomes an update."""

    name: Optional[str] = option(
        "optimizer: sgd, momentum (SGD with momentum 0.9), nesterov (the same with "
        "Nesterov's look-ahead) or adam",
        flag="--optimizer", key="optimizer", choices=OPTIMIZERS)
    lr: Optional[float] = option(
        "learning rate for one worker (its batch is the reference batch); sync mode "
        "scales it as the global batch grows with the workers (--lr-scaling)",
        flag="--lr", type=float, number=Number(False, 0, math.inf, above_low=True))
    scaling: str = option(
        "how sync mode scales --lr for a global batch k times one worker's (k = the "
        "workers): linear (x k, Goyal et al.), sqrt (x sqrt(k)) or none", "linear",
        flag="--lr-scaling", key="lr_scaling", choices=LR_SCALINGS)
    warmup_epochs: Optional[float] = option(
        "sync: epochs over which a scaled learning rate rises linearly from one "
        "worker's (--lr) to the scaled one (gradual warm-up, Goyal et al. 2017); default: "
        "a fifth of the run's epochs, at most 5, whenever the rate of sgd, momentum or "
        "nesterov is scaled up (adam: none); 0 = none",
        flag="--warmup-epochs", type=float, metavar="E",
        number=Number(False, 0, 1_000_000))
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
    elastic_batch: str = option(
        "when the run resumes on another number of workers (a host lost or back under "
        "mpitrain launch): global keeps the global batch (each worker's batch follows, "
        "the learning rate too where it does not divide), per-worker keeps each worker's "
        "batch (the global batch follows the workers, the learning rate --lr-scaling)",
        "global", flag="--elastic-batch", choices=ELASTIC_BATCHES)

    def check(self, run) -> None:  # run: the whole Config
        if self.allreduce == "horovod" and run.async_mode:
            raise UsageError("--allreduce horovod is for sync training: Horovod has no "
                             "parameter-server mode (drop --async or use --allreduce mpi)")
        if self.horovod_timeline and self.allreduce != "horovod":
            raise UsageError("--horovod-timeline needs --allreduce horovod")
        if self.elastic_batch != "global" and run.async_mode:
            raise UsageError("--elastic-batch is for sync runs: an async run keeps each "
                             "worker's batch and the learning rate on any number of workers")
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

    staleness: Union[int, str, None] = option(
        "async only: bound on staleness (server updates between the version a gradient "
        "was computed at and its application). K = fast workers wait so no gradient is "
        "more than K updates old, which lets at most K+1 workers compute at a time; 0 = "
        "one at a time, on the current weights; none = unbounded; auto (default): "
        f"{AUTO_STALENESS} with more than {AUTO_STALENESS + 1} workers (beyond it the "
        "accuracy of an epoch falls with the staleness: docs/scaling.md), else none",
        "auto", flag="--staleness", type=int_or_word, metavar="K|auto|none",
        number=Number(True, 0), accepts=STALENESS_WORDS)
    servers: int = option(
        "async only: parameter servers. Ranks 0..K-1 each own one contiguous share of the "
        "parameters (balanced by size), apply its updates and answer each worker's push "
        "with its weights; rank 0 also evaluates, checkpoints and writes. The workers are "
        "ranks K..N-1 (docs/architecture.md)", 1, flag="--servers", type=int, metavar="K",
        number=COUNT)
    pipeline: str = option(
        "async only: whether a worker computes its next gradient while its last push "
        "and the reply travel (hiding the round trip, but each gradient one of its own "
        "updates staler): auto (only with at most 2 workers, where the wait for a "
        "reply is at least 0.3 of a step's compute, measured over the first steps: "
        "with more, the staleness it adds costs more than the wait it hides), on, "
        "or off; a --staleness bound never pipelines", "auto", flag="--pipeline",
        choices=PIPELINES)
    compensation: str = option(
        "async only: how the server damps a stale gradient (one computed at weights "
        "`staleness` updates old): dc (delay compensation, DC-ASGD-a, Zheng et al. 2017: "
        "g + lambda g*g*(w_now - w_read), lambda adapted per parameter; the server keeps "
        "the weights of every lease in flight), inverse (its learning rate divided by its "
        "staleness, Zhang et al. 2016), sqrt (by the square root), none, or auto (dc "
        "where the weights kept for every worker fit in 256 MB, else sqrt)", "auto",
        flag="--staleness-compensation", key="staleness_compensation",
        choices=COMPENSATIONS)
    momentum_correction: str = option(
        "async only: the server's momentum (momentum SGD's 0.9, Adam's beta_1) lowered by "
        "the momentum that N asynchronous workers add by themselves, 1 - 1/N (Mitliagkas "
        "et al. 2016, 'Asynchrony begets momentum'): on, or off (the optimizer's own)",
        "on", flag="--momentum-correction", key="momentum_correction",
        choices=("on", "off"))
    dc_lambda: float = option(
        "with --staleness-compensation dc: the variance control lambda_0 (the paper's 2)",
        2.0, flag="--dc-lambda", type=float, metavar="L",
        number=Number(False, 0, 1_000_000))

    def check(self, run) -> None:  # run: the whole Config
        if self.compensation not in ("auto", "none") and not run.async_mode:
            raise UsageError(f"--staleness-compensation {self.compensation} is for the "
                             "async parameter server: add --async")
        if self.momentum_correction != "on" and not run.async_mode:
            raise UsageError(f"--momentum-correction {self.momentum_correction} is for the "
                             "async parameter server: add --async")
        if self.dc_lambda != 2.0 and self.compensation not in ("dc", "auto"):
            raise UsageError(f"--dc-lambda sets delay compensation, not "
                             f"--staleness-compensation {self.compensation}: use dc")
        if self.staleness not in ("auto", None) and not run.async_mode:
            raise UsageError("--staleness bounds the async parameter server: add --async")
        if run.staleness_bound is not None and self.pipeline == "on":
            if self.staleness == "auto":
                raise UsageError(f"--pipeline on keeps two pushes in flight, which the default "
                                 f"--staleness bound ({AUTO_STALENESS} with more than "
                                 f"{AUTO_STALENESS + 1} workers) does not allow: add "
                                 "--staleness none, or drop --pipeline on")
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
        "gradients on the wire: none (float32); fp16 (half the bytes); powersgd (each "
        "weight matrix of n x m values travels as two factors of --compression-rank R, R "
        "(n + m) values; Vogels et al. 2019, as PyTorch DDP's powerSGD_hook); or topk "
        "(each variable's --compression-ratio largest values, as index-value pairs; sync: "
        "gathered from every worker). All keep what they do not send in the worker's "
        "residual, added to its next gradient (error feedback); all work in the sync "
        "allreduce and the async pushes", "none", flag="--compression", choices=COMPRESSIONS)
    compression_rank: int = option(
        "with --compression powersgd: the rank R of each matrix's approximation (more: "
        "closer to the exact gradient, more bytes); a matrix is compressed only where its "
        "factors are at most half its values", POWERSGD_RANK, flag="--compression-rank",
        key="compression_rank", type=int, metavar="R", number=Number(True, 1, 1024))
    compression_ratio: float = option(
        "with --compression topk: the share of each variable's values a worker sends a "
        "step, those largest in magnitude (the rest waits in its residual)", TOPK_RATIO,
        flag="--compression-ratio", key="compression_ratio", type=float, metavar="F",
        number=Number(False, 0, 0.25, above_low=True))
    compression_min_size: int = option(
        "with --compression powersgd or topk: variables of fewer values travel whole",
        COMPRESSION_MIN_SIZE, flag="--compression-min-size", key="compression_min_size",
        type=int, metavar="N", number=Number(True, 0))
    compression_warmup: int = option(
        "with --compression powersgd or topk, sync: the first N steps exchange the exact "
        "gradient (the early, large gradients), as PyTorch's start_powerSGD_iter; async "
        "pushes compress from the first", POWERSGD_WARMUP,
        flag="--compression-warmup-steps", key="compression_warmup", type=int,
        metavar="N", number=Number(True, 0))
    shared_memory: str = option(
        "memory that ranks of one host share, instead of MPI messages. Sync, mpi engine, "
        "every worker on one host: the workers sum the gradient in it (each its chunk of "
        "every worker's buffer, bit-identical everywhere); auto: for overlapped buckets "
        "of 1 MB or more, without --compression; on: every bucket, overlapping as with "
        "--overlap on. Async: the workers on rank 0's host leave their gradients there "
        "and take their weights from there, only headers go through MPI; auto: where it "
        "can be mapped; on: every worker, which must share rank 0's host. off: always MPI",
        "auto", flag="--shared-memory", choices=SHARED_MEMORY)

    def check(self, run) -> None:  # run: the whole Config
        self._check_compression(run)
        if self.shared_memory != "on" or run.async_mode:
            return
        for clash, fix in (
                (run.sync.allreduce == "horovod",
                 "Horovod moves its own bytes: use --allreduce mpi"),
                (self.compression != "none", f"it sums float32: drop --compression "
                                             f"{self.compression}"),
                (run.sync.overlap == "off", "it sums the overlapped buckets: drop --overlap off"),
                (run.compiler == "xla", "it sums the overlapped buckets, which XLA cannot "
                                        "compile: use --compile auto or graph")):
            if clash:
                raise UsageError(f"--shared-memory on is for the sync mpi engine's float32 "
                                 f"buckets; {fix}")

    def _check_compression(self, run) -> None:
        """Each compression's own options only with it; powersgd and topk in sync only
        where MPI moves the whole gradient at once."""
        for flag, given, needs in (
                ("--compression-rank", self.compression_rank != POWERSGD_RANK, ("powersgd",)),
                ("--compression-ratio", self.compression_ratio != TOPK_RATIO, ("topk",)),
                ("--compression-min-size", self.compression_min_size != COMPRESSION_MIN_SIZE,
                 PER_VARIABLE),
                ("--compression-warmup-steps", self.compression_warmup != POWERSGD_WARMUP,
                 PER_VARIABLE)):
            if given and self.compression not in needs:
                raise UsageError(f"{flag} is for --compression {' or '.join(needs)}: add "
                                 f"--compression {needs[0]}, or drop {flag}")
        if self.compression not in PER_VARIABLE:
            return
        name = f"--compression {self.compression}"
        if run.async_mode:
            if self.compression_warmup != POWERSGD_WARMUP:
                raise UsageError(f"--compression-warmup-steps is for sync training: async "
                                 f"pushes have a fixed length, {name} compresses every push: "
                                 "drop --compression-warmup-steps")
            return
        for clash, fix in (
                (run.sync.allreduce == "horovod", "it exchanges its messages through MPI: use "
                                                  "--allreduce mpi"),
                (run.sync.overlap == "on", "it needs the whole gradient: drop --overlap on")):
            if clash:
                raise UsageError(f"{name} in sync mode is for the mpi allreduce; {fix}")


@dataclass(frozen=True)
class CheckpointSettings:
    """When rank 0 saves the run (:class:`mpitrain.run.checkpoint.Checkpoint`)."""

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
    """How long ranks wait for each other (:mod:`mpitrain.config.bounds`)."""

    timeout: float = option(
        "seconds any rank waits for another before the job is aborted with the "
        "stalled rank named", 300.0, flag="--timeout", type=float, metavar="S",
        number=SECONDS)
    start_timeout: float = option(
        "seconds a rank waits for every rank of the job to start MPI: a rank that never "
        "does (it exited before, e.g. under a wrapper script, or is stuck before it) "
        "ends the job with an error naming this; at least 1", 120.0,
        flag="--start-timeout", type=float, metavar="S",
        # a floor: below it even ranks that all start are called never started
        number=Number(False, 1.0, MAX_SECONDS, unit="of seconds"))
    liveness_floor: float = option(
        "the least time a silent worker gets before rank 0 counts it as lost: async "
        "under mpirun --enable-recovery drops it and goes on, sync names it and ends "
        "the job (its bound is 20x its measured interval between messages, at least "
        "this, at most --timeout)", 10.0,
        flag="--liveness-floor", type=float, metavar="S", number=SECONDS)

    @property
    def bounds(self) -> Bounds:
        """Every wait derived from these (see :mod:`mpitrain.config.bounds`)."""
        return Bounds(self.timeout, self.start_timeout)


@dataclass(frozen=True)
class TelemetrySettings:
    """What every rank samples about its host (:mod:`mpitrain.results.telemetry`)."""

    sample_interval: float = option(
        "seconds between telemetry samples (CPU, memory, network) on every rank; 0 = off",
        1.0, flag="--sample-interval", type=float, metavar="S",
        number=Number(False, 0.01, MAX_SECONDS, off=0, unit="of seconds"))
