"""MPI in this process: loading it, ending it (bounded), aborting the job, and what the
launcher says before MPI starts. The only module of mpitrain that imports mpi4py (the
others of :mod:`mpitrain.comm` get it from :func:`_load_mpi`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from enum import Enum
from pathlib import Path
from typing import Callable, List, Optional

from ..launch import dialect
from ..errors import UsageError

_MPI = None


#: seconds MPI_Finalize may take before the process leaves without it (see finalize)
FINALIZE_BOUND = 60
_finalize_bound: Optional[float] = None  # set by bound_finalize()


#: seconds a rank waits for every rank of the job to start MPI (see start_watch)
START_BOUND = 120.0
#: the n-th rank's watch ends its job this much later than rank 0's (n at most 10), so
#: that one rank prints the error and the launcher ends the others before theirs fire
START_STAGGER = 5.0


def _load_mpi(start_bound: Optional[float] = None):
    """Import mpi4py and initialise MPI once; the first call bounds MPI's start-up by
    ``start_bound`` seconds (START_BOUND if None; see :func:`start_watch`). Before MPI
    starts, a library of another family than the launcher that started this process is
    refused in one line (:func:`check_launcher`): MPICH's aborts in MPI_Init with a page
    of its own, Open MPI's would run each rank alone."""
    global _MPI
    if _MPI is None:
        if open_mpi_4_recovery():
            # Open MPI 4.1 opens MPI_Finalize with a PMIx fence over every rank of the
            # job; when a rank has left early (a dropped async worker), that fence
            # can wait for it forever (seen with a SIGSTOPped async worker dropped and
            # woken: docs/architecture.md, "No closing fence under recovery"). Every
            # message of the protocols is
            # completed before finalizing, so the fence protects nothing here.
            os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # mpitrain starts it below, once checked
        with warnings.catch_warnings():  # mpi4py's own "suspicious environment" warning:
            warnings.simplefilter("ignore", RuntimeWarning)  # check_launcher says it
            from mpi4py import MPI  # noqa: WPS433
        if not MPI.Is_initialized():
            check_launcher(MPI.Get_library_version())
            if dialect.launcher_of_this_process() == "srun":
                os.environ.update(dialect.srun_rank_environment(
                    dialect.identify(MPI.Get_library_version())))
            with start_watch(START_BOUND if start_bound is None else start_bound):
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _MPI = MPI
        # runs before mpi4py's own exit hook, which would call MPI_Finalize unbounded
        atexit.register(finalize)
        if MPI.COMM_WORLD.Get_size() == 1 and launcher_world_size() > 1:
            raise _mismatch(MPI.Get_library_version(), "it runs alone (a job of 1 rank)")
    return _MPI


def check_launcher(library_version: str) -> None:
    """UsageError when this process's MPI library (``library_version``, from
    MPI_Get_library_version) is of another family than the launcher that started it, or,
    under srun, cannot start under the MPI plugin srun used."""
    library = dialect.identify(library_version)
    launcher = dialect.launcher_of_this_process()
    hydra = launcher.startswith("Hydra")
    if launcher == "srun":
        problem = dialect.srun_problem(library)
        if problem and library is not None:  # (a problem is only ever found for a library)
            raise UsageError(f"mpi4py loaded {library.name}, but {problem}")
        return
    if library is None or not launcher:
        return
    if (library.family == dialect.MPICH) != hydra:
        raise _mismatch(library_version, "the two cannot make one job")


def _mismatch(library_version: str, consequence: str) -> "UsageError":
    library = dialect.identify(library_version)
    name = library.name if library else library_version.splitlines()[0].strip()
    where = _loaded_libmpi()
    started = dialect.launcher_of_this_process() or "a launcher"
    own = Path(sys.executable).parent / "mpirun"
    return UsageError(
        f"mpi4py loaded {name}{f' ({where})' if where else ''} but this job was started by "
        f"{started} of {launcher_world_size()} ranks: {consequence}; start it with "
        f"{own if own.is_file() else f'the mpirun of {name}'}, or with mpitrain launch, "
        "which picks it")


def _loaded_libmpi() -> str:
    """The path of the libmpi this process has loaded ('' if it cannot be told)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return ""


#: run by the watch process (python -S -I: no site, nothing of the user's environment).
#: Its stdin is a pipe from the rank: end of file (MPI started, or the rank is gone)
#: ends it quietly; past the bound it prints the error, ends the rank, and ends the job
#: through the launcher (under --enable-recovery the rank's death alone would not), or,
#: under srun, cancels the job step (bounded: 30 s).
_WATCH = """
import os, select, signal, subprocess, sys
bound, rank_pid, launcher_pid = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if select.select([0], [], [], bound)[0]:
    sys.exit(0)
