"""TensorFlow's own distribution on this machine: the baselines mpitrain is compared with.

    python bench/tf_baselines.py --strategy {mwms,ps} --model {lr,lenet,alexnet} \\
        --workers N --epochs E --batch-size B --lr LR --optimizer {sgd,momentum,adam} \\
        [--lr-schedule {constant,cosine}] [--image-size S] [--synthetic-size N] \\
        [--data-dir DIR] [--steps K] [--seed S] [--timeout SECONDS] --json-out FILE

* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy``, one process per worker
  (one replica each), synchronous all-reduce over gRPC, a custom training loop
  (``strategy.run`` inside a ``tf.function`` over a distributed dataset). Keras 3's
  ``model.fit`` does not work with MWMS in Keras 3.15 / TF 2.18 (``ValueError:
  Attempt to convert a value (PerReplica...)``; keras-team/keras#20585).
* ``ps``: ``tf.distribute.experimental.ParameterServerStrategy``: a coordinator
  (the ``chief`` task, a subprocess), one parameter server and N workers;
  ``ClusterCoordinator.schedule`` of one training step per closure, each reading
  the next batch of the worker's own shard through
  ``coordinator.create_per_worker_dataset``. Keras 3 variables work under PSS (they
  are placed on the PS), but ``model.fit`` does not (Keras 3 has no
  ClusterCoordinator support), and the Keras 3 optimizer's step counter is
  incremented with a read-then-write (``keras.Variable.assign_add`` is
  ``assign(self + value)``), which loses increments when workers update
  concurrently (317 of 400 counted in a probe); this script makes that one
  increment an atomic ``AssignAddVariableOp`` on the PS, so cosine decay and
  Adam's bias correction see the true number of updates.

The script launches every process itself (TF_CONFIG on free localhost ports),
bounds every wait (``--timeout``, default 1800 s for the whole run), kills all its
children on any error, timeout or signal (and the children die with it even if it
is SIGKILLed: PR_SET_PDEATHSIG), and writes one JSON result, also printed as the
last stdout line. A cluster that fails in TensorFlow's runtime rather than in this
script (an InternalError, UnavailableError... from gRPC or the eager service, or a
crash: see ``not_ours``) is started again on new ports, at most ``CLUSTER_STARTS``
times in all within ``--timeout``, each restart one ``tf_baselines: note: ...`` line on
stderr and counted in the result (``cluster_starts``). Errors: one
``tf_baselines: error: ...`` line on stderr, exit status 2 (usage) or 1. It imports
nothing from mpitrain.

Semantics follow mpitrain: each worker trains on its own disjoint, equal shard of
the training set (train_size // workers, remainder dropped), reshuffled every
epoch; an epoch is one pass of every worker over its shard (ceil(shard / batch)
steps, the last batch smaller); the global batch is workers x batch. Sync: one
update per step with the mean of the workers' mean gradients. Async: workers x
steps-per-epoch updates per epoch. Cosine decay runs over all the run's updates.
The learning rate is used as given (no scaling). Threads: intra-op = the host's
CPUs // workers (at least 1), inter-op = 1, in every process.

``wall_time_s`` runs from just before the first training step (its tracing
included, as in mpitrain) to the end of the last one; process start-up, imports,
cluster connection, model building and the final evaluation are excluded and
reported separately (``startup_s``, ``eval_s``, ``total_s``).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "tf_baselines"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_MNIST = REPO.parent / "shared" / "data" / "mnist"
MODELS = ("lr", "lenet", "alexnet")
SYNTHETIC_CLASSES = 1000
SYNTHETIC_TEST = 256  # mpitrain's synthetic test-set size
SYNTHETIC_POOL = 64
EVAL_BATCH = 2000
IDX = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
       "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
ERROR_TAG = "TF_BASELINES_CHILD_ERROR:"
PS_INTER_OP_THREADS = 2


class Failure(Exception):
    """A run-time failure: reported as one line, exit status 1."""


class UsageFailure(Failure):
    """Bad arguments: exit status 2."""


class ClusterFailure(Failure):
    """A process of the cluster failed; ``not_ours`` when TensorFlow's runtime did (see
    :func:`not_ours`), so that starting the cluster again may well succeed."""

    def __init__(self, message: str, not_ours: bool):
        super().__init__(message)
        self.not_ours = not_ours


#: how many times the cluster is started at most: again after a failure of TensorFlow's
#: own runtime (not_ours), within the one --timeout
CLUSTER_STARTS = 3
#: errors of TensorFlow's runtime, gRPC and the eager service, that a child reports as
#: its own (never this script's Failure): e.g. ParameterServerStrategy's coordinator
#: now and then sends a worker a request it cannot parse ("InternalError: ... Unable to
#: parse request", the request's device string corrupted in the coordinator), a server
#: cannot bind its port (UnknownError), a peer is not there yet (UnavailableError)
TF_RUNTIME_ERRORS = ("InternalError", "UnknownError", "UnavailableError", "AbortedError",
                     "CancelledError", "DeadlineExceededError")
#: signals that kill a child from inside TensorFlow's native code
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageFailure(message)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser() -> Parser:
    p = Parser(prog="python bench/tf_baselines.py",
               description="TensorFlow MultiWorkerMirroredStrategy / ParameterServerStrategy "
                           "baselines on localhost (see the module docstring).")
    p.add_argument("--strategy", required=True, choices=("mwms", "ps"))
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--workers", required=True, type=positive_int)
    p.add_argument("--epochs", required=True, type=positive_int)
    p.add_argument("--batch-size", required=True, type=positive_int, help="per worker")
    p.add_argument("--lr", required=True, type=positive_float, help="used as given")
    p.add_argument("--optimizer", required=True, choices=("sgd", "momentum", "adam"))
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    p.add_argument("--image-size", type=positive_int, default=32, help="alexnet only")
    p.add_argument("--synthetic-size", type=positive_int, default=1280,
                   help="alexnet: synthetic training examples per epoch")
    p.add_argument("--data-dir", default=None,
                   help=f"MNIST IDX files (default $MPITRAIN_DATA_DIR or {DEFAULT_MNIST})")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="stop after K steps per worker (ps: K x workers updates)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="bound on the whole run, seconds (everything is killed after it)")
    p.add_argument("--json-out", required=True)
    # internal: the role of a child process and where the chief writes its result
    p.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------------------
# Data (numpy only; shared by the launcher's checks and the children)
# ---------------------------------------------------------------------------------------
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def find_idx(directory: Path, stem: str) -> Path:
    for name in (stem, stem.replace("-idx", ".idx")):
        for suffix in (".gz", ""):
            if (directory / (name + suffix)).is_file():
                return directory / (name + suffix)
    raise Failure(f"{directory}: missing {stem}[.gz] (MNIST IDX files expected)")


def read_idx(path: Path):
    import numpy as np

    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise Failure(f"{path}: cannot read ({e}); corrupt or truncated") from None
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise Failure(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise Failure(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    if len(raw) - 4 - 4 * ndim != int(np.prod(shape)) * dtype.itemsize:
        raise Failure(f"{path}: IDX size does not match its header {shape}; truncated?")
    return np.frombuffer(raw, dtype, offset=4 + 4 * ndim).reshape(shape)


def data_dir(args) -> Path:
    return Path(args.data_dir or os.environ.get("MPITRAIN_DATA_DIR") or DEFAULT_MNIST)


def load_mnist(directory: Path, splits=("train", "test")) -> dict:
    """uint8 images (N, 28, 28, 1) and int32 labels of ``splits``."""
    import numpy as np

    if not directory.is_dir():
        raise Failure(f"--data-dir {directory}: no such directory")
    out = {}
    for split in splits:
        x = read_idx(find_idx(directory, IDX["x_" + split]))
        y = read_idx(find_idx(directory, IDX["y_" + split]))
        if x.ndim != 3 or x.shape[1:] != (28, 28) or x.dtype != np.uint8 or y.shape != (len(x),):
            raise Failure(f"{directory}: {split} images {x.shape} / labels {y.shape} are "
                          "not MNIST-shaped")
        out["x_" + split] = np.ascontiguousarray(x[..., None])
        out["y_" + split] = y.astype(np.int32)
    return out


def synthetic(n: int, image_size: int, seed: int, split: str, classes: int = SYNTHETIC_CLASSES):
    """mpitrain's synthetic data: (pool of <= 64 float32 images, n int32 labels of
    ``classes`` classes).

    Example i is pool[i % len(pool)]; the same generator calls as mpitrain, so
    the data are the very same for the same seed.
    """
    import numpy as np

    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    labels = rng.integers(0, classes, n, dtype=np.int32)
    pool = rng.random((min(SYNTHETIC_POOL, n), image_size, image_size, 3), dtype=np.float32)
    return pool, labels


def train_size(args) -> int:
    if args.model == "alexnet":
        return args.synthetic_size
    labels = read_idx(find_idx(data_dir(args), IDX["y_train"]))
    return len(labels)


class Plan:
    """Step arithmetic shared by the launcher and the children (mpitrain's)."""

    def __init__(self, args, n_train: int):
        self.n_train = n_train
        self.shard = n_train // args.workers
        self.steps_per_epoch = -(-self.shard // args.batch_size)
        full = self.steps_per_epoch * args.epochs
        self.steps_per_worker = min(full, args.steps) if args.steps else full
        async_ = args.strategy == "ps"
        self.updates = self.steps_per_worker * (args.workers if async_ else 1)
        self.decay_steps = full * (args.workers if async_ else 1)
        last = self.shard - (self.steps_per_epoch - 1) * args.batch_size
        self.batch_sizes = [args.batch_size] * (self.steps_per_epoch - 1) + [last]

    def examples(self, steps: int, batch: int) -> int:
        """Examples in a worker's first ``steps`` steps."""
        epochs, rest = divmod(steps, self.steps_per_epoch)
        return epochs * self.shard + sum(self.batch_sizes[:rest])


def check_args(args) -> Plan:
    if args.model == "alexnet" and args.image_size < 32:
        raise UsageFailure(f"--image-size {args.image_size} is too small for alexnet; "
                           "use 32 or more")
    n = train_size(args)
    if n < args.workers:
        raise UsageFailure(f"{args.workers} workers but only {n} training examples")
    plan = Plan(args, n)
    if args.batch_size > plan.shard:
        raise UsageFailure(f"--batch-size {args.batch_size} is larger than a worker's shard "
                           f"({plan.shard} = {n} // {args.workers})")
    if args.model != "alexnet":
        load_mnist(data_dir(args))  # fail here, once, rather than in every child
    return plan


# ---------------------------------------------------------------------------------------
# Launcher: no TensorFlow here
# ---------------------------------------------------------------------------------------
def free_ports(n: int):
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _child_setup():
    os.setsid()  # own process group: killed as a group
    try:  # die with the launcher, even if it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Launcher:
    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        self.procs = []  # (name, Popen, log path)
        self.logdir = Path(tempfile.mkdtemp(prefix="tf_baselines-"))

    def spawn(self, name: str, role: str, cluster: dict, task_type: str, index: int,
              result: str = None):
        tf_config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), PYTHONUNBUFFERED="1")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        cmd = [sys.executable, str(Path(__file__).resolve()), *self.argv, "--_role", role]
        if result:
            cmd += ["--_result", result]
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                    preexec_fn=_child_setup)
        self.procs.append((name, proc, log))

    def run(self, deadline: float) -> dict:
        """Start the cluster, wait for the chief's result (until ``deadline``, a
        time.monotonic()) and return it."""
        args = self.args
        t_launch = time.time()
        result_file = str(self.logdir / "result.json")
        W = args.workers
        if args.strategy == "mwms":
            ports = free_ports(W)
            cluster = {"worker": [f"localhost:{p}" for p in ports]}
            for i in range(W):
                self.spawn(f"worker{i}", "mwms-worker", cluster, "worker", i,
                           result_file if i == 0 else None)
            main = self.procs[0][1]
        else:
            ports = free_ports(W + 2)
            cluster = {"chief": [f"localhost:{ports[0]}"], "ps": [f"localhost:{ports[1]}"],
                       "worker": [f"localhost:{p}" for p in ports[2:]]}
            self.spawn("ps0", "ps-server", cluster, "ps", 0)
            for i in range(W):
                self.spawn(f"worker{i}", "ps-server", cluster, "worker", i)
            self.spawn("chief", "ps-chief", cluster, "chief", 0, result_file)
            main = self.procs[-1][1]
        servers_run_forever = args.strategy == "ps"
        while True:
            if time.monotonic() > deadline:
                self.dump_stacks()
                raise Failure(f"timed out after {args.timeout:.0f} s (--timeout); killed "
                              f"every process; logs in {self.logdir}")
            done = main.poll() is not None
            for name, proc, log in self.procs:
                rc = proc.poll()
                if rc is None or rc == 0 and (not servers_run_forever or proc is main):
                    continue
                how = "died" if servers_run_forever and proc is not main else "failed"
                error = last_error(log)
                raise ClusterFailure(f"{name} {how} (exit status {rc}): {error}; "
                                     f"logs in {self.logdir}", not_ours(rc, error))
            if done and all(p.poll() is not None for _, p, _ in self.procs
                            if not servers_run_forever or p is main):
                break
            time.sleep(0.05)
        try:
            result = json.loads(Path(result_file).read_text())
        except (OSError, ValueError) as e:
            raise Failure(f"the chief exited without a result ({e}); logs in {self.logdir}")
        self.cleanup()
        result["startup_s"] = round(result.pop("_t_first_step") - t_launch, 3)
        result["total_s"] = round(time.time() - t_launch, 3)
        return result

    def dump_stacks(self):
        """Python stacks of every live child into its log (faulthandler), for the post-mortem."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)

    def cleanup(self):
        """Stop every child (process group): SIGTERM, then SIGKILL after 5 s; reap all."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 5
        for _, proc, _ in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc, _ in self.procs:
            try:  # the group too: anything a child may have left behind
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def not_ours(returncode: int, error: str) -> bool:
    """True if a child that exited with ``returncode`` after ``error`` (its
    :func:`last_error`) failed in TensorFlow's runtime, not in this script: a
    TF_RUNTIME_ERRORS exception, or a crash signal."""
    return (-returncode in CRASH_SIGNALS
            or error.split(":", 1)[0].strip() in TF_RUNTIME_ERRORS)


