"""Helpers shared by the benchmarks: launching mpirun, output directory, tables."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
LOCAL_HOSTFILE = REPO / "hostfiles" / "local"
DEFAULT_MNIST = REPO.parent / "shared" / "data" / "mnist"
#: runs several mpitrain command lines in one launch (the suite's own helper)
RUNS_IN_ONE_LAUNCH = REPO / "tests" / "helpers" / "cli_runs.py"


def bench_parser(name: str, doc: str, quick_help: str = "a few steps each (smoke)"):
    """The command line of ``python -m bench NAME``: its docstring as help, and --quick."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    return p


def on_every_rank(rank_side: Callable, *args) -> None:
    """``rank_side(*args)`` on a rank of a benchmark's mpirun job: an exception on any
    rank prints its traceback and ends the whole job at once (MPI_Abort, as
    ``python -m mpitrain`` does), so the other ranks never wait out their timeout in
    a collective the failed rank will not join."""
    try:
        rank_side(*args)
    except BaseException as error:  # noqa: B902 - a crash on one rank must not hang the others
        if isinstance(error, SystemExit) and not error.code:
            raise
        from mpitrain.comm import abort_world, world_rank_if_running

        sys.stderr.write(f"bench: error on rank {world_rank_if_running()}:\n")
        traceback.print_exc()
        abort_world(1)  # where mpitrain started MPI
        mpi = sys.modules.get("mpi4py.MPI")  # where the benchmark started it itself
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)
        raise  # MPI never started: the exit ends the job


def mnist_dir() -> str:
    return os.environ.get("MPITRAIN_DATA_DIR", str(DEFAULT_MNIST))


def mpi_env() -> dict:
    from mpitrain.launch.dialect import launch_environment

    env = launch_environment()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpirun(np_: int, args: List[str], timeout: float = 1800,
           env: Optional[Dict[str, str]] = None,
           hostfile: Path = LOCAL_HOSTFILE) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``np_`` ranks of this machine; raise if it fails."""
    cmd = ["mpirun", "-q", "-np", str(np_), "-hostfile", str(hostfile),
           sys.executable, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**mpi_env(), **(env or {})},
                            cwd=REPO, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result


def available_mb() -> float:
    """This machine's free memory, in MB."""
    import psutil

    return psutil.virtual_memory().available / 2**20


def slots_file(out: Path, np_: int) -> Path:
    """A hostfile giving this machine ``np_`` slots (hostfiles/local has 4)."""
    path = out / f"hostfile-np{np_}"
    path.write_text(f"localhost slots={np_}\n")
    return path


def horovod_python() -> str:
    """The Horovod environment's interpreter (setup.sh's .venv-horovod: TensorFlow 2.18,
    the newest Horovod 0.28.1 builds against; $MPITRAIN_HOROVOD_PYTHON overrides)."""
    path = Path(os.environ.get("MPITRAIN_HOROVOD_PYTHON", REPO / ".venv-horovod/bin/python"))
    if not path.is_file():
        raise RuntimeError(f"no Horovod environment at {path}: bash setup.sh builds it")
    return str(path)


def train(np_: int, args: List[str], results: Path, timeout: float = 3600,
          hostfile: Path = LOCAL_HOSTFILE, mpirun_args: List[str] = (),
          python: str = sys.executable) -> Dict[str, str]:
    """One real ``mpirun ... python -m mpitrain ARGS`` run; returns its runs.csv row
    (plus ``run_dir``). Raises if the run fails."""
    results.mkdir(parents=True, exist_ok=True)
    launch_mpitrain(np_, ["-m", "mpitrain", *map(str, args), "--results-dir", str(results),
                          "--quiet"], timeout, hostfile, mpirun_args, python)
    return last_run(results)


def train_many(np_: int, runs: Dict[str, List[str]], results: Path, timeout: float = 3600,
               hostfile: Path = LOCAL_HOSTFILE, mpirun_args: List[str] = (),
               python: str = sys.executable) -> Dict[str, Dict[str, str]]:
    """Real ``python -m mpitrain ARGS`` runs ({name: ARGS}) in order in one ``mpirun``
    launch (one MPI job, one TensorFlow import per rank: start-up is paid once, not per
    run; a run's own timings start at its first step as always), each writing to
    ``results/name``; ``timeout`` is per run. Returns each run's runs.csv row (plus
    ``run_dir``) by name; raises if a run fails."""
    launch_mpitrain(np_, runs_in_one_launch(runs, results), timeout * len(runs), hostfile,
                    mpirun_args, python)
    return {name: last_run(results / name) for name in runs}


def runs_in_one_launch(runs: Dict[str, List[str]], results: Path) -> List[str]:
    """The program (after ``python``) that runs ``runs`` ({name: ``mpitrain`` ARGS}) in
    order in one launch, each with ``--results-dir results/name --quiet``: the suite's
    cli_runs helper and the RUNS.json it reads, written into ``results``."""
    results.mkdir(parents=True, exist_ok=True)
    spec = [[*map(str, args), "--results-dir", str(results / name), "--quiet"]
            for name, args in runs.items()]
    (results / "runs.json").write_text(json.dumps(spec))
    return [str(RUNS_IN_ONE_LAUNCH), str(results / "runs.json")]


def launch_mpitrain(np_: int, program: List[str], timeout: float, hostfile: Path,
                    mpirun_args: List[str], python: str) -> None:
    """``mpirun ... python PROGRAM`` on ``np_`` ranks; raise with its error if it fails."""
    cmd = ["mpirun", "-q", *mpirun_args, "-np", str(np_), "-hostfile", str(hostfile),
           python, *program]
    result = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=REPO,
                            timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stderr[-2000:]}")


