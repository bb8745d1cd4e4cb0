"""Elastic launches on the emulated cluster: a node lost mid-run, then returned.

For sync and async, on the emulated cluster2 (node0 with two slots, node1, node2;
links at 1 GbE): the run under ``mpitrain launch -np 2:4 --host-poll 5``, node2 lost
after the first checkpoint (every process in it killed and the node removed:
``scripts/netns-cluster fail node2``) and returned (``revive``: a fresh node at its
address) once the job went on without it; and, to compare the accuracy, the same run
undisturbed (``-np 4``). Measured from the launcher's own lines as they arrive:

* the loss: seconds from the kill until the job trains without node2 -- sync: the
  launcher, its job failed, has restarted it on node0 and node1 (the restart's mpirun
  started); async: the parameter server dropped node2's worker and the launcher, told
  by the run's status.json, left node2 out (the job never stopped);
* the return: seconds from the revival until the job runs on node2 again (node2
  probed after its cooldown, the job stopped at a checkpoint, the restart's mpirun
  started);
* the final accuracy against the undisturbed run's.

Async loses node2 twice (after the job went back on it, once it checkpointed there):
the second cooldown is twice the first, and both changes are timed (``later_losses``:
loss/return seconds).

What each change cost, as the launcher recorded it in the run's membership.csv
(``changes``: change:steps lost/downtime seconds each): the steps trained since the
checkpoint the job went on from (a failure's: a lower bound, rank 0 noting its step
every few seconds), checked against the checkpoint interval (``--checkpoint-steps``).

    python -m bench elastic [--quick]
"""

from __future__ import annotations

import csv
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from mpitrain.launch.watch import kill_tree

from .common import bench_parser, mnist_dir, mpi_env, out_dir, table, write_csv
from .netns import NETNS, Skipped, emulated_cluster, skipped

#: per mode: the training command, and whether the undisturbed run is made
FULL = {"sync": (["lenet", "--epochs", "3", "--checkpoint-steps", "60"], True),
        "async": (["lenet", "--async", "--epochs", "15", "--checkpoint-steps", "300",
                   "--liveness-floor", "3"], True)}
#: the smoke: LR, small batches so that the run lasts through both changes (the sync
#: accuracy still compared: the suite's check that a rescaled run ends where it should)
QUICK = {"sync": (["lr", "--batch-size", "4", "--lr", "0.05", "--epochs", "2",
                   "--checkpoint-steps", "200"], True),
         "async": (["lr", "--async", "--batch-size", "4", "--epochs", "6",
                    "--checkpoint-steps", "300", "--liveness-floor", "3"], False)}
COMMON = ["--quiet", "--sample-interval", "0", "--timeout", "60"]
#: the launcher's probe interval of a host left out (and its first cooldown)
HOST_POLL = "5"
BOUND = 900.0


