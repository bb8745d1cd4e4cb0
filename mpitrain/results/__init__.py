"""A run's output: its directory and the row in ``runs.csv`` (:mod:`.run_dir`), the CSV
files' columns (:mod:`.schema`) and what every rank measures about itself
(:mod:`.telemetry`)."""
