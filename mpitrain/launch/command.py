"""``mpitrain launch``'s command line and its start: the options, where the hosts come
from, the preflight, the probes of a launch that has not begun; then the
:class:`~mpitrain.launch.job.Launcher` runs the job through its restarts (see
:mod:`mpitrain.launch.job` for what the command does). Outside the job: no TensorFlow,
no MPI.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from . import dialect
from ..errors import UsageError
from .discovery import DiscoveryScript, SlurmAllocation, host_source
from .job import Launcher, say
from .membership import HOST_POLL, HOSTS_WAIT, MAX_COOLDOWN, Job, Membership
from .probe import require_reachable
from ..results.run_dir import ELASTIC_ENV


def add_parser(commands) -> None:
    """The ``launch`` sub-command's options (the same launch shape as ``check``)."""
    launch = commands.add_parser(
        "launch", help="run a training job under mpirun, restarting it from its checkpoint "
        "when it fails",
        description="Preflight the launch, run 'mpirun ... python -m mpitrain MODEL "
        "[OPTIONS]', and when the job fails restart it with --resume from its last "
        "checkpoint, up to --max-restarts times. Run it as 'mpitrain launch -np 4 -hostfile "
        "hostfiles/cluster2 lr --async' (no mpirun). Exit codes: 0 done, 1 failed after "
        "the last restart, 2 usage error, 74 results could not be written (never "
        "restarted), 143 stopped by a signal.")
    launch.add_argument("-np", "--np", dest="np_range", type=np_range, default=None,
                        metavar="N|MIN:MAX",
                        help="ranks (default: $SLURM_NTASKS inside a SLURM allocation, else "
                        "1); MIN:MAX (with -hostfile, --host-discovery-script or in a SLURM "
                        "allocation): start on the hosts that answer with at least MIN, "
                        "grow to MAX as hosts come back, never run on fewer "
                        "than MIN")
    launch.add_argument("--min-np", type=int, default=None, metavar="MIN",
                        help="with --max-np: -np MIN:MAX as horovodrun spells it (default 1)")
    launch.add_argument("--max-np", type=int, default=None, metavar="MAX")
    launch.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE")
    launch.add_argument("--host-discovery-script", metavar="SCRIPT",
                        help="instead of -hostfile: an executable printing the hosts "
                        "available now, one HOST:SLOTS a line (Horovod's contract), run "
                        "every second while the job runs; the job starts on those that "
                        "answer (at least -np MIN ranks) and grows to -np MAX")
    launch.add_argument("--oversubscribe", action="store_true",
                        help="allow more ranks than slots (as mpirun --oversubscribe)")
    launch.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="restarts after failures before giving up (default 3)")
    launch.add_argument("--host-poll", type=float, default=HOST_POLL, metavar="S",
                        help="seconds between probes of a host left out after a failure; "
                        "when it answers, the job stops at a checkpoint and goes on with it "
                        f"(0: only at the next restart; default {HOST_POLL:g})")
    launch.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None,
                        metavar=("LOWER", "UPPER"),
                        help="seconds a host left out waits before it is probed again: "
                        "LOWER after its first loss, doubling with each loss again, at most "
                        "UPPER (Horovod's option of that name; default: --host-poll, "
                        f"{MAX_COOLDOWN:g})")
    launch.add_argument("--reset-limit", type=int, default=None, metavar="N",
                        help="stop the job to grow it at most N times (Horovod's "
                        "--reset-limit; then it keeps its size; failures are bounded by "
                        "--max-restarts); default: no limit")
    launch.add_argument("--hosts-wait", type=float, default=HOSTS_WAIT, metavar="S",
                        help="with -np MIN:MAX: seconds to wait for hosts when those that "
                        f"answer hold fewer than MIN ranks, then give up (default {HOSTS_WAIT:g})")
    launch.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument for mpirun, e.g. --mpirun-arg=--bind-to "
                        "--mpirun-arg=none (repeatable)")
    launch.add_argument("training", nargs="...", metavar="MODEL [OPTIONS] | SCRIPT.py [ARGS]",
                        help="the training command (as after 'python -m mpitrain'), or your "
                        "script (a mpitrain.horovod one: restarted as it is, it resumes from "
                        "its own checkpoints)")


def is_script(training: Sequence[str]) -> bool:
    """Whether the training command is the user's own script (``SCRIPT.py [ARGS]``, e.g. one
    written against mpitrain.horovod) rather than mpitrain's (a model name, or a
    ``FILE.py:FUNCTION`` spec)."""
    return bool(training) and training[0].endswith(".py") and Path(training[0]).is_file()