class Lines:
    """A process's stderr lines, each with the time it arrived (read on a thread)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen = proc, []  # type: List[Tuple[float, str]]
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.seen.append((time.monotonic(), line.rstrip("\n")))

    def first(self, after: float, found: Callable[[str], bool]) -> Optional[float]:
        return next((t for t, line in list(self.seen) if t >= after and found(line)), None)

    def wait_for(self, after: float, found: Callable[[str], bool], what: str) -> float:
        deadline = time.monotonic() + BOUND
        while (t := self.first(after, found)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launch never showed {what}:\n" + self.text()[-3000:])
            time.sleep(0.1)
        return t

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(line for _, line in self.seen)


def netns(*args: str) -> None:
    done = subprocess.run([str(NETNS), *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"netns-cluster {' '.join(args)}: {done.stdout}{done.stderr}")


def launch(cluster: dict, np_: str, training: List[str], results: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mpitrain", "launch", "-np", np_, "-hostfile",
           str(cluster["hostfile"]), *[f"--mpirun-arg={a}" for a in cluster["mpirun_args"]],
           "--host-poll", HOST_POLL, *training, *COMMON, "--data-dir", mnist_dir(),
           "--results-dir", str(results)]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=mpi_env(), start_new_session=True)


def finish(proc: subprocess.Popen, lines: Lines) -> str:
    try:
        proc.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise RuntimeError("the launch did not end within its bound") from None
    text = lines.text()
    if proc.returncode != 0:
        raise RuntimeError(f"the launch failed (exit {proc.returncode}):\n{text[-3000:]}")
    return text


def runs(results: Path, name: str = "runs.csv") -> List[Dict[str, str]]:
    """The rows of ``results``/runs.csv (one per attempt), or of another table there."""
    with open(results / name, newline="") as f:
        return list(csv.DictReader(f))


def checkpoint_interval(training: List[str]) -> int:
    return int(training[training.index("--checkpoint-steps") + 1])


def checkpoint_since(results: Path, since: float) -> bool:
    """Whether a checkpoint of the run under ``results`` was written after ``since`` (a
    time.time())."""
    return any(p.stat().st_mtime > since for p in results.glob("*/checkpoint.npz"))


def disturbed(cluster: dict, mode: str, training: List[str], results: Path,
              cycles: int = 1) -> dict:
    """node2 lost after a checkpoint and returned once the job went on without it,
    ``cycles`` times (each loss after a checkpoint of the job back on node2); the times
    each change took, the cooldown the launcher gave node2 at each loss, the launcher's
    lines and the final runs.csv rows."""
    proc = launch(cluster, "2:4", training, results)
    lines = Lines(proc)
    try:
        found: Dict[str, list] = {"loss_s": [], "return_s": [], "cooldown_s": []}
        since = 0.0
        for cycle in range(1, cycles + 1):
            deadline = time.monotonic() + BOUND
            while not checkpoint_since(results, since):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("no checkpoint before the run ended:\n"
                                       + lines.text()[-3000:])
                time.sleep(0.2)
            lost_at = time.monotonic()
            netns("fail", "node2")
            went_on = lines.wait_for(lost_at, (lambda line: "launch: $ " in line)
                                     if mode == "sync" else
                                     (lambda line: "host node2 left out" in line),
                                     "the job going on without node2")
            left = lines.wait_for(lost_at, lambda line: f"lost {cycle} time(s)" in line,
                                  "node2 left out")
            said = next(line for t, line in lines.seen if t == left and "lost " in line)
            revived_at = time.monotonic()
            netns("revive", "node2")
            back = lines.wait_for(revived_at, lambda line: "launch: $ " in line
                                  and "-np 4 " in line, "the job restarted on node2")
            since = time.time()
            found["loss_s"].append(round(went_on - lost_at, 1))
            found["return_s"].append(round(back - revived_at, 1))
            found["cooldown_s"].append(float(said.split("probed again in ")[1].split(" s")[0]))
    except BaseException:
        kill_tree(proc.pid)  # (its mpirun and ranks: a bench that failed leaves nothing)
        raise
    text = finish(proc, lines)
    run_dir, = [p for p in results.iterdir() if p.is_dir()]
    return {**found, "stderr": text, "rows": runs(results),
            "changes": runs(run_dir, "membership.csv")}


def undisturbed(cluster: dict, training: List[str], results: Path) -> float:
    proc = launch(cluster, "4", training, results)
    finish(proc, Lines(proc))
    return float(runs(results)[-1]["test_accuracy"])


def measure(cluster: dict, cases: Dict[str, Tuple[List[str], bool]], tmp: Path) -> List[dict]:
    rows = []
    for mode, (training, compared) in cases.items():
        # async twice: a node that fails again waits a cooldown twice as long
        run = disturbed(cluster, mode, training, tmp / f"{mode}-disturbed",
                        cycles=2 if mode == "async" else 1)
        final = run["rows"][-1]
        row = {"mode": mode, "model": training[0], "loss_s": run["loss_s"][0],
               "return_s": run["return_s"][0],
               "later_losses": " ".join(f"{loss}/{back}" for loss, back in
                                        zip(run["loss_s"][1:], run["return_s"][1:])),
               "cooldowns_s": " ".join(f"{c:g}" for c in run["cooldown_s"]),
               "attempts": " ".join(f"{r['np']}:{r['status']}" for r in run["rows"]),
               "changes": " ".join(f"{c['change'].replace(' ', '-')}:{c['steps_lost'] or '?'}/"
                                   f"{c['downtime_s'] or '?'}" for c in run["changes"]),
               "steps_lost_max": max((int(c["steps_lost"]) for c in run["changes"]
                                      if c["steps_lost"]), default=None),
               "checkpoint_steps": checkpoint_interval(training),
               "final_np": final["np"], "accuracy": float(final["test_accuracy"]),
               "undisturbed_accuracy": None, "stderr": run["stderr"]}
        if compared:
            row["undisturbed_accuracy"] = undisturbed(cluster, training, tmp / f"{mode}-ref")
        rows.append(row)
    return rows


def checks_of(rows: List[dict], quick: bool) -> List[dict]:
    checks = []
    for row in rows:
        name = f"{row['model']} {row['mode']}"
        checks += [{"benchmark": "elastic", "ratio": f"{name}: seconds from node2's loss to the "
                    "job going on without it", "value": row["loss_s"], "target": "<= 30",
                    "met": row["loss_s"] <= 30},
                   {"benchmark": "elastic", "ratio": f"{name}: seconds from node2's return to "
                    "the job running on it again", "value": row["return_s"], "target": "<= 60",
                    "met": row["return_s"] <= 60}]
        if row["steps_lost_max"] is not None:
            checks.append({"benchmark": "elastic", "ratio": f"{name}: most steps a change "
                           "lost, in checkpoint intervals", "value": round(
                               row["steps_lost_max"] / row["checkpoint_steps"], 2),
                           "target": "<= 1", "met": row["steps_lost_max"] <=
                           row["checkpoint_steps"]})
        if row["undisturbed_accuracy"] is not None:
            gap = round(abs(row["accuracy"] - row["undisturbed_accuracy"]) * 100, 2)
            checks.append({"benchmark": "elastic", "ratio": f"{name}: final accuracy, pp from "
                           "the undisturbed run's", "value": gap, "target": "<= 0.5",
                           "met": None if quick else gap <= 0.5})
    return checks


def main(argv=None, out=None, cluster: Optional[dict] = None) -> dict:
    """``cluster``: an emulated cluster already up (its hostfile and mpirun arguments, as
    :func:`bench.netns.emulated_cluster` yields them); else one is brought up."""
    parser = bench_parser("elastic", __doc__, "LR, sync compared with an undisturbed run")
    args = parser.parse_args(argv)
    out = out or out_dir()
    cases = QUICK if args.quick else FULL
    kept = out / "elastic-runs"  # (each run's results directory, to look into)
    try:
        if cluster is not None:
            rows = measure(cluster, cases, kept)
        else:
            with emulated_cluster("1gbit") as up:
                rows = measure(up, cases, kept)
    except Skipped as why:
        return skipped("elastic", why)
    for row in rows:
        (out / f"elastic-{row['mode']}.log").write_text(row["stderr"] + "\n")
    shown = [{k: v for k, v in row.items() if k != "stderr"} for row in rows]
    write_csv(out / "elastic.csv", shown)
    print(table(shown, list(shown[0])))
    return {"rows": rows, "checks": checks_of(rows, args.quick)}


if __name__ == "__main__":
    main()
