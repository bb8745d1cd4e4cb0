"""Async engines side by side: mpitrain's parameter server vs TensorFlow's
ParameterServerStrategy, on LR and LeNet.

Two workers each (mpitrain at -np 3: rank 0 is the server; PSS: a coordinator,
one parameter server and two workers over gRPC on localhost), the same model,
data, per-worker batch, number of applied updates and (unscaled) learning rate.
Epoch time excludes process start-up on both sides. Target: mpitrain <= 0.5x
PSS's epoch time at equal accuracy (within 1 pp). PSS runs as TensorFlow ships
and with oneDNN's kernels, which mpitrain uses (once where they are one configuration:
see ``bench engines``). LR runs 5
epochs, LeNet 2; mpitrain's runs share one launch.

    python -m bench async_engines [--quick]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .common import bench_parser, out_dir, print_checks, table, write_csv
from .engines import as_shipped_and_onednn, comparison, engine_row, mpitrain_runs

CASES = {
    "lr": (["--epochs", "5", "--batch-size", "100"],
           ["--epochs", "5", "--batch-size", "100", "--optimizer", "sgd", "--lr", "0.5"]),
    "lenet": (["--epochs", "2", "--batch-size", "64"],
              ["--epochs", "2", "--batch-size", "64", "--optimizer", "adam", "--lr", "0.001",
               "--lr-schedule", "cosine"]),
}
TARGET = 0.5


def main(argv=None, out=None) -> dict:
    parser = bench_parser("async_engines", __doc__)
    parser.add_argument("--models", help="default lr,lenet; with --quick, lr")
    args = parser.parse_args(argv)
    out = out or out_dir()
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        models = (args.models or ("lr" if args.quick else "lr,lenet")).split(",")
        # mpitrain's runs share a launch (start-up paid once; each timed from its first step)
        # (plain async SGD, as ParameterServerStrategy's: no staleness compensation)
        ours = mpitrain_runs({model: CASES[model][0] for model in models}, args.quick,
                             Path(tmp), "--async", "--staleness-compensation", "none")
        for model in models:
            mine, theirs = ours[model], CASES[model][1]
            rows.append(engine_row(model, "mpitrain-async", mine))
            for name, pss in as_shipped_and_onednn("ParameterServerStrategy", "ps", model,
                                                   theirs, args.quick).items():
                rows.append(engine_row(model, name, pss))
                checks += comparison("async_engines", f"{model}: mpitrain async / {name}",
                                     mine, pss, TARGET, 1, args.quick)
    write_csv(out / "async_engines.csv", rows)
    print(table(rows, list(rows[0])))
    print_checks(checks)
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