def np_range(text: str) -> Tuple[int, int]:
    """``-np N`` (N, N) or ``-np MIN:MAX``; argparse's one-line error otherwise."""
    low, colon, high = text.partition(":")
    try:
        bounds = (int(low), int(high if colon else low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with 1 <= MIN <= MAX (got "
                                         f"{text!r})")
    return bounds


def bounds_given(args) -> Optional[Tuple[int, int]]:
    """-np's bounds, or those of horovodrun's spelling, --min-np MIN --max-np MAX (not
    both: horovodrun's -np, the size it starts at, has no counterpart here)."""
    if args.min_np is None and args.max_np is None:
        return args.np_range
    if args.np_range is not None or args.max_np is None:
        raise UsageError("give -np MIN:MAX, or --max-np MAX with --min-np MIN (default 1) "
                         "and no -np: the job starts on as many ranks as the hosts that "
                         "answer hold, up to MAX")
    try:
        return np_range(f"{1 if args.min_np is None else args.min_np}:{args.max_np}")
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--min-np/--max-np {e}") from None


def cooldown_range(given: Optional[List[float]], host_poll: float) -> Tuple[float, float]:
    """--blacklist-cooldown-range's (LOWER, UPPER), checked; by default --host-poll's
    seconds (HOST_POLL if 0) and MAX_COOLDOWN."""
    if given is None:
        return (host_poll or HOST_POLL, max(MAX_COOLDOWN, host_poll))
    lower, upper = given
    if not 0 < lower <= upper:
        raise UsageError(f"--blacklist-cooldown-range {lower:g} {upper:g}: give LOWER and "
                         "UPPER seconds with 0 < LOWER <= UPPER (e.g. 10 600)")
    return lower, upper


def world_size(args) -> int:
    """-np (MIN:MAX's MAX), or the task count of the SLURM allocation the launcher runs
    in, or 1."""
    bounds = bounds_given(args)
    return bounds[1] if bounds else int(os.environ.get("SLURM_NTASKS", "1"))


def run(args, cfg) -> int:
    """Entry point for ``mpitrain launch`` once the training arguments parsed as ``cfg``
    (None for a script, :func:`is_script`: mpitrain's defaults; its telemetry, if on,
    goes to $MPITRAIN_RESULTS_DIR)."""
    script = cfg is None
    if script:
        from ..config import Config

        cfg = Config.of(results_dir=os.environ.get("MPITRAIN_RESULTS_DIR", "results"))
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more (got {args.max_restarts})")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise UsageError(f"--reset-limit must be 0 or more (got {args.reset_limit})")
    from .preflight import check_launch

    bounds = bounds_given(args)
    np_ = world_size(args)
    np_min = bounds[0] if bounds else np_
    source = host_source(args.hostfile, args.host_discovery_script, bounds
                         if np_min < np_ else None)
    listed = isinstance(source, (DiscoveryScript, SlurmAllocation))  # not a hostfile
    elastic = np_min < np_ or listed
    # (where a source lists the hosts, where ranks go is said once they answer, below)
    placement = check_launch(np_, None if listed else args.hostfile,
                             args.oversubscribe or listed, cfg.async_mode,
                             cfg.asynchronous.servers)
    in_slurm = source is None and args.hostfile is None and bool(os.environ.get("SLURM_JOB_ID"))
    if in_slurm:
        placement = [f"{np_} ranks on the SLURM allocation of job {os.environ['SLURM_JOB_ID']}"]
    runner = launcher_for_this_python()
    if not listed:
        say_placement(placement, script)
    hosts = source.read() if source is not None else None
    # no hostfile and no allocation: every rank on this host, as many as -np asks for
    oversubscribe = args.oversubscribe or (hosts is None and not in_slurm)
    if args.host_poll < 0 or args.hosts_wait < 0:
        raise UsageError(f"--host-poll and --hosts-wait must be 0 (off) or a number of "
                         f"seconds (got {args.host_poll:g}, {args.hosts_wait:g})")
    cooldown = cooldown_range(args.blacklist_cooldown_range, args.host_poll)
    job = Job(np_, None if listed else hosts, args.hostfile, oversubscribe,
              list(args.mpirun_arg), cfg.async_mode, runner, keep_binding=cfg.keep_cpu_binding,
              recovery=cfg.async_mode and runner.supports_recovery,
              membership=Membership(hosts, np_, oversubscribe, args.host_poll,
                                    np_min=np_min if elastic else 1, source=source,
                                    wait=args.hosts_wait, cooldown=cooldown)
              if hosts is not None else None)
    if cfg.async_mode and np_ > 2 and not runner.supports_recovery:
        say(f"note: {runner.impl.name} cannot keep a job running after one of its ranks "
            "died, so a lost worker costs a restart from the last checkpoint (Open MPI "
            "keeps the others training)")
    elastic_state = None
    if script:  # (its hvd.elastic state, if it has one, lives as long as the launch)
        job.program = [str(Path(args.training[0]).resolve())]
        Path(cfg.results_dir).mkdir(parents=True, exist_ok=True)
        elastic_state = Path(cfg.results_dir) / f"elastic-state-{uuid.uuid4().hex[:12]}.pkl"
        job.environment[ELASTIC_ENV] = str(elastic_state)
    launcher = Launcher(job, list(args.training[script:]), Path(cfg.results_dir), cfg.resume,
                        args.max_restarts, script=script)
    launcher.growth.reset_limit = args.reset_limit
    if elastic:  # starts on the hosts that answer (at least -np MIN's)
        for line in job.rehost(launcher.hostfile_path(), announce=say, starting=True):
            say(line)
        if listed:
            say_placement(check_launch(job.np, job.hostfile, oversubscribe, cfg.async_mode,
                                       cfg.asynchronous.servers), script)
    else:  # a typo in a host name must not make the run a smaller one
        require_reachable(job.hosts, job.mpirun_args, runner)
    try:
        return launcher.run()
    finally:
        if elastic_state is not None:  # (it lives as long as the launch)
            elastic_state.unlink(missing_ok=True)


def say_placement(lines: List[str], script: bool) -> None:
    for line in lines:  # every rank of a script trains: no parameter server
        say(re.sub(r": (parameter server|worker|single) on ", ": on ", line) if script
            else line)


def launcher_for_this_python() -> dialect.Mpirun:
    """The mpirun to start ranks of this Python with (see :func:`.dialect.find_mpirun`);
    UsageError when there is none, or when it is not of the MPI this Python's mpi4py
    loads (their ranks would each start alone: N single-rank runs instead of one job)."""
    try:
        runner = dialect.mpirun()
    except FileNotFoundError:
        raise UsageError("mpirun not found: install Open MPI or MPICH (bash setup.sh installs "
                         "Open MPI), or set MPITRAIN_MPIRUN to your launcher") from None
    problem = dialect.mismatch(runner, dialect.library_of(sys.executable))
    if problem:
        raise UsageError(problem)
    return runner