os.write(2, sys.argv[4].encode() + b"\\n")
os.kill(rank_pid, signal.SIGKILL)
if launcher_pid:
    os.kill(launcher_pid, signal.SIGTERM)
elif sys.argv[5:]:
    subprocess.run(["scancel", "--quiet", sys.argv[5]], timeout=30, stdin=subprocess.DEVNULL)
"""


@contextlib.contextmanager
def start_watch(bound: float):
    """Bound the block (MPI_Init) by ``bound`` seconds, plus START_STAGGER per launcher
    rank (at most 10 of them): past that, this rank prints one line naming the problem,
    is killed, and its launcher (mpirun or its daemon: the rank's parent, or an ancestor
    past a wrapper script) is told to end the job; under srun, its job step is cancelled.

    MPI_Init waits for every rank of the job, with no bound of its own: a rank that
    exits before starting MPI (a wrapper script that hides a usage error's exit status)
    or never gets there (an import stuck on a stalled file system) would keep the others
    there forever. It holds the interpreter while it waits, so no Python thread or
    signal handler could run: the watch is a small process of its own."""
    rank = launcher_rank()
    bound += START_STAGGER * min(rank, 10)
    message = (f"mpitrain: error: rank {rank} on {platform.node()} waited {bound:g} s for "
               "every rank of the job to start MPI: a rank never did (it exited before "
               "starting it, e.g. under a wrapper script that hid its exit status, or is "
               "stuck before it, e.g. importing from a stalled file system); start python "
               "-m mpitrain directly under mpirun (or srun), or raise --start-timeout if "
               "start-up is this slow")
    try:
        watch = subprocess.Popen([sys.executable, "-S", "-I", "-c", _WATCH, str(bound),
                                  str(os.getpid()), str(_launcher_pid()), message,
                                  *_srun_step()], stdin=subprocess.PIPE)
    except OSError:  # no interpreter to run it (an embedded Python): start unwatched
        yield
        return
    try:
        yield
    finally:
        watch.stdin.close()  # type: ignore[union-attr]  # (stdin=PIPE) end of file: MPI started (or failed with an error of its own)
        try:
            watch.wait(timeout=10)  # it ends at once
        except subprocess.TimeoutExpired:
            watch.kill()


def _srun_step() -> list:
    """``[JOB.STEP]``, the SLURM job step this rank is a task of when srun started it (no
    process of srun's can end the job as mpirun can: the start watch cancels the step,
    or else each waiting rank's watch would fire in turn, START_STAGGER apart), else
    ``[]``."""
    if dialect.launcher_of_this_process() != "srun" or "SLURM_JOB_ID" not in os.environ:
        return []
    return [f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"]


def bound_finalize(seconds: float = FINALIZE_BOUND) -> None:
    """Bound the MPI_Finalize at this process's exit by ``seconds``: for programs whose
    ranks all reach their end together (the CLI). A user's script under mpitrain.fit
    keeps MPI's own finalize (bounded only under --enable-recovery): its rank 0 may
    work on long after the other ranks are done and waiting there."""
    global _finalize_bound
    _finalize_bound = seconds


#: what runs just before MPI_Finalize on this rank (see :func:`before_finalize`)
_BEFORE_FINALIZE: List[Callable[[], None]] = []


def before_finalize(step: Callable[[], None]) -> None:
    """Run ``step`` just before MPI ends on this rank (:func:`finalize`): for the
    modules above this one that hold MPI objects MPI_Finalize must not find (they
    register it as they load, so this module needs to know none of them). Local."""
    if step not in _BEFORE_FINALIZE:
        _BEFORE_FINALIZE.append(step)


def finalize(bound: Optional[float] = None) -> None:
    """End MPI on this rank (a collective in MPI's terms). With a bound (``bound``, or
    the one set by :func:`bound_finalize`, or FINALIZE_BOUND under --enable-recovery)
    it never waits longer: past it the kernel ends the process (SIGALRM's default
    action), the run's files already written. A no-op when MPI is not running.

    A plain alarm because MPI_Finalize holds the interpreter: no Python thread or
    handler could run while it waits."""
    if not world_size_if_running():
        return
    if bound is None:
        bound = _finalize_bound or (FINALIZE_BOUND if recovery_enabled() else None)
    sys.stdout.flush()
    sys.stderr.flush()
    for step in _BEFORE_FINALIZE:
        step()
    if bound is None:
        _MPI.Finalize()
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(bound)))
    _MPI.Finalize()
    signal.alarm(0)


def launcher_rank() -> int:
    """This process's rank as told by the launcher's environment, without initialising MPI.

    Lets usage errors be printed once (by rank 0) before MPI starts.
    """
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def launcher_world_size() -> int:
    """The job's size as told by the launcher's environment (1 when run without one)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 1


class Role(Enum):
    """What a rank does; decided once from (rank, world size)."""

    SINGLE = "single"  # -np 1: trains, evaluates and writes results alone
    SERVER = "server"  # rank 0 of several: owns the canonical model, evaluates, writes
    #: ranks 1..K-1 under async --servers K: a parameter server of one share of the
    #: parameters (rank 0 serves the first share and evaluates and writes)
    PARTITION = "partition"
    WORKER = "worker"  # the other ranks: train on their shard

    @classmethod
    def of(cls, rank: int, size: int, servers: int = 1) -> "Role":
        if size == 1:
            return cls.SINGLE
        if rank == 0:
            return cls.SERVER
        return cls.PARTITION if rank < servers else cls.WORKER

    @property
    def trains(self) -> bool:
        return self in (Role.SINGLE, Role.WORKER)

    @property
    def serves(self) -> bool:
        """Owns the canonical model, evaluates and writes results."""
        return self in (Role.SINGLE, Role.SERVER)


def ulfm() -> bool:
    """True under Open MPI 5's ``--with-ft ulfm``: MPI reports a dead peer
    (MPI_ERR_PROC_FAILED) and offers ULFM's calls (MPIX_Comm_shrink, ...)."""
    return dialect.flag_on("OMPI_MCA_mpi_ft_enable")


def open_mpi_4_recovery() -> bool:
    """True under Open MPI 4's ``mpirun --enable-recovery``. Its mpirun exits 0 whatever
    its ranks return (ended through SIGTERM, :func:`abort_world`, it exits 1), and its
    MPI_Finalize opens with a PMIx fence over every rank (see :func:`_load_mpi`)."""
    return dialect.flag_on("OMPI_MCA_orte_enable_recovery") and not ulfm()


def recovery_enabled() -> bool:
    """True when the job runs under a launcher that keeps the other ranks running after
    one dies (Open MPI 4's ``mpirun --enable-recovery``, Open MPI 5's ``--with-ft
    ulfm``); an async server may then go on without a lost worker instead of ending the
    job."""
    return dialect.launcher_recovery()


def world_size_if_running() -> int:
    """Size of MPI_COMM_WORLD if MPI was initialised (and not finalised), else 0."""
    if _MPI is None or not _MPI.Is_initialized() or _MPI.Is_finalized():
        return 0
    return _MPI.COMM_WORLD.Get_size()


def world_rank_if_running() -> int:
    """This process's world rank if MPI is running a job of several ranks, else the
    launcher's rank (which also tells apart ranks that each started MPI alone)."""
    return _MPI.COMM_WORLD.Get_rank() if world_size_if_running() > 1 else launcher_rank()


def abort_world(code: int) -> None:
    """Abort every rank of the job (no-op when MPI is not running).

    Under ``mpirun --enable-recovery`` MPI_Abort ends only the calling process and the
    others run on (and a SIGSTOPped rank would keep mpirun waiting forever), so the
    job is ended through the process that started this rank instead: mpirun, or its
    daemon on another host, ends the whole job on SIGTERM, a stopped rank too, in
    seconds (docs/architecture.md, "Ending a job through mpirun").
    """
    if world_size_if_running():
        sys.stdout.flush()
        sys.stderr.flush()
        if recovery_enabled() and end_job_through_launcher():
            time.sleep(30.0)  # mpirun ends this process meanwhile; else abort below
        _MPI.COMM_WORLD.Abort(code)


def end_job_through_launcher() -> bool:
    """Ask the process that started this rank (mpirun, or its daemon on another host) to
    end the whole job (SIGTERM); whether there was one to ask. Local."""
    launcher = _launcher_pid(levels=1)
    if launcher:
        os.kill(launcher, signal.SIGTERM)
    return bool(launcher)


def _launcher_pid(levels: int = 4) -> int:
    """Process id of the launcher that started this rank (mpirun, or its daemon on another
    host: Open MPI's or Hydra's), looking up to ``levels`` ancestors up (past a wrapper
    script); 0 if there is none (a singleton, srun)."""
    import psutil

    try:
        process = psutil.Process().parent()
        for _ in range(levels):
            if process is None:
                return 0
            if process.name() in dialect.LAUNCHER_PROCESSES:
                return process.pid
            process = process.parent()
    except psutil.Error:
        pass
    return 0


def library_versions() -> dict:
    """Versions of mpi4py and the MPI library this process runs on, and what started it
    (:func:`dialect.launcher_of_this_process`: an mpirun, srun, or '' for a singleton)."""
    MPI = _load_mpi()
    import mpi4py

    text = MPI.Get_library_version()
    found = dialect.identify(text)
    return {"mpi4py": mpi4py.__version__,
            "mpi_library": text.splitlines()[0].strip(),
            "mpi": found.name if found else text.splitlines()[0].strip()[:40],
            "mpi_standard": "%d.%d" % MPI.Get_version(),
            "launcher": dialect.launcher_of_this_process()}
