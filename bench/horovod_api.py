"""mpitrain.horovod against real Horovod and against mpitrain's own CLI: Horovod's
synthetic benchmark (images/s per rank and in total) on LeNet, ResNet-20 and AlexNet
32x32, at -np 2 (and 3 with ``--np 2,3``: it doubles the run).

Four sides per model and rank count, run one after another:

* ``horovod``: Horovod 0.28.1 (its last release) in .venv-horovod, TensorFlow 2.18;
* ``mpitrain.horovod-tf2.18``: mpitrain.horovod in the same environment;
* ``mpitrain.horovod``: mpitrain.horovod on the newest TensorFlow (.venv, 2.21);
* ``cli``: ``python -m mpitrain MODEL`` with as many workers (``-np N+1``: rank 0
  serves), synthetic data, the same batch; images/s from its steady epochs
  (timing.csv, the epochs between the first and the last).

The first three run bench/horovod_step.py, Horovod's tensorflow2_synthetic_benchmark.py
in shape: one fixed batch of 64 per rank, a ``tf.function`` step with a
DistributedGradientTape and the model's optimizer (mpitrain's per-model default), the
variables broadcast after the first step, warm-up steps, then timed iterations of a
few steps each; rank 0 reports the mean images/s of a rank and x ranks in total. Every
side runs oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1), ``mpirun --bind-to none``, and
TensorFlow's threads as mpitrain.horovod's init sets them (the host's cores shared
among its ranks, one inter-op thread; the Horovod side sets the same itself).

Targets (issue 42): mpitrain.horovod's total images/s >= 1.5x Horovod's on LeNet and
ResNet-20 and >= 1.0x on AlexNet (the same environment, TensorFlow 2.18), and within
10% of the CLI's on the same model (``mpitrain.horovod`` / ``cli`` >= 0.9, TensorFlow
2.21).

    python -m bench horovod_api [--quick] [--models LIST] [--np LIST] [--rounds N]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from .common import (LOCAL_HOSTFILE, REPO, bench_parser, horovod_python, last_json_line,
                     mpi_env, out_dir, print_checks, steady_epoch_seconds, table, train,
                     write_csv)

BATCH = 64
#: model: (image side or None for the model's own, warm-up steps, iterations, steps each)
CASES = {"lenet": (None, 10, 10, 10), "resnet": (None, 5, 5, 5), "alexnet": (32, 3, 4, 3)}
QUICK = (1, 1, 2)
#: steps per epoch of the CLI's runs (three epochs: one steady one between)
CLI_STEPS = {"lenet": 40, "resnet": 10, "alexnet": 5}
TARGET_HOROVOD = {"lenet": 1.5, "resnet": 1.5, "alexnet": 1.0}
TARGET_CLI = 0.9
SIDES = ("horovod", "mpitrain.horovod-tf2.18", "mpitrain.horovod", "cli")


def step_side(side: str, model: str, np_: int, quick: bool) -> dict:
    """One bench/horovod_step.py job; its JSON line (images/s per rank and in total)."""
    image, warmup, iters, per_iter = CASES[model]
    if quick:
        warmup, iters, per_iter = QUICK
    python = sys.executable if side == "mpitrain.horovod" else horovod_python()
    api = "horovod" if side == "horovod" else "mpitrain"
    cmd = ["mpirun", "-q", "--bind-to", "none", "-np", str(np_), "-hostfile",
           str(LOCAL_HOSTFILE), python, str(REPO / "bench" / "horovod_step.py"), "--api", api,
           "--model", model, "--batch-size", str(BATCH), "--warmup", str(warmup), "--iters",
           str(iters), "--batches-per-iter", str(per_iter),
           *(["--image-size", str(image)] if image else [])]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600,
                            env={**mpi_env(), "TF_ENABLE_ONEDNN_OPTS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stderr[-2000:]}")
    return last_json_line(result.stdout)


def cli_side(model: str, np_: int, quick: bool, results: Path) -> dict:
    """mpitrain's CLI with ``np_`` workers on the same model and batch: images/s."""
    image = CASES[model][0]
    steps = 2 if quick else CLI_STEPS[model]
    row = train(np_ + 1, [model, "--dataset", "synthetic", "--batch-size", BATCH, "--epochs", 3,
                          "--synthetic-size", np_ * BATCH * steps, "--eval-every", 100,
                          *(["--image-size", image] if image else [])], results)
    epoch = steady_epoch_seconds(row["run_dir"])
    total = np_ * BATCH * steps / epoch
    return {"img_sec_per_rank": total / np_, "img_sec_total": total, "img_sec_conf": None,
            "tensorflow": "", "steady_epoch_s": epoch}


