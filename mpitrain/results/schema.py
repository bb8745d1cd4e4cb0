"""The CSV files of a run, column by column: one definition for writers and readers.

Writers take the column names from here (:data:`CURVE_COLUMNS` for
:class:`mpitrain.results.run_dir.RunResults`, the telemetry columns for
:mod:`mpitrain.results.telemetry`, :data:`STALENESS_COLUMNS` for the async server);
readers (:mod:`mpitrain.report.plots`, :mod:`mpitrain.report.markdown`) validate a
file against the same :class:`Column` tuples. A column's flags say what a reader
may expect of it: ``text`` (else a number), ``optional`` (files written by
other mpitrain versions may lack it) and ``blank_ok`` (cells may be empty).

``runs.csv`` has one row per run and open-ended columns (a newer mpitrain adds
some; the row is built from the run's settings and summary):
:func:`runs_columns` types the columns of a given header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class Column:
    """One CSV column: numeric (a float, NaN when blank) unless ``text``."""

    name: str
    text: bool = False
    optional: bool = False  # may be absent from the header (older/newer mpitrain)
    blank_ok: bool = False  # cells may be empty


def _cols(*names: str, **flags) -> Tuple[Column, ...]:
    return tuple(Column(n, **flags) for n in names)


def names(columns: Tuple[Column, ...]) -> Tuple[str, ...]:
    """The header a writer writes: the column names, in order."""
    return tuple(c.name for c in columns)


#: curve.csv: one row per evaluation (epoch 0 is the initial model: no train loss yet)
CURVE = (_cols("epoch") + _cols("step", optional=True, blank_ok=True) + _cols("wall_time_s")
         + _cols("train_loss", "test_loss", "test_accuracy", blank_ok=True)
         + _cols("examples_per_s", optional=True, blank_ok=True))
#: telemetry.csv: samples per rank; host_cpu_percent and net_* only on each host's
#: lowest rank (blank elsewhere), net_* cumulative since the start of the run
TELEMETRY = (_cols("time_s", "rank") + (Column("host", text=True),)
             + (Column("role", text=True, optional=True, blank_ok=True),)
             + _cols("cpu_percent", "rss_mb", blank_ok=True)
             + _cols("host_cpu_percent", "net_rx_bytes", "net_tx_bytes", "net_rx_packets",
                     "net_tx_packets", optional=True, blank_ok=True))
#: timing.csv: seconds per epoch and rank, and how they split
TIMING = (_cols("epoch", "rank") + _cols("host", "role", text=True, optional=True, blank_ok=True)
          + _cols("wall_s", "compute_s", "comm_s", "wait_s")
          + _cols("codec_s", optional=True, blank_ok=True))  # (newer runs: compression)
#: comm.csv: payload through mpitrain's communication layer, per rank and kind
COMM = (_cols("rank") + _cols("host", "role", text=True, optional=True, blank_ok=True)
        + (Column("kind", text=True),) + _cols("sent_bytes")
        + _cols("sent_msgs", optional=True, blank_ok=True) + _cols("recv_bytes")
        + _cols("recv_msgs", "wait_s", optional=True, blank_ok=True))
#: staleness.csv (async): how many of a worker's gradients had each staleness
STALENESS = (_cols("worker", "staleness", "count")
             + _cols("server", optional=True, blank_ok=True))  # (--servers K: each's own)

#: membership.csv (written by mpitrain launch): one row per change of the job's
#: membership -- a restart after a failure, a stop to grow, an async worker lost while the
#: job went on -- with the checkpoint step and training clock the job went on from, the
#: steps trained since that checkpoint that the change lost and the seconds from the
#: change to the job running again (blank where unknown)
MEMBERSHIP = ((Column("time", text=True), Column("change", text=True))
              + _cols("hosts_out", "hosts_in", text=True, blank_ok=True)
              + _cols("np_before", "np_after")
              + _cols("step", "wall_time_s", "steps_lost", "downtime_s", blank_ok=True)
              + (Column("why", text=True, blank_ok=True),))

CURVE_COLUMNS = names(CURVE)
TELEMETRY_COLUMNS = names(TELEMETRY)
TIMING_COLUMNS = names(TIMING)
COMM_COLUMNS = names(COMM)
STALENESS_COLUMNS = names(STALENESS)
MEMBERSHIP_COLUMNS = names(MEMBERSHIP)

#: a run directory's tables besides curve.csv, by file stem; any of them may be absent
OPTIONAL_TABLES = {"telemetry": TELEMETRY, "timing": TIMING, "comm": COMM,
                   "staleness": STALENESS, "membership": MEMBERSHIP}

#: runs.csv: the columns that hold numbers (others, and unknown ones, are text)
RUNS_NUMERIC = frozenset({
    "np", "workers", "batch_size", "global_batch", "epochs", "steps", "lr", "wall_time_s",
    "test_accuracy", "test_loss", "train_loss", "mpi_bytes", "staleness_mean",
    "staleness_max", "staleness_bound", "pushes", "applied", "server_updates_per_s",
    "worker_steps_per_s", "server_cpu_share", "server_loop_cpu_share", "updates_short",
    "finish_s", "server_nice", "servers", "server_momentum"})
#: runs.csv: per-node columns node<i>_<metric> (numbers, except node<i>_host)
NODE_COLUMN = re.compile(r"node(\d+)_(\w+)")


def runs_columns(header: List[str]) -> List[Column]:
    """runs.csv's columns for ``header``: ``run`` is required; every other column is
    optional and may be blank. The known numeric columns and the node metrics
    (``node<i>_cpu_avg``, ...) must hold numbers; everything else (model, mode,
    dataset, node hosts, and columns that later versions add) is read as text."""
    columns = [Column("run", text=True)]
    for name in header:
        node = NODE_COLUMN.fullmatch(name)
        numeric = name in RUNS_NUMERIC or bool(node and node.group(2) != "host")
        if name != "run":
            columns.append(Column(name, text=not numeric, optional=True, blank_ok=True))
    return columns
