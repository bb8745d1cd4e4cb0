"""PowerSGD side by side with PyTorch DDP's ``powerSGD_hook`` on the emulated cluster
(part of ``bench compression``): the same model, rank, data, batch, optimizer and link.

mpitrain runs on cluster2 as everywhere in ``bench compression`` (rank 0 and worker 1
on node0, workers 2 and 3 on node1 and node2); DDP's three workers run one on each
node (``scripts/netns-cluster exec``), rank 0 on node0, over gloo through the same
shaped links, with the intra-op threads mpitrain's workers used. Both sides exchange
their first ``EXACT_STEPS`` steps exactly (PyTorch's ``start_powerSGD_iter`` cannot be
lower with error feedback) and compress every matrix whose factors are at most half
its values (PyTorch's rule; mpitrain's ``--compression-min-size 0``); both compress the
whole gradient after back-propagation (DDP with one bucket: ONE_BUCKET_MB says why).
Each side also runs without compression, for its own baseline (DDP with its default
buckets, overlapped). Timed: the epoch (training time / epochs, the first epoch's
tracing included) and the steady epoch (between the first and the last). Differences
that stay: DDP views a kernel as output x input, mpitrain as fan-in x filters;
TensorFlow's kernels against PyTorch's (their compute-only steps: ``bench ddp``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Dict, List

from .common import REPO, mnist_dir, steady_epoch_seconds
from .ddp import CASES, DDP_ATTEMPTS, error_lines, steady_epoch, torch_python
from .engines import LIKE_THE_BASELINES
from .netns import NETNS

WORKERS = 3  # one per node of cluster2
RANK = 2
EXACT_STEPS = 2
EPOCHS = 3  # one steady epoch between the first and the last
#: the model, and in quick mode: (model, its options beyond bench ddp's CASES)
FULL = ("alexnet", ["--epochs", str(EPOCHS)])
QUICK = ("lenet", ["--epochs", "1", "--steps", "3"])
#: what one DDP worker may take (AlexNet's 12 steps take a few minutes here)
DDP_TIMEOUT = 1800
#: the rendezvous port on node0
PORT = 29561
#: DDP's bucket size with powerSGD_hook: one bucket for the whole gradient. With
#: several, the hooks of two buckets interleave their gloo collectives differently on
#: different ranks, and gloo aborts ("Received data size doesn't match expected size",
#: seen here with AlexNet's five buckets); one bucket is also what mpitrain does
ONE_BUCKET_MB = 4096


def mpitrain_runs(quick: bool) -> Dict[str, List[str]]:
    """The mpitrain side's runs ({compression: arguments}), for the compression bench's
    launch on cluster2."""
    model, extra = QUICK if quick else FULL
    common = [model, *CASES[model], *extra, "--eval-every", extra[1], "--checkpoint-every",
              extra[1], *LIKE_THE_BASELINES, "--data-dir", mnist_dir(),
              "--allreduce-wait", "poll"]  # (why: bench.compression.POLL)
    return {"none": common,
            "powersgd": [*common, "--compression", "powersgd", "--compression-rank", str(RANK),
                         "--compression-warmup-steps", str(EXACT_STEPS),
                         "--compression-min-size", "0"]}


def measured_ours(row: dict, quick: bool) -> dict:
    epochs = float(row["epochs"])
    config = json.loads((Path(row["run_dir"]) / "config.json").read_text())
    return {"epoch_s": float(row["wall_time_s"]) / epochs,
            "steady_epoch_s": None if quick else steady_epoch_seconds(row["run_dir"]),
            "threads": config["ranks"][-1].get("threads"),
            "test_accuracy": float(row["test_accuracy"])}


def ddp_run(python: str, compression: str, quick: bool, threads: int, tmp: Path) -> dict:
    """DDP's three workers on node0..2 (rank r on node r), gloo over the shaped links;
    its epoch times. Every worker is bounded; a failure raises with its output, after
    one more run if a worker was killed by a signal (gloo's occasional abort, as
    ``bench ddp`` retries it)."""
    attempt = 1
    while True:
        try:
            return _ddp_workers(python, compression, quick, threads, tmp)
        except _KilledBySignal as failure:
            if attempt == DDP_ATTEMPTS:
                raise RuntimeError(str(failure)) from None
            print(f"compression: {failure}\ncompression: running DDP once more", flush=True)
            attempt += 1


class _KilledBySignal(RuntimeError):
    pass


def _ddp_workers(python: str, compression: str, quick: bool, threads: int, tmp: Path) -> dict:
    model, extra = QUICK if quick else FULL
    out = tmp / f"ddp-{compression}.json"
    args = [python, "-m", "bench.torch_ddp", "--model", model, *CASES[model], *extra,
            "--data-dir", mnist_dir(), "--json-out", str(out), "--threads", str(threads)]
    if compression == "powersgd":
        args += ["--powersgd-rank", str(RANK), "--powersgd-exact-steps", str(EXACT_STEPS),
                 "--bucket-cap-mb", str(ONE_BUCKET_MB)]
    env = {**os.environ, "WORLD_SIZE": str(WORKERS), "MASTER_ADDR": "10.77.0.1",
           "MASTER_PORT": str(PORT), "GLOO_SOCKET_IFNAME": "eth0",
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    workers = [subprocess.Popen([str(NETNS), "exec", f"node{r}", *args], cwd=REPO,
                                env={**env, "RANK": str(r), "LOCAL_RANK": "0"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
               for r in range(WORKERS)]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=DDP_TIMEOUT)[0])
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    failed = [(r, w.returncode) for r, w in enumerate(workers) if w.returncode]
    if failed:
        error = _KilledBySignal if any(code < 0 for _, code in failed) else RuntimeError
        raise error("\n".join([f"DDP on the emulated cluster failed ({failed}):",
                               *(line for o in outputs for line in error_lines(o))]))
    r = json.loads(out.read_text())
    return {"epoch_s": r["train_s"] / r["epochs"], "steady_epoch_s": steady_epoch(r, quick),
            "threads": r["threads"], "test_accuracy": r["test_accuracy"]}


def rows_and_checks(found: Dict[str, dict], quick: bool, tmp: Path) -> tuple:
    """Run DDP beside mpitrain's ``found`` runs (runs.csv rows by compression, made on
    the cluster that is up); (rows, checks). Skipped (one row) without PyTorch."""
    python = torch_python()
    if not python:
        return [], [{"benchmark": "compression", "ratio": "DDP powerSGD_hook beside",
                     "value": "skipped", "target": "no PyTorch: bash setup.sh installs it",
                     "met": None}]
    model = (QUICK if quick else FULL)[0]
    rows, ours = [], {name: measured_ours(row, quick) for name, row in found.items()}
    theirs = {name: ddp_run(python, name, quick, int(ours[name]["threads"] or 1), tmp)
              for name in ours}
    for side, measured in (("mpitrain", ours), ("ddp", theirs)):
        for name, m in measured.items():
            rows.append({"model": model, "side": side, "compression": name,
                         **{k: round(v, 4) if isinstance(v, float) else v
                            for k, v in m.items()}})
    key = "epoch_s" if quick else "steady_epoch_s"
    ratio = round(ours["powersgd"][key] / theirs["powersgd"][key], 3)
    checks = [{"benchmark": "compression",
               "ratio": f"{model} {key} at 1 GbE, mpitrain powersgd / DDP powerSGD_hook",
               "value": ratio, "target": "reported" if quick else "<= 1",
               "met": None if quick else ratio <= 1}]
    return rows, checks
