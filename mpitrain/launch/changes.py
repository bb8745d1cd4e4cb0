"""What each change of a launched job's membership cost: a row of the run's
``membership.csv`` (columns: :data:`mpitrain.results.schema.MEMBERSHIP`) per change.

Three changes: a ``failure`` (the job failed and is restarted from its checkpoint,
perhaps on fewer hosts), a ``grow`` (the launcher stopped it at a checkpoint to take in
hosts that answer) and a ``worker lost`` (an async job went on without a worker under
mpirun's recovery: no restart). A restart's row is written once the next attempt says
running, when what it cost is known: the steps trained since the checkpoint it goes on
from (a failure's, by the step rank 0 last noted in status.json, at most
:data:`mpitrain.results.run_dir.PROGRESS_NOTE_EVERY` seconds old: a lower bound; a stop
to grow checkpoints where it stops and loses none) and the seconds from the change to
the job running again. A change after which the launch gave up keeps its row, with no
downtime. The report and the run's figures read the file (:mod:`mpitrain.report`).

Outside the job: no TensorFlow, no MPI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

from ..results.run_dir import CsvLog
from ..results.schema import MEMBERSHIP_COLUMNS
from ..run.checkpoint import saved_position

MEMBERSHIP_CSV = "membership.csv"


@dataclass
class _Change:
    change: str
    why: str
    run_dir: Path
    began: float  # time.monotonic()
    time: str  # when, for the row
    np_before: int
    hosts_before: List[str]
    step_reached: Optional[int]  # rank 0's last noted step (status.json's ``step``)
    #: the step and training clock of the checkpoint the job goes on from
    position: Optional[Tuple[int, float]]


class ChangeLog:
    """The launcher's record of membership changes (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: Optional[_Change] = None
        self._workers_seen: set = set()
        self._lost_in_attempt = 0  # the attempt's workers lost while it went on
        self._trouble: List[str] = []  # a file that could not be written, said at the end

    def began(self, change: str, why: str, run_dir: Optional[Path], np_before: int,
              hosts: Optional[Sequence[str]], status: Optional[dict]) -> None:
        """A restart is coming, from the checkpoint in ``run_dir`` (None: the run has
        none, nothing is recorded): the job ran on ``np_before`` ranks (less the
        workers it went on without) on ``hosts`` (None: no hostfile) and ``status`` is
        its last status.json."""
        training, self._lost_in_attempt = np_before - self._lost_in_attempt, 0
        self.pending = None if run_dir is None else _Change(
            change, why, Path(run_dir), time.monotonic(), _now(), training,
            list(hosts or ()), _int((status or {}).get("step")), saved_position(run_dir))

    def running(self, status: Optional[dict], np_after: int,
                hosts: Optional[Sequence[str]]) -> None:
        """The next attempt's ``status`` (its status.json), on ``np_after`` ranks on
        ``hosts``: once it says running (or that it ended well), the pending change's
        row, with its downtime."""
        if self.pending is not None and (status or {}).get("status") in ("running", "ok"):
            self._write(self.pending, np_after, hosts,
                        round(time.monotonic() - self.pending.began, 1))

    def close(self, say: Callable[[str], None]) -> None:
        """The launch ends: a change after which the job did not run again keeps its row
        (no downtime); a file that could not be written is said."""
        if self.pending is not None:
            self._write(self.pending, 0, (), None)
        for line in self._trouble:
            say(line)

    def workers_lost(self, status: Optional[dict], run_dir: Optional[Path],
                     np_: int) -> List[dict]:
        """The workers ``status.json`` newly records as lost (``lost_workers``; an async
        job goes on without them), each a row: the job of ``np_`` ranks goes on with one
        fewer, at once."""
        lost = [w for w in (status or {}).get("lost_workers") or []
                if (w.get("rank"), w.get("pid")) not in self._workers_seen]
        for worker in lost:
            self._workers_seen.add((worker.get("rank"), worker.get("pid")))
            self._lost_in_attempt += 1
            if run_dir is not None:
                training = np_ - self._lost_in_attempt
                self._append(Path(run_dir), {
                    "time": _now(), "change": "worker lost",
                    "hosts_out": str(worker.get("host") or ""),
                    "np_before": training + 1, "np_after": training, "downtime_s": 0,
                    "step": _int(worker.get("update")), "wall_time_s": worker.get("wall_time_s"),
                    "why": f"rank {worker.get('rank')}: {worker.get('reason')}"})
        return lost

    def _write(self, change: _Change, np_after: int, hosts: Optional[Sequence[str]],
               downtime: Optional[float]) -> None:
        self.pending = None
        after = list(hosts or ())
        step, clock = change.position or (None, None)
        lost: Optional[int] = 0  # a stop to grow checkpoints where it stops
        if change.change == "failure":
            known = change.step_reached is not None and step is not None
            lost = max(0, cast(int, change.step_reached) - cast(int, step)) if known else None
        self._append(change.run_dir, {
            "time": change.time, "change": change.change,
            "hosts_out": " ".join(h for h in change.hosts_before if h not in after),
            "hosts_in": " ".join(h for h in after if h not in change.hosts_before),
            "np_before": change.np_before, "np_after": np_after, "step": step,
            "wall_time_s": clock, "steps_lost": lost,
            "downtime_s": downtime, "why": change.why})

    def _append(self, run_dir: Path, row: Dict) -> None:
        try:
            CsvLog(run_dir / MEMBERSHIP_CSV, MEMBERSHIP_COLUMNS).append(row)
        except OSError as e:  # the run's record of itself is not worth ending it for
            if not self._trouble:
                self._trouble.append(f"cannot write {run_dir / MEMBERSHIP_CSV} ({e}): "
                                    "the job's membership changes are not recorded")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _int(value) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) else None
