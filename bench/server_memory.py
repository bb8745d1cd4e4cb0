"""The async server's memory against workers: its peak RSS (every server's, the
largest) with 2 workers and with 16 (``--workers``), AlexNet at 224x224 with its
defaults, three ways: through MPI (as across hosts), in shared memory (as on one host),
and two servers through MPI (``--servers 2``). The server is the real one with the
real model; the workers push zeros without TensorFlow (:func:`bench.async_ps.rank_side`,
four pushes each), so that 16 of them fit on one machine: a server's memory does not
depend on how a gradient was computed, and pushes as fast as MPI takes them keep every
worker's message in flight at once, the pools' worst case (docs/architecture.md,
"Wire format (`train/protocol.py`)", its paragraph on the server's memory). A worker
count whose messages would not fit in the free memory is left out and named. Ratio:
the peak at each worker count over the peak at the first (target <= 1.25).

    python -m bench server_memory [--quick] [--workers 2,16] [--image-size 224]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

from .async_ps import launch
from .common import available_mb, bench_parser, out_dir, slots_file, table, write_csv

#: the model and image side whose messages the server keeps
MODEL = ("alexnet", 224)
#: the peak at the most workers over the peak at the fewest, at most
BOUND = 1.25
#: the ways to run the server: the issue's three
RUNS = [("through MPI", {"shared_memory": "off"}), ("shared memory", {}),
        ("two servers, through MPI", {"servers": 2, "shared_memory": "off"})]
#: pushes of each worker
PUSHES = 4


def main(argv=None, out=None) -> dict:
    parser = bench_parser("server_memory", __doc__, "LR, 1 and 2 workers, through MPI (smoke)")
    parser.add_argument("--workers", default="2,16",
                        help="the worker counts compared (the first is the reference)")
    parser.add_argument("--image-size", type=int, default=MODEL[1],
                        help="AlexNet's image side (smaller: smaller messages, the same "
                        "pools; the suite's test takes 32)")
    args = parser.parse_args(argv)
    out = out or out_dir()
    model, size = ("lr", 0) if args.quick else (MODEL[0], args.image_size)
    counts = [1, 2] if args.quick else [int(n) for n in args.workers.split(",")]
    rows, message_mb, left_out = [], 0.0, []
    for name, settings in RUNS[:1] if args.quick else RUNS:
        for workers in counts:
            row = measure(out, name, settings, workers, model, size, message_mb)
            if row:
                rows.append(row)
                message_mb = max(message_mb, row["message_mb"])
            else:
                left_out.append((name, workers))
    for row in rows:
        first = next(r for r in rows if r["run"] == row["run"])
        row["vs_first"] = round(row["server_peak_rss_mb"] / first["server_peak_rss_mb"], 3)
    write_csv(out / "server_memory.csv", rows)
    shape = f"{model} {size}x{size}" if size else model
    print(f"The async server's peak RSS against workers ({shape}, workers pushing zeros, "
          f"{PUSHES} pushes each; of every server, the largest):")
    print(table(rows, list(rows[0])))
    checks = [{"benchmark": "server_memory", "ratio": f"server peak RSS, {row['workers']} / "
               f"{counts[0]} workers, {shape}, {row['run']}", "value": row["vs_first"],
               "target": f"<= {BOUND}", "met": row["vs_first"] <= BOUND}
              for row in rows if row["workers"] != counts[0]]
    # a worker count that did not fit is a check not made, said as such
    return {"checks": checks + [{"benchmark": "server_memory", "ratio": f"server peak RSS, "
                                 f"{workers} workers, {shape}, {name}", "value":
                                 "left out: not enough free memory", "target": f"<= {BOUND}",
                                 "met": False} for name, workers in left_out]}


def measure(out: Path, name: str, settings: Dict, workers: int, model: str, size: int,
            message_mb: float) -> Dict:
    """One launch: the server's peak RSS with ``workers`` workers; {} where their
    messages (two each, three in shared memory, and the server's) would not fit."""
    np_ = workers + settings.get("servers", 1)
    shared = settings.get("shared_memory") != "off"
    needed, free = (workers * (3 if shared else 2) + 8) * message_mb, available_mb()
    if needed > free:
        print(f"server_memory: {name} at {workers} workers left out: about {needed:.0f} MB "
              f"needed, {free:.0f} MB free")
        return {}
    found = launch(np_, "mpitrain-default", PUSHES * workers, hostfile=slots_file(out, np_),
                   model=model, image_size=size, settings=json.dumps(settings))
    return {"run": name, "workers": workers, "np": np_,
            "message_mb": round(found["message_mb"], 2),
            "server_peak_rss_mb": round(found["server_peak_rss_mb"])}


if __name__ == "__main__":
    main()
