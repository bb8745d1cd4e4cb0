"""Several ``mpitrain`` command lines in one launch: one MPI job, one TensorFlow
import per rank, instead of one of each per run (the suite's acceptance runs at
one process count share a launch this way).

    mpirun -np N python tests/helpers/cli_runs.py RUNS.json [--codes]

RUNS.json is a list of argument lists, each what would follow ``python -m
mpitrain``. Every rank runs them in order through the CLI's own entry point
(:func:`mpitrain.cli.commands.main`: the same parsing, configuration, results and error
handling); a run that fails on every rank alike prints its error and the next
one starts. An argument ``{run_in:DIR}`` stands for the run directory an earlier
run made in results directory DIR (its only one), so a later run may ``--resume``
it. Exit status: the first non-zero exit code of a run, else 0. With
``--codes``, rank 0 also prints ``cli_runs: run I exit CODE`` after each run (to
stderr, after the run's own lines), for tests that check every run's code.
"""

import json
import re
import sys
from pathlib import Path

from mpitrain.cli import commands as cli
from mpitrain.comm import world_rank_if_running
from mpitrain.cli.exits import leave


def _resolved(arg: str) -> str:
    """``arg`` with ``{run_in:DIR}`` replaced by the one run directory in DIR."""
    found = re.fullmatch(r"\{run_in:(.+)\}", arg)
    if not found:
        return arg
    runs = [p for p in Path(found[1]).iterdir() if (p / "config.json").is_file()]
    assert len(runs) == 1, f"{arg}: {len(runs)} run directories there, not one"
    return str(runs[0])


def main(path: str, codes: bool = False) -> int:
    with open(path) as f:
        runs = json.load(f)
    status = 0
    for i, argv in enumerate(runs):
        code = cli.main([_resolved(str(arg)) for arg in argv],
                        ends_process=i == len(runs) - 1)
        status = status or code
        if codes and world_rank_if_running() == 0:
            print(f"cli_runs: run {i} exit {code}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    leave(main(sys.argv[1], "--codes" in sys.argv[2:]))  # as python -m mpitrain ends
