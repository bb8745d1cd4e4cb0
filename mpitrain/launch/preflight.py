"""Checks that fail fast with one clear line instead of hanging or crashing later.

Two halves:

* :func:`check_launch` runs before mpirun, without MPI (``mpitrain check``): the
  hostfile exists, is readable and well formed (line and reason), -np fits its
  slots (or oversubscription is allowed), -np suits the mode. mpirun itself
  rejects these cases with multi-line banners (and a malformed ``slots=x``
  as an "internal error"), before any rank could explain.
* :func:`check_ranks` runs inside every job (training runs and ``mpitrain
  check``'s own short job): rank 0 compares the versions every rank runs
  (Python, TensorFlow, numpy, mpi4py, the MPI library, mpitrain) and names the host that
  differs. Data on every host is checked by :func:`mpitrain.data.load`, which
  makes the ranks agree on what they loaded.

And :func:`check_engine`, of both: the sync engine asked for (``--allreduce horovod``)
is installed, on the command line before MPI starts and on every rank of the job.
"""

from __future__ import annotations

import platform
from collections import defaultdict
from importlib import metadata
from typing import Dict, List, Optional

from .. import __version__
from ..errors import UsageError
from . import hostfile

COMPARED = ("python", "tensorflow", "numpy", "mpi4py", "mpi", "mpitrain")


def installed_version(*distributions: str) -> str:
    """The installed version of the first of ``distributions`` found, without importing it."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "missing"


HOROVOD_INSTALL = ("HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 "
                   "HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 pip install "
                   "--no-build-isolation horovod==0.28.1")
#: the environment setup.sh builds Horovod in (TensorFlow 2.18: Horovod's newest that builds)
HOROVOD_VENV = ".venv-horovod"


def horovod_missing() -> str:
    """The one-line error for --allreduce horovod where Horovod is not installed."""
    tf = installed_version("tensorflow-cpu", "tensorflow")
    return (f"Horovod is not installed in this environment (TensorFlow {tf}); Horovod 0.28.1 "
            "builds only against TensorFlow 2.16-2.18 (Python 3.10-3.12): bash setup.sh "
            f"builds it into {HOROVOD_VENV}, so run {HOROVOD_VENV}/bin/python -m mpitrain "
            "under mpirun, or install tensorflow-cpu==2.18.1 and then: " + HOROVOD_INSTALL)


def check_engine(allreduce: str) -> None:
    """UsageError, one line saying how to install it, if ``allreduce`` (the sync
    engine, --allreduce) is not installed in this environment."""
    from importlib.util import find_spec

    if allreduce == "horovod" and find_spec("horovod") is None:
        raise UsageError(horovod_missing())


def local_versions(mpi: str = "missing") -> Dict[str, str]:
    """What this process runs, as compared across ranks (``mpi``: the MPI library's name
    and version, e.g. Open MPI 5.0.11, which the caller that loaded it knows)."""
    return {"python": platform.python_version(),
            "tensorflow": installed_version("tensorflow-cpu", "tensorflow"),
            "numpy": installed_version("numpy"), "mpi4py": installed_version("mpi4py"),
            "mpi": mpi, "mpitrain": __version__}


def check_launch(np_: int, hostfile_path: Optional[str], oversubscribe: bool,
                 async_mode: bool, servers: int = 1) -> List[str]:
    """Validate a launch before mpirun; returns the rank -> role -> host lines
    (``servers``: async --servers K, ranks 0..K-1 serve; checked against -np by the
    config).

    Raises UsageError (one line) for a missing/unreadable/malformed hostfile,
    -np larger than its slots without oversubscription, or -np too small.
    """
    if np_ < 1:
        raise UsageError(f"-np must be at least 1 (got {np_})")
    if async_mode and np_ < 2:
        raise UsageError("--async needs a parameter server and at least one worker: "
                         "run with -np 2 or more")
    if hostfile_path is None:
        hosts = [hostfile.Host(platform.node(), np_)]
    else:
        hosts = hostfile.read(hostfile_path)
        if not oversubscribe:
            hostfile.placement(hosts, np_)  # raises if -np exceeds the slots
    placement = _round_robin(hosts, np_) if oversubscribe else hostfile.placement(hosts, np_)
    servers = min(servers, np_ - 1) if np_ > 1 else 0
    roles = ["single"] if np_ == 1 else (
        ["parameter server"] if servers == 1 else
        [f"parameter server {s + 1}/{servers}" for s in range(servers)]) + \
        ["worker"] * (np_ - servers)
    return [f"rank {r}: {role} on {host}" for r, (role, host) in enumerate(zip(roles, placement))]


def _round_robin(hosts, np_: int) -> List[str]:
    # mpirun --oversubscribe keeps filling slots in order and wraps around
    slots = [h.name for h in hosts for _ in range(h.slots)]
    return [slots[r % len(slots)] for r in range(np_)]


def check_ranks(comm, versions: Dict[str, str]) -> None:
    """Collective: UsageError on every rank if ranks run different versions."""
    everyone = comm.allgather_objects({k: versions.get(k, "missing") for k in COMPARED})
    for key in COMPARED:
        seen = defaultdict(list)
        for rank, v in enumerate(everyone):
            seen[v[key]].append(rank)
        if len(seen) > 1:
            parts = [f"{key} {version} on {_where(comm, ranks)}"
                     for version, ranks in sorted(seen.items(), key=lambda kv: kv[1][0])]
            raise UsageError("ranks run different versions: " + "; ".join(parts) +
                             "; install the same environment on every host")


def _where(comm, ranks: List[int]) -> str:
    by_host = defaultdict(list)
    for r in ranks:
        by_host[comm.hosts[r]].append(str(r))
    return ", ".join(f"{host} (rank{'s' if len(rs) > 1 else ''} {','.join(rs)})"
                     for host, rs in by_host.items())
