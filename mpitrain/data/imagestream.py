"""An image folder streamed (``--data DIR --stream``): each example is its own file,
decoded when a worker reaches it, so a folder of any size trains in a worker's memory
for a few batches. Which examples and in what order: :mod:`.order` (the folder is one
"file" of N examples there, its windows shuffled). Packing the folder once
(``mpitrain data pack``) reads faster, since every epoch decodes every image again
here; streaming the folder itself needs no copy.

Unlike an image folder read whole, the images' mode and size are not read from every
file's header before training (a million headers on every rank): the mode is RGB if
any of :data:`SAMPLE` headers spread over the folder has colour, else grayscale; the
size is ``--image-size``, else the first image's, and an image of another size ends
the run with a line naming it, as does one that does not decode (none is skipped).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from ..errors import DataError
from .imagefolders import decode_images, image_mode, list_images
from .memory import MemoryBudget
from .shards import Dataset
from .shardset import read_test_split

#: headers read to decide between grayscale and RGB
SAMPLE = 64
#: threads decoding a batch's images (Pillow lets go of the GIL while it decodes)
DECODERS = 4


class ImageFiles:
    """One split of an image folder, read by example (the interface of
    :class:`.shardset.Split`: one "file" of :attr:`size` examples)."""

    def __init__(self, directory: Path, files: List[Tuple[Path, int]], mode: str,
                 input_shape: Tuple[int, int, int], image_size: Optional[int]):
        self.directory, self.files, self.mode = directory, files, mode
        self.input_shape, self.image_size = input_shape, image_size
        self.dtype = np.dtype(np.uint8)
        self.labels = np.array([label for _, label in files], np.int32)
        self._pool = ThreadPoolExecutor(DECODERS, thread_name_prefix="mpitrain-decode")

    @property
    def size(self) -> int:
        return len(self.files)

    @property
    def counts(self) -> Tuple[int, ...]:
        return (len(self.files),)

    def read(self, files: np.ndarray, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The images at ``rows`` (decoded, resized, as uint8) and their labels."""
        parts = np.array_split(rows, min(DECODERS, max(1, len(rows))))
        decoded = list(self._pool.map(self._decode, parts))
        x = np.concatenate(decoded) if decoded else np.empty((0, *self.input_shape), np.uint8)
        if x.shape[1:] != self.input_shape:
            raise DataError(f"{self.directory}: images of {x.shape[2]}x{x.shape[1]} where "
                            f"the first is {self.input_shape[1]}x{self.input_shape[0]}; pass "
                            "--image-size PX to resize every image")
        return x, self.labels[rows]

    def _decode(self, rows: np.ndarray) -> np.ndarray:
        if not len(rows):
            return np.empty((0, *self.input_shape), np.uint8)
        x = decode_images([self.files[r] for r in rows.tolist()], self.mode, self.image_size)
        return x[..., None] if x.ndim == 3 else x

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def streamed_folder(directory: Path, splits, image_size: Optional[int], eval_examples: int,
                    budget: MemoryBudget) -> Dataset:
    """An image folder as a run loads it with ``--stream``: the training split to stream
    (``train_shards``), the test split decoded now if ``splits`` has it (its
    ``eval_examples`` sample, or all of it, checked against ``budget`` first)."""
    classes, files = list_images(directory)
    everything = files["train"] + files["test"]
    spread = [everything[i] for i in np.linspace(0, len(everything) - 1,
                                                 min(SAMPLE, len(everything))).astype(int)]
    mode, _ = image_mode([path for path, _ in spread], image_size)
    _, (width, height) = image_mode([everything[0][0]], image_size)
    side = (image_size, image_size) if image_size else (height, width)
    shape = (*side, 3 if mode == "RGB" else 1)
    train = ImageFiles(directory, files["train"], mode, shape, image_size)
    ds = Dataset("images", str(directory), len(classes), shape, train.size, classes=classes,
                 train_shards=train)
    if "test" in splits:
        read_test_split(ds, ImageFiles(directory, files["test"], mode, shape, image_size),
                        eval_examples, budget, f"--data {directory}", "images")
    return ds
