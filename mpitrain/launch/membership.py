"""Which hosts of the launch a job runs on, as hosts are lost, come back and are added;
and :class:`Job`, what mpirun is asked to run on them.

``mpitrain launch -np N -hostfile FILE`` starts on every host of FILE (all must answer:
:func:`.probe.require_reachable`); ``-np MIN:MAX`` (or a discovery script) starts on
those that answer, with at least MIN ranks. A host that stops answering is left out at
the next restart (the job runs on the others, with fewer ranks where their slots are
fewer; under MIN:MAX never fewer than MIN: the launcher waits up to ``--hosts-wait``
seconds, HOSTS_WAIT by default, for hosts, then gives up). A host
left out is probed again, while the job runs and is short of slots, once its cooldown
has passed and then every ``--host-poll`` seconds; when it answers, the launcher stops
the job at a checkpoint (the stop signal's path: every rank checkpoints) and restarts it
on the larger set of hosts, up to -np (MAX), from that checkpoint (the run rescales as it
does when it shrinks: :class:`mpitrain.run.resume.Rescale`). The cooldown doubles each
time the same host is lost again (``--host-poll``, then twice, four times that..., at
most MAX_COOLDOWN; or ``--blacklist-cooldown-range LOWER UPPER``): a host that keeps
failing costs fewer and fewer restarts, as
Horovod's elastic blacklist cooldown does. A restart after a failure probes the hosts
whose cooldown has passed too. The hosts come from a hostfile, a host discovery script
(``--host-discovery-script``) or, with -np MIN:MAX and no hostfile, the SLURM allocation
(:mod:`.discovery`), read again while the job runs: a new host (a replacement node) is
probed and taken in as a returning one is.

Bookkeeping on a clock, and a probe run on a thread of its own (a probe of a host that
does not answer takes up to PROBE_TIMEOUT, which the launcher's watch of the job must
not wait for). Outside the job: no TensorFlow, no MPI.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

from . import dialect, hostfile
from ..errors import MpitrainError, UsageError
from .discovery import HostSource
from .probe import unreachable
from ..results.run_dir import ATTEMPT_ENV

#: seconds between probes of a host left out, by default (``--host-poll``), and its
#: first cooldown
HOST_POLL = 10.0
#: the longest cooldown of a host lost again and again
MAX_COOLDOWN = 600.0
#: seconds the launcher waits for hosts to answer when those that do hold fewer ranks
#: than -np MIN:MAX's minimum, before it gives up
HOSTS_WAIT = 300.0

#: probe(host names) -> {name: why} of those that did not answer
Probe = Callable[[Sequence[str]], Dict[str, str]]


@dataclass
class _LeftOut:
    why: str
    cooldown: float
    next_probe: float


@dataclass
class Membership:
    """The launch's hosts (``hosts``, in hostfile order) and -np (``np``), and which of
    them are left out now. ``poll``: seconds between probes of a host left out (0: a
    host left out is taken back only at a restart after a failure)."""

    hosts: List[hostfile.Host]
    np: int
    oversubscribe: bool
    poll: float = HOST_POLL
    #: -np MIN:MAX's minimum: the job never runs on fewer ranks (1: the mode's own)
    np_min: int = 1
    #: seconds to wait for hosts when those that answer hold fewer than np_min ranks
    #: (``--hosts-wait``; None: HOSTS_WAIT)
    wait: Optional[float] = None
    clock: Callable[[], float] = time.monotonic
    left_out: Dict[str, _LeftOut] = field(default_factory=dict)
    #: how many times each host was lost, for its cooldown
    losses: Dict[str, int] = field(default_factory=dict)
    #: (LOWER, UPPER) seconds: a host left out is probed again LOWER seconds after its
    #: first loss, twice that after its second..., at most UPPER (None: poll (HOST_POLL
    #: if 0) and MAX_COOLDOWN; ``--blacklist-cooldown-range``)
    cooldown: Optional[Tuple[float, float]] = None
    #: where the hosts come from, read again while the job runs (see :meth:`reread`)
    source: Optional[HostSource] = None
    _probing: Optional[threading.Thread] = None
    _answered: List[str] = field(default_factory=list)

    def reread(self, now: bool = False) -> List[str]:
        """If the source's hosts changed since they were last read (the hostfile edited,
        the discovery script's answer), they become the launch's: a new host is left
        out, due for a probe at once, so that it joins as a host that comes back does (a
        replacement node); a host no longer listed is not run on after the next restart.
        ``now``: read the source now, waiting for it (bounded), rather than take what
        its last poll found. Lines saying what changed; a source that cannot be read
        keeps the hosts as they were (one line)."""
        if self.source is None:
            return []
        if not now:
            hosts, lines = self.source.poll()
            return lines if hosts is None else lines + self._rehost(hosts)
        try:
            return self._rehost(self.source.read())
        except UsageError as e:
            return [f"{e}: the hosts stay as they were"]

    def _rehost(self, hosts: List[hostfile.Host]) -> List[str]:
        before = {h.name for h in self.hosts}
        added = [h.name for h in hosts if h.name not in before]
        removed = [h.name for h in self.hosts if h.name not in {h.name for h in hosts}]
        self.hosts = hosts
        for name in removed:
            self.left_out.pop(name, None)
        where = cast(HostSource, self.source).where
        for name in added:
            self.left_out[name] = _LeftOut(f"new in {where}", 0.0, self.clock())
        return ([f"{where}: host(s) {', '.join(added)} added: probed, and taken in if "
                 "they answer and the job is short of slots"] if added else []) + \
            ([f"{where}: host(s) {', '.join(removed)} removed: the job leaves them at its "
              "next restart"] if removed else [])

    def current(self) -> List[hostfile.Host]:
        """The hosts the job runs on: the launch's, less those left out."""
        return [h for h in self.hosts if h.name not in self.left_out]

    def np_now(self) -> int:
        """The ranks the job runs with on :meth:`current`: the launch's -np, fewer where
        those hosts have fewer slots (unless oversubscribed)."""
        return self.np if self.oversubscribe else min(self.np, hostfile.total_slots(
            self.current()))

    def leave_out(self, gone: Dict[str, str]) -> List[str]:
        """Leave out the hosts of ``gone`` ({name: why}); one line per host, with when it
        is probed again."""
        lines, now = [], self.clock()
        for name, why in gone.items():
            self.losses[name] = self.losses.get(name, 0) + 1
            lower, upper = self.cooldown or (self.poll or HOST_POLL, MAX_COOLDOWN)
            cooldown = min(upper, lower * 2 ** (self.losses[name] - 1))
            self.left_out[name] = _LeftOut(why, cooldown, now + cooldown)
            again = (f"probed again in {cooldown:g} s, then every {self.poll:g} s while the "
                     "job runs" if self.poll else "probed again at the next restart, "
                     f"{cooldown:g} s from now or later")
            lines.append(f"host {name} left out ({why}; lost {self.losses[name]} time(s)): "
                         f"{again}")
        return lines

    def take_back(self, names: Sequence[str]) -> None:
        for name in names:
            self.left_out.pop(name, None)

    def cooled(self) -> List[str]:
        """The hosts left out whose next probe is due."""
        now = self.clock()
        return [name for name, out in self.left_out.items() if now >= out.next_probe]

    def look(self, probe: Probe) -> List[str]:
        """While the job runs: start a probe of the hosts due (on a thread) if none runs;
        the hosts a finished probe found answering (none until one has). Hosts that did
        not answer are probed again ``poll`` seconds later. Does nothing with poll 0."""
        if not self.poll or self.np_now() >= self.np:  # (nothing to gain: no probe)
            return []
        if self._probing is not None and not self._probing.is_alive():
            self._probing = None
            answered, self._answered = self._answered, []
            return [name for name in answered if name in self.left_out]
        due = self.cooled()
        if self._probing is None and due:
            for name in due:
                self.left_out[name].next_probe = self.clock() + self.poll
            self._probing = threading.Thread(target=self._probe, args=(probe, due),
                                             daemon=True, name="mpitrain launch host probe")
            self._probing.start()
        return []

    def growth(self, running: int, probe: Probe) -> Tuple[List[str], str]:
        """While the job runs on ``running`` ranks: the hosts it can grow by now, and why
        -- those left out that a finished probe found answering (see :meth:`look`), or
        its hosts if they offer more slots than it runs on (a discovery script's or the
        hostfile's count raised); none yet, ([], '')."""
        back = self.look(probe) if self.left_out else []
        if back:
            return back, f"host(s) {', '.join(back)} answer"
        if self.np_now() > running:
            return [h.name for h in self.current()], \
                f"the hosts offer {self.np_now()} slot(s), the job runs on {running}"
        return [], ""

    def workers_lost(self, lost: List[dict]) -> List[str]:
        """An async job goes on without a lost worker (mpirun's recovery), which its
        status.json records (``lost_workers``; ``lost``: those newly recorded, see
        :meth:`.changes.ChangeLog.workers_lost`): leave out the host each ran on (not the
        first host, the parameter server's), so that it is probed after its cooldown and
        the job grows back when it answers. Lines to say."""
        gone, job = {}, self.current()
        for worker in lost:
            name = self._named(str(worker.get("host")))
            if name is not None and name != job[0].name and name not in self.left_out:
                gone[name] = f"its worker, rank {worker.get('rank')}, was lost: " \
                             f"{worker.get('reason')}"
        return self.leave_out(gone)

    def _named(self, host: str) -> Optional[str]:
        """The launch's host ``host`` (a rank's host name) is, also by its short name."""
        names = [h.name for h in self.hosts]
        short = {name.split(".")[0]: name for name in names}
        return host if host in names else short.get(host.split(".")[0])

    def _probe(self, probe: Probe, names: List[str]) -> None:
        gone = probe(names)
        self._answered = [name for name in names if name not in gone]


