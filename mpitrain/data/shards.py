"""What a rank holds of the data, and how the training split is divided among workers.

:class:`Dataset` is the record every source fills; the rest is the shard arithmetic
that the training protocols and the checkpoint positions count in: each worker owns a
disjoint, equal-size slice of the training set (:func:`shard_range`, the remainder
dropped), passes over it once an epoch in batches shuffled reproducibly per (seed,
worker, epoch) (:func:`epoch_batches`), and an epoch is :func:`batches_per_epoch` steps.
Pure arithmetic: numpy and :mod:`mpitrain.errors` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import UsageError

SPLITS = ("train", "test")
#: what ``--data`` reads, for the errors that say a path is none of them
USER_FORMATS = ("an .npz with x_train, y_train, x_test, y_test; a directory of class "
                "sub-folders of PNG/JPEG images; CIFAR-10's python batches "
                "(data_batch_1..5, test_batch); or a shard set (mpitrain data pack)")


@dataclass
class Dataset:
    """The splits a rank loaded, with where they came from."""

    name: str  # mnist, digits, synthetic, npz, images, cifar10, arrays: in the results
    source: str  # a path or URL, for the log and config.json
    num_classes: int
    input_shape: Tuple[int, ...]
    train_size: int
    x_train: Optional[np.ndarray] = None
    y_train: Optional[np.ndarray] = None
    x_test: Optional[np.ndarray] = None
    y_test: Optional[np.ndarray] = None
    note: str = ""  # a line the user must see (e.g. the offline fallback)
    classes: Optional[List[str]] = None  # class names, where the data names them
    #: the whole test split's size where only a sample of it is kept (--eval-examples)
    test_split_size: Optional[int] = None
    #: a shard set's train split (a :class:`.shardset.Split`), read as training goes,
    #: not into ``x_train``; a worker's part of it is ``stream``
    train_shards: Optional[Any] = None
    #: a worker's examples of ``train_shards`` (a :class:`.shardset.StreamedTrain`)
    stream: Optional[Any] = None


#: the seed of the test examples --eval-examples keeps: fixed, so that runs of any
#: --seed are evaluated on the same ones
EVAL_SAMPLE_SEED = 20260101


def eval_sample(n_test: int, n: int) -> np.ndarray:
    """The indices (sorted) of the ``n`` test examples of ``n_test`` that
    ``--eval-examples n`` evaluates on: a random sample without replacement, the same
    on every rank and in every run; all of them when ``n`` is 0 or not below ``n_test``."""
    if not n or n >= n_test:
        return np.arange(n_test)
    return np.sort(np.random.default_rng(EVAL_SAMPLE_SEED).choice(n_test, n, replace=False))


def shard_range(n_examples: int, n_workers: int, index: int) -> Tuple[int, int]:
    """[start, stop) of worker ``index``'s shard: disjoint, equal sizes, remainder dropped."""
    size = n_examples // n_workers
    return index * size, (index + 1) * size


def check_shards(n_examples: int, n_workers: int, batch_size: int) -> int:
    """Shard size per worker; UsageError if a worker would get no data or less than a batch."""
    size = n_examples // n_workers
    if size == 0:
        raise UsageError(f"{n_workers} workers but only {n_examples} training examples: every "
                         "worker would get no data; use fewer ranks (mpirun -np)")
    if batch_size > size:
        raise UsageError(f"--batch-size {batch_size} is larger than a worker's shard "
                         f"({size} examples = {n_examples} / {n_workers} workers); use "
                         f"--batch-size {size} or less")
    return size


def batches_per_epoch(shard_size: int, batch_size: int) -> int:
    """Steps in one pass over a shard; the last batch may be smaller."""
    return -(-shard_size // batch_size)


def epoch_batches(shard_size: int, batch_size: int, seed: int, worker: int,
                  epoch: int) -> Iterator[np.ndarray]:
    """Index arrays of one epoch over a shard, shuffled reproducibly per (seed, worker, epoch)."""
    order = np.random.default_rng([seed, worker, epoch]).permutation(shard_size)
    for start in range(0, shard_size, batch_size):
        yield order[start:start + batch_size]



def as_float32(x: np.ndarray) -> np.ndarray:
    """Examples as float32: uint8 pixels scaled to 0..1, other numbers as they are."""
    if x.dtype == np.uint8:
        out = x.astype(np.float32)
        out /= np.float32(255.0)  # in place: the same rounding as x / 255, one array
        return out
    return x.astype(np.float32, copy=False)
