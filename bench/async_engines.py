"""Async engines side by side: mpitrain's parameter server vs TensorFlow's
ParameterServerStrategy, on LR and LeNet.

Two workers each (mpitrain at -np 3: rank 0 is the server; PSS: a coordinator,
one parameter server and two workers over gRPC on localhost), both on mpitrain's
TensorFlow, the same model, data, per-worker batch, number of applied updates,
optimizer, (unscaled) learning rate and schedule, and one evaluation at the end.
Like with like, the judged run ("mpitrain-async") is PSS's algorithm: plain async
SGD (no staleness compensation), each worker with one step in flight (``--pipeline
off``: a PSS worker runs one closure at a time). mpitrain's defaults (pipelined
where the round trip is worth hiding, stale gradients compensated) are run beside
it as "mpitrain-async-defaults" and reported against PSS, judged nowhere: a
different algorithm. Epoch time excludes process start-up on both sides. Target:
mpitrain <= 0.5x PSS's epoch time at equal accuracy (within 1 pp). PSS runs as
TensorFlow ships and with oneDNN's kernels, which mpitrain uses (once where they
are one configuration: see ``bench engines``). LR runs 5 epochs, LeNet 2;
mpitrain's runs share one launch.

    python -m bench async_engines [--quick]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .common import bench_parser, out_dir, print_checks, table, write_csv
from .engines import (ALGORITHMS, as_shipped_and_onednn, both_sides, comparison, engine_row,
                      mpitrain_runs)

#: model: (mpitrain options, tf_baselines options): the sync benchmark's cases, but
#: the rate unscaled (an async update is one worker's gradient, on both sides)
CASES = {model: both_sides(*ALGORITHMS[model], scale=False) for model in ("lr", "lenet")}
#: PSS's algorithm in mpitrain's options
LIKE_PSS = ["--async", "--staleness-compensation", "none", "--pipeline", "off"]
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
        cases = {}
        for model in models:
            cases[model] = [*CASES[model][0], *LIKE_PSS]
            cases[f"{model}+defaults"] = [*CASES[model][0], "--async"]
        ours = mpitrain_runs(cases, args.quick, Path(tmp))
        for model in models:
            mine, defaults = ours[model], ours[f"{model}+defaults"]
            rows += [engine_row(model, "mpitrain-async", mine),
                     engine_row(model, "mpitrain-async-defaults", defaults)]
            for name, pss in as_shipped_and_onednn("ParameterServerStrategy", "ps", model,
                                                   CASES[model][1], args.quick).items():
                rows.append(engine_row(model, name, pss))
                checks += comparison("async_engines", f"{model}: mpitrain async / {name}",
                                     mine, pss, TARGET, 1, args.quick)
                checks += comparison("async_engines", f"{model}: mpitrain async with its "
                                     f"defaults (not PSS's algorithm) / {name}", defaults,
                                     pss, None, 1, args.quick)
    write_csv(out / "async_engines.csv", rows)
    print(table(rows, list(rows[0])))
    print_checks(checks)
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
