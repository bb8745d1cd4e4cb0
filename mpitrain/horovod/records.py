"""Opt-in: mpitrain's results for a Horovod-style script (``hvd.init(results_dir=DIR)`` or
``$MPITRAIN_RESULTS_DIR=DIR``), in the files the CLI writes, so ``mpitrain report DIR``
plots them.

Rank 0 writes a run directory ``DIR/<time>-<script>-horovod-np<N>/``:

* ``config.json`` (the command line, every rank's host and versions) and
  ``status.json`` (running, then ok or failed with the reason; ``mpitrain launch``
  follows it);
* ``telemetry.csv``: every rank's CPU and memory, and each host's CPU and network,
  sampled every second;
* ``timing.csv``: each rank's seconds computing, moving data and waiting for the
  others (:class:`mpitrain.train.protocol.PhaseTimer`: every collective is charged
  to comm and wait, the rest to compute), a row per Keras epoch when the script
  trains with ``model.fit`` and one of ``hvd.callbacks``, else one row for the run;
* ``comm.csv``: the exact bytes and messages each rank moved, by kind;
* ``curve.csv``: per Keras epoch, the (averaged) training loss and the validation loss
  and accuracy; without epochs, one row at the end;

and a row in ``DIR/runs.csv`` (engine ``mpitrain.horovod``). Every rank samples itself
on a daemon thread; the rows are gathered on rank 0 when the script ends (collective:
at ``hvd.shutdown()`` or at exit), or written by the one failing rank alone.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

from .. import __version__
from ..results import telemetry
from ..comm import library_versions
from ..results.run_dir import NullResults, RunResults, attempt_facts
from ..train.protocol import PhaseTimer

#: seconds between two samples of CPU, memory and network
SAMPLE_INTERVAL = 1.0
ENGINE = "mpitrain.horovod"


class Telemetry:
    """One script's run directory and this rank's sampler and phase timer; ``engine``
    (:class:`~.collectives.Collectives`) counts the run's steps (its gradient exchanges)."""

    def __init__(self, comm, engine, results, sampler, script: str):
        self.comm, self.results, self.sampler, self.script = comm, results, sampler, script
        self.engine = engine
        self.role = "single" if comm.size == 1 else "worker"  # every rank trains
        self.timer = PhaseTimer()
        self.started = time.perf_counter()
        self.epochs = 0
        #: (epoch, logs, wall seconds, steps): not yet in curve.csv
        self._pending: Optional[tuple] = None
        self._last: dict = {}  # the last epoch's logs, for runs.csv

    @classmethod
    def start(cls, comm, engine, results_dir: str, timeout: float) -> "Telemetry":
        """Open the run on every rank (collective): rank 0 writes config.json and says
        running; every rank starts sampling itself (and its host, on its lowest rank)."""
        script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") \
            else "script"
        results = RunResults(Path(results_dir), f"{script}-horovod-np{comm.size}") \
            if comm.rank == 0 else NullResults()
        ranks = comm.allgather_objects(_rank_facts())
        results.write_json("config.json", {
            "config": {"model": script, "mode": "sync", "world_size": comm.size,
                       "workers": comm.size, "engine": ENGINE, "timeout": timeout},
            "argv": sys.argv, "ranks": ranks,
            "versions": {k: ranks[0].get(k) for k in ("python", "tensorflow", "keras", "numpy",
                                                      "mpi4py", "mpi_library", "mpitrain")}})
        results.set_status("running", **attempt_facts())
        leader = comm.ranks_on_host()[0] == comm.rank
        sampler = telemetry.Sampler(comm.rank, comm.host, "single" if comm.size == 1
                                    else "worker", SAMPLE_INTERVAL, node_leader=leader).start()
        return cls(comm, engine, results, sampler, script)

    def epoch_end(self, epoch: int, logs: Optional[dict]) -> None:
        """A Keras epoch ended (``epoch`` counts from 0): close this rank's timing row.
        Its curve row is written at the next epoch's end or at the finish, from ``logs``,
        the dict Keras hands every callback, by then averaged if MetricAverageCallback
        is among them, whatever their order. Several callbacks may call it per epoch."""
        if epoch + 1 <= self.epochs:
            return
        self._flush_curve()
        self.epochs = epoch + 1
        self.timer.end_epoch(self.epochs)
        self._pending = (self.epochs, logs if logs is not None else {},
                         time.perf_counter() - self.started, self.steps())

    def _flush_curve(self) -> None:
        if self._pending is None:
            return
        epoch, logs, wall, steps = self._pending
        self._pending, self._last = None, dict(logs)
        self.results.add_curve_row({"epoch": epoch, "step": steps,
                                    "wall_time_s": round(wall, 3),
                                    "train_loss": _number(logs.get("loss")),
                                    "test_loss": _number(logs.get("val_loss")),
                                    "test_accuracy": _number(logs.get("val_accuracy"))})

    def steps(self) -> int:
        return self.engine.gradient_exchanges

    def finish(self, status: str, reason: str = "", collective: bool = True) -> None:
        """Write the run's files and its runs.csv row; collective unless ``collective``
        is False (a failure only this rank knows: it writes its own telemetry)."""
        wall = time.perf_counter() - self.started
        steps = self.steps()
        self._flush_curve()
        if not self.epochs:  # a custom loop: the whole run is one row
            self.timer.end_epoch(1)
            self.results.add_curve_row({"epoch": 1, "step": steps, "wall_time_s": round(wall, 3)})
        if collective:
            gathered = telemetry.collect(self.comm, self.role, self.sampler, self.timer,
                                         self.results)
        else:
            gathered = telemetry.write_local(self.comm, self.role, self.sampler, self.timer,
                                             self.results)
        self.results.add_run_row({
            "model": self.script, "mode": "sync", "np": self.comm.size,
            "workers": self.comm.size, "engine": ENGINE, "status": status, "reason": reason,
            "epochs": self.epochs or "", "steps": steps, "wall_time_s": round(wall, 3),
            "train_loss": _number(self._last.get("loss")),
            "test_loss": _number(self._last.get("val_loss")),
            "test_accuracy": _number(self._last.get("val_accuracy")),
            **telemetry.node_summary(gathered, self.comm.hosts)})
        self.results.set_status(status, reason)


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _rank_facts() -> dict:
    import keras
    import numpy
    import tensorflow as tf

    return {"host": platform.node(), "pid": os.getpid(), "python": platform.python_version(),
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "numpy": numpy.__version__, "mpitrain": __version__, **library_versions()}
