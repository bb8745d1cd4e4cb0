"""--overlap: AlexNet (32x32 synthetic images, 27.5M parameters, a 110 MB gradient) sync
at -np 3 with its gradient allreduced in 25 MB buckets while back-propagation runs,
against the whole gradient in one allreduce after it: on this machine's shared memory
and on the emulated 3-node cluster2 with 1 GbE links (skipped where it cannot be made).

Steady-state seconds per step: the workers' time in the middle epochs of a run of
640 images, ``--batches-per-epoch 3 --epochs 4`` (batches of 107 images a worker;
the first epoch traces and calibrates, the last one writes the final checkpoint);
one run of each setting per place, on then off, both in one launch.

    python -m bench overlap [--quick]
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from .common import bench_parser, out_dir, steady_epoch_seconds, table, train_many, write_csv
from .netns import Skipped, emulated_cluster

STEPS_PER_EPOCH, EPOCHS = 3, 4
MODEL = ["alexnet", "--image-size", "32", "--synthetic-size", "640"]
#: the smoke's model: LeNet, its gradient (0.2 MB) in 50 KB buckets, so that it too is
#: overlapped bucket by bucket (AlexNet's build and 110 MB steps: a minute of CPU)
QUICK_MODEL = ["lenet", "--dataset", "synthetic", "--image-size", "28", "--synthetic-size",
               "640", "--bucket-mb", "0.05"]


def steady_step_seconds(results: Path, epochs: int = EPOCHS,
                        steps_per_epoch: int = STEPS_PER_EPOCH, model=tuple(MODEL),
                        **cluster) -> dict:
    """Seconds per step of the workers in the epochs after the first and before the
    last, with --overlap on and off (on first; one launch: start-up paid once), by
    setting."""
    found = train_many(3, {overlap: [
        *model, "--batches-per-epoch", steps_per_epoch, "--epochs", epochs, "--eval-every",
        "1000", "--checkpoint-every", "1000", "--sample-interval", "0", "--overlap", overlap]
        for overlap in ("on", "off")}, results, **cluster)
    return {overlap: steady_epoch_seconds(row["run_dir"]) / steps_per_epoch
            for overlap, row in found.items()}


def main(argv=None, out=None) -> dict:
    args = bench_parser("overlap", __doc__, "LeNet on shared memory only, 3 steps a run "
                        "(smoke)").parse_args(argv)
    out = out or out_dir()
    epochs, steps = (3, 1) if args.quick else (EPOCHS, STEPS_PER_EPOCH)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for where in ("shared memory",) if args.quick else ("shared memory",
                                                            "emulated cluster, 1 GbE"):
            cluster = emulated_cluster("1gbit") if "1 GbE" in where \
                else contextlib.nullcontext({})
            try:
                with cluster as launch:
                    seconds = steady_step_seconds(Path(tmp) / str(len(rows)), epochs, steps,
                                                  QUICK_MODEL if args.quick else MODEL,
                                                  **launch)
            except Skipped as why:
                print(f"{where}: skipped: {why}")
                continue
            rows.append({"where": where, "on_s_per_step": round(seconds["on"], 3),
                         "off_s_per_step": round(seconds["off"], 3),
                         "on_over_off": round(seconds["on"] / seconds["off"], 3)})
    write_csv(out / "overlap.csv", rows)
    print(table(rows, list(rows[0])))
    model = "LeNet 28x28, 50 KB buckets" if args.quick else "AlexNet 32x32"
    return {"rows": rows, "checks": [
        {"benchmark": "overlap", "ratio": f"{model} sync -np 3, {r['where']}: step time "
         "with --overlap on / off", "value": r["on_over_off"], "target": "< 1",
         "met": r["on_over_off"] < 1} for r in rows]}


if __name__ == "__main__":
    main()
