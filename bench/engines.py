"""Sync engines side by side: mpitrain's MPI allreduce vs Horovod vs TensorFlow's
MultiWorkerMirroredStrategy, on LR, LeNet and AlexNet (small images).

Like with like: every judged ratio compares two engines on the same TensorFlow.
Horovod 0.28.1 builds only against TensorFlow 2.18, so the Horovod engine
(mpitrain with ``--allreduce horovod``) runs in setup.sh's Horovod environment,
and so does the MPI engine it is judged against ("mpi-horovod-env": the same
code, kernels and TensorFlow, only the exchange differs). MWMS runs in mpitrain's
own environment and is judged against mpitrain there ("mpi"). The ratio of each
engine on its own stack (mpi on mpitrain's TensorFlow / Horovod on 2.18), what a
user who installs each gets, is reported beside them, labelled, and judged
nowhere: most of it is the TensorFlow version, not the exchange.

Two workers each (mpitrain at -np 3: rank 0 is the parameter server and does not
take part in the gradient allreduce; MWMS: two worker processes over gRPC on
localhost), the same model, data, per-worker batch, global batch, epochs,
optimizer, (linearly scaled) learning rate and schedule, and one evaluation at
the end. Epoch time is training time / epochs: from the first step (its tracing,
or XLA's compilation, included) to the last update on every side, process
start-up and the final evaluation excluded (``after_last_step_s`` shows the
latter: ours with the final checkpoint). mpitrain runs as it does by default
(graph-mode steps) but for the sync warm-up, which the baselines do not have;
``--xla`` adds a run with ``--compile xla`` (left out of ``bench all``: with
oneDNN's kernels XLA's own are slower; docs/architecture.md, "XLA only on
request"). Ratios (issue 15's targets): mpi / horovod <= 0.6 and mpi / MWMS <= 0.9
on all three, for each mpitrain run; accuracy within 0.5 pp. Beside each ratio,
its floor: our workers' compute time alone (timing.csv) over the other engine's
epoch time, the ratio an exchange that cost nothing would give with the same
kernels.
LR runs 5 epochs, LeNet 2, AlexNet one of 640 synthetic images. AlexNet runs
``ROUNDS`` (2) interleaved rounds, every side once a round, and each side keeps its
faster run (the median of two taken low: ``rounds_s`` lists every round's epoch time).
A round runs each environment's mpitrain runs of its models in one launch per engine
(start-up paid once; each run timed from its first step), then MWMS's.

mpitrain runs TensorFlow with oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS=1; its wheels
turn them on only on AVX-512 VNNI/AMX CPUs), in both environments. MWMS runs as
TensorFlow ships ("mwms") and with the same kernels as mpitrain ("mwms-onednn"),
so the ratios show what the kernels gain and what the engine does; where
TensorFlow's default already runs oneDNN's kernels (AVX-512 VNNI/AMX CPUs) the two
are one configuration, run once as "mwms".

    python -m bench engines [--quick] [--models LIST] [--xla]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from .common import (REPO, bench_parser, horovod_python, mnist_dir, mpi_env, out_dir,
                     print_checks, table, timing, train_many, write_csv)

WORKERS = 2
#: model: (the data and epochs both sides get, the optimizer, one worker's learning
#: rate, the schedule). mpitrain is given them as options (so a change of its defaults
#: cannot make the sides differ) and scales the rate linearly by the workers; the
#: baseline is given the scaled rate (tf_baselines.py uses its rate as given)
ALGORITHMS = {
    "lr": (["--epochs", "5", "--batch-size", "100"], "sgd", 0.5, "cosine"),
    "lenet": (["--epochs", "2", "--batch-size", "64"], "adam", 0.001, "cosine"),
    "alexnet": (["--epochs", "1", "--batch-size", "32", "--image-size", "32",
                 "--synthetic-size", "640"], "momentum", 0.01, "constant"),
}


def both_sides(data: List[str], optimizer: str, lr: float, schedule: str,
               workers: int = WORKERS, scale: bool = True) -> tuple:
    """(mpitrain's options, tf_baselines.py's) for one case: the same data, epochs,
    batch, optimizer and schedule; mpitrain given one worker's rate, which it scales
    linearly (sync), the baseline the rate mpitrain ends up with (``scale``: False
    for async, where neither side scales)."""
    algorithm = ["--optimizer", optimizer, "--lr-schedule", schedule]
    theirs = lr * workers if scale else lr
    return ([*data, *algorithm, "--lr", str(lr)], [*data, *algorithm, "--lr", f"{theirs:g}"])


#: model: (mpitrain options, tf_baselines options)
CASES = {model: both_sides(*spec) for model, spec in ALGORITHMS.items()}
QUICK = {"lr": ["--steps", "20"], "lenet": ["--steps", "10"], "alexnet": ["--steps", "2"]}
#: interleaved rounds per model (every side once a round), each side's median kept
#: (the lower of an even count): AlexNet's 1-epoch runs move between single rounds as
#: much as the gap to its target (docs/benchmarks.md, "Known limits")
ROUNDS = {"lr": 1, "lenet": 1, "alexnet": 2}
TARGET_HOROVOD = 0.6
TARGET_MWMS = 0.9


def tf_baseline(strategy: str, model: str, args, quick: bool, onednn: bool = False,
                timeout=3600) -> dict:
    """Run bench/tf_baselines.py (TensorFlow alone) and return its JSON result.

    ``onednn``: with TF_ENABLE_ONEDNN_OPTS=1, the kernels mpitrain runs TensorFlow
    with; else TensorFlow's own default (oneDNN only on CPUs with AVX-512 VNNI/BF16
    or AMX), as a user of the strategy gets it without setting anything."""
    env = mpi_env()
    if onednn:
        env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    else:
        env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        extra = ["--steps", QUICK[model][1]] if quick else []
        cmd = [sys.executable, str(REPO / "bench" / "tf_baselines.py"), "--strategy", strategy,
               "--model", model, "--workers", str(WORKERS), "--data-dir", mnist_dir(),
               "--json-out", str(out), *args, *extra]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        for line in result.stderr.splitlines():  # a cluster started again, say
            if line.startswith("tf_baselines: note:"):
                print(line, flush=True)
        return json.loads(out.read_text())


def as_shipped_and_onednn(name: str, strategy: str, model: str, options: List[str],
                          quick: bool) -> Dict[str, dict]:
    """A TensorFlow baseline (tf_baselines.py's ``strategy``, given ``options``) as
    TensorFlow ships it (``name``) and with oneDNN's kernels (``name-onednn``); only the
    first where TensorFlow's default already runs them on this CPU (its result says
    ``onednn``): the second would be the same configuration, run again."""
    shipped = tf_baseline(strategy, model, options, quick)
    found = {name: shipped}
    if shipped["onednn"]:
        print(f"{model}: {name}-onednn not run: TensorFlow as shipped already runs "
              "oneDNN's kernels on this CPU (the same configuration)", flush=True)
    else:
        found[f"{name}-onednn"] = tf_baseline(strategy, model, options, quick, onednn=True)
    return found


#: mpitrain's options that make it run the baselines' algorithm: no warm-up of the sync
#: rate (the TensorFlow, Horovod and PyTorch baselines scale it without one)
LIKE_THE_BASELINES = ["--warmup-epochs", "0"]


def mpitrain_runs(cases: Dict[str, List[str]], quick: bool, results: Path, *extra,
                  python: str = sys.executable) -> Dict[str, dict]:
    """One mpitrain run with two workers of each case in ``cases`` ({name: its
    options}; a name is its model, or MODEL+VARIANT), all in one launch (start-up paid
    once; each run is timed from its first step), by name. Each evaluates once, at the
    end, like the TensorFlow baselines (by default it would evaluate every epoch); its
    wall time, like theirs, runs to the last update, and ``after_last_step_s`` is the
    rest (our final evaluation and checkpoint: runs.csv's ``finish_s``; theirs:
    evaluation)."""
    runs = {}
    for name, args in cases.items():
        model = name.split("+")[0]
        runs[name] = [model, *args, *(QUICK[model] if quick else []), "--data-dir",
                       mnist_dir(), "--eval-every", args[args.index("--epochs") + 1],
                       *LIKE_THE_BASELINES, *extra]
    found = train_many(WORKERS + 1, runs, results, python=python)
    return {name: measured_run(row) for name, row in found.items()}


def measured_run(row: Dict[str, str]) -> dict:
    """An mpitrain run's figures from its runs.csv row and files."""
    epochs = float(row["epochs"])
    ranks = json.loads((Path(row["run_dir"]) / "config.json").read_text())["ranks"]
    return {"wall_time_s": float(row["wall_time_s"]),
            "epoch_time_s": float(row["wall_time_s"]) / epochs,
            "compute_epoch_s": compute_seconds(row["run_dir"]) / epochs,
            "test_accuracy": float(row["test_accuracy"]), "epochs": epochs,
            "after_last_step_s": float(row["finish_s"]),
            "onednn": all(rank.get("onednn") for rank in ranks),
            "tensorflow": ranks[0].get("tensorflow", "")}


