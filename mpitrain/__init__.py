"""mpitrain: MPI data-parallel training for TensorFlow (sync allreduce and async parameter server).

From a script under mpirun: :func:`mpitrain.fit` (see :mod:`mpitrain.api`); from the
shell: ``mpitrain MODEL [OPTIONS]`` (see :mod:`mpitrain.cli.commands`).
"""

__version__ = "0.1.0"

import os as _os

# oneDNN's kernels, unless the user set it. TensorFlow's x86 wheels use them by default
# only on CPUs with AVX-512 VNNI/BF16 or AMX; elsewhere (AVX2) they fall back to Eigen's,
# which take several times as long for a convolutional model's step (docs/architecture.md,
# "oneDNN's kernels by default"); results differ in rounding only (sums in another order). Set
# here, it is set before any mpitrain module imports TensorFlow (the package runs
# first), and it reaches a script that imports TensorFlow after mpitrain; TensorFlow
# reads it when it loads.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

from .api import FitResult, fit, stream_shards  # noqa: E402  (light: TensorFlow loads on use)

__all__ = ["fit", "FitResult", "stream_shards", "__version__"]
