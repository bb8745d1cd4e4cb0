"""Recording a run whose rank 0 died before it recorded how the run ended: by
``mpitrain launch`` after an attempt (:func:`record_lost_attempt`), or by the run's
witness (:mod:`mpitrain.results.witness`) after rank 0's process is gone, run as
``python -m mpitrain.results.lost_run RUN_DIR PID ROWS_BEFORE new|resumed``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..atomic import write_json_atomic
from ..errors import ResultsError
from .run_dir import append_run_row, run_ended, run_identity, run_rows
from ..userfiles import read_bounded, read_json_object

REASON = ("rank 0 was killed before it could record how the run ended (a signal, the "
          "out-of-memory killer, or mpirun ending the job when another rank died: "
          "mpirun's output names that rank)")


def record_lost_attempt(run_dir: Path, reason: str, resumed: bool, token: Optional[str],
                        rows_before: int) -> bool:
    """For ``mpitrain launch`` and the witness: write the runs.csv row of an attempt
    whose rank 0 did not (killed first). Whether it did is told by runs.csv itself: the
    attempt has its row if the run has more rows than ``rows_before`` (its rows when
    the attempt began, see :func:`~mpitrain.results.run_dir.run_rows`), whatever
    status.json says (rank 0 can be killed between writing its row and saying so).
    Without one, the row takes the attempt's own ending from status.json (the one
    carrying the attempt's ``token``: rank 0 killed while it recorded its failure), else
    says failed with ``reason`` (rank 0 killed while its status said running, or before
    it wrote any: the status.json is then an earlier attempt's). The row's settings come
    from config.json (the newest resumed-*.json if the attempt was ``resumed``). True if
    it recorded; False if there was nothing to record or no room."""
    run_dir = Path(run_dir)
    try:
        if run_rows(run_dir) > rows_before or not (run_dir / "config.json").is_file():
            return False
        status = read_json_object(run_dir / "status.json")
        if not (status and status.get("launch_attempt") == token):
            status = {"launch_attempt": token}  # an earlier attempt's, or none
        if not run_ended(status):
            status = {**status, "status": "failed", "reason": reason}
        sessions = sorted(run_dir.glob("resumed-*.json")) if resumed else []
        meta = json.loads(read_bounded(sessions[-1] if sessions else run_dir / "config.json"))
        row = {"run": run_dir.name, **_identity_of(meta, status), "resumed": resumed}
        append_run_row(run_dir.parent / "runs.csv", row)
        write_json_atomic(run_dir / "status.json", {
            **status, "runs_csv": "written", "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    except (OSError, ValueError, KeyError, TypeError, ResultsError):
        return False
    return True


def _identity_of(meta: dict, status: dict) -> dict:
    """runs.csv's columns that a run's config.json (``meta``) and ``status`` tell."""
    config, ended, reason = meta["config"], status["status"], status.get("reason", "")
    if "dataset" not in meta:  # a script's run under mpitrain.horovod: its settings are few
        return {"model": config["model"], "mode": config["mode"], "np": config["world_size"],
                "workers": config["workers"], "engine": config["engine"], "status": ended,
                "reason": reason}
    return run_identity(config, meta["dataset"], ended, reason,
                        (meta.get("rescaled") or {}).get("rule", ""))


def record_if_lost(run_dir: Path, pid: int, rows_before: int, resumed: bool) -> bool:
    """After process ``pid`` (rank 0) is gone: record the run as
    :func:`record_lost_attempt` does if that process left it running, or ended without
    its row. True if it recorded."""
    status = read_json_object(run_dir / "status.json")
    if not status:
        return False
    writer = status.get("writer")
    left_running = (status.get("status") == "running" and isinstance(writer, dict)
                    and writer.get("pid") == pid)
    row_pending = run_ended(status) and status.get("runs_csv") == "pending"
    if not (left_running or row_pending):
        return False
    return record_lost_attempt(run_dir, REASON, resumed, status.get("launch_attempt"),
                               rows_before)


def main(argv) -> int:
    """The witness: waits for end-of-file on stdin (rank 0's process gone, or its run
    recorded), then records the run if rank 0 could not."""
    run_dir, pid, rows_before, resumed = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    while sys.stdin.buffer.read(4096):  # nothing is written: returns once rank 0 has
        pass  # exited or closed the pipe
    record_if_lost(run_dir, pid, rows_before, resumed == "resumed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
