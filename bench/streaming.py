"""Data larger than memory: training streamed from a shard set (``mpitrain data pack``,
then ``--data DIR``) against the same data in memory.

* **memory**: a synthetic set of ``--gb`` GB on disk (32x32x3 images, CIFAR-sized,
  written by ``mpitrain data pack synthetic``), one epoch of sync LR (the cheapest
  model: reading is the largest share of its step) at 2 and 4 workers; each worker's
  RSS (telemetry.csv, every second) from its first sample to its last. Ratio: the
  largest over the first, the worst worker (target <= 1.10). The set could not be
  loaded in memory at all: every worker would hold its share as float32, 4x the
  bytes on disk divided by the workers.
* **throughput**: a subset that fits (LeNet on 28x28x1 images, ResNet-20 on 32x32x3),
  sync at 2 workers, the same examples packed as shards and saved as an npz: the
  steady epoch (timing.csv) in memory over streamed (target >= 0.9); beside it the rate
  the stream alone reads and decodes in one thread, over the training's rate, which
  says whether reading could ever be the bottleneck (it is not where the ratio is
  well above 1).
* **accuracy**: the real MNIST (the files the suite uses) in memory and packed as
  shards, sync LR at 2 workers for the same epochs: test accuracy, streamed minus in
  memory, in percentage points (target within 0.3). The two orders differ (in memory:
  each worker its own fixed part, shuffled; streamed: the whole set shuffled an epoch),
  so this is also the noise of a changed order. CIFAR-10 is not measured here: these
  machines have no copy and cannot download it.

    python -m bench streaming [--quick] [--gb 20] [--data DIR]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from .common import (bench_parser, mnist_dir, out_dir, run_table, slots_file,
                     steady_epoch_seconds, table, train_many, write_csv)

RSS_BOUND, SPEED_BOUND, ACCURACY_PP = 1.10, 0.9, 0.3
#: (model, image side, channels, training examples, epochs) of the throughput runs
THROUGHPUT = [("lenet", 28, 1, 24_000, 3), ("resnet", 32, 3, 3_000, 3)]
ACCURACY_EPOCHS = 5


def main(argv=None, out=None) -> dict:
    parser = bench_parser("streaming", __doc__, "a few MB, a few steps; 2 workers, LeNet "
                          "(smoke)")
    parser.add_argument("--gb", type=float, default=20.0, help="the memory run's data on disk")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="where the packed data goes, kept and reused by the next run "
                        "given the same DIR (default: the results directory, deleted at "
                        "the end)")
    args = parser.parse_args(argv)
    out = out or out_dir()
    data = args.data or out / "data"
    checks = memory(out, data, 0.005 if args.quick else args.gb, args.quick)
    checks += throughput(out, data, args.quick)
    checks += accuracy(out, data, args.quick)
    if not args.data:
        shutil.rmtree(data, ignore_errors=True)
    return {"checks": checks}


def pack(dest: Path, *source: str) -> float:
    """``mpitrain data pack SOURCE.. DEST``, unless DEST holds a set already (--data:
    packed by an earlier run, from the same deterministic source); returns the
    seconds it took."""
    if (dest / "manifest.json").exists():
        return 0.0
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "mpitrain", "data", "pack", *source,
                           str(dest)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pack {source} failed: {done.stderr[-2000:]}")
    return time.time() - began


def synthetic(dest: Path, examples: int, side: int, channels: int) -> float:
    return pack(dest, "synthetic", "--examples", str(examples), "--image-size", str(side),
                "--channels", str(channels))


def memory(out: Path, data: Path, gb: float, quick: bool) -> List[Dict]:
    examples = max(2000, int(gb * 2**30 / 3072))
    shards = data / "large"
    seconds = synthetic(shards, examples, 32, 3)
    on_disk = sum(p.stat().st_size for p in shards.glob("train-*.npz")) / 2**30
    print(f"streaming: packed {examples:,} examples ({on_disk:.2f} GB) in {seconds:.0f} s")
    rows, counts = [], (2,) if quick else (2, 4)
    for workers in counts:
        np_ = workers + 1
        run = train_many(np_, {"large": ["lr", "--data", shards, "--batch-size", 256,
                                         "--epochs", 1, "--eval-examples", 2000,
                                         *(["--steps", 30] if quick else [])]},
                         out / f"memory-np{np_}", hostfile=slots_file(out, np_))["large"]
        telemetry = run_table(run["run_dir"], "telemetry", ("worker",))
        for rank in np.unique(telemetry["rank"]):
            rss = telemetry["rss_mb"][telemetry["rank"] == rank]
            rows.append({"workers": workers, "rank": int(rank), "samples": len(rss),
                         "first_mb": round(float(rss[0])), "last_mb": round(float(rss[-1])),
                         "max_mb": round(float(rss.max())),
                         "max_over_first": round(float(rss.max() / rss[0]), 3),
                         "epoch_s": round(float(run["wall_time_s"]), 1),
                         "data_gb": round(on_disk, 2)})
    write_csv(out / "streaming_memory.csv", rows)
    print(table(rows, list(rows[0])))
    checks = []
    for workers in counts:
        worst = max(r["max_over_first"] for r in rows if r["workers"] == workers)
        checks.append({"benchmark": "streaming", "ratio": f"worker RSS, largest / first, one "
                       f"epoch of {on_disk:.1f} GB streamed, {workers} workers", "value": worst,
                       "target": f"<= {RSS_BOUND}", "met": worst <= RSS_BOUND})
    return checks


def throughput(out: Path, data: Path, quick: bool) -> List[Dict]:
    rows = []
    for model, side, channels, examples, epochs in THROUGHPUT[:1] if quick else THROUGHPUT:
        if quick:
            examples = 600
        shards = data / f"{model}-shards"
        synthetic(shards, examples, side, channels)
        npz = as_npz(shards, data / f"{model}.npz")
        common = ["--epochs", epochs, "--batch-size", 64, "--eval-examples", 500]
        runs = train_many(3, {"memory": [model, "--data", npz, *common],
                              "streamed": [model, "--data", shards, *common]},
                          out / f"throughput-{model}")
        memory_s = steady_epoch_seconds(runs["memory"]["run_dir"])
        streamed_s = steady_epoch_seconds(runs["streamed"]["run_dir"])
        trained = examples / 2 / streamed_s  # examples/s of one worker
        rows.append({"model": model, "image": f"{side}x{side}x{channels}",
                     "examples": examples, "memory_epoch_s": round(memory_s, 3),
                     "streamed_epoch_s": round(streamed_s, 3),
                     "memory_over_streamed": round(memory_s / streamed_s, 3),
                     "worker_examples_per_s": round(trained),
                     "read_examples_per_s": round(read_rate(shards)),
                     "read_over_training": round(read_rate(shards) / trained, 1)})
    write_csv(out / "streaming_throughput.csv", rows)
    print(table(rows, list(rows[0])))
    return [{"benchmark": "streaming", "ratio": f"{r['model']} ({r['image']}) sync epoch, in "
             "memory / streamed, 2 workers", "value": r["memory_over_streamed"],
             "target": f">= {SPEED_BOUND}", "met": r["memory_over_streamed"] >= SPEED_BOUND}
            for r in rows]


def as_npz(shards: Path, dest: Path) -> Path:
    """The shard set's examples as one npz (x_train.. y_test), for the in-memory side."""
    from mpitrain.data.order import EpochOrder
    from mpitrain.data.shardset import ShardSet

    arrays = {}
    for split, part in ShardSet.open(shards).splits.items():
        everything = np.arange(part.size)
        arrays["x_" + split], arrays["y_" + split] = part.read(
            *EpochOrder(part.counts).locate(everything))
    np.savez(dest, **arrays)
    return dest


