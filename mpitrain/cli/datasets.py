"""``mpitrain data pack|index|check``: a dataset made into a shard set to stream,
TFRecord files indexed to stream as they are, and a set checked (see
:mod:`mpitrain.data.packing`). No MPI; TensorFlow only to read TFRecords."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError


def add_parser(commands) -> None:
    data = commands.add_parser(
        "data", help="pack or index a dataset to stream it, or check a shard set",
        description="Shard sets are what --data streams: each worker reads only the "
        "examples it trains on, so the dataset need not fit in memory.")
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    pack = sub.add_parser(
        "pack", help="write a dataset as a shard set",
        description="Write SRC (an npz with x_train, y_train, x_test, y_test; MNIST's IDX "
        "files' directory; CIFAR-10's python batches; an image folder; or 'synthetic') "
        "into DEST as shards of about --shard-mb MB with a manifest.json; the training "
        "examples are shuffled first, so every shard holds every class.")
    pack.add_argument("src", metavar="SRC")
    pack.add_argument("dest", type=Path, metavar="DEST")
    pack.add_argument("--shard-mb", type=float, default=128.0,
                      help="size of a shard in MB (default: 128)")
    pack.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default: 0)")
    pack.add_argument("--image-size", type=int, metavar="PX",
                      help="resize an image folder's images to PX x PX")
    pack.add_argument("--examples", type=int, default=60000,
                      help="synthetic: training examples (default: 60000; test: a sixth)")
    pack.add_argument("--channels", type=int, default=1, help="synthetic: 1 or 3")
    pack.add_argument("--classes", type=int, default=10, help="synthetic: classes")
    index = sub.add_parser(
        "index", help="index TFRecord files to stream them as they are",
        description="Read SRC's TFRecord files of tf.train.Example once (train* and "
        "test*/validation*/val*/eval*) and write into DEST a manifest naming them and an "
        "index of every record (offset, length, label): --data DEST then streams the "
        "records from where they lie, decoding each as it is read.")
    index.add_argument("src", type=Path, metavar="SRC")
    index.add_argument("dest", type=Path, metavar="DEST")
    index.add_argument("--image-size", type=int, metavar="PX",
                       help="resize every image to PX x PX as it is read")
    check = sub.add_parser("check", help="check a shard set: every problem on a line",
                           description="Check DIR's manifest and every shard (presence, "
                           "size, checksum, arrays, labels); exit 1 if any is wrong.")
    check.add_argument("directory", type=Path, metavar="DIR")


def run(args: argparse.Namespace) -> int:
    from ..data import packing

    if args.data_command == "check":
        problems = packing.check(args.directory)
        for line in problems:
            print(line)
        if not problems:
            print(f"{args.directory}: every shard is whole")
        return 1 if problems else 0
    if args.data_command == "index":
        manifest = packing.index_records(args.src.absolute(), args.dest, args.image_size,
                                         _progress)
        counts = ", ".join(f"{entry['examples']:,} {split} records"
                           for split, entry in manifest["splits"].items())
        print(f"{args.dest}: {counts} of {args.src}, {manifest['num_classes']} classes")
        return 0
    size = args.image_size or 28  # (the synthetic images' side)
    if args.src == packing.SYNTHETIC and (args.examples < 1 or args.channels not in (1, 3)
                                          or args.classes < 2):
        raise UsageError("synthetic data needs --examples >= 1, --channels 1 or 3 and "
                         "--classes >= 2")
    source = packing.open_source(args.src, args.image_size,
                                 (args.examples, size, args.channels, args.classes),
                                 args.seed)
    manifest = packing.pack(source, args.dest, args.shard_mb, args.seed, _progress)
    counts = ", ".join(f"{entry['examples']:,} {split} in {len(entry['shards'])} shard(s)"
                       for split, entry in manifest["splits"].items())
    print(f"{args.dest}: {counts}")
    return 0


def _progress(line: str) -> None:
    end = "\r" if sys.stderr.isatty() else "\n"
    print(line, file=sys.stderr, end=end, flush=True)
