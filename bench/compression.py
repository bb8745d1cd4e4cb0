"""--compression fp16 against float32 gradients on the emulated 3-node cluster2 with
1 GbE links: LeNet (sync and async, 1 epoch of the real MNIST) and AlexNet (sync, 32x32
synthetic images, a few steps): epoch time with fp16 / without, side by side, and the
test accuracy difference (LeNet; AlexNet's synthetic labels are noise).

    python -m bench compression [--quick]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .common import bench_parser, mnist_dir, out_dir, table, train, write_csv
from .netns import Skipped, emulated_cluster, per_epoch, skipped

RUNS = [("lenet", "sync", ["--epochs", "1"]), ("lenet", "async", ["--epochs", "1"]),
        ("alexnet", "sync", ["--image-size", "32", "--steps", "8"])]
QUICK = {"lenet": ["--steps", "10"], "alexnet": ["--steps", "2"]}


def main(argv=None, out=None) -> dict:
    args = bench_parser("compression", __doc__).parse_args(argv)
    out = out or out_dir()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with emulated_cluster("1gbit") as cluster:
                for model, mode, options in RUNS:
                    for compression in ("none", "fp16"):
                        run_args = [model, *options, *(QUICK[model] if args.quick else []),
                                    "--compression", compression, "--data-dir", mnist_dir(),
                                    *(["--async"] if mode == "async" else [])]
                        row = train(4, run_args, Path(tmp) / f"{model}-{mode}-{compression}",
                                    **cluster)
                        rows.append({"model": model, "mode": mode, "compression": compression,
                                     "s_per_epoch": per_epoch(row),
                                     "test_accuracy": float(row["test_accuracy"]),
                                     "mpi_mb": round(float(row["mpi_bytes"]) / 1e6, 1)})
        except Skipped as why:
            return skipped("compression", why)
    write_csv(out / "compression.csv", rows)
    print(table(rows, list(rows[0])))
    checks = []
    for model, mode, _ in RUNS:
        plain, half = [r for r in rows if (r["model"], r["mode"]) == (model, mode)]
        checks.append({"benchmark": "compression", "ratio": f"{model} {mode} epoch time at "
                       "1 GbE, fp16 / float32", "value": round(half["s_per_epoch"] /
                                                              plain["s_per_epoch"], 3),
                       "target": "< 1", "met": half["s_per_epoch"] < plain["s_per_epoch"]})
        if model == "lenet":
            gap = round(100 * (half["test_accuracy"] - plain["test_accuracy"]), 2)
            checks.append({"benchmark": "compression", "ratio": f"{model} {mode} test "
                           "accuracy, fp16 - float32 (pp)", "value": gap,
                           "target": "within 0.5", "met": abs(gap) <= 0.5})
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
