"""Open MPI 4.1, Open MPI 5 and MPICH side by side, in one run, each implementation's own
mpirun starting its own environment's Python (.venv with the system's Open MPI,
.venv-openmpi5 and .venv-mpich as setup.sh builds them):

- the comm ratios: one in-place allreduce of LR's and LeNet's gradient sizes at -np 2,
  blocking (as a worker with a core waits) and started nonblocking then tested with a
  sched_yield between tests (as an oversubscribed worker polls);
- LR and LeNet sync and async seconds per epoch at -np 3 on this machine (sync: with
  the wait --allreduce-wait auto picks there);
- the wait policy: sync LR and LeNet with --allreduce-wait spin and poll at -np 3 (two
  workers and the server on this machine's cores), and LR at -np 4 (oversubscribed), the
  two alternating in one launch (spin first for LR and poll first for LeNet in odd
  rounds, the other way in even ones), so that the host's load falls on both alike; and
  which one auto picks. LeNet is left out at -np 4: what oversubscription does to the
  two waits is the same question LR answers there (poll much faster than spin on both
  Open MPIs, the two alike on MPICH), at a third of a round's time.

Each round runs every implementation in turn, so that a change of the host's load falls
on all of them; a figure is the median over the rounds (one round by default, to keep
``bench all`` short: ``--rounds 3`` for a median). The cores other processes kept busy
as each -np 3 launch started (what auto counts: its async run's config.json) are
recorded. Every figure is also given as a ratio to the best
implementation's; the target is that none is more than 10% slower than the best (each
ratio <= 1.10), and that the wait auto picks is within 10% of the faster one.

    python -m bench mpis [--quick] [--rounds N]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

from .common import (LOCAL_HOSTFILE, REPO, bench_parser, last_json_line, mnist_dir,
                     mpi_env, on_every_rank, runs_in_one_launch, table, timing, write_csv)

#: implementation key -> its Python (the system's Open MPI runs under this one's)
ENVIRONMENTS = {"openmpi4": Path(sys.executable), "openmpi5": REPO / ".venv-openmpi5/bin/python",
                "mpich": REPO / ".venv-mpich/bin/python"}
#: float32 gradient sizes: LR (7,850 parameters) and LeNet (61,706)
SIZES = {"lr": 7850, "lenet": 61706}
TARGET = 1.10
WAITS = ("spin", "poll")


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
                        os.sched_yield()
                times.append(time.perf_counter() - t0)
            found[f"{name} {way}"] = statistics.median(times)
    # how many sessions the ranks run in: Linux's autogroup scheduling (on by default)
    # makes each session one scheduling group (docs/benchmarks.md, "Known limits")
    sessions = len(set(comm.allgather(os.getsid(0))))
    if comm.Get_rank() == 0:
        print(json.dumps({**found, "sessions": sessions}), flush=True)


def available():
    """(key, python, its mpirun) of each implementation that is installed here."""
    from mpitrain.launch import dialect

    for key, python in ENVIRONMENTS.items():
        if not python.is_file():
            print(f"bench mpis: {key}: no environment at {python.parent.parent} (bash setup.sh "
                  "builds it): left out", flush=True)
            continue
        own = python.parent / "mpirun"
        runner = dialect.mpirun_at(str(own)) if own.is_file() else dialect.mpirun()
        yield key, python, runner


def launch(runner, np_: int, python: Path, args, timeout: float = 1800) -> str:
    from mpitrain.launch import hostfile

    hosts = hostfile.for_launcher(str(LOCAL_HOSTFILE), runner.hostfile_format)
    cmd = [*runner.command(np_, hosts), str(python), *map(str, args)]
    env = {**mpi_env(), "PATH": f"{python.parent}:{mpi_env().get('PATH', '')}"}
    # a session of its own, as a user's shell gives the launcher: the scheduling group
    # its ranks share (where its launcher keeps them in one) is not the bench's
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=timeout, start_new_session=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                           f"{result.stdout[-1500:]}\n{result.stderr[-1500:]}")
    return result.stdout


def epoch_seconds(results: Path) -> float:
    """Seconds per epoch of the one run in ``results``: the workers' mean wall time of the
    epochs after the first (tracing) from timing.csv; a run of one epoch or less (the
    quick runs' steps) its wall time over its (fractional) epochs."""
    import csv

    with open(results / "runs.csv", newline="") as f:
        row = list(csv.DictReader(f))[-1]
    rows = timing(results / row["run"], ("worker",))
    later = rows["wall_s"][rows["epoch"] > 1]
    if later.size:
        return float(later.mean())
    return float(row["wall_time_s"]) / float(row["epochs"])


def train_in_one_launch(runner, python: Path, np_: int, runs: List[Tuple[str, List[str]]],
                        where: Path) -> Dict[str, float]:
    """Run each (name, mpitrain arguments) of ``runs`` in order in one launch of ``np_``
    ranks; seconds per epoch of each, by name."""
    launch(runner, np_, python, runs_in_one_launch(
        {name: [*argv, "--data-dir", mnist_dir()] for name, argv in runs}, where))
    return {name: epoch_seconds(where / name) for name, _ in runs}


def auto_wait(np_: int, others_busy: float) -> str:
    """The wait --allreduce-wait auto picks for the sync workers of a job of ``np_``
    ranks on this host while other processes keep ``others_busy`` cores busy."""
    from mpitrain.comm import spins

    workers = np_ - 1  # the server does not join the allreduce (Comm._decide_waits)
    return "spin" if spins("auto", ["here"] * workers, [os.cpu_count() or 1] * workers,
                           [True] * workers, [others_busy] * workers) else "poll"


def others_busy(run_dir: Path) -> float:
    """The most cores other processes kept busy on a rank's host as the run in
    ``run_dir`` started (its config.json; 0 where none was measured)."""
    config = json.loads(next(run_dir.glob("*/config.json")).read_text())
    return max(rank.get("others_busy_cores") or 0.0 for rank in config["ranks"])


def models(np_: int, quick: bool) -> Tuple[str, ...]:
    """The models whose sync runs compare the waits at -np ``np_`` (see the docstring)."""
    return ("lr",) if quick or np_ == 4 else ("lr", "lenet")


def round_of(runner, python: Path, round_: int, quick: bool, out: Path, load: list) -> dict:
    """One implementation's launches of one round: the allreduce at -np 2, then the
    training runs at -np 3 (and, unless ``quick``, 4); seconds by measure. Appends to
    ``load`` the cores others kept busy as the -np 3 launch's async run started."""
    figures = {}
    raw = last_json_line(launch(runner, 2, python, ["-m", "bench.mpis", "--rank-side",
                                                    "50" if quick else "500"]))
    figures["rank sessions"] = raw.pop("sessions")
    figures.update({f"allreduce {k} us": v * 1e6 for k, v in raw.items()})
    size = ["--steps", "20"] if quick else ["--epochs", "2"]
    for np_ in (3,) if quick else (3, 4):
        runs = []
        for i, model in enumerate(models(np_, quick)):
            # spin first, then poll first, by model and by round: ABBA
            waits = WAITS if (round_ + i) % 2 else WAITS[::-1]
            runs += [(f"{model} sync {wait} np{np_}", [model, *size, "--allreduce-wait", wait])
                     for wait in waits]
            if np_ == 3:
                runs.append((f"{model} async", [model, *size, "--async"]))
        where = out / "mpis-runs" / f"{runner.impl.key}-r{round_}" / f"np{np_}"
        figures.update(train_in_one_launch(runner, python, np_, runs, where))
        if np_ == 3:
            load.append(others_busy(where / runs[-1][0]))
    return figures


def main(argv=None, out: Path = None) -> dict:
    parser = bench_parser("mpis", __doc__, "LR only, 20 steps a run, -np 3 only, one round")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds over the implementations (default 1)")
    args = parser.parse_args(argv or [])
    out = out or Path(".")
    rounds = args.rounds or 1
    found: Dict[str, List[dict]] = {}
    implementations = list(available())
    load: Dict[str, list] = {key: [] for key, _, _ in implementations}
    for round_ in range(1, rounds + 1):
        for key, python, runner in implementations:
            figures = round_of(runner, python, round_, args.quick, out, load[key])
            found.setdefault(key, []).append(figures)
            print(f"round {round_}, {runner.impl.name}: "
                  f"{ {k: round(v, 4) for k, v in figures.items()} }", flush=True)
    rows, waits = [], []
    for key, python, runner in implementations:
        median = {k: statistics.median(f[k] for f in found[key]) for k in found[key][0]}
        auto3 = auto_wait(3, statistics.median(load[key]))
        row = {"mpi": runner.impl.name, "rank sessions at -np 2": median["rank sessions"],
               **{k: round(v, 1) for k, v in median.items() if k.startswith("allreduce")}}
        for model in ("lr",) if args.quick else ("lr", "lenet"):
            row[f"{model} sync s/epoch"] = round(median[f"{model} sync {auto3} np3"], 3)
            row[f"{model} async s/epoch"] = round(median[f"{model} async"], 3)
            for np_ in (3,) if args.quick else (3, 4):
                if model not in models(np_, args.quick):
                    continue
                spin, poll = (median[f"{model} sync {w} np{np_}"] for w in WAITS)
                waits.append({"mpi": runner.impl.name, "np": np_, "model": model,
                              "spin s/epoch": round(spin, 3), "poll s/epoch": round(poll, 3),
                              "poll / spin": round(poll / spin, 2),
                              "auto picks": auto_wait(np_, statistics.median(load[key])),
                              "others' busy cores": f"{min(load[key]):.2f}-{max(load[key]):.2f}"})
        rows.append(row)
    checks = ratio_checks(rows) + wait_checks(waits)
    write_csv(out / "mpis.csv", rows)
    write_csv(out / "mpis-waits.csv", waits)
    print(table(rows, list(rows[0]) if rows else ["mpi"]), flush=True)
    print(table(waits, list(waits[0]) if waits else ["mpi"]), flush=True)
    return {"checks": checks}


def ratio_checks(rows: List[dict]) -> List[dict]:
    """Each measure of each implementation over the best one's (written into ``rows``)."""
    checks = []
    for measure in [k for k in rows[0] if k not in ("mpi", "rank sessions at -np 2")] \
            if rows else []:
        best = min(row[measure] for row in rows)
        for row in rows:
            ratio = row[measure] / best if best > 0 else 1.0
            row[f"{measure} / best"] = round(ratio, 2)
            checks.append({"benchmark": "mpis", "ratio": f"{measure}: {row['mpi']} / best",
                           "value": f"{ratio:.2f}", "target": f"<= {TARGET}",
                           "met": ratio <= TARGET})
    return checks


def wait_checks(waits: List[dict]) -> List[dict]:
    """The wait auto picks over the faster of spin and poll, per implementation, -np and
    model."""
    checks = []
    for w in waits:
        picked = w[f"{w['auto picks']} s/epoch"]
        ratio = picked / min(w["spin s/epoch"], w["poll s/epoch"])
        checks.append({"benchmark": "mpis", "ratio": f"{w['model']} sync -np {w['np']}, "
                       f"{w['mpi']}: auto ({w['auto picks']}) / the faster wait",
                       "value": f"{ratio:.2f}", "target": f"<= {TARGET}",
                       "met": ratio <= TARGET})
    return checks


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-side"]:
        on_every_rank(rank_side, int(sys.argv[2]))
    else:
        main(sys.argv[1:])
