"""Image folders, read: the class folders and their images listed (with the train /
test division), the images' mode and size found from their headers, and images decoded
with Pillow. Used by :mod:`.decoding` (a folder read whole), :mod:`.imagestream` (a
folder streamed) and :mod:`.packing`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import DataError
from ..userfiles import open_regular
from .shards import SPLITS, USER_FORMATS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
#: an image folder without train/ and test/ holds out this share of each class as test
HOLDOUT = 0.1


def _class_folders(directory: Path) -> List[Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_in(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def list_images(directory: Path) -> Tuple[List[str], Dict[str, List[Tuple[Path, int]]]]:
    """(class names, each split's (image file, class index) pairs) of an image folder;
    DataError if it has fewer than two classes or a class without training images."""
    if (directory / "train").is_dir() and (directory / "test").is_dir():
        classes = [p.name for p in _class_folders(directory / "train")]
        test_classes = [p.name for p in _class_folders(directory / "test")]
        if set(test_classes) - set(classes):
            raise DataError(f"{directory / 'test'}: classes "
                            f"{sorted(set(test_classes) - set(classes))} "
                            f"are not in {directory / 'train'}")
        files = {split: [(f, classes.index(c.name)) for c in _class_folders(directory / split)
                         for f in _images_in(c)] for split in SPLITS}
    else:
        folders = _class_folders(directory)
        classes = [p.name for p in folders]
        files = {"train": [], "test": []}
        for index, folder in enumerate(folders):
            images = _images_in(folder)
            # a fixed split, whatever --seed: the test set is the same in every run
            order = np.random.default_rng(index).permutation(len(images))
            n_test = max(1, int(round(HOLDOUT * len(images)))) if len(images) > 1 else 0
            files["test"] += [(images[i], index) for i in sorted(order[:n_test])]
            files["train"] += [(images[i], index) for i in sorted(order[n_test:])]
    if len(classes) < 2 or not files["train"]:
        raise DataError(f"--data {directory}: expected class sub-folders holding PNG/JPEG "
                        f"images (found {len(classes)} folder(s), {len(files['train'])} "
                        f"images); or give {USER_FORMATS}")
    seen = {c for _, c in files["train"]}
    empty = [name for index, name in enumerate(classes) if index not in seen]
    if empty:
        where = directory / "train" if (directory / "train").is_dir() else directory
        raise DataError(f"{where / empty[0]}: no training images (PNG/JPEG) for class "
                        f"{empty[0]!r}; add some or remove the folder")
    return classes, files


def image_mode(paths: List[Path], image_size: Optional[int] = None):
    """(RGB if any image has colour, else grayscale (L); the first image's (width,
    height)). Reads every file's header (both splits, on every rank): without
    ``image_size`` all must share one size."""
    from PIL import Image

    mode, first = "L", None
    for path in paths:
        try:
            with open_regular(path, DataError) as file, Image.open(file) as image:
                if image.mode not in ("1", "L", "LA", "I", "I;16", "F"):
                    mode = "RGB"
                size = image.size
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds
            raise DataError(f"{path}: not a readable image ({type(e).__name__}: {e}); "
                            "replace or remove it") from None
        if first is None:
            first = (path, size)
        elif not image_size and size != first[1]:
            raise DataError(f"{path}: image is {size[0]}x{size[1]} but {first[0]} is "
                            f"{first[1][0]}x{first[1][1]}; pass --image-size PX to resize "
                            "every image to PX x PX")
    assert first is not None, "no images"  # (the caller's classes each have one)
    return mode, first[1]


def decode_images(files, mode: str, image_size: Optional[int]) -> np.ndarray:
    from PIL import Image

    out, first = [], None
    for path, _ in files:
        try:
            with open_regular(path, DataError) as file, Image.open(file) as opened:
                image = opened.convert(mode)
                if image_size:
                    image = image.resize((image_size, image_size),
                                         Image.BILINEAR)  # type: ignore[attr-defined]
                pixels = np.asarray(image, np.uint8)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{path}: not a readable image ({type(e).__name__}: {e}); "
                            "replace or remove it") from None
        if first is None:
            first = (path, pixels.shape)
        elif pixels.shape != first[1]:
            raise DataError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]} but "
                            f"{first[0]} is {first[1][1]}x{first[1][0]}; pass --image-size "
                            "PX to resize every image to PX x PX")
        out.append(pixels)
    return np.stack(out) if out else np.zeros((0, 1, 1), np.uint8)

