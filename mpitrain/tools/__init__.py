"""Tools around training, run outside the training job or before it starts.

``plots`` and ``report`` (figures and the markdown report of results),
``sweep`` (a grid of runs, resumable), ``preflight`` and ``hostfile`` (launch
checks before mpirun; preflight's version comparison also runs inside every job).
They read the runs' files through :mod:`mpitrain.schema`; none of them trains.
The command line reaches them as ``mpitrain plot|report|sweep|check``.
"""
