"""``python -m bench NAME [options]``: run one benchmark (``--help`` lists them)."""

import importlib
import sys

BENCHMARKS = {
    "sync_step": "sync LR step time at -np 1..4 and the allreduce's share of a step",
    "async_ps": "async server update rate vs the raw-MPI bound; async vs sync epoch time",
    "sampler": "epoch time with the telemetry sampler on vs off",
}


def main(argv):
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m bench NAME [--quick] [options]\n\nbenchmarks:")
        for name, summary in BENCHMARKS.items():
            print(f"  {name:14s} {summary}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(f"bench.{argv[0]}").main(argv[1:])


sys.exit(main(sys.argv[1:]))
