"""The limit of data parallelism here: sync step time / the same workers' compute-only
step time (gradients and updates, the exchange removed), LeNet and AlexNet (32x32) at
2 workers (-np 3; rank 0 sleeps as the parameter server does).

Two measurements side by side in one run per model:

* the hot path, in one job: every worker runs the trainer's step (gradient and
  exchange as the trainer makes them with its defaults: the fused allreduce for
  LeNet; for AlexNet the buckets overlapped with back-propagation, summed through
  the workers' shared memory; then apply) and the step without the exchange (the
  gradient, then apply), interleaved (compute, sync, compute, sync) so both see
  the same machine;
* the real trainer (``mpirun ... python -m mpitrain MODEL``, 3 or 4 epochs): the
  workers' seconds per step in steady state, the epochs between the first and the
  last in its timing.csv (their whole loop: reports, heartbeats; no evaluation or
  checkpoint until the final ones), against the compute-only step of the first
  measurement.

Target (issue 15): <= 1.10.

    python -m bench lower_bound [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import (last_json_line, mnist_dir, mpirun, on_every_rank, out_dir,
                     steady_epoch_seconds, table, train, write_csv)

TARGET = 1.10
#: what the trainer runs: LeNet on MNIST, AlexNet on synthetic 32x32 ImageNet-shaped
#: data (1000 classes, as the registry's synthetic defaults)
MODELS = {"lenet": {"batch": 64, "shape": (28, 28, 1), "classes": 10, "optimizer": "adam",
                    "lr": 0.002},
          "alexnet": {"batch": 64, "shape": (32, 32, 3), "classes": 1000,
                      "optimizer": "momentum", "lr": 0.02},
          # measured by bench ddp (its compute-only step), not by this benchmark
          "resnet": {"batch": 64, "shape": (32, 32, 3), "classes": 10, "optimizer": "adam",
                     "lr": 0.002}}
#: the real trainer's run per model, full and --quick: (epochs, data options). LeNet:
#: 157 steps an epoch on the 20,000-image MNIST, one steady epoch; AlexNet: 5 steps an
#: epoch (640 images, 2 workers x batch 64), two steady epochs
TRAINER_RUNS = {
    "lenet": {False: (3, ["--data-dir", mnist_dir()]),
              True: (3, ["--dataset", "synthetic", "--image-size", "28",
                         "--synthetic-size", "256"])},
    "alexnet": {False: (4, ["--image-size", "32", "--synthetic-size", "640"])},
}


def rank_side(model: str, steps: int) -> None:
    """Runs on every rank under mpirun; rank 0 prints one JSON line of results."""
    from mpitrain import models
    from mpitrain.comm import IDLE, Comm
    from mpitrain.config import Config
    from mpitrain.exchange import plan
    from mpitrain.models.replica import Replica, init_tensorflow

    spec = MODELS[model]
    comm = Comm.world(timeout=600)
    os.sched_setaffinity(0, range(os.cpu_count()))
    workers = comm.workers
    n_workers = comm.size - 1
    init_tensorflow(max(1, (os.cpu_count() or 1) // n_workers) if workers else 1, 0)
    replica = Replica(models.get(model), spec["shape"], spec["classes"], spec["optimizer"],
                      spec["lr"], applies=workers is not None,
                      compiler="auto")  # the trainer's default: both sides update alike
    comm.bcast_(replica.weights())
    result = {}
    if workers is None:  # the parameter server: asleep until the workers are done
        comm.barrier("the workers", backoff=IDLE)
    else:
        tail = 1 + workers.size  # the trainer's status tail (mpitrain/train/sync.py)
        defaults = Config.of(model=model)  # the trainer's defaults: engine, overlap, buckets
        with plan(defaults, replica, workers, tail) as exchange:
            timed = interleaved_steps(replica, exchange, workers, spec, steps)
        comm.barrier("the workers", backoff=IDLE)
        result = {mode: min(times) for mode, times in timed.items()}
    results = comm.allgather_objects(result)
    if comm.rank == 0:
        rows = [r for r in results if r]
        print(json.dumps({k: float(np.mean([r[k] for r in rows])) for k in rows[0]}))


def interleaved_steps(replica, exchange, workers, spec: dict, steps: int) -> dict:
    """Seconds per step of the compute-only step and of the sync step, each timed twice,
    interleaved (compute, sync, compute, sync), after 3 warm-up steps each time."""
    rng = np.random.default_rng(workers.rank)
    x = rng.random((spec["batch"], *spec["shape"]), dtype=np.float32)
    y = rng.integers(0, spec["classes"], spec["batch"]).astype(np.int32)
    timed = {"compute": [], "sync": []}
    for mode in ("compute", "sync", "compute", "sync"):
        for i in range(steps + 3):  # 3 warm-up steps (tracing, caches)
            if i == 3:
                workers.barrier()
                t0 = time.perf_counter()
            # as the trainer: the gradient pre-divided, the exchange a sum
            if mode == "sync":
                grad, _, _ = exchange.grad(x, y)
                exchange.allreduce_(grad)
            else:
                grad, _, _ = replica.grad(x, y, scale=1.0 / workers.size)
            replica.apply(grad[:replica.n_params])
        workers.barrier()
        timed[mode].append((time.perf_counter() - t0) / steps)
    return timed


def hot_path(model: str, steps: int) -> dict:
    """Seconds per step of ``model``'s compute-only step (``compute``) and sync step
    (``sync``) on the hot path, 2 workers (-np 3), ``steps`` steps each way, twice."""
    return last_json_line(mpirun(3, ["-m", "bench.lower_bound", "--rank-side", model,
                                     "--steps", str(steps)]).stdout)


def trainer_step(model: str, quick: bool, results: Path) -> float:
    """Seconds per step of the real trainer's workers in steady state: one sync run,
    its middle epochs (after the first step's tracing, before the final report)."""
    spec = MODELS[model]
    epochs, data = TRAINER_RUNS[model][quick]
    row = train(3, [model, "--epochs", epochs, "--batch-size", spec["batch"], "--optimizer",
                    spec["optimizer"], "--eval-every", "1000", "--checkpoint-every", "1000",
                    "--sample-interval", "0", *data], results)
    steps_per_epoch = int(row["steps"]) / float(row["epochs"])
    return steady_epoch_seconds(row["run_dir"]) / steps_per_epoch


def main(argv=None, out=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench lower_bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="LeNet only, a few steps (smoke)")
    parser.add_argument("--rank-side", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        on_every_rank(rank_side, args.rank_side, args.steps)
        return {}
    # (the smoke: LeNet only; AlexNet's build and steps cost it a launch and half a
    # minute of CPU, and run the same code)
    steps = {"lenet": 3} if args.quick else {"lenet": 100, "alexnet": 10}
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in steps:
            hot = hot_path(model, steps[model])
            real = trainer_step(model, args.quick, Path(tmp) / model)
            rows.append({"model": model, "workers": 2,
                         "compute_only_ms": round(1e3 * hot["compute"], 2),
                         "hot_path_sync_ms": round(1e3 * hot["sync"], 2),
                         "trainer_sync_ms": round(1e3 * real, 2),
                         "hot_path_ratio": round(hot["sync"] / hot["compute"], 3),
                         "trainer_ratio": round(real / hot["compute"], 3)})
            for what, key in (("hot path", "hot_path_ratio"), ("trainer", "trainer_ratio")):
                checks.append({"benchmark": "lower_bound", "ratio": f"{model}, 2 workers: "
                               f"sync {what} step / compute-only step", "value": rows[-1][key],
                               "target": f"<= {TARGET}", "met": rows[-1][key] <= TARGET})
    path = (out or out_dir()) / "lower_bound.csv"
    write_csv(path, rows)
    print(table(rows, list(rows[0])))
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
