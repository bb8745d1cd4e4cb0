"""The data of a run: where it comes from, how it is decoded, how workers share it.

* :mod:`.sources`: the built-in datasets (MNIST found or downloaded, scikit-learn's
  digits, synthetic images);
* :mod:`.decoding`: the user's own data (``--data``: an npz, image folders, CIFAR-10's
  batches; or the arrays given to ``mpitrain.fit``);
* :mod:`.memory`: what a rank may read, checked before it is read;
* :mod:`.shards`: the :class:`Dataset` record and the shard arithmetic the training
  protocols count in (a leaf: numpy only).

:func:`load` is the one entry of a run (collective): every rank loads the splits it
needs itself (workers the training set, of which each keeps its shard; the server the
test set), and the ranks agree on what was loaded, so a host without data fails the
whole job with one message rather than training on different data. Images are float32
in [0, 1] shaped (N, H, W, C) (uint8 pixels are scaled; float data is kept as it is);
labels are int32.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, cast

import numpy as np

from ..errors import DataError, UsageError
from .decoding import GIVEN_ARRAYS, given_arrays, read_user
from .memory import MemoryBudget, available_memory
from .shardset import StreamedTrain
from .shards import SPLITS, Dataset, as_float32, eval_sample, shard_range
from .sources import RepeatingImages, digits, load_mnist, synthetic_dataset


def read_user_data(path: str, splits=SPLITS, image_size: Optional[int] = None,
                   budget: Optional[MemoryBudget] = None) -> Dataset:
    """The user's dataset at ``path`` (see :mod:`.decoding`) as :func:`load` gives it
    on one rank without MPI: the ``splits`` asked for, as float32, checked against
    ``budget`` (default: this host's available memory)."""
    budget = budget or MemoryBudget(available_memory())
    return _finish(read_user(path, splits, image_size, budget), shard=None)


def load(dataset: str, data_dir: Optional[str], comm, splits=SPLITS,
         seed: int = 0, synthetic_shape: Optional[dict] = None,
         user_data: Optional[str] = None, image_size: Optional[int] = None,
         shard: Optional[Tuple[int, int]] = None,
         arrays: Optional[Dict[str, np.ndarray]] = None, eval_examples: int = 0,
         read_timeout: float = 300.0, stream: bool = False) -> Dataset:
    """Load ``splits`` of ``dataset`` on this rank. Collective over ``comm``.

    ``synthetic_shape`` (image_size, channels, num_classes, n_train, n_test)
    describes ``--dataset synthetic``; ``user_data`` is ``--data`` (:mod:`.decoding`),
    ``arrays`` the ones ``mpitrain.fit`` was given (:func:`.decoding.given_arrays`);
    ``shard`` (workers, this worker's index) keeps only this worker's shard of the
    training split (see :func:`_finish`); ``eval_examples`` (``--eval-examples``), if not
    0, keeps only that sample of the test split (:func:`.shards.eval_sample`);
    ``read_timeout`` bounds a streamed worker's wait for its next batch (a shard set:
    :mod:`.shardset`; an image folder with ``stream``: :mod:`.imagestream`). Contract:
    every rank calls it with the same ``dataset``; on return every rank holds the same
    dataset (same name and training-set size), or every rank raises the first rank's
    error (naming that rank and host).
    """
    result, error = None, None
    budget = MemoryBudget.of(comm, shard)
    try:
        if user_data or arrays is not None:
            result = read_user(cast(str, user_data), splits, image_size, budget, arrays,
                               eval_examples, stream)
        elif dataset in ("auto", "mnist"):
            result = load_mnist(dataset, data_dir, comm, splits)
        elif dataset == "digits":
            result = digits(seed)
        elif dataset == "synthetic":
            result = synthetic_dataset(dict(cast(dict, synthetic_shape)), seed, splits, budget)
        else:
            raise UsageError(f"unknown dataset {dataset!r}")
    except (DataError, UsageError) as e:
        if e.everywhere:  # already agreed on inside
            raise
        error = e
    comm.agree(error)
    result = cast(Dataset, result)  # (no error: every rank has one)
    _agree_on_dataset(result, comm)
    for split in SPLITS:
        if split not in splits:
            setattr(result, "x_" + split, None)
            setattr(result, "y_" + split, None)
    result = _finish(result, shard, eval_examples)
    if result.train_shards is not None and shard is not None:
        result.stream = StreamedTrain(result.train_shards, *shard, seed=seed,
                                      timeout=read_timeout)
    return result


def _finish(dataset: Dataset, shard: Optional[Tuple[int, int]],
            eval_examples: int = 0) -> Dataset:
    """With ``shard`` (workers, index), the training split cut to that worker's shard (its
    own copy, so the whole set read can be freed), and the test split to its
    ``eval_examples`` sample; then pixels as float32 (uint8 scaled to 0..1). In that
    order: a worker never holds the whole training set as floats, four times the bytes
    of its pixels."""
    if eval_examples and dataset.y_test is not None and eval_examples < len(dataset.y_test):
        keep = eval_sample(len(dataset.y_test), eval_examples)
        dataset.test_split_size = len(dataset.y_test)
        dataset.y_test = dataset.y_test[keep]
        if dataset.x_test is not None:  # (synthetic images: a batch of real ones)
            dataset.x_test = dataset.x_test[keep]
    if shard is not None and dataset.y_train is not None:
        start, stop = shard_range(dataset.train_size, *shard)
        dataset.y_train = take_shard(dataset.y_train, start, stop)
        if dataset.x_train is not None:
            dataset.x_train = take_shard(dataset.x_train, start, stop)
    for key in ("x_train", "x_test"):
        x = getattr(dataset, key)
        if isinstance(x, np.ndarray):  # not RepeatingImages: synthetic pixels are floats
            setattr(dataset, key, as_float32(x))
    return dataset


def take_shard(array, start: int, stop: int):
    """A worker's own copy of its shard (a view for synthetic data, which has no copies)."""
    if isinstance(array, RepeatingImages):
        return array.shard(start, stop)
    return array[start:stop].copy()


def _agree_on_dataset(result: Dataset, comm) -> None:
    summaries = comm.allgather_objects((result.name, result.train_size, result.num_classes,
                                        result.input_shape))
    if len(set(summaries)) > 1:
        lines = [f"{comm.name(r)} has {name} with {size} training examples of shape "
                 f"{shape} in {classes} classes"
                 for r, (name, size, classes, shape) in enumerate(summaries)]
        raise DataError("ranks loaded different data (" + "; ".join(lines) + "); give every "
                        "host the same files (--data, or MNIST via --data-dir or "
                        "$MPITRAIN_DATA_DIR)")


def describe(ds: Dataset) -> List[str]:
    """Lines for the log: dataset, origin and any note the user must see."""
    lines = [f"dataset {ds.name} from {ds.source}"]
    if ds.note:
        lines.append(ds.note)
    if ds.test_split_size is not None and ds.y_test is not None:
        lines.append(f"evaluating on {len(ds.y_test):,} of the {ds.test_split_size:,} test "
                     "examples (--eval-examples): its accuracy is a sample's")
    return lines


__all__ = ["Dataset", "GIVEN_ARRAYS", "MemoryBudget", "SPLITS", "describe", "given_arrays",
           "load", "read_user_data"]