def last_run(results: Path) -> Dict[str, str]:
    """The last row of ``results``/runs.csv, with its ``run_dir``."""
    with open(results / "runs.csv", newline="") as f:
        row = list(csv.DictReader(f))[-1]
    return {**row, "run_dir": str(results / row["run"])}


def run_table(run_dir, name: str, roles=None):
    """A run's ``name``.csv (timing, telemetry, comm, staleness), read and validated by
    mpitrain's own reader (a damaged file is named; numbers come as floats); only the
    rows whose role is in ``roles``, if given."""
    import numpy as np

    from mpitrain.results.schema import OPTIONAL_TABLES
    from mpitrain.report.run_files import read_table

    table = read_table(Path(run_dir) / f"{name}.csv", OPTIONAL_TABLES[name])
    return table if roles is None else table.where(np.isin(table["role"], list(roles)))


def timing(run_dir, roles):
    """The rows of a run's timing.csv whose role is in ``roles`` (:func:`run_table`)."""
    return run_table(run_dir, "timing", roles)


def steady_epoch_seconds(run_dir, roles=("worker",)) -> float:
    """Mean wall seconds of one epoch in steady state, from a run's timing.csv: the
    epochs after the first (tracing, the allreduce calibration, rank 0's evaluation
    of the initial model) and before the last (the final report, evaluation and
    checkpoint), over the ranks whose role is in ``roles``. Benchmarks of
    throughput drop the warm-up like this (Horovod's synthetic benchmark too)."""
    rows = timing(run_dir, roles)
    epoch = rows["epoch"]
    middle = rows["wall_s"][(epoch > 1) & (epoch < epoch.max())]
    if not middle.size:
        raise RuntimeError(f"{run_dir}: timing.csv has no epoch between the first and the "
                           "last: a steady-state measure needs a run of 3 epochs or more")
    return float(middle.mean())


def first_epoch_seconds(run_dir, roles=("worker",)) -> float:
    """Mean wall seconds of a run's first epoch, over the ranks whose role is in
    ``roles`` (timing.csv): with :func:`steady_epoch_seconds`, what the warm-up (the
    step's tracing, the first evaluation) adds to one epoch."""
    rows = timing(run_dir, roles)
    return float(rows["wall_s"][rows["epoch"] == 1].mean())


def last_json_line(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (what a rank-side script prints)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in output:\n{text[-2000:]}")


def out_dir() -> Path:
    path = REPO / "results" / "bench" / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(path: Path, rows: List[Dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)


def table(rows: List[Dict], columns: List[str]) -> str:
    """A plain-text table of ``rows`` for the terminal."""
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def print_checks(checks: List[Dict]) -> None:
    """One line per check: its value, target and verdict."""
    for c in checks:
        value = c["value"]
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        verdict = "reported" if c.get("met") is None else ("met" if c["met"] else "SHORT")
        print(f"{c['ratio']}: {shown} (target {c.get('target', '-')}: {verdict})")


def markdown_table(path: Path) -> List[str]:
    """A CSV file as the lines of a Markdown table."""
    from mpitrain.report.markdown import md_table

    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return md_table(rows[0], rows[1:]).splitlines() if rows else []


def write_summary(out: Path, checks: List[Dict], argv: List[str], seconds: float,
                  minutes: Dict[str, float] = None) -> Path:
    """summary.md: every ratio with its target and whether it is met, the minutes each
    benchmark took, then every CSV the run wrote, as a table (``python -m bench.docs``
    writes docs/benchmarks.md's results table from these)."""
    import os
    import platform

    lines = [f"# Benchmark summary ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `python -m bench {' '.join(argv)}`  ",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; took {seconds / 60:.1f} min; load average "
             f"at the end {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min).  ",
             f"Commit: {commit_line()}", "",
             "| benchmark | ratio | value | target | |", "| --- | --- | --- | --- | --- |"]
    for c in checks:
        value = c["value"]
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        verdict = "" if c.get("met") is None else ("met" if c["met"] else "**short**")
        lines.append(f"| {c['benchmark']} | {c['ratio']} | {shown} | {c.get('target', '')} "
                     f"| {verdict} |")
    if minutes:
        lines += ["", "Minutes per benchmark: " + ", ".join(
            f"{name} {value:.1f}" for name, value in minutes.items()) + "."]
    for table_path in sorted(out.glob("*.csv"), key=lambda p: p.stat().st_mtime):
        lines += ["", f"## {table_path.name}", "", *markdown_table(table_path)]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def commit_line() -> str:
    """The checkout's commit, as summary.md records it: `abc1234`, with "and uncommitted
    changes" when the tree differs from it, or "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, text=True, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    changed = " and uncommitted changes" if dirty.stdout.strip() else ""
    return f"`{head.stdout.strip()}`{changed}"


def write_block(path: Path, block: str, name: str) -> None:
    """Replace what lies between the lines ``<!-- bench NAME: begin -->`` and
    ``<!-- bench NAME: end -->`` in ``path`` with ``block``: a document's generated part
    (docs/scaling.md's ``scale``, docs/benchmarks.md's ``results``). ValueError if the
    document lacks either line."""
    begin, end = f"<!-- bench {name}: begin -->", f"<!-- bench {name}: end -->"
    text = path.read_text()
    if begin not in text or end not in text.split(begin, 1)[1]:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block.strip()}\n{end}{tail}")
