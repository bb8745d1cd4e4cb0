"""``mpitrain launch``: run a training job under mpirun and restart it when it fails.

    mpitrain launch -np 4 -hostfile hostfiles/cluster2 --max-restarts 3 lr --async

The launcher runs the launch preflight (:mod:`mpitrain.launch.preflight`; every host of
the hostfile must be reachable: a run that has not begun is never made smaller), starts
``mpirun ... python -m mpitrain ARGS`` (this environment's mpirun, in its own dialect:
:mod:`mpitrain.launch.dialect`) and waits. When the job fails (a rank killed, a stalled
rank named by the watchdog, the parameter server lost), it restarts it with ``--resume
RUN_DIR`` from the run's last checkpoint, up to ``--max-restarts`` times: the run goes on
in the same results directory with one continuous curve; a sync run ends with the same
weights, bit for bit, as one that never failed (:mod:`mpitrain.run`), losing at most
the steps since the last checkpoint.

Before each restart the hosts are probed (mpirun, with the job's own launch options,
runs ``true`` there): a host that is gone is left out, the restart runs on a hostfile
of the others (``hostfile.launch`` in the run directory), with fewer ranks where their
slots are fewer, and the run resumes with fewer workers (:class:`mpitrain.run.resume.Rescale`:
sync keeps its global batch, async its batch and learning rate). A host left out is
probed again while the job runs, and when it answers the job is stopped at a checkpoint
and resumed with it. The hosts come from the hostfile, a discovery script
(``--host-discovery-script``) or, with ``-np MIN:MAX``, the SLURM allocation: see
:mod:`.membership` and :mod:`.discovery`. Without any of them (this machine, or mpirun's
own reading of a SLURM allocation) nothing is probed.

An async job with two or more workers runs under Open MPI's recovery
(``--enable-recovery`` on 4.x, ULFM's ``--with-ft ulfm`` on 5.x): a worker that dies or
stalls is dropped by the parameter server and the job finishes without a restart (see
:mod:`mpitrain.train.asynchronous`); only the server's loss needs one. MPICH cannot keep
a job running after a rank died: there any loss costs a restart.

What is never restarted: success (exit 0), a usage error (2: the same arguments would
fail again), a run stopped by a signal (143), a run that recorded that it ended well
(mpirun's failure after it is kept: nothing is left to train), and anything after the
launcher itself was asked to stop. Signals: SIGUSR1, SIGTERM and SIGINT to the launcher
are passed to mpirun as SIGUSR1, which mpirun forwards to every rank and then waits, so
the ranks stop at one step and checkpoint (SLURM's ``--signal=B:TERM@60`` ends here); a
second signal, or no exit within ``STOP_GRACE`` seconds, kills the job's whole process
group. mpirun runs in a session of its own that the launcher kills on any exit, and
after each attempt every process on this host that carries the attempt's token (ranks
that Open MPI's daemons, which leave mpirun's session, started), so no rank outlives it.

While mpirun runs, the launcher follows the attempt's status.json
(:mod:`mpitrain.launch.watch`: when the run ended by its own word, or its rank 0 is
gone, mpirun gets ``TEARDOWN_GRACE`` seconds to exit), and every attempt keeps its
runs.csv row.

Exit codes: 0 the run finished (after N restarts, printed); 1 it still failed after the
last restart, or failed before writing any checkpoint twice; 2 usage error; 74 its
results could not be written (a full or read-only disk: never restarted); 143 stopped by
a signal (resume with ``--resume`` or launch again).

``mpitrain launch -np N SCRIPT.py ARGS`` runs the user's own script instead (one written
against :mod:`mpitrain.horovod`): a failure short of a usage error (2) is restarted with
the same command (the script resumes from its own checkpoints), up to ``--max-restarts``
times, unless it failed the same way twice (:class:`ErrorTail`). A failed attempt's run
directory is the one its token marks (:mod:`.watch`); on a multi-host cluster the
results directory must be on the launcher's host.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, List, Optional, Sequence, Tuple, cast

from . import dialect
from ..errors import (EXIT_CANNOT_WRITE, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE,
                      MpitrainError, ResultsError)
from .changes import ChangeLog
from .membership import Job
from .probe import require_reachable
from .watch import (ErrorTail, RunWatch, describe, kill_strays, kill_tree, recorded_code,
                    restartable, run_dirs)
from ..run.checkpoint import CHECKPOINT
from ..run.signals import STOP_SIGNALS
from ..results.lost_run import record_lost_attempt
from ..results.run_dir import (ATTEMPT_ENV, ELASTIC_ENV, EXIT_CODE_OF_STATUS, run_ended,
                               run_rows)

PROG = "mpitrain launch"
#: seconds the job gets to checkpoint and exit after a stop signal before it is killed
STOP_GRACE = 120.0
#: seconds mpirun gets to exit once the run's status.json says the run ended, before it
#: is killed: several times what a healthy job takes then (rank 0's last files, then an
#: abort or every rank's finalize: docs/architecture.md, "Ending a job through mpirun"),
#: small against the minutes Open MPI can spend tearing down a job on a lost host.
TEARDOWN_GRACE = 15.0
#: TEARDOWN_GRACE when the job ran on a host since lost, whose daemon mpirun would wait for
LOST_HOST_GRACE = 3.0
#: seconds an attempt's rank 0 gets to say running (mpirun starting every rank, which
#: then wait for each other up to --start-timeout): past it mpirun is stuck starting them
START_BOUND = 600.0
NEVER_STARTED = ("the job did not start within {:g} s (rank 0 never said running: mpirun "
                 "waits for a host's daemon that never answered it?); killing it")
#: seconds between two looks at mpirun (and at the run's status.json)
POLL_INTERVAL = 1.0


class Launcher:
    """Runs one job to completion through restarts; see the module docstring."""

    def __init__(self, job: Job, training: List[str], results_dir: Path,
                 resume: Optional[str], max_restarts: int, script: bool = False):
        # script: the user's own, restarted as it is (it resumes from its own checkpoints)
        self.job, self.training, self.script = job, training, script
        self.results_dir, self.resume, self.max_restarts = results_dir, resume, max_restarts
        self.proc: Optional[subprocess.Popen] = None
        self.tail = ErrorTail()  # a script's stderr
        self.stop_signal: Optional[int] = None
        self.kill_at: Optional[float] = None
        self.changes = ChangeLog()  # each change of membership, a row of membership.csv
        self.growth = Growth(job, self.changes)  # when the job stops to take hosts in
        self.status: Optional[dict] = None  # the last attempt's last status.json
        self.token = ""  # the attempt's (ATTEMPT_ENV)
        self.failures = self.without_checkpoint = 0  # (restarts after each)
        #: a script's hvd.elastic state, carried from attempt to attempt of the launch
        self.elastic_state = job.environment.get(ELASTIC_ENV)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            return self._attempts()
        finally:
            self._kill_job()  # whatever happened: no rank outlives the launcher
            self.changes.close(say)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempts(self) -> int:
        started, restarts = time.monotonic(), 0
        while True:
            before = run_dirs(self.results_dir)
            argv = self.training + (["--resume", self.resume] if self.resume else [])
            token = uuid.uuid4().hex
            # the run's rows so far: the attempt has its own once there is one more
            rows_before = rows_of(Path(self.resume)) if self.resume else 0
            code, watched, finished = self._run_job(argv, token)
            self._kill_job()  # a rank that outlived mpirun must not hold on to its shard
            if code == 0:
                if restarts:
                    say(f"the run finished after {restarts} restart(s) "
                        f"({time.monotonic() - started:.0f} s in all)")
                return 0
            run_dir = failed_run_dir(self.results_dir, self.resume, before, watched)
            if self.growth.hosts and self.stop_signal is None and code == EXIT_INTERRUPTED \
                    and checkpointed(run_dir, self.elastic_state):
                outcome = self._grow(run_dir)
            else:
                outcome = self._after_failure(code, finished, run_dir, token, rows_before)
            if outcome is not None:
                return outcome
            restarts += 1

    def _grow(self, run_dir: Optional[Path]) -> Optional[int]:
        """The job stopped at a checkpoint to take in the hosts the growth names: restart
        it on them (None), or give up (an exit code) if none can be taken."""
        if not self.script:
            self.resume = str(run_dir)
        back, self.growth.hosts = self.growth.hosts, []
        self.growth.stops += 1
        self.changes.began("grow", f"host(s) {', '.join(back)} answer", run_dir,
                           self.job.np, self.job.host_names(), self.status)
        try:
            changed = self.job.rehost(self.hostfile_path(), back=back, announce=say)
        except MpitrainError as e:
            say(f"the job stopped to take back {', '.join(back)}; {e}")
            return EXIT_FAILURE
        for line in changed:
            say(line)
        say(f"restarting from {self.elastic_state if self.script else self.resume}"
            " on the hosts there are")
        return None

    def _after_failure(self, code: int, finished: bool, run_dir: Optional[Path], token: str,
                       rows_before: int) -> Optional[int]:
        """After an attempt that did not end well: the launcher's exit code, or None to
        restart it (from its checkpoint, on the hosts that answer)."""
        if self.stop_signal is not None or code == EXIT_INTERRUPTED:
            say(f"stopped (exit {code}); the run can be resumed" +
                (f" with --resume {self.resume}" if self.resume else ""))
            return EXIT_INTERRUPTED
        if code == EXIT_USAGE:
            return EXIT_USAGE
        self.growth.hosts = []  # (a failure while it stopped to take hosts in: restarted below)
        if finished:  # (resumed, it would be refused: every step is done)
            say(f"the run ended well (status ok, its results written) but mpirun exited "
                f"{code} after it: a rank failed or was killed as the job ended (see "
                "above); nothing is left to train, so no restart")
            return code
        if run_dir is not None and record_lost_attempt(  # each attempt keeps its row
                run_dir, f"the job ended (mpirun exit {code}) before rank 0 recorded how: "
                "a rank was killed, or its host lost", resumed=self.resume is not None,
                token=token, rows_before=rows_before):
            say("rank 0 did not record this attempt's end: its runs.csv row written")
        if code == EXIT_CANNOT_WRITE or not restartable(run_dir):
            say(f"the job failed (exit {code}) writing its results: a restart would fail "
                "the same way; giving up (see the error above)")
            return EXIT_CANNOT_WRITE
        if self.script:  # the same command again: it resumes from its own checkpoints
            if self.tail.failed_the_same_way(code):
                say(f"the script failed the same way twice (exit {code}: "
                    f"{self.tail.last_error}); a restart cannot help: giving up")
                return EXIT_FAILURE
        elif run_dir is not None and (run_dir / CHECKPOINT).is_file():
            self.resume = str(run_dir)
        elif self.resume is None:
            self.without_checkpoint += 1  # nothing saved yet: start it again from scratch
            if self.without_checkpoint > 1:
                say(f"the job failed (exit {code}) twice before its first checkpoint; "
                    "giving up (see the error above)")
                return EXIT_FAILURE
        self.failures += 1
        left = self.max_restarts - self.failures
        if left < 0:
            say(f"the job failed (exit {code}) and no restarts are left "
                f"(--max-restarts {self.max_restarts}); giving up")
            return EXIT_FAILURE
        self.changes.began("failure", (self.status or {}).get("reason") or f"mpirun exit "
                           f"{code}", run_dir, self.job.np, self.job.host_names(), self.status)
        try:
            if self.resume:
                changed = self.job.rehost(self.hostfile_path(), announce=say)
            else:  # nothing to resume: a smaller run from scratch is not this run
                require_reachable(self.job.hosts, self.job.mpirun_args, self.job.runner)
                changed = []
        except MpitrainError as e:
            say(f"the job failed (exit {code}); {e}")
            return EXIT_FAILURE
        for line in changed:
            say(line)
        where = (f"from the checkpoint in {self.resume}" if self.resume else
                 "the script (it resumes from its own checkpoints)" if self.script
                 else "from scratch")
        say(f"the job failed (exit {code}); restarting {where} ({left} restart(s) left)")
        return None

    def hostfile_path(self) -> Path:
        """Where the hostfile of the hosts left is written: the run directory (it records
        where the run went on), else the results directory."""
        where = Path(self.resume) if self.resume else self.results_dir
        where.mkdir(parents=True, exist_ok=True)
        return where / "hostfile.launch"

    def _run_job(self, argv: Sequence[str], token: str) -> Tuple[int, Optional[Path], bool]:
        """Run one attempt with its ``token``: its exit code (:func:`recorded_code`; mpirun
        killed TEARDOWN_GRACE after the run's end or rank 0's: the status's, or 1), the
        run directory its token marked (None if rank 0 never said running) and whether
        the run recorded that it ended well."""
        command = self.job.command() + list(argv)
        say("$ " + " ".join(command))
        self.kill_at = None  # (a stop to take hosts back set it for the attempt before)
        self.token = token
        watch = RunWatch(self.results_dir, Path(self.resume) if self.resume else None, token)
        # a session of its own: one killpg reaches mpirun and every local rank
        self.proc = subprocess.Popen(command, start_new_session=True, env=dialect.
                                     launch_environment(**self.job.environment,
                                                        **{ATTEMPT_ENV: token}),
                                     stderr=subprocess.PIPE if self.script else None)
        if self.script:  # its failure's last line, to tell a restart that cannot help
            self.tail.follow(cast(IO[bytes], self.proc.stderr))
        code = self._watch_job(watch)
        watch.poll()  # (a run that ended between two looks)
        self.status = watch.status
        self.changes.running(watch.status, self.job.np, self.job.host_names())
        recorded = recorded_code(code, watch.status, records=not self.script)
        if code == 0 and recorded != 0:  # (under ULFM Open MPI 5's exits 0 once all died)
            say("mpirun exited 0, but the run did not record that it ended well")
        finished = run_ended(watch.status) and cast(dict, watch.status)["status"] == "ok"
        return recorded, watch.run_dir, finished

    def _watch_job(self, watch: "RunWatch") -> int:
        """Wait for mpirun, looking at the run's status.json once a second (see run)."""
        proc = cast(subprocess.Popen, self.proc)  # (started by the caller)
        while True:
            try:
                return proc.wait(timeout=POLL_INTERVAL)
            except subprocess.TimeoutExpired:
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    say(f"the job did not stop within {STOP_GRACE:g} s; killing it")
                    self._kill_job()
                    continue  # the wait returns its exit code at once
                watch.poll()
                self.changes.running(watch.status, self.job.np, self.job.host_names())
                self._look_for_hosts_back(watch)
                status = cast(dict, watch.status)  # (either is only true of a status read)
                grace = LOST_HOST_GRACE if self.job.on_a_lost_host() else TEARDOWN_GRACE
                late = f"but mpirun did not exit within {grace:g} s; killing it"
                if watch.overdue(grace):  # the code mpirun would have given
                    return self._kill_overdue(f"the run ended ({describe(status)}) {late}",
                                              EXIT_CODE_OF_STATUS[status["status"]])
                if watch.writer_gone_overdue(grace):  # no end recorded: a failure
                    return self._kill_overdue(f"rank 0 (pid {status['writer']['pid']}) is "
                                              f"gone {late}", EXIT_FAILURE)
                if not self.script and watch.never_started(START_BOUND):
                    return self._kill_overdue(NEVER_STARTED.format(START_BOUND), EXIT_FAILURE)

    def _kill_overdue(self, message: str, code: int) -> int:
        """Kill a job whose run ended, or whose rank 0 is gone, but whose mpirun has not
        exited, or whose ranks never started; ``code``, the attempt's exit code."""
        say(message)
        self._kill_job()
        return code

    def _look_for_hosts_back(self, watch: "RunWatch") -> None:
        """While the job runs with hosts left out: probe those due; when one answers (or
        its hosts offer more slots), stop the job at a checkpoint (as a stop signal
        does) to restart it larger. Only once its run says running (every rank then
        takes the stop signal; before, it would end a rank still starting), or a
        script's hvd.elastic state is written (it stops at its next commit)."""
        ready = self.kill_at is None and (checkpointed(None, self.elastic_state) if self.script
                                         else (watch.status or {}).get("status") == "running")
        back, why = self.growth.due(watch, ready)
        if back and self.proc is not None and self.proc.poll() is None:
            self.growth.hosts = back
            say(f"{why}: stopping the job at a checkpoint to take them in")
            self.proc.send_signal(signal.SIGUSR1)  # mpirun forwards it and waits
            self.kill_at = time.monotonic() + STOP_GRACE

    def _on_signal(self, signum, frame) -> None:
        first = self.stop_signal is None
        self.stop_signal = signum
        if self.proc is None or self.proc.poll() is not None:
            return
        if first:
            say(f"{signal.Signals(signum).name}: asking every rank to stop and checkpoint")
            self.proc.send_signal(signal.SIGUSR1)  # mpirun forwards it and waits
            self.kill_at = time.monotonic() + STOP_GRACE
        else:
            self._kill_job()

    def _kill_job(self) -> None:
        """Kill the job's session: mpirun if alive, and any rank it left behind, also
        those its daemons started outside the session (on this host)."""
        if self.proc is None:
            return
        kill_tree(self.proc.pid)
        self.proc.wait()
        if strays := kill_strays(self.token):
            say(f"killed {strays} process(es) of the attempt that outlived mpirun")


class Growth:
    """When a running job stops to take hosts in: those left out that answer again, or
    more slots on its hosts (:meth:`.membership.Membership.growth`), at most
    ``reset_limit`` times (``--reset-limit``; None: no limit)."""

    def __init__(self, job: Job, changes: ChangeLog, reset_limit: Optional[int] = None):
        self.job, self.changes, self.reset_limit = job, changes, reset_limit
        self.hosts: List[str] = []  # those the job is stopping to take in (none: it is not)
        self.stops = 0  # the stops to grow so far

    def due(self, watch: RunWatch, ready: bool) -> Tuple[List[str], str]:
        """Looked at while the job runs (``ready``: it can take a stop now; see
        Launcher._look_for_hosts_back): what changed of its hosts is said (the source's
        list; async workers lost, whose hosts are left out); the hosts to stop it for
        and why, or ([], '')."""
        members = self.job.membership
        lost = self.changes.workers_lost(watch.status, watch.run_dir, self.job.np)
        if members is None or self.stops == self.reset_limit:
            return [], ""
        for line in members.reread() + members.workers_lost(lost):
            say(line)
        return members.growth(self.job.np, self.job.probe) if ready else ([], "")


def failed_run_dir(results_dir: Path, resume: Optional[str], before: set,
                   watched: Optional[Path]) -> Optional[Path]:
    """The run directory a failed attempt wrote in: the resumed one, else the one its
    token marked (``watched``, see RunWatch), else the newest of ``results_dir`` not in
    ``before`` (an attempt that failed before rank 0 said running)."""
    if resume:
        return Path(resume)
    if watched is not None:
        return watched
    new = sorted(run_dirs(results_dir) - before)
    return new[-1] if new else None


def checkpointed(run_dir: Optional[Path], elastic_state: Optional[str]) -> bool:
    """Whether a job wrote what a restart resumes from: a script's hvd.elastic state at
    ``elastic_state``, else the checkpoint of ``run_dir``."""
    if elastic_state is not None:
        return Path(elastic_state).is_file()
    return run_dir is not None and (run_dir / CHECKPOINT).is_file()


def rows_of(run_dir: Path) -> int:
    """The run's rows in runs.csv (see :func:`run_rows`); 0 if it cannot be read (no row
    can be added to it then either)."""
    try:
        return run_rows(run_dir)
    except ResultsError:
        return 0


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