def compute_seconds(run_dir: str) -> float:
    """The workers' mean seconds computing (gradients and updates, the first step's
    tracing included) over a run, from its timing.csv: its training time if the
    exchange and every wait cost nothing, so compute / another engine's time is the
    lowest ratio any exchange could reach with these kernels."""
    rows = timing(run_dir, ("worker", "single"))
    return float(rows["compute_s"].sum()) / len(rows.values("rank"))  # mean over ranks


def engine_row(model: str, engine: str, m: dict, **extra) -> dict:
    """One CSV row of an engine's measurement (``onednn``: TensorFlow ran oneDNN's kernels)."""
    return {"model": model, "engine": engine, **extra,
            "epoch_time_s": round(m["epoch_time_s"], 4), "wall_time_s": round(m["wall_time_s"], 3),
            "compute_epoch_s": round(m["compute_epoch_s"], 4) if "compute_epoch_s" in m else None,
            "after_last_step_s": m.get("after_last_step_s", m.get("eval_s")),
            "test_accuracy": round(m["test_accuracy"], 4), "onednn": m.get("onednn"),
            "tensorflow": m.get("tensorflow", ""), "rounds_s": m.get("rounds_s", "")}


def median_round(runs: list) -> dict:
    """The run with the median epoch time, the lower one of an even count (all of its
    numbers: its compute, accuracy...), with every round's epoch time as ``rounds_s``."""
    ranked = sorted(runs, key=lambda m: m["epoch_time_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "rounds_s": " ".join(f"{m['epoch_time_s']:.3f}" for m in runs)}


def comparison(benchmark: str, label: str, ours: dict, theirs: dict, time_target: float,
               accuracy_pp: float, quick: bool) -> list:
    """The checks of one comparison: epoch-time ratio; its floor, the ratio had our
    exchange and waits cost nothing (:func:`compute_seconds`); and accuracy gap (not
    judged in quick mode, where a few steps say nothing about accuracy). Each label
    ends with the TensorFlow both sides ran; ``time_target`` None (sides on different
    TensorFlow versions: not like with like) reports the ratios and judges nothing."""
    ratio = round(ours["epoch_time_s"] / theirs["epoch_time_s"], 3)
    floor = round(ours["compute_epoch_s"] / theirs["epoch_time_s"], 3)
    gap = round(100 * (ours["test_accuracy"] - theirs["test_accuracy"]), 2)
    stack = stack_label(ours, theirs)
    judged = time_target is not None
    return [{"benchmark": benchmark, "ratio": f"{label} epoch time{stack}", "value": ratio,
             "target": f"<= {time_target}" if judged else "reported",
             "met": ratio <= time_target if judged else None},
            {"benchmark": benchmark, "ratio": f"{label} epoch time's floor: our workers' "
             f"compute alone / theirs{stack}", "value": floor, "target": "reported",
             "met": None},
            {"benchmark": benchmark, "ratio": f"{label} test accuracy difference (pp){stack}",
             "value": gap, "target": f"within {accuracy_pp}" if judged else "reported",
             "met": None if quick or not judged else abs(gap) <= accuracy_pp}]


def stack_label(ours: dict, theirs: dict) -> str:
    """' (same TensorFlow, V)', or ' (each on its own stack: TensorFlow V1 / V2)'."""
    mine, other = ours.get("tensorflow", ""), theirs.get("tensorflow", "")
    if mine == other:
        return f" (same TensorFlow, {mine})" if mine else ""
    return f" (each on its own stack: TensorFlow {mine} / {other})"


def engine_round(cases: Dict[str, List[str]], quick: bool, tmp: Path, r: int) -> dict:
    """One round of mpitrain's engines, one launch each ({engine: {model: run}}): the MPI
    engine in mpitrain's environment ("mpi"), and in setup.sh's Horovod environment
    (TensorFlow 2.18, which Horovod builds against) the MPI engine ("mpi-horovod-env")
    and the Horovod engine ("horovod"): these two differ in the exchange alone."""
    hvd = horovod_python()
    return {"mpi": mpitrain_runs(cases, quick, tmp / f"mpi-{r}"),
            "mpi-horovod-env": mpitrain_runs(cases, quick, tmp / f"mpi-hvdenv-{r}", python=hvd),
            "horovod": mpitrain_runs(cases, quick, tmp / f"hvd-{r}", "--allreduce", "horovod",
                                     python=hvd)}


def engine_checks(model: str, measured: Dict[str, dict], quick: bool) -> list:
    """The comparisons of one model: judged only between engines on the same TensorFlow
    (mpi / horovod both in the Horovod environment; mpi and mpi-xla / MWMS in mpitrain's),
    and, reported beside them, each engine on its own stack (mpi / horovod as installed)."""
    pairs = [("mpi-horovod-env", "mpi", "horovod", TARGET_HOROVOD)]
    for ours_as in [e for e in ("mpi", "mpi-xla") if e in measured]:
        pairs.append((ours_as, ours_as, "horovod", None))
        pairs += [(ours_as, ours_as, engine, TARGET_MWMS)
                  for engine in ("mwms", "mwms-onednn") if engine in measured]
    checks = []
    for ours, shown, engine, target in pairs:
        if ours in measured and engine in measured:
            checks += comparison("engines", f"{model}: {shown} / {engine}", measured[ours],
                                 measured[engine], target, 0.5, quick)
    return checks


def main(argv=None, out=None) -> dict:
    parser = bench_parser("engines", __doc__)
    parser.add_argument("--models", help="default lr,lenet,alexnet; with --quick, lr (the "
                        "smoke: every engine once)")
    parser.add_argument("--xla", action="store_true", help="also run mpitrain --compile xla")
    args = parser.parse_args(argv)
    out = out or out_dir()
    rows, checks = [], []
    models = (args.models or ("lr" if args.quick else "lr,lenet,alexnet")).split(",")
    with tempfile.TemporaryDirectory() as tmp:
        rounds = {model: [] for model in models}
        for r in range(1 if args.quick else max(ROUNDS[m] for m in models)):
            here = [m for m in models if args.quick or r < ROUNDS[m]]
            ours = {model: CASES[model][0] for model in here}
            found = engine_round(ours, args.quick, Path(tmp), r)
            for model in here:
                rounds[model].append({**{engine: runs[model] for engine, runs in found.items()},
                                      **as_shipped_and_onednn("mwms", "mwms", model,
                                                              CASES[model][1], args.quick)})
        for model in models:
            measured = {engine: median_round([r[engine] for r in rounds[model]])
                        for engine in rounds[model][0]}
            if args.xla and not args.quick:  # a few steps say nothing of XLA, and its
                # compilation would double the smoke run's mpitrain time
                measured["mpi-xla"] = mpitrain_runs({model: CASES[model][0]}, False,
                                                    Path(tmp) / f"{model}-xla", "--compile",
                                                    "xla")[model]
            rows += [engine_row(model, engine, m, workers=WORKERS)
                     for engine, m in measured.items()]
            checks += engine_checks(model, measured, args.quick)
    write_csv(out / "engines.csv", rows)
    print(table(rows, list(rows[0])))
    print_checks(checks)
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