def read_rate(shards: Path) -> float:
    """Examples a second one worker's stream reads and decodes (to float32) alone."""
    from mpitrain.data.shardset import ShardSet, StreamedTrain

    stream = StreamedTrain(ShardSet.open(shards).splits["train"], 2, 0, seed=0, timeout=60)
    began, n = time.perf_counter(), 0
    for _, y in stream.epoch(64, epoch=1):
        n += len(y)
    return n / (time.perf_counter() - began)


def accuracy(out: Path, data: Path, quick: bool) -> List[Dict]:
    shards = data / "mnist"
    pack(shards, mnist_dir())
    epochs = ["--steps", 20] if quick else ["--epochs", ACCURACY_EPOCHS]
    runs = train_many(3, {"memory": ["lr", "--data-dir", mnist_dir(), *epochs],
                          "streamed": ["lr", "--data", shards, *epochs]},
                      out / "accuracy")
    rows = [{"run": name, "dataset": run["dataset"], "epochs": run["epochs"],
             "test_accuracy": float(run["test_accuracy"])} for name, run in runs.items()]
    write_csv(out / "streaming_accuracy.csv", rows)
    print(table(rows, list(rows[0])))
    pp = round(100 * (rows[1]["test_accuracy"] - rows[0]["test_accuracy"]), 2)
    return [{"benchmark": "streaming", "ratio": "MNIST LR sync 2 workers, test accuracy "
             "streamed - in memory (pp)", "value": pp, "target": f"within +-{ACCURACY_PP}",
             "met": abs(pp) <= ACCURACY_PP}]


if __name__ == "__main__":
    main()
