"""Sync LR step time at -np 1..4 and the share of a step spent in the allreduce.

Each rank runs the trainer's hot path on real MNIST batches (the worker loop of
:mod:`mpitrain.train.sync`: gradient, one fused allreduce, apply; the fused
single-call step when there is one worker) and times each phase; rank 0 waits
asleep as the parameter server does. Prints:

* per-step time of sync at -np N vs single-node (-np 1), per global step and
  per example;
* the allreduce's share of a sync step (target <= 10%): its transfer cost
  (calibrated back-to-back, nobody late) and, separately, the whole time in the
  allreduce call, which also holds the wait for the slower worker;
* the cost of keeping rank 0's model current (weights copy + checksum + send,
  once per evaluation) as a share of an epoch.

    python -m bench sync_step [--steps N]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .common import (last_json_line, mnist_dir, mpirun, on_every_rank, out_dir, table,
                     write_csv)

TARGET_ALLREDUCE_SHARE = 0.10


def rank_side(steps: int, data_dir: str) -> None:
    """Runs on every rank under mpirun; rank 0 prints one JSON line of results."""
    from mpitrain import data, models
    from mpitrain.data import shards
    from mpitrain.comm import Comm
    from mpitrain.models.replica import Replica, checksum, init_tensorflow

    comm = Comm.world(timeout=120)
    import os
    os.sched_setaffinity(0, range(os.cpu_count()))
    workers = comm.workers
    n_workers = 1 if comm.size == 1 else comm.size - 1
    init_tensorflow(max(1, (os.cpu_count() or 1) // n_workers) if workers else 1, 0)
    ds = data.load("mnist", data_dir, comm, ("train",))
    replica = Replica(models.get("lr"), ds.input_shape, 10, "sgd", 0.5 * n_workers)
    comm.bcast_(replica.weights())
    result = {}
    if workers is not None:
        start, stop = shards.shard_range(ds.train_size, n_workers, workers.rank)
        x, y = ds.x_train[start:stop], ds.y_train[start:stop]
        batches = [idx for epoch in range(1, 100)
                   for idx in shards.epoch_batches(len(y), 100, 0, workers.rank, epoch)]
        alone = workers.size == 1
        t_grad = t_ar = t_apply = 0.0
        for i in range(steps + 20):
            if i == 20:  # warm-up done (tracing, caches)
                workers.barrier()
                t_grad = t_ar = t_apply = 0.0
                t0 = time.perf_counter()
            idx = batches[i % len(batches)]
            a = time.perf_counter()
            if alone:
                replica.train_step(x[idx], y[idx])
                b = c = time.perf_counter()
            else:
                g, _, _ = replica.grad(x[idx], y[idx], scale=1.0 / workers.size)  # as the trainer
                b = time.perf_counter()
                workers.allreduce_sum_(g)
                c = time.perf_counter()
                replica.apply(g)
            d = time.perf_counter()
            t_grad, t_ar, t_apply = t_grad + b - a, t_ar + c - b, t_apply + d - c
        elapsed = time.perf_counter() - t0
        # the allreduce's own cost: back-to-back after a barrier, nobody is late
        workers.barrier()
        g = np.zeros(replica.n_params, np.float32)
        t1 = time.perf_counter()
        for _ in range(200):
            workers.allreduce_sum_(g)
        transfer = (time.perf_counter() - t1) / 200
        # cost of one evaluation report (what keeps rank 0's model current)
        e0 = time.perf_counter()
        w = replica.weights()
        checksum(w)
        e1 = time.perf_counter()
        result = {"step_ms": 1e3 * elapsed / steps, "grad_ms": 1e3 * t_grad / steps,
                  "allreduce_ms": 1e3 * t_ar / steps, "apply_ms": 1e3 * t_apply / steps,
                  "report_ms": 1e3 * (e1 - e0), "shard": len(y),
                  "transfer_ms": 1e3 * transfer if not alone else 0.0}
    results = comm.allgather_objects(result)
    if comm.rank == 0:
        rows = [r for r in results if r]
        keys = rows[0].keys()
        print(json.dumps({k: float(np.mean([r[k] for r in rows])) for k in keys}))
    comm.barrier()


def main(argv=None, out=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench sync_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="200 steps at -np 1 and 3 (smoke)")
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    if args.rank_side:
        on_every_rank(rank_side, steps, mnist_dir())
        return {}
    rows = []
    for np_ in (1, 3) if args.quick else (1, 2, 3, 4):
        r = last_json_line(mpirun(np_, ["-m", "bench.sync_step", "--rank-side",
                                        "--steps", str(steps)]).stdout)
        workers = max(1, np_ - 1)
        epoch_steps = -(-int(r["shard"]) // 100)
        rows.append({"np": np_, "workers": workers, "step_ms": round(r["step_ms"], 3),
                     "grad_ms": round(r["grad_ms"], 3),
                     "allreduce_ms": round(r["allreduce_ms"], 3),
                     "apply_ms": round(r["apply_ms"], 3),
                     "allreduce_share": round(r["allreduce_ms"] / r["step_ms"], 3),
                     "transfer_ms": round(r["transfer_ms"], 4),
                     "transfer_share": round(r["transfer_ms"] / r["step_ms"], 4),
                     "us_per_example": round(1e3 * r["step_ms"] / (100 * workers), 2),
                     "eval_report_share_of_epoch": round(
                         r["report_ms"] / (epoch_steps * r["step_ms"]), 5)})
    path = (out or out_dir()) / "sync_step.csv"
    write_csv(path, rows)
    print(table(rows, list(rows[0])))
    single = rows[0]["step_ms"]
    print()
    for row in rows[1:]:
        line = (f"-np {row['np']} ({row['workers']} worker(s)): sync step / single-node step = "
                f"{row['step_ms'] / single:.2f}, per example "
                f"{row['us_per_example'] / rows[0]['us_per_example']:.2f}x")
        if row["workers"] > 1:
            share, total = row["transfer_share"], row["allreduce_share"]
            verdict = "met" if share <= TARGET_ALLREDUCE_SHARE else "SHORT"
            line += (f"; allreduce transfer {100 * share:.1f}% of a step (target <= 10%: "
                     f"{verdict}); time in the allreduce call incl. waiting for the slower "
                     f"worker {100 * total:.1f}%")
        else:
            line += "; no allreduce (one worker: rank 0 does not join the step)"
        print(line)
    print(f"\nresults: {path}")
    return {"checks": [
        {"benchmark": "sync_step", "ratio": f"allreduce transfer share of a sync LR step, "
         f"-np {r['np']}", "value": r["transfer_share"], "target": "<= 0.10",
         "met": r["transfer_share"] <= TARGET_ALLREDUCE_SHARE}
        for r in rows if r["workers"] > 1] + [
        {"benchmark": "sync_step", "ratio": f"sync LR step / single-node step, -np {r['np']}",
         "value": round(r["step_ms"] / single, 3), "target": "reported", "met": None}
        for r in rows[1:]]}


if __name__ == "__main__":
    main()  # returns the checks for bench/__main__.py; exit status 0
