"""mpitrain.horovod against real Horovod and against mpitrain's own CLI: Horovod's
synthetic benchmark (images/s per rank and in total) on LeNet, ResNet-20 and AlexNet
32x32, at -np 2 (and 3 with ``--np 2,3``: it doubles the run).

Four sides per rank count, each one ``mpirun`` launch that runs every model in turn
(start-up, mpirun and TensorFlow's import on every rank, paid once per side instead of
once per model):

* ``horovod``: Horovod 0.28.1 (its last release) in .venv-horovod, TensorFlow 2.18;
* ``mpitrain.horovod-tf2.18``: mpitrain.horovod in the same environment;
* ``mpitrain.horovod``: mpitrain.horovod on the newest TensorFlow (.venv, 2.21);
* ``cli``: ``python -m mpitrain MODEL`` with as many workers (``-np N+1``: rank 0
  serves), synthetic data, the same batch; images/s from its steady epochs
  (timing.csv, the epochs between the first and the last). The models' runs share one
  launch through :func:`bench.common.train_many`, each a whole run of the CLI's own
  entry point with its own results. (Its sync server lowers its priority during a run
  and restores it after, which needs root or RLIMIT_NICE: without them only a launch's
  last run would defer to the workers, and the earlier models' figures would change.
  This host runs the benchmark as root.)

The order: for each rank count, ``--rounds`` rounds (default 1); a round runs the four
sides one after another in the order above (never two at once), and each side's launch
times the models in ``--models`` order (LeNet, ResNet-20, AlexNet), so every side's
figure of a model follows the same models in its process. A model's four figures are
therefore not back to back: a whole launch of every model (about 50 s at -np 2)
separates two sides' figures of it. With several rounds each model keeps its median
round per side.

The first three run bench/horovod_step.py, Horovod's tensorflow2_synthetic_benchmark.py
in shape: one fixed batch of 64 per rank, a ``tf.function`` step with a
DistributedGradientTape and the model's optimizer (mpitrain's per-model default), the
variables broadcast after the first step, warm-up steps, then timed iterations of a
few steps each (each model from its own first step: its docstring says what the
models of one process share); rank 0 reports the mean images/s of a rank and x ranks
in total. Every side runs oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1), ``mpirun
--bind-to none``, and TensorFlow's threads as mpitrain.horovod's init sets them (the
host's cores shared among its ranks, one inter-op thread; the Horovod side sets the
same itself).

Targets (issue 42): mpitrain.horovod's total images/s >= 1.5x Horovod's on LeNet and
ResNet-20 and >= 1.0x on AlexNet (the same environment, TensorFlow 2.18), and within
10% of the CLI's on the same model (``mpitrain.horovod`` / ``cli`` >= 0.9, TensorFlow
2.21).

    python -m bench horovod_api [--quick] [--models LIST] [--np LIST] [--rounds N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from .common import (LOCAL_HOSTFILE, REPO, bench_parser, horovod_python, mpi_env, out_dir,
                     print_checks, steady_epoch_seconds, table, train_many, write_csv)

BATCH = 64
#: model: (image side or None for the model's own, warm-up steps, iterations, steps each)
CASES = {"lenet": (None, 10, 10, 10), "resnet": (None, 5, 5, 5), "alexnet": (32, 3, 4, 3)}
QUICK = (1, 1, 2)
#: steps per epoch of the CLI's runs (three epochs: one steady one between)
CLI_STEPS = {"lenet": 40, "resnet": 10, "alexnet": 5}
TARGET_HOROVOD = {"lenet": 1.5, "resnet": 1.5, "alexnet": 1.0}
TARGET_CLI = 0.9
SIDES = ("horovod", "mpitrain.horovod-tf2.18", "mpitrain.horovod", "cli")


def step_side(side: str, models: List[str], np_: int, quick: bool) -> Dict[str, dict]:
    """One bench/horovod_step.py job timing every model in turn: each model's JSON line
    (images/s per rank and in total), by model."""
    cases = [CASES[model] for model in models]
    image = [c[0] or 0 for c in cases]
    counts = [QUICK if quick else c[1:] for c in cases]  # warm-up, iterations, steps each
    python = sys.executable if side == "mpitrain.horovod" else horovod_python()
    api = "horovod" if side == "horovod" else "mpitrain"
    cmd = ["mpirun", "-q", "--bind-to", "none", "-np", str(np_), "-hostfile",
           str(LOCAL_HOSTFILE), python, str(REPO / "bench" / "horovod_step.py"),
           "--api", api, "--model", ",".join(models), "--batch-size", str(BATCH),
           "--image-size", listed(image), "--warmup", listed(c[0] for c in counts),
           "--iters", listed(c[1] for c in counts),
           "--batches-per-iter", listed(c[2] for c in counts)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                            timeout=3600 * len(models),
                            env={**mpi_env(), "TF_ENABLE_ONEDNN_OPTS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stderr[-2000:]}")
    found = {line["model"]: line for line in json_lines(result.stdout)}
    if set(found) != set(models):
        raise RuntimeError(f"{' '.join(cmd)}: results for {sorted(found)}, not {models}:\n"
                           f"{result.stdout[-2000:]}")
    return found


def listed(values) -> str:
    return ",".join(map(str, values))


def json_lines(text: str) -> List[dict]:
    """Every line of ``text`` that is a JSON object (rank 0's one per model)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def cli_side(models: List[str], np_: int, quick: bool, results: Path) -> Dict[str, dict]:
    """mpitrain's CLI with ``np_`` workers on each model and the same batch, the models'
    runs in one launch: images/s, by model."""
    steps = {model: 2 if quick else CLI_STEPS[model] for model in models}
    runs = {model: [model, "--dataset", "synthetic", "--batch-size", BATCH, "--epochs", 3,
                    "--synthetic-size", np_ * BATCH * steps[model], "--eval-every", 100,
                    *(["--image-size", CASES[model][0]] if CASES[model][0] else [])]
            for model in models}
    found = train_many(np_ + 1, runs, results)
    got = {}
    for model in models:
        epoch = steady_epoch_seconds(found[model]["run_dir"])
        total = np_ * BATCH * steps[model] / epoch
        got[model] = {"img_sec_per_rank": total / np_, "img_sec_total": total,
                      "img_sec_conf": None, "tensorflow": "", "steady_epoch_s": epoch}
    return got


def run_side(side: str, models: List[str], np_: int, quick: bool,
             results: Path) -> Dict[str, dict]:
    """One side's launch: every model's result, by model."""
    if side == "cli":
        return cli_side(models, np_, quick, results)
    return step_side(side, models, np_, quick)


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
    rows, checks_by = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for np_ in counts:
            # a round: every side once, each side's launch timing every model in turn
            rounds = [{side: run_side(side, models, np_, args.quick,
                                      Path(tmp) / f"{side}-{np_}-{r}")
                       for side in SIDES} for r in range(1 if args.quick else args.rounds)]
            for model in models:
                got = {side: median_of([r[side][model] for r in rounds]) for side in SIDES}
                for side in SIDES:
                    m = got[side]
                    rows.append({"model": model, "np": np_, "side": side,
                                 "img_sec_per_rank": round(m["img_sec_per_rank"], 1),
                                 "img_sec_total": round(m["img_sec_total"], 1),
                                 "conf_95": (None if m.get("img_sec_conf") is None
                                             else round(m["img_sec_conf"], 1)),
                                 "tensorflow": m.get("tensorflow", ""),
                                 "rounds": " ".join(
                                     f"{r[side][model]['img_sec_total']:.1f}"
                                     for r in rounds)})
                checks_by[model, np_] = checks_of(model, np_, got, args.quick)
    # by model, then rank count (the table's order since before the launches were shared)
    order = [(model, np_) for model in models for np_ in counts]
    rows.sort(key=lambda row: order.index((row["model"], row["np"])))
    checks = [check for case in order for check in checks_by[case]]
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
