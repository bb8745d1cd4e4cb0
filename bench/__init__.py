"""mpitrain benchmarks: every comparison measured side by side in one run, printed as ratios.

Run ``python -m bench --help``. Results land in ``results/bench/<timestamp>/``.
"""