def last_error(log: Path) -> str:
    """The child's own error line, else the last line that looks like an error."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith(ERROR_TAG):
            return line[len(ERROR_TAG):].strip()
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[:400]
    return (lines[-1].strip()[:400] if lines else "no output")


def launch(args, argv) -> int:
    plan = check_args(args)

    def on_signal(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        result = run_cluster(args, argv, time.monotonic() + args.timeout)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # no second interruption while cleaning up
    assert result["steps_per_worker_planned"] == plan.steps_per_worker
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(json.dumps(result), flush=True)
    return 0


def run_cluster(args, argv, deadline: float) -> dict:
    """The chief's result, the cluster started up to CLUSTER_STARTS times (each on new
    ports) while it fails in TensorFlow's runtime (:func:`not_ours`), each restart said
    in one line on stderr and counted in the result (``cluster_starts``). A failed
    start's logs are kept; the successful one's are removed."""
    for start in range(1, CLUSTER_STARTS + 1):
        launcher = Launcher(args, argv)
        try:
            result = launcher.run(deadline)
        except ClusterFailure as e:
            if not e.not_ours or start == CLUSTER_STARTS:
                raise
            print(f"{PROG}: note: the cluster failed in TensorFlow, not in this script "
                  f"({e}); starting it again on new ports ({start + 1} of {CLUSTER_STARTS})",
                  file=sys.stderr, flush=True)
            continue
        finally:
            launcher.cleanup()
        shutil.rmtree(launcher.logdir, ignore_errors=True)
        result["cluster_starts"] = start
        return result


# ---------------------------------------------------------------------------------------
# Children: TensorFlow
# ---------------------------------------------------------------------------------------
def threads_per_process(workers: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(1, cpus // workers)


def init_tf(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import keras

    threads = threads_per_process(args.workers)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)
    return tf, keras, threads


def build_model(keras, model: str, image_size: int):
    L = keras.layers
    if model == "lr":
        return keras.Sequential([keras.Input((28, 28, 1)), L.Flatten(), L.Dense(10)])
    if model == "lenet":
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            L.Conv2D(6, 5, padding="same", activation="relu"), L.MaxPooling2D(2),
            L.Conv2D(16, 5, activation="relu"), L.MaxPooling2D(2),
            L.Flatten(), L.Dense(120, activation="relu"), L.Dense(84, activation="relu"),
            L.Dense(10)])
    S = image_size
    return keras.Sequential([
        keras.Input((S, S, 3)), L.ZeroPadding2D(2),
        L.Conv2D(64, 11, strides=4 if S >= 64 else 1, activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Conv2D(192, 5, padding="same", activation="relu"), L.MaxPooling2D(3, 2),
        L.Conv2D(384, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"), L.MaxPooling2D(3, 2),
        L.Flatten(), L.Dropout(0.5), L.Dense(4096, activation="relu"), L.Dropout(0.5),
        L.Dense(4096, activation="relu"), L.Dense(SYNTHETIC_CLASSES)])


def make_optimizer(keras, args, decay_steps: int):
    lr = args.lr
    if args.lr_schedule == "cosine":
        lr = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps)
    if args.optimizer == "sgd":
        return keras.optimizers.SGD(lr)
    if args.optimizer == "momentum":
        return keras.optimizers.SGD(lr, momentum=0.9)
    return keras.optimizers.Adam(lr)


def build_in_scope(strategy, keras, args, plan):
    """(model, built optimizer, loss) with the variables placed by ``strategy``."""
    with strategy.scope():
        model = build_model(keras, args.model, args.image_size)
        optimizer = make_optimizer(keras, args, plan.decay_steps)
        optimizer.build(model.trainable_variables)
    return model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_arrays(args):
    """(images, labels, pool_size or 0) of the whole training set, as numpy.

    MNIST images stay uint8 (converted to float32 / 255 in the pipeline, which
    is bit-identical to converting first); synthetic images are the pool.
    """
    if args.model == "alexnet":
        pool, labels = synthetic(args.synthetic_size, args.image_size, args.seed, "train")
        return pool, labels, len(pool)
    data = load_mnist(data_dir(args), ("train",))
    return data["x_train"], data["y_train"], 0


def test_arrays(args):
    import numpy as np

    if args.model == "alexnet":
        pool, labels = synthetic(SYNTHETIC_TEST, args.image_size, args.seed, "test")
        return pool[np.arange(len(labels)) % len(pool)], labels
    data = load_mnist(data_dir(args), ("test",))
    return data["x_test"].astype(np.float32) / np.float32(255.0), data["y_test"]


def shard_dataset(tf, x, y, pool: int, start, shard: int, batch: int, seed: int):
    """One worker's shard [start, start + shard): reshuffled every epoch, batched
    (the last batch of an epoch smaller), repeated, prefetched. ``start`` may be a
    tensor (the PS worker index is only known on the worker)."""
    x = tf.constant(x)
    y = tf.constant(y)
    start = tf.cast(start, tf.int64)

    def gather(idx):
        idx = idx + start
        if pool:
            images = tf.gather(x, idx % pool)
        else:
            images = tf.cast(tf.gather(x, idx), tf.float32) / 255.0
        return images, tf.gather(y, idx)

    ds = tf.data.Dataset.range(shard).shuffle(shard, seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch).map(gather).repeat().prefetch(2)


def make_eval(tf, keras, model):
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def eval_batch(x, y):
        logits = model(x, training=False)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32),
                                                 y), tf.int32))
        return tf.reduce_sum(per_example(y, logits)), correct

    def evaluate(x, y):
        loss, correct = 0.0, 0
        for s in range(0, len(y), EVAL_BATCH):
            l, c = eval_batch(x[s:s + EVAL_BATCH], y[s:s + EVAL_BATCH])
            loss += float(l)
            correct += int(c)
        return loss / len(y), correct / len(y)

    return evaluate


def base_result(args, plan: Plan, threads: int, tf, keras) -> dict:
    return {"strategy": args.strategy, "model": args.model, "workers": args.workers,
            "global_batch": args.workers * args.batch_size, "epochs": args.epochs,
            "batch_size": args.batch_size, "lr": args.lr, "optimizer": args.optimizer,
            "lr_schedule": args.lr_schedule,
            "dataset": "synthetic" if args.model == "alexnet" else "mnist",
            "image_size": args.image_size if args.model == "alexnet" else 28,
            "train_size": plan.n_train, "shard_size": plan.shard,
            "steps_per_epoch": plan.steps_per_epoch,
            "steps_per_worker_planned": plan.steps_per_worker,
            "decay_steps": plan.decay_steps if args.lr_schedule == "cosine" else None,
            "intra_op_threads": threads, "inter_op_threads": 1,
            "tensorflow": tf.__version__, "keras": keras.__version__, "seed": args.seed,
            "onednn": onednn_enabled()}


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN's kernels in this process (TF_ENABLE_ONEDNN_OPTS,
    or TensorFlow's default for this CPU)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def finish(args, result: dict, wall: float, examples: int, t_first: float,
           evaluate, x_test, y_test):
    t = time.perf_counter()
    loss, acc = evaluate(x_test, y_test)
    result.update({
        "wall_time_s": round(wall, 4),
        "epoch_time_s": round(wall * result["steps_per_epoch"]
                              / result["steps_per_worker_planned"], 4),
        "examples": examples,
        "examples_per_s": round(examples / wall, 2),
        "test_accuracy": round(acc, 6), "test_loss": round(loss, 6),
        "test_size": int(len(y_test)),
        "eval_s": round(time.perf_counter() - t, 3),
        "_t_first_step": t_first,
    })
    tmp = args._result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args._result)


def mwms_worker(args):
    tf, keras, threads = init_tf(args)

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x, y, pool = train_arrays(args)
    plan = Plan(args, len(y))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if strategy.num_replicas_in_sync != args.workers:
        raise Failure(f"{strategy.num_replicas_in_sync} replicas in sync, expected "
                      f"{args.workers} (one per worker process)")
    model, optimizer, loss_fn = build_in_scope(strategy, keras, args, plan)

    def dataset_fn(ctx):
        assert ctx.num_input_pipelines == args.workers and ctx.input_pipeline_id == index
        return shard_dataset(tf, x, y, pool, index * plan.shard, plan.shard, args.batch_size,
                             args.seed + index)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function
    def train_step(iterator):
        def step(images, labels):
            with tf.GradientTape() as tape:
                # mean over the local batch / replicas: the optimizer all-reduces with
                # SUM, so the update is the mean of the workers' mean gradients (mpitrain)
                loss = loss_fn(labels, model(images, training=True))
                scaled = loss / strategy.num_replicas_in_sync
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        images, labels = next(iterator)
        # this worker's loss only: reducing it across workers would add a second
        # collective per step (mpitrain does exactly one all-reduce per step)
        return strategy.experimental_local_results(strategy.run(step, args=(images, labels)))[0]

    result = base_result(args, plan, threads, tf, keras)
    epoch_times = []
    t_first = time.time()
    t0 = time.perf_counter()
    t_epoch = t0
    first_step_s = None
    loss = None
    for step in range(1, plan.steps_per_worker + 1):
        loss = train_step(iterator)
        if step == 1:
            float(loss)
            first_step_s = time.perf_counter() - t0
        if step % plan.steps_per_epoch == 0 or step == plan.steps_per_worker:
            last_loss = float(loss)  # waits for the step: every worker is done with it
            if not math.isfinite(last_loss):
                raise Failure(f"training diverged: loss {last_loss} at step {step}")
            now = time.perf_counter()
            epoch_times.append(round(now - t_epoch, 4))
            t_epoch = now
    wall = time.perf_counter() - t0
    if int(optimizer.iterations.numpy()) != plan.steps_per_worker:
        raise Failure(f"optimizer counted {int(optimizer.iterations.numpy())} updates, "
                      f"expected {plan.steps_per_worker}")
    if index != 0:
        return
    result.update({"steps": plan.steps_per_worker, "steps_per_worker": plan.steps_per_worker,
                   "updates": plan.steps_per_worker, "epoch_times_s": epoch_times,
                   "first_step_s": round(first_step_s, 4), "final_train_loss": last_loss})
    examples = args.workers * plan.examples(plan.steps_per_worker, args.batch_size)
    x_test, y_test = test_arrays(args)
    finish(args, result, wall, examples, t_first, make_eval(tf, keras, model), x_test, y_test)


def ps_server(args):
    """A PS or worker task of ParameterServerStrategy: a gRPC server, forever."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    threads = threads_per_process(args.workers)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    # Two inter-op threads, not one: a worker task runs a closure whose ops wait on
    # the PS (variable reads, the atomic step increment) while its iterator op runs;
    # with a single inter-op thread every closure hung (observed: coordinator.join
    # never returned, all tasks idle).
    tf.config.threading.set_inter_op_parallelism_threads(PS_INTER_OP_THREADS)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads,
                                      inter_op_parallelism_threads=PS_INTER_OP_THREADS)
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc",
                                  config=config, start=True)
    server.join()


