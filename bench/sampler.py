"""Cost of the telemetry sampler: epoch time with sampling on vs off.

Runs sync LR at -np 3 with ``--sample-interval 1`` (the default) and ``0`` (off),
interleaved so machine noise hits both alike (all runs in one launch: start-up paid
once; each run starts and stops its own sampler), and prints the median ratio on/off
(target <= 1.03 at the default). One sample's CPU is also timed directly, in
this process. ``--intervals 0,1,0.1`` adds sampling ten times more often.

    python -m bench sampler [--quick] [--repeats N] [--intervals LIST]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from .common import bench_parser, mnist_dir, out_dir, table, train_many, write_csv

TARGET = 1.03


def main(argv=None, out=None) -> dict:
    parser = bench_parser("sampler", __doc__, "1 repeat of 2 epochs (smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--intervals", default="0,1",
                        help="sampling intervals in seconds; must include 0 (off) and 1 (the default)")
    args = parser.parse_args(argv)
    repeats, epochs = (1, 2) if args.quick else (args.repeats, args.epochs)
    intervals = args.intervals.split(",")
    if not {"0", "1"} <= set(intervals):
        parser.error("--intervals must include 0 (off) and 1 (the default)")
    order = [(r, interval) for r in range(repeats) for interval in intervals]
    with tempfile.TemporaryDirectory() as tmp:
        # one launch (start-up paid once): each run starts and stops its own sampler
        found = train_many(3, {f"{r}-{i}": ["lr", "--data-dir", mnist_dir(), "--epochs",
                                            epochs, "--sample-interval", i]
                               for r, i in order}, Path(tmp))
    times = {i: [float(found[f"{r}-{i}"]["wall_time_s"]) / epochs for r in range(repeats)]
             for i in intervals}
    per_sample = sample_cost_s()
    off = statistics.median(times["0"])
    rows = [{"sample_interval_s": i, "median_s_per_epoch": round(statistics.median(t), 4),
             "runs": len(t), "ratio_vs_off": round(statistics.median(t) / off, 3)}
            for i, t in times.items()]
    path = (out or out_dir()) / "sampler.csv"
    write_csv(path, rows)
    print(f"Sync LR, -np 3, {epochs} epochs, {repeats} interleaved repeats:")
    print(table(rows, list(rows[0])))
    default = next(r["ratio_vs_off"] for r in rows if r["sample_interval_s"] == "1")
    print(f"\nepoch time with sampling every 1 s / without = {default:.3f} "
          f"(target <= {TARGET}: {'met' if default <= TARGET else 'SHORT'})")
    print(f"one sample (process CPU and RSS, host CPU and network: the node leader's "
          f"work) takes {1e6 * per_sample:.0f} us: {100 * per_sample:.3f}% of a core at "
          "one sample per second")
    print(f"results: {path}")
    return {"checks": [{"benchmark": "sampler", "ratio": "epoch time, sampling every 1 s / off",
                        "value": default, "target": f"<= {TARGET}", "met": default <= TARGET},
                       {"benchmark": "sampler", "ratio": "CPU share of one rank's sampler at "
                        "1 sample/s (directly timed)", "value": round(per_sample, 6),
                        "target": "reported", "met": None}]}


def sample_cost_s(samples: int = 2000) -> float:
    """Seconds per sample of the node leader's sampler, timed in this process."""
    import time

    from mpitrain.results.telemetry import Sampler

    sampler = Sampler(0, "bench", "single", 1.0, node_leader=True)
    t0 = time.perf_counter()
    for _ in range(samples):
        sampler.sample()
    return (time.perf_counter() - t0) / samples


if __name__ == "__main__":
    main()  # returns the checks for bench/__main__.py; exit status 0
