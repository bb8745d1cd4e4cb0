"""Several ``mpitrain`` command lines in one launch: one MPI job, one TensorFlow
import per rank, instead of one of each per run (the suite's acceptance runs at
one process count share a launch this way).

    mpirun -np N python tests/helpers/cli_runs.py RUNS.json

RUNS.json is a list of argument lists, each what would follow ``python -m
mpitrain``. Every rank runs them in order through the CLI's own entry point
(:func:`mpitrain.cli.main`: the same parsing, configuration, results and error
handling); a run that fails on every rank alike prints its error and the next
one starts. Exit status: the first non-zero exit code of a run, else 0.
"""

import json
import sys

from mpitrain import cli


def main(path: str) -> int:
    with open(path) as f:
        runs = json.load(f)
    status = 0
    for i, argv in enumerate(runs):
        code = cli.main([str(arg) for arg in argv], ends_process=i == len(runs) - 1)
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
