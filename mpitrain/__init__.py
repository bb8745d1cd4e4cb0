"""mpitrain: MPI data-parallel training for TensorFlow (sync allreduce and async parameter server).

From a script under mpirun: :func:`mpitrain.fit` (see :mod:`mpitrain.api`); from the
shell: ``mpitrain MODEL [OPTIONS]`` (see :mod:`mpitrain.cli`).
"""

__version__ = "0.1.0"

import os as _os

# TensorFlow reads it when it loads, so it reaches a script that imports TensorFlow after
# mpitrain (see TENSORFLOW_ENV in mpitrain.models.keras_import); the user's value wins
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from .api import FitResult, fit  # noqa: E402  (light: TensorFlow and MPI load on the first fit)

__all__ = ["fit", "FitResult", "__version__"]
