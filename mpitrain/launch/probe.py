"""Whether mpirun can still start a process on each host of a job: probed before a launch
(every host must answer: a run that has not begun is never made smaller) and before
each restart (a host that does not is left out, one back is taken back:
:meth:`mpitrain.launch.job.Job.rehost`).
Outside the job: no TensorFlow, no MPI."""

from __future__ import annotations

import subprocess
import time
from typing import Dict, Optional, Sequence

from . import dialect, hostfile
from ..errors import MpitrainError
from .watch import kill_tree


def require_reachable(hosts: Optional[Sequence[hostfile.Host]], mpirun_args: Sequence[str],
                      runner: dialect.Mpirun) -> None:
    """Before a run begins: every host of the hostfile must be reachable (mpirun starts
    ``true`` there), or the launch fails with one line naming the host. A run that has
    not begun is never rescaled: a typo in a host name must not silently make it a
    smaller run."""
    if not hosts:
        return
    gone = unreachable(hosts, mpirun_args, runner)
    if gone:
        why = "; ".join(f"{h}: {reason}" for h, reason in gone.items())
        raise MpitrainError(f"host(s) {', '.join(gone)} cannot be reached: mpirun cannot "
                            f"start a process there ({why}); fix the host name in the "
                            "hostfile, or the host (ssh, the same environment path), or leave "
                            "it out of the hostfile")



#: seconds mpirun gets to start ``true`` on a host before the host counts as gone
PROBE_TIMEOUT = 30.0


def unreachable(hosts: Sequence[hostfile.Host], mpirun_args: Sequence[str],
                runner: dialect.Mpirun) -> Dict[str, str]:
    """{host: why} for the hosts on which mpirun (with the job's own options: its launch
    agent) cannot run ``true`` within PROBE_TIMEOUT, twice in a row (one transient failure,
    e.g. an ssh hiccup, does not cost a host its place; a lost host fails both). Hosts are
    probed all at once."""
    failed = _probe([h.name for h in hosts], mpirun_args, runner)
    return _probe(list(failed), mpirun_args, runner) if failed else failed


def _probe(names: Sequence[str], mpirun_args: Sequence[str],
           runner: dialect.Mpirun) -> Dict[str, str]:
    probes = {name: subprocess.Popen(
        runner.probe(name, mpirun_args),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        stdin=subprocess.DEVNULL, env=dialect.launch_environment())
        for name in names}
    deadline, gone = time.monotonic() + PROBE_TIMEOUT, {}
    for name, probe in probes.items():
        try:
            _, err = probe.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(probe.pid)
            probe.communicate()
            gone[name] = f"no answer within {PROBE_TIMEOUT:g} s"
            continue
        if probe.returncode != 0:
            first = next((line.strip() for line in err.splitlines()
                          if line.strip() and not line.startswith("---")), "")
            gone[name] = f"exit {probe.returncode}" + (f": {first}" if first else "")
    return gone