def run_side(side: str, model: str, np_: int, quick: bool, results: Path) -> dict:
    if side == "cli":
        return cli_side(model, np_, quick, results)
    return step_side(side, model, np_, quick)


def checks_of(model: str, np_: int, got: dict, quick: bool) -> list:
    def check(ratio, value, target="reported", met=None):  # quick: a smoke, not judged
        return {"benchmark": "horovod_api", "ratio": f"{model} -np {np_}: {ratio}",
                "value": value, "target": target, "met": None if quick else met}

    def ratio(a, b):
        return round(got[a]["img_sec_total"] / got[b]["img_sec_total"], 3)

    vs_horovod, vs_cli = ratio("mpitrain.horovod-tf2.18", "horovod"), \
        ratio("mpitrain.horovod", "cli")
    return [check("mpitrain.horovod / Horovod total images/s (TensorFlow 2.18)", vs_horovod,
                  f">= {TARGET_HOROVOD[model]}", vs_horovod >= TARGET_HOROVOD[model]),
            check("mpitrain.horovod on TensorFlow 2.21 / Horovod on 2.18, total images/s",
                  ratio("mpitrain.horovod", "horovod")),
            check("mpitrain.horovod / mpitrain CLI total images/s (TensorFlow 2.21)", vs_cli,
                  f">= {TARGET_CLI}", vs_cli >= TARGET_CLI)]


def main(argv=None, out=None) -> dict:
    parser = bench_parser("horovod_api", __doc__)
    parser.add_argument("--models", help=f"default {','.join(CASES)} (--quick: lenet)")
    parser.add_argument("--np", help="rank counts, default 2")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds (every side once a round); medians kept")
    args = parser.parse_args(argv)
    out = out or out_dir()
    models = (args.models or ("lenet" if args.quick else ",".join(CASES))).split(",")
    counts = [int(n) for n in (args.np or "2").split(",")]
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for np_ in counts:
                rounds = [{side: run_side(side, model, np_, args.quick,
                                          Path(tmp) / f"{model}-{np_}-{r}")
                           for side in SIDES} for r in range(1 if args.quick else args.rounds)]
                got = {side: median_of([r[side] for r in rounds]) for side in SIDES}
                for side in SIDES:
                    m = got[side]
                    rows.append({"model": model, "np": np_, "side": side,
                                 "img_sec_per_rank": round(m["img_sec_per_rank"], 1),
                                 "img_sec_total": round(m["img_sec_total"], 1),
                                 "conf_95": (None if m.get("img_sec_conf") is None
                                             else round(m["img_sec_conf"], 1)),
                                 "tensorflow": m.get("tensorflow", ""),
                                 "rounds": " ".join(f"{r[side]['img_sec_total']:.1f}"
                                                    for r in rounds)})
                checks += checks_of(model, np_, got, args.quick)
    write_csv(out / "horovod_api.csv", rows)
    print(table(rows, list(rows[0])))
    print_checks(checks)
    return {"rows": rows, "checks": checks}


def median_of(results: list) -> dict:
    """The round whose total images/s is the median (the lower middle one of an even
    number)."""
    ordered = sorted(results, key=lambda m: m["img_sec_total"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    main()
