"""--compression fp16, powersgd and topk against float32 gradients on the emulated 3-node
cluster2 with 1 GbE links: LeNet (sync 1 epoch, async 3 epochs, of the real MNIST) and
AlexNet (sync, 32x32 synthetic images, a few steps): epoch time compressed / not, side
by side, and the test accuracy difference (LeNet; AlexNet's synthetic labels are noise);
and LeNet sync at 10 GbE, where the link does not bind (the crossover: what compression
costs, reported). PowerSGD (rank 2) and top-k (1%) run at their defaults but without the
sync warm-up steps, so every step is compressed: their sync accuracy here is the
no-warm-up case's. ``compute_s_per_epoch``: the workers' seconds computing (their
timing.csv), what an epoch would take if the exchange cost nothing: a compression's
epoch time over fp16's cannot go below its compute over fp16's time (the floor printed
beside the target). ``mpi_mb`` counts every byte the run moved through MPI, its final
checkpoint included, which under compression carries each worker's residual.

And PowerSGD side by side with PyTorch DDP's ``powerSGD_hook`` on the same cluster,
model, rank and link (:mod:`bench.ddp_powersgd`; AlexNet, LeNet in quick mode).

Async accuracy moves from run to run with the order in which stale gradients land
(1-epoch LeNet runs spread up to 4 pp), so async is measured as 2 interleaved
pairs of 3-epoch runs (the order swapped in the second: ABBA) and compared by their means;
each side's spread is printed beside them. Sync runs are repeatable: one pair. The runs
of one link share one launch (start-up paid once; each is timed from its first step).

    python -m bench compression [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from . import ddp_powersgd
from .common import bench_parser, mnist_dir, out_dir, table, train_many, write_csv
from .engines import compute_seconds
from .netns import Skipped, emulated_cluster, per_epoch, skipped

#: (link, model, mode, options, interleaved pairs); LeNet at 10 GbE is the crossover:
#: where the link does not bind, compression's own computing is not repaid
RUNS = [("1gbit", "lenet", "sync", ["--epochs", "1"], 1),
        ("1gbit", "lenet", "async", ["--epochs", "3"], 2),
        ("1gbit", "alexnet", "sync", ["--image-size", "32", "--steps", "8"], 1),
        ("10gbit", "lenet", "sync", ["--epochs", "1"], 1)]
LINKS = {"1gbit": "1 GbE", "10gbit": "10 GbE"}
QUICK = {"lenet": ["--steps", "10"], "alexnet": ["--steps", "2"]}
#: each compression's own options
OPTIONS = {"none": [], "fp16": [], "powersgd": ["--compression-warmup-steps", "0"],
           "topk": ["--compression-warmup-steps", "0"]}
#: how the sync runs wait in the allreduce: the emulated nodes share this machine's
#: cores, which --allreduce-wait auto cannot see (each node has a hostname of its own),
#: so it would spin, on a core another node's worker computes on; float16's and
#: top-k's exchanges always poll, and a spinning float32 baseline alone would be slowed
POLL = ["--allreduce-wait", "poll"]
#: the async runs take no warm-up option (async pushes compress from the first)
ASYNC_OPTIONS = {"powersgd": [], "topk": []}
ACCURACY_TARGET = 0.5  # pp
#: PowerSGD's and top-k's step at most this much of fp16's where the link is the
#: bottleneck (AlexNet)
LOW_TRAFFIC_TARGET = 0.6


def compressions(mode: str, pair: int) -> tuple:
    """What a pair of runs compares, in its order (the second pair reversed: ABBA)."""
    names = tuple(OPTIONS)
    return names if pair % 2 == 0 else names[::-1]


def options_of(mode: str, compression: str) -> list:
    return ASYNC_OPTIONS.get(compression, []) if mode == "async" else OPTIONS[compression]


def main(argv=None, out=None) -> dict:
    args = bench_parser("compression", __doc__, "LeNet sync at 1 GbE, a few steps (smoke)"
                        ).parse_args(argv)
    runs = RUNS[:1] if args.quick else RUNS
    out = out or out_dir()
    rows, ddp_rows, checks = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for link in dict.fromkeys(run[0] for run in runs):
                with emulated_cluster(link) as cluster:
                    found, beside = on_the_cluster(link, runs, args.quick, Path(tmp), cluster)
                    if beside:  # DDP beside, on the same cluster
                        ddp_rows, checks = ddp_powersgd.rows_and_checks(
                            beside, args.quick, Path(tmp))
                rows += [row_of(key, row) for key, row in found.items()]
        except Skipped as why:
            return skipped("compression", why)
    write_csv(out / "compression.csv", rows)
    print(table(rows, list(rows[0])))
    if ddp_rows:
        write_csv(out / "compression_ddp.csv", ddp_rows)
        print(table(ddp_rows, list(dict.fromkeys(k for r in ddp_rows for k in r))))
    for link, model, mode, _, _ in runs:
        checks += checks_of(link, model, mode, rows)
    return {"rows": rows, "checks": checks}


def on_the_cluster(link: str, runs, quick: bool, tmp: Path, cluster: dict) -> tuple:
    """``runs``' runs at ``link`` in one launch (start-up paid once, each run timed from
    its first step), at 1 GbE with mpitrain's side of DDP's comparison: ({(link, model,
    mode, pair, compression): runs.csv row}, {compression: the DDP comparison's row})."""
    in_order = {(link, model, mode, pair, compression): [
        model, *options, *(QUICK[model] if quick else []), "--compression", compression,
        *options_of(mode, compression), "--data-dir", mnist_dir(),
        *(["--async"] if mode == "async" else POLL)]
        for at, model, mode, options, pairs in runs if at == link
        for pair in range(1 if quick else pairs)
        for compression in compressions(mode, pair)}
    beside = ddp_powersgd.mpitrain_runs(quick) if link == "1gbit" else {}
    found = train_many(4, {**{"-".join(map(str, key)): run_args
                              for key, run_args in in_order.items()},
                           **{f"beside-ddp-{name}": run_args
                              for name, run_args in beside.items()}}, tmp / link, **cluster)
    return ({key: found["-".join(map(str, key))] for key in in_order},
            {name: found[f"beside-ddp-{name}"] for name in beside})


def row_of(key: tuple, row: dict) -> dict:
    link, model, mode, pair, compression = key
    epochs = float(row["epochs"])
    return {"link": link, "model": model, "mode": mode, "pair": pair + 1,
            "compression": compression, "s_per_epoch": per_epoch(row),
            "compute_s_per_epoch": round(compute_seconds(row["run_dir"]) / epochs, 4),
            "test_accuracy": float(row["test_accuracy"]),
            "mpi_mb": round(float(row["mpi_bytes"]) / 1e6, 1)}


def checks_of(link: str, model: str, mode: str, rows) -> list:
    """Each compression's epoch time over float32's (PowerSGD's and top-k's over fp16's
    too) and, for LeNet at 1 GbE, its test accuracy's difference. At 10 GbE the times
    are reported: the crossover, where compressing does not pay."""
    by = {name: [r for r in rows if (r["link"], r["model"], r["mode"], r["compression"])
                 == (link, model, mode, name)] for name in OPTIONS}
    plain, checks, at = by["none"], [], LINKS[link]
    judged_link = link == "1gbit"

    def check(ratio, value, target, met):
        checks.append({"benchmark": "compression", "ratio": f"{model} {mode} {ratio}",
                       "value": value, "target": target, "met": met})

    for name in ("fp16", "powersgd", "topk"):
        if not by[name]:
            continue
        ratio = round(mean(by[name], "s_per_epoch") / mean(plain, "s_per_epoch"), 3)
        check(f"epoch time at {at}, {name} / float32", ratio,
              "< 1" if judged_link else "reported", ratio < 1 if judged_link else None)
        if model == "lenet" and judged_link:
            gap = round(100 * (mean(by[name], "test_accuracy")
                               - mean(plain, "test_accuracy")), 2)
            if len(plain) > 1:
                print(f"{model} {mode}, {len(plain)} pairs: test accuracy float32 "
                      f"{spread(plain)}, {name} {spread(by[name])}; means differ by "
                      f"{gap:+.2f} pp")
            check(f"test accuracy, {name} - float32 (pp; mean of {len(plain)} pair(s))",
                  gap, f"within {ACCURACY_TARGET}", abs(gap) <= ACCURACY_TARGET)
    judged = model == "alexnet"  # (LeNet's gradient is too small for the link to matter)
    for name in ("powersgd", "topk"):
        if by[name] and judged_link:
            fp16 = mean(by["fp16"], "s_per_epoch")
            ratio = round(mean(by[name], "s_per_epoch") / fp16, 3)
            floor = round(mean(by[name], "compute_s_per_epoch") / fp16, 3)
            check(f"epoch time at {at}, {name} / fp16 (its compute alone: {floor})", ratio,
                  f"<= {LOW_TRAFFIC_TARGET}" if judged else "reported",
                  ratio <= LOW_TRAFFIC_TARGET if judged else None)
    return checks


def mean(rows, column: str) -> float:
    return statistics.fmean(r[column] for r in rows)


def spread(rows) -> str:
    """'mean% (min-max%)' of the rows' test accuracy."""
    values = [100 * r["test_accuracy"] for r in rows]
    return f"{statistics.fmean(values):.2f}% ({min(values):.2f}-{max(values):.2f}%)"


if __name__ == "__main__":
    main()
