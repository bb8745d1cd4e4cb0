"""Offline reporting on finished runs: a run directory's files read and validated
(:mod:`.run_files`), figures (:mod:`.plots`, :mod:`.run_figures`) and the markdown
report (:mod:`.markdown`). No TensorFlow, no MPI: ``mpitrain plot|report`` start in a
second."""
