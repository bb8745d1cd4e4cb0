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

from . import BENCHMARKS
from .common import out_dir, write_summary
from .figures import draw


def main(argv):
    known = (*BENCHMARKS, "all")
    if not argv or argv[0] in ("-h", "--help") or not set(argv[0].split(",")) <= set(known):
        print(__doc__ + "\nbenchmarks:")
        for name, summary in BENCHMARKS.items():
            print(f"  {name:14s} {summary}")
        print(f"  {'all':14s} every one above, in that order, then summary.md")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    names = list(BENCHMARKS) if argv[0] == "all" else argv[0].split(",")
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
