"""``mpitrain.fit``: train from your own script under mpirun, the way Horovod users work.

    # train.py, run as: mpirun -np 4 python train.py
    import mpitrain

    def build(input_shape, num_classes):
        ...return a keras.Model producing logits...

    result = mpitrain.fit(build, train=(x_train, y_train), test=(x_test, y_test),
                          mode="async", epochs=5, batch_size=64)
    if result:  # rank 0 only
        print(result.test_accuracy, result.run_dir)

It is the CLI's training run (:func:`mpitrain.run.session.run`) with the model and
the data handed over in memory: the same typed configuration (every option of
``mpitrain MODEL --help``, by its field name), the same roles, protocols,
results files, telemetry, checkpoints and fault handling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

from .config import Config, resolve, settings_with_flags
from .errors import Dropped, MpitrainError, UsageError

MODES = ("sync", "async")


@dataclass(frozen=True)
class FitResult:
    """What a run reached, as rank 0 (the parameter server) saw it."""

    test_accuracy: float
    test_loss: float
    train_loss: Optional[float]
    epochs: float
    steps: int
    wall_time_s: float  # training time, to the last update (runs.csv's finish_s: the rest)
    run_dir: Path  # config.json, curve.csv, checkpoint.npz, telemetry... (runs.csv beside it)


def fit(model: Union[Callable, str], train: Optional[Tuple] = None, test: Optional[Tuple] = None,
        *, mode: str = "sync", data: Optional[str] = None, **options) -> Optional[FitResult]:
    """Train ``model`` data-parallel over the MPI job this script runs in.

    Cross-rank contract: every rank of the job calls ``fit`` with the same
    arguments (the same arrays: each rank may load them itself); rank 0 becomes
    the parameter server, the others workers, as with the CLI. At ``mpirun -np
    1`` it trains on its own (``mode`` does not matter). A script may call it
    several times (one run after another, e.g. a small sweep), every rank the
    same number of times in the same order; each call is a run of its own.

    ``model``: a function ``(input_shape, num_classes) -> keras.Model`` producing
    logits, a registered name (``"lenet"``) or a ``"FILE.py:FUNCTION"`` spec.
    ``train``/``test``: ``(x, y)`` arrays (images (N, H, W[, C]) or features
    (N, D); integer labels 0..K-1; uint8 pixels are scaled to [0, 1]), or instead
    ``data=`` a path as for ``--data``. ``mode``: ``"sync"`` (allreduce) or
    ``"async"`` (parameter server). ``options``: any training option by its
    config field name (``epochs``, ``batch_size``, ``lr``, ``optimizer``,
    ``staleness``, ``results_dir``, ``clip_grad_norm``, ``outputs``...).

    Returns a :class:`FitResult` on rank 0 and ``None`` on the other ranks (also on
    an async worker the server dropped under ``mpirun --enable-recovery``).
    Raises an :class:`mpitrain.errors.MpitrainError` (usage, data, divergence,
    interruption) identically on every rank; an error only one rank can see
    (a stalled peer, a local crash) is printed and ends the whole job, as in the
    CLI, so no rank is left waiting.
    """
    cfg, explicit, spec, arrays = _config(model, train, test, mode, data, options)
    from .cli import exits
    from .run import session

    try:
        summary = session.run(cfg, explicit, model=spec, arrays=arrays)
    except Dropped as error:  # async under --enable-recovery: the run went on without it
        exits.report(error)
        return None
    except MpitrainError as error:
        if not error.everywhere:
            exits.report(error)  # reports to rank 0, which aborts the job
        raise
    except Exception:  # a crash on one rank must not leave the others waiting
        exits.crash()
        raise
    if summary.run_dir is None:
        return None
    return FitResult(summary.test_accuracy, summary.test_loss, summary.train_loss,
                     summary.epochs_done, summary.steps, summary.wall_time_s,
                     Path(summary.run_dir))


def _config(model, train, test, mode, data, options):
    """(the run's Config, built once as the command line's is, the keys of the settings
    given, the model's spec if it is a function, the arrays if given) from fit's
    arguments."""
    from . import data as datasets, models
    from .comm import launcher_world_size

    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    names = {s.key for s in settings_with_flags()} - {"async_mode", "data"}
    unknown = sorted(set(options) - names)
    if unknown:
        raise UsageError(f"fit() got unknown option(s) {', '.join(unknown)}; options are the "
                         f"training settings: {', '.join(sorted(names))}")
    if (train is None) != (test is None) or (train is None) == (data is None):
        raise UsageError("give fit() train=(x, y) and test=(x, y), or data=PATH")
    spec = None
    if callable(model):
        spec = models.from_callable(model)
        model = spec.name
    elif not isinstance(model, str):
        raise UsageError("model must be a function (input_shape, num_classes) -> keras.Model, "
                         "a registered name or a FILE.py:FUNCTION spec")
    arrays = None if data is not None else datasets.given_arrays(train, test)
    cfg = Config.of(model=models.canonical(model), async_mode=mode == "async",
                    data=datasets.GIVEN_ARRAYS if data is None else data,
                    **options).checked(lambda s: f"fit({s.key}=...)")
    if not cfg.resume:  # a resumed run's config is its own (see session.run)
        defaults = spec.defaults if spec else models.defaults_for(cfg.model)
        cfg = resolve(cfg, defaults, launcher_world_size())
    explicit = frozenset(options) | {"data"} | ({"async_mode"} if mode == "async" else set())
    return cfg, explicit, spec, arrays


def stream_shards(path: Union[str, Path], batch_size: int, rank: int, size: int,
                  seed: int = 0, split: str = "train", first_epoch: int = 1,
                  timeout: float = 300.0):
    """This rank's batches of the shard set at ``path`` (``mpitrain data pack``'s
    output) as a ``tf.data.Dataset`` of (x float32, y int32), and the steps of an epoch.

    ``split="train"``: epoch after epoch from ``first_epoch`` (Keras's
    ``initial_epoch + 1``), each in the order mpitrain's own runs use
    (:mod:`mpitrain.data.order`), the ranks taking batches in turn: together they train
    on every example at most once an epoch, each reading only its own. ``split="test"``:
    the rank's part of the test split, once, in order (the parts are disjoint and
    cover it). Contract: every rank calls it with the same ``path``, ``batch_size``,
    ``size`` and ``seed`` and its own ``rank``; DataError naming the shard if the set
    is missing or damaged, or a read stalls for ``timeout`` seconds.
    """
    import itertools

    import numpy as np
    import tensorflow as tf

    from .data.order import EpochOrder
    from .data.shards import as_float32, shard_range
    from .data.shardset import ShardSet, StreamedTrain, read_ahead

    if not 0 <= rank < size or batch_size < 1:
        raise UsageError(f"stream_shards: rank {rank} of size {size}, batch_size "
                         f"{batch_size}: give 0 <= rank < size and a batch of 1 or more")
    shards = ShardSet.open(path)
    if split not in shards.splits:
        raise UsageError(f"stream_shards: {path} has no {split!r} split (it has "
                         f"{', '.join(shards.splits)})")
    part = shards.splits[split]
    if split == "train":
        stream = StreamedTrain(part, size, rank, seed, timeout)
        steps = -(-len(stream) // batch_size)

        def batches():
            for epoch in itertools.count(first_epoch):
                yield from stream.epoch(batch_size, epoch)
    else:
        start, stop = shard_range(part.size, size, rank)
        steps = -(-(stop - start) // batch_size)
        order = EpochOrder(part.counts)

        def read(begin: int):
            ids = np.arange(begin, min(begin + batch_size, stop))
            x, y = part.read(*order.locate(ids))
            return as_float32(x), y

        def batches():
            yield from read_ahead((read(b) for b in range(start, stop, batch_size)), 4,
                                  timeout, f"the shards in {path}")
    signature = (tf.TensorSpec((None, *shards.input_shape), tf.float32),
                 tf.TensorSpec((None,), tf.int32))
    return tf.data.Dataset.from_generator(batches, output_signature=signature), steps
