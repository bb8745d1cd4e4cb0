"""LR and LeNet epoch time on the emulated 3-node cluster2 (network namespaces),
with links shaped to 10 GbE and to 1 GbE.

Ranks on different "nodes" talk over real TCP through shaped veth links
(scripts/netns-cluster); all nodes still share this machine's cores. Prints the
ratio 1 GbE / 10 GbE per model and mode. Note: on 2 cores TCP itself tops out
below 10 Gbit/s, so the 10 GbE shaping does not bind here; and the kernel has
no netem, so links are rate-limited but not delayed.

    python -m bench netns [--quick]
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from .common import bench_parser, REPO, mnist_dir, out_dir, table, train_many, write_csv

NETNS = REPO / "scripts" / "netns-cluster"
MODELS = {"lr": ["--epochs", "3"], "lenet": ["--epochs", "1"]}
QUICK = {"lr": ["--steps", "20"], "lenet": ["--steps", "10"]}


class Skipped(Exception):
    """The emulated cluster cannot be made here (no root, no veth); the reason."""


@contextlib.contextmanager
def emulated_cluster(link: str, nodes: int = 3) -> Iterator[dict]:
    """The emulated cluster of ``nodes`` nodes up with links shaped to ``link`` (e.g.
    '1gbit'); yields the ``train`` keywords that run on it (cluster2's hostfile, mpirun
    arguments). Torn down after."""
    up = subprocess.run([NETNS, "up", "--link", link, "--nodes", str(nodes)],
                        capture_output=True, text=True)
    if up.returncode == 77:
        raise Skipped((up.stdout + up.stderr).strip())
    if up.returncode != 0:
        raise RuntimeError(up.stdout + up.stderr)
    try:
        mpirun_args = subprocess.run([NETNS, "mpirun-args"], capture_output=True, text=True,
                                     check=True).stdout.split()
        hostfile = subprocess.run([NETNS, "hostfile", "cluster2"], capture_output=True,
                                  text=True, check=True).stdout.strip()
        yield {"hostfile": Path(hostfile), "mpirun_args": mpirun_args}
    finally:
        subprocess.run([NETNS, "down"], capture_output=True)


def skipped(benchmark: str, why, what: str = "emulated cluster") -> dict:
    """The checks of a benchmark that could not run here: ``what`` is missing, ``why``."""
    print(f"skipped: {why}")
    return {"checks": [{"benchmark": benchmark, "ratio": what,
                        "value": "skipped", "target": str(why)[:80], "met": None}]}


def per_epoch(row: dict) -> float:
    return round(float(row["wall_time_s"]) / float(row["epochs"]), 4)


def main(argv=None, out=None) -> dict:
    parser = bench_parser("netns", __doc__, "LR only, a few steps (smoke)")
    args = parser.parse_args(argv)
    out = out or out_dir()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in ("10gbit", "1gbit"):
            try:
                with emulated_cluster(link) as cluster:
                    cases = [(model, mode) for model in MODELS
                             if not args.quick or model == "lr" for mode in ("sync", "async")]
                    # one launch per link: start-up paid once, each run timed from its start
                    found = train_many(4, {f"{model}-{mode}": [
                        model, *MODELS[model], *(QUICK[model] if args.quick else []),
                        "--data-dir", mnist_dir(), *(["--async"] if mode == "async" else [])]
                        for model, mode in cases}, Path(tmp) / link, **cluster)
                for (model, mode), row in zip(cases, found.values()):
                    rows.append({"link": link, "model": model, "mode": mode,
                                 "s_per_epoch": per_epoch(row),
                                 "node0_mb": round(float(row["node0_rx_mb"]) +
                                                   float(row["node0_tx_mb"]), 2)})
            except Skipped as why:
                return skipped("netns", why)
    write_csv(out / "netns.csv", rows)
    print(table(rows, list(rows[0])))
    checks = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in ("sync", "async"):
            fast, slow = [r["s_per_epoch"] for r in rows if r["model"] == model
                          and r["mode"] == mode]
            checks.append({"benchmark": "netns", "ratio": f"{model} {mode} epoch time on "
                           "emulated cluster2, 1 GbE / 10 GbE", "value": round(slow / fast, 3),
                           "target": "reported", "met": None})
            print(f"{checks[-1]['ratio']}: {checks[-1]['value']:.2f}")
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
