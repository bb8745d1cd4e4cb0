"""Everything that runs outside the training job: ``mpitrain launch`` (:mod:`.job`, which
restarts a failed job, and :mod:`.watch`), hostfiles, the checks before a job starts
(:mod:`.preflight`), sweeps, and what each MPI calls things (:mod:`.dialect`).

The layer rule: nothing here imports TensorFlow or mpi4py (tests/unit/test_layout.py),
so these commands start in a second."""
