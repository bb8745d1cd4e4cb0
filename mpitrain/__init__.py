"""mpitrain: MPI data-parallel training for TensorFlow (sync allreduce and async parameter server)."""

__version__ = "0.1.0"
