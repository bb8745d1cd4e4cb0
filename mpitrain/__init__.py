"""mpitrain: MPI data-parallel training for TensorFlow (sync allreduce and async parameter server).

From a script under mpirun: :func:`mpitrain.fit` (see :mod:`mpitrain.api`); from the
shell: ``mpitrain MODEL [OPTIONS]`` (see :mod:`mpitrain.cli`).
"""

__version__ = "0.1.0"

from .api import FitResult, fit  # noqa: E402  (light: TensorFlow and MPI load on the first fit)

__all__ = ["fit", "FitResult", "__version__"]
