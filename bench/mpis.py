"""Open MPI 4.1, Open MPI 5 and MPICH side by side, in one run: the comm ratios (one
in-place allreduce of LR's and LeNet's gradient sizes at -np 2, blocking as a worker
with a core waits, and started nonblocking and polled as an oversubscribed one does)
and LR and LeNet sync and async epoch times at -np 3 on this machine, each
implementation's own mpirun starting its own environment's Python (.venv with the
system's Open MPI, .venv-openmpi5 and .venv-mpich as setup.sh builds them).

Every figure is also given as a ratio to the best implementation's; the target is
that none is more than 10% slower than the best (each ratio <= 1.10).

    python -m bench mpis [--quick]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import LOCAL_HOSTFILE, REPO, bench_parser, last_json_line, mnist_dir, mpi_env, \
    on_every_rank, table, write_csv

#: implementation key -> its Python (the system's Open MPI runs under this one's)
ENVIRONMENTS = {"openmpi4": Path(sys.executable), "openmpi5": REPO / ".venv-openmpi5/bin/python",
                "mpich": REPO / ".venv-mpich/bin/python"}
#: float32 gradient sizes: LR (7,850 parameters) and LeNet (61,706)
SIZES = {"lr": 7850, "lenet": 61706}
TARGET = 1.10


def rank_side(iterations: int) -> None:
    """Under mpirun: median seconds of each way of summing each size; rank 0 prints JSON."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    found = {}
    for name, size in SIZES.items():
        buf = np.ones(size, np.float32)
        for way in ("blocking", "polled"):
            times = []
            for _ in range(iterations):
                comm.Barrier()
                t0 = time.perf_counter()
                if way == "blocking":
                    comm.Allreduce(MPI.IN_PLACE, buf)
                else:
                    request = comm.Iallreduce(MPI.IN_PLACE, buf)
                    while not request.Test():
                        pass
                times.append(time.perf_counter() - t0)
            found[f"{name} {way}"] = statistics.median(times)
    if comm.Get_rank() == 0:
        print(json.dumps(found), flush=True)


def available():
    """(key, python, its mpirun) of each implementation that is installed here."""
    from mpitrain import dialect

    for key, python in ENVIRONMENTS.items():
        if not python.is_file():
            print(f"bench mpis: {key}: no environment at {python.parent.parent} (bash setup.sh "
                  "builds it): left out", flush=True)
            continue
        own = python.parent / "mpirun"
        runner = dialect.mpirun_at(str(own)) if own.is_file() else dialect.mpirun()
        yield key, python, runner


def launch(runner, np_: int, python: Path, args, timeout: float = 1800) -> str:
    from mpitrain.tools import hostfile

    hosts = hostfile.for_launcher(str(LOCAL_HOSTFILE), runner.hostfile_format)
    cmd = [*runner.command(np_, hosts), str(python), *map(str, args)]
    env = {**mpi_env(), "PATH": f"{python.parent}:{mpi_env().get('PATH', '')}"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stdout[-1500:]}\n{result.stderr[-1500:]}")
    return result.stdout


def epoch_seconds(runner, python: Path, model: str, mode: str, quick: bool, out: Path) -> float:
    """Seconds per epoch of one run (its wall time over its epochs) at -np 3."""
    import csv

    results = out / "mpis-runs" / f"{runner.impl.key}-{model}-{mode}"
    size = ["--steps", "20"] if quick else ["--epochs", "1"]
    launch(runner, 3, python, ["-m", "mpitrain", model, *size, "--quiet", "--data-dir",
                               mnist_dir(), "--results-dir", results,
                               *(["--async"] if mode == "async" else [])])
    with open(results / "runs.csv", newline="") as f:
        row = list(csv.DictReader(f))[-1]
    return float(row["wall_time_s"]) / float(row["epochs"])


def main(argv=None, out: Path = None) -> dict:
    args = bench_parser("mpis", __doc__, "LR only, 20 steps a run, few iterations").parse_args(
        argv or [])
    out = out or Path(".")
    rows = []
    for key, python, runner in available():
        figures = last_json_line(launch(runner, 2, python, ["-m", "bench.mpis", "--rank-side",
                                                            "50" if args.quick else "500"]))
        row = {"mpi": runner.impl.name, **{f"allreduce {k} us": round(v * 1e6, 1)
                                          for k, v in figures.items()}}
        for model in ("lr",) if args.quick else ("lr", "lenet"):
            for mode in ("sync", "async"):
                row[f"{model} {mode} s/epoch"] = round(
                    epoch_seconds(runner, python, model, mode, args.quick, out), 3)
        rows.append(row)
        print(row, flush=True)
    checks = []
    measures = [k for k in rows[0] if k != "mpi"] if rows else []
    for measure in measures:
        best = min(row[measure] for row in rows)
        for row in rows:
            ratio = row[measure] / best if best > 0 else 1.0
            row[f"{measure} / best"] = round(ratio, 2)
            checks.append({"benchmark": "mpis", "ratio": f"{measure}: {row['mpi']} / best",
                           "value": f"{ratio:.2f}", "target": f"<= {TARGET}",
                           "met": ratio <= TARGET})
    write_csv(out / "mpis.csv", rows)
    print(table(rows, ["mpi", *measures]), flush=True)
    return {"checks": checks}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-side"]:
        on_every_rank(rank_side, int(sys.argv[2]))
    else:
        main(sys.argv[1:])