def ps_chief(args):
    tf, keras, threads = init_tf(args)

    x, y, pool = train_arrays(args)
    plan = Plan(args, len(y))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    model, optimizer, loss_fn = build_in_scope(strategy, keras, args, plan)
    # Keras 3 increments its step counter with a read-then-write (Variable.assign_add
    # is assign(self + value)): concurrent workers lose increments, so the schedule and
    # Adam's bias correction would lag the real number of updates. Make it atomic.
    counter = optimizer.iterations

    def atomic_assign_add(value, _var=counter):
        return _var.value.assign_add(tf.cast(value, _var.value.dtype))

    counter.assign_add = atomic_assign_add

    def dataset_fn(ctx=None):
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return shard_dataset(tf, x, y, pool, tf.cast(worker, tf.int64) * plan.shard,
                             plan.shard, args.batch_size, args.seed)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def train_step(iterator):
        def step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss, tf.distribute.coordinator.experimental_get_current_worker_index()

        images, labels = next(iterator)
        return strategy.run(step, args=(images, labels))

    result = base_result(args, plan, threads, tf, keras)
    t_first = time.time()
    t0 = time.perf_counter()
    handles = [coordinator.schedule(train_step, args=(per_worker_iterator,))
               for _ in range(plan.updates)]
    coordinator.join()
    wall = time.perf_counter() - t0
    outputs = [h.fetch() for h in handles]
    per_worker = [0] * args.workers
    for _, worker in outputs:
        per_worker[int(worker)] += 1
    last_loss = float(outputs[-1][0])
    if not math.isfinite(last_loss):
        raise Failure(f"training diverged: loss {last_loss} at the last update")
    counted = int(optimizer.iterations.numpy())
    if counted != plan.updates:
        raise Failure(f"optimizer counted {counted} updates, expected {plan.updates}")
    # examples: each worker's steps over its own repeating shard (a faster worker does more)
    examples = sum(plan.examples(n, args.batch_size) for n in per_worker)
    result.update({"steps": plan.updates, "updates": plan.updates,
                   "steps_per_worker": per_worker, "ps": 1, "final_train_loss": last_loss})
    x_test, y_test = test_arrays(args)
    finish(args, result, wall, examples, t_first, make_eval(tf, keras, model), x_test, y_test)


def child(args) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # the launcher asks for stacks on a timeout
    try:
        {"mwms-worker": mwms_worker, "ps-server": ps_server, "ps-chief": ps_chief}[args._role](args)
        return 0
    except BaseException as e:  # one tagged line for the launcher, then the traceback
        import traceback

        traceback.print_exc()
        message = str(e).strip().splitlines()
        print(f"{ERROR_TAG} {type(e).__name__}: {message[0] if message else ''}"[:600],
              flush=True)
        return 1


def main(argv) -> int:
    try:
        args = parser().parse_args(argv)
        if args._role:
            return child(args)
        return launch(args, argv)
    except UsageFailure as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Failure as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Interrupted as e:
        print(f"{PROG}: error: interrupted by {e}; killed every process", file=sys.stderr,
              flush=True)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