@dataclass
class Job:
    """What mpirun is asked to run: ranks, hosts and its options. Before a restart the
    hosts mpirun can no longer start a process on are left out, and those back are
    taken back (:meth:`rehost`)."""

    np: int
    hosts: Optional[List[hostfile.Host]]  # None: no hostfile (this machine, or SLURM's)
    hostfile: Optional[str]
    oversubscribe: bool
    mpirun_args: List[str]
    async_mode: bool
    runner: dialect.Mpirun = field(default_factory=dialect.mpirun)  # (the one found here)
    keep_binding: bool = False  # --keep-cpu-binding: mpirun's own binding
    recovery: bool = False  # an async job whose mpirun keeps the others after a rank died
    program: List[str] = field(default_factory=lambda: ["-m", "mpitrain"])  # or a script
    #: the launch's hosts and which are left out (None without a hostfile)
    membership: Optional[Membership] = None
    #: variables every rank gets, besides the attempt's token (ATTEMPT_ENV)
    environment: Dict[str, str] = field(default_factory=dict)

    def command(self) -> List[str]:
        """mpirun in its own dialect (see :mod:`mpitrain.launch.dialect`), then the program."""
        given = (hostfile.for_launcher(self.hostfile, self.runner.hostfile_format)
                 if self.hostfile else None)
        # the async server goes on without a lost worker instead of the job ending
        cmd = self.runner.command(self.np, given, self.oversubscribe, self.keep_binding,
                                  self.recovery and self.np > 2,
                                  export=[ATTEMPT_ENV, *self.environment],  # (ATTEMPT_ENV:
                                  # the attempt's token, for rank 0)
                                  extra=self.mpirun_args)
        return cmd + [sys.executable, *self.program]

    def host_names(self) -> Optional[List[str]]:
        """The hosts the job trains on now (None without a hostfile): its hosts, less
        those left out since it started (an async worker's, lost while it went on)."""
        out = self.membership.left_out if self.membership is not None else {}
        return None if self.hosts is None else [h.name for h in self.hosts
                                                if h.name not in out]

    def on_a_lost_host(self) -> bool:
        """Whether the job runs on a host since left out (mpirun then waits for a daemon
        there that cannot answer: the launcher need not wait as long for it to exit)."""
        members = self.membership
        return members is not None and any(h.name in members.left_out
                                           for h in self.hosts or ())

    def probe(self, names: Sequence[str]) -> Dict[str, str]:
        """{name: why} of the launch's hosts of ``names`` on which mpirun, with the job's
        options, cannot start a process (:func:`.probe.unreachable`)."""
        hosts = cast(Membership, self.membership).hosts
        return unreachable([h for h in hosts if h.name in names], self.mpirun_args,
                           self.runner)

    def rehost(self, write_to: Path, back: Sequence[str] = (),
               announce: Callable[[str], None] = print, starting: bool = False) -> List[str]:
        """Probe the hosts the job runs on, those left out whose cooldown has passed and
        those of ``back`` (found answering while it ran); leave out the ones gone and take
        back the others (:class:`.membership.Membership`), -np following the slots (a
        hostfile of the hosts written at ``write_to``). Below -np MIN:MAX's minimum, wait
        for hosts first (:meth:`_wait_for_hosts`, saying so through ``announce``). Returns
        what changed, a line a host (none if nothing did); UsageError if too few ranks
        are left for the mode, MpitrainError if the wait ran out."""
        members = self.membership
        if members is None:
            return []
        reread = members.reread(now=True)
        returning = list(dict.fromkeys([*members.cooled(), *back]))
        gone = self.probe([h.name for h in members.hosts if h.name in returning
                           or h.name not in members.left_out])
        members.take_back([name for name in returning if name not in gone])
        lines = reread + members.leave_out({name: f"mpirun cannot start a process there: {why}"
                                   for name, why in gone.items()
                                   if name not in members.left_out})
        for name in returning:  # still gone: probed again a poll later
            if name in gone:
                members.left_out[name].next_probe = members.clock() + members.poll
        if members.np_now() < members.np_min:
            self._wait_for_hosts(announce)
        hosts, np_ = members.current(), members.np_now()
        if hosts == self.hosts:
            return lines
        if not hosts or (self.async_mode and np_ < 2):
            raise UsageError(f"host(s) {', '.join(gone)} cannot be reached ("
                             + "; ".join(f"{h}: {why}" for h, why in gone.items())
                             + f") and the hosts left offer {hostfile.total_slots(hosts)} "
                             "slot(s): too few to continue the run (fix the hosts, then "
                             "launch again with --resume)")
        write_to.write_text(hostfile.render(hosts, self.runner.hostfile_format))
        taken = [h.name for h in hosts if h not in (self.hosts or ())]
        if taken:
            lines.append(f"host(s) {', '.join(taken)} answer: taken in")
        more = "more" if np_ > self.np else "fewer"
        change = (f"the run starts on the {np_} rank(s) their slots hold" if starting else
                  f"the run resumes with {more} workers")
        lines.append(f"the job runs on {', '.join(h.name for h in hosts)} ({write_to})"
                     + (f"; -np {self.np} -> {np_}, {change}" if np_ != self.np else ""))
        self.np, self.hosts, self.hostfile = np_, hosts, str(write_to)
        return lines

    def _wait_for_hosts(self, announce: Callable[[str], None]) -> None:
        """Probe the hosts left out every poll until those that answer hold -np MIN:MAX's
        minimum, for at most ``--hosts-wait`` seconds; MpitrainError (one line) if they never
        do."""
        members = cast(Membership, self.membership)
        began, floor = members.clock(), members.np_min
        bound = HOSTS_WAIT if members.wait is None else members.wait

        def out() -> str:
            return "; ".join(f"{name}: {left.why}" for name, left in members.left_out.items())
        announce(f"the hosts that answer hold {members.np_now()} rank(s), fewer than -np "
                 f"{floor}:{members.np}'s minimum: waiting up to {bound:g} s for hosts "
                 f"to answer (left out: {out()})")
        while members.np_now() < floor and members.clock() - began < bound:
            time.sleep(min(members.poll or HOST_POLL, max(0.0, bound)))
            for line in members.reread(now=True):  # (hosts a script lists now)
                announce(line)
            names = list(members.left_out)
            gone = self.probe(names)
            members.take_back([name for name in names if name not in gone])
        if members.np_now() < floor:
            raise MpitrainError(f"-np {floor}:{members.np}: the hosts that answer hold "
                                f"{members.np_now()} rank(s) after {bound:g} s of waiting "
                                f"(left out: {out()}); bring hosts back, then launch again "
                                "(with --resume RUN_DIR if the run has begun)")
