"""``python -m bench NAME[,NAME...] [--quick]`` runs benchmarks; ``python -m bench all``
runs them all.

Every benchmark measures its comparisons side by side in one run and prints
ratios; ``all`` writes everything into one ``results/bench/<timestamp>/`` with a
``summary.md`` (each ratio with its target and whether it is met, the minutes each
benchmark took, and every CSV as a table).
"""

import importlib
import sys
import time

from .common import out_dir, write_summary
from .figures import draw

BENCHMARKS = {
    "comm": "allreduce bus bandwidth vs raw mpi4py and memcpy (LR, LeNet, AlexNet sizes)",
    "engines": "sync epoch time and accuracy: mpitrain vs Horovod vs MultiWorkerMirrored",
    "async_engines": "async epoch time and accuracy: mpitrain vs ParameterServerStrategy",
    "scaling": "throughput at 1/2/3 workers per model and mode; peak memory per rank",
    "sync_step": "sync LR step time at -np 1..4 and the allreduce's share of a step",
    "async_ps": "async server update rate vs the raw-MPI bound; async vs sync epoch time",
    "sampler": "epoch time with the telemetry sampler on vs off",
    "netns": "LR and LeNet epoch time on the emulated 3-node cluster, 10 GbE vs 1 GbE",
    "compression": "--compression fp16 vs float32 on the emulated cluster at 1 GbE",
    "lower_bound": "sync step / compute-only step at 2 workers (LeNet, AlexNet)",
    "overlap": "AlexNet sync step time with --overlap on vs off, shared memory and 1 GbE",
    "startup": "CPU of importing TensorFlow and Keras: mpitrain's way vs plain",
    "mpis": "Open MPI 4.1 vs Open MPI 5 vs MPICH: allreduce, LR/LeNet sync and async epochs",
}
ALL = ["comm", "engines", "async_engines", "scaling", "sync_step", "async_ps", "sampler",
       "netns", "compression", "lower_bound", "overlap", "startup", "mpis"]


def main(argv):
    known = (*BENCHMARKS, "all")
    if not argv or argv[0] in ("-h", "--help") or not set(argv[0].split(",")) <= set(known):
        print(__doc__ + "\nbenchmarks:")
        for name, summary in BENCHMARKS.items():
            print(f"  {name:14s} {summary}")
        print(f"  {'all':14s} every one above, in that order, then summary.md")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    names = ALL if argv[0] == "all" else argv[0].split(",")
    out = out_dir()
    checks, failed, started, minutes = [], [], time.time(), {}
    for name in names:
        print(f"\n=== {name}: {BENCHMARKS[name]} ===", flush=True)
        began = time.time()
        try:
            result = importlib.import_module(f"bench.{name}").main(argv[1:], out) or {}
        except Exception as exc:  # one broken benchmark must not cost the others' results
            print(f"bench {name}: FAILED: {exc}", file=sys.stderr, flush=True)
            failed.append(name)
            result = {"checks": [{"benchmark": name, "ratio": "ran to completion",
                                  "value": f"failed: {str(exc).splitlines()[0][:120]}",
                                  "target": "runs", "met": False}]}
        checks += result.get("checks", [])
        minutes[name] = (time.time() - began) / 60
    summary = write_summary(out, checks, argv, time.time() - started, minutes)
    figures = draw(out)
    print(f"\nsummary: {summary}\nfigures: {', '.join(p.name for p in figures) or 'none'}")
    return 1 if failed else 0


sys.exit(main(sys.argv[1:]))
