"""One training run from start to finish, on every rank.

The order matters and is the same on every rank: MPI up, the configuration (built once,
by the CLI or ``mpitrain.fit``; a resumed run's read from its directory by rank 0 and
handed to the others), CPU placement, data (a collective that agrees on what was
loaded), TensorFlow and the replica, the results writer, the trainer, the results.
Every cross-rank step is bounded by ``--timeout``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, Optional, cast

import numpy as np

from .. import data, models
from ..results import telemetry
from ..launch import preflight as preflight_checks
from ..comm import Comm, Role, library_versions, placement
from ..config import Config
from ..errors import Interrupted, MpitrainError, ResultsError, UsageError, WriteError
from .checkpoint import Checkpoint
from .signals import StopRequest
from .resume import remap_position, resumed_config
from .metadata import describe_lr, rank_facts, run_metadata, run_row, summary_lines
from .startup import StartAgain, Startup
from .console import Console, NullConsole
from ..data.shards import batches_per_epoch, check_shards
from ..models.keras_import import onednn_hint
from ..models.replica import Replica, check_outputs, ends_in_softmax, init_tensorflow
from ..config.settings import MAX_COUNT
from ..results.run_dir import NullResults, RunResults, attempt_facts
from ..train import Context, Summary, lr_schedule, trainer
from ..train.context import ConsoleOutput, ResultsWriter
from ..train.asynchronous.recovery import lost_in_this_job
from ..userfiles import read_bounded


def run(cfg: Config, explicit: frozenset = frozenset(), ends_process: bool = False, *,
        model: Optional[models.ModelSpec] = None,
        arrays: Optional[Dict[str, np.ndarray]] = None) -> Summary:
    """Train as configured; the serving rank writes the results. Collective.

    ``explicit`` names the settings given on the command line (for --resume);
    ``ends_process``: the process ends with this run (the CLI's last run), so what the
    run changes about the process need not be undone (:mod:`mpitrain.train.priority`).
    ``model`` and ``arrays`` are what ``mpitrain.fit`` hands over in memory: the model
    to train instead of loading ``cfg.model`` by name, the data instead of reading
    ``cfg.data.path`` (see :func:`mpitrain.data.given_arrays`).

    The phases, in the same order on every rank: MPI and the run's configuration (a
    resumed run's from its directory), the model's spec and the version checks, the
    rank's role and CPU placement, the data (before TensorFlow: a bad file fails in a
    second), the replica, the results, then training and its records.
    """
    stop = StopRequest().install()  # first, so a signal during setup is not lost
    comm = Comm.world(cfg.faults.timeout, cfg.sync.allreduce_wait, cfg.faults.start_timeout)
    before: Optional[StartAgain] = None
    while True:  # again only without a worker lost while the job started (.startup)
        try:
            return attempt(cfg, explicit, comm, stop, ends_process, model, arrays, before)
        except StartAgain as again:
            before, comm = again, again.comm


def attempt(cfg: Config, explicit: frozenset, comm: Comm, stop: StopRequest,
            ends_process: bool, model, arrays, before: Optional[StartAgain]) -> Summary:
    """:func:`run` on ``comm``, from the run's configuration on; raises
    :class:`StartAgain` out of a start-up that lost a worker the run goes on without."""
    checkpoint, rescale = None, None
    if cfg.resume:
        cfg, checkpoint, rescale = prepare_resume(cfg, explicit, comm)
    else:
        cfg = at_job_size(cfg, comm)
    startup = Startup(cfg, comm, before)
    try:
        ctx, spec = start(cfg, comm, stop, startup, checkpoint, rescale, model, arrays)
        trained = check_resumable(ctx, comm)
    except MpitrainError as error:
        startup.survive(error)
        raise
    ctx.ends_process = ends_process
    summary = train_and_record(ctx, spec, startup, trained)
    ctx.console.summary(summary_lines(ctx.cfg, summary, ctx.results.path))
    summary.run_dir = str(ctx.results.path) if ctx.results.path else None
    return summary


def start(cfg: Config, comm: Comm, stop: StopRequest, startup: Startup,
          checkpoint: Optional[Checkpoint], rescale, model, arrays):
    """The start-up from the model on: (the run's Context, the model's spec)."""
    spec = model if model is not None else load_model(cfg.model, comm)
    collectively(comm, lambda: preflight_checks.check_engine(cfg.sync.allreduce))
    preflight_checks.check_ranks(comm, preflight_checks.local_versions(library_versions()["mpi"]))
    role = comm.assign_roles(cfg.asynchronous.servers)
    console: ConsoleOutput = Console(cfg.quiet) if role.serves else NullConsole()
    if startup.note():
        console.note(startup.note())
    threads = placement.place(cfg.keep_cpu_binding, len(comm.workers_on_host()), role.trains,
                              cfg.threads)

    cfg, dataset, shard_size, worker_index = load_data(cfg, comm, spec, arrays)
    for line in data.describe(dataset):
        (console.note if line == dataset.note else console.info)(line)
    if checkpoint is not None:  # in this session's units if it was saved on another -np
        checkpoint = remap_position(checkpoint, cfg, dataset.train_size,
                                    rescale.original if rescale else None)
    if rescale is not None:
        console.note(f"resumed on another number of ranks, {rescale.rule}")

    init_tensorflow(threads, cfg.seed + comm.rank)  # rank 0's seed draws the initial model
    replica = build_replica(cfg, comm, spec, dataset, shard_size, role, console)
    ranks = comm.allgather_objects(rank_facts(threads, comm))
    hint = onednn_hint(ranks)
    if hint:
        console.note(hint)
    results = open_results(cfg, comm, "config.json" if checkpoint is None else
                           f"resumed-{time.strftime('%Y%m%d-%H%M%S')}.json",
                           run_metadata(cfg, dataset, replica, ranks, rescale), startup.run_dir)
    startup.run_dir = str(results.path) if results.path else None
    console.info(f"{cfg.model} {cfg.mode} on {comm.size} rank(s) ({cfg.workers} worker(s)), "
                 f"batch {cfg.batch_size}/worker, {describe_lr(cfg, replica.n_params)}, "
                 f"{cfg.epochs} epoch(s); results in {results.path}"
                 + (f" (resuming at step {checkpoint.step})" if checkpoint else ""))

    run_dir = comm.allgather_objects(str(results.path) if results.path else None)[0]
    ctx = Context(cfg, comm, role, replica, dataset, results, console, stop=stop,
                  resume_from=checkpoint, run_dir=run_dir, shard_size=shard_size,
                  worker_index=worker_index, rescaled=rescale.rule if rescale else "",
                  lost=list(startup.lost) if role.serves else [], started=startup.end)
    return ctx, spec


def build_replica(cfg: Config, comm: Comm, spec, dataset, shard_size: int, role: Role,
                  console: ConsoleOutput) -> Replica:
    """The model as this rank's :class:`Replica` (built collectively: a model that fails
    to build on one rank fails the job, named, on all), with a note when outputs said
    to be probabilities are not."""
    replica = collectively(comm, lambda: Replica(
        spec, dataset.input_shape, dataset.num_classes, cast(str, cfg.optimizer.name),
        cfg.effective_lr,
        cfg.optimizer.clip_grad_norm, lr_schedule(cfg, shard_size),
        from_logits=cfg.outputs == "logits",
        applies=role.trains and not cfg.async_mode,  # the ranks that run Keras' optimizer
        compiler=cfg.compiler), spec)
    if cfg.outputs == "probabilities" and not ends_in_softmax(replica.model,
                                                              dataset.input_shape):
        console.note(f"--outputs probabilities, but the outputs of {cfg.model} are not "
                     "probabilities (rows that sum to 1): they are taken as probabilities as "
                     "they are (end it with a softmax, or pass --outputs logits)")
    return replica


def train_and_record(ctx: Context, spec, startup: Startup, trained: bool) -> Summary:
    """Train (or, ``trained``: a run killed after its final checkpoint, only finish its
    records) and write what the run has: on success its telemetry, runs.csv row and status
    ok; on an error the same with the reason (:func:`record_failure`), then the error,
    unless it is a loss the trainer's start-up survives (:class:`StartAgain`).
    Collective; every request of the run is freed before it returns or raises."""
    comm, cfg, results = ctx.comm, ctx.cfg, ctx.results
    sampler = start_sampler(cfg, comm)
    if ctx.role is Role.SERVER:
        comm.listen_for_failures()
    try:
        try:
            # kept in every later status: `mpitrain launch` finds its attempt's run by
            # the token and tells whether rank 0 is gone by the writer
            lost = {"lost_workers": ctx.lost} if ctx.lost else {}
            results.set_status("running", "", **attempt_facts(), **lost)
            summary = final_results(ctx) if trained else trainer(cfg.async_mode)(ctx)
        except Exception as error:  # the user's model raising in a step is the user's
            blamed = models.blame_user_code(spec, error)
            if blamed is None:
                raise
            raise blamed from None
    except MpitrainError as error:
        try:
            startup.survive(error)
        except StartAgain:
            sampler.stop()
            raise
        record_failure(ctx, error, sampler)
        raise
    finally:
        comm.stop_listening()
        comm.free_requests()
    try:
        gathered = telemetry.collect(comm, ctx.role.value, sampler, ctx.timer, results,
                                     lost=lost_in_this_job(ctx.lost, comm.pids))
        results.add_run_row({**run_row(cfg, ctx.data, summary, rescaled=ctx.rescaled),
                             **telemetry.node_summary(gathered, comm.hosts)})
        results.set_status("ok")
    except WriteError as error:  # rank 0's alone: the others are done
        record_failure(ctx, error, sampler, summary)
        raise
    return summary


def preflight(cfg: Config) -> None:
    """``mpitrain check``'s job: every in-job check of a training run, without training."""
    comm = Comm.world(cfg.faults.timeout, start_timeout=cfg.faults.start_timeout)
    cfg = at_job_size(cfg, comm)
    spec = load_model(cfg.model, comm)
    collectively(comm, lambda: preflight_checks.check_engine(cfg.sync.allreduce))
    comm.assign_roles(cfg.asynchronous.servers)
    versions = preflight_checks.local_versions(library_versions()["mpi"])
    preflight_checks.check_ranks(comm, versions)
    cfg, dataset, shard_size, _ = load_data(cfg, comm, spec)
    if models.is_spec(cfg.model):  # the user's model builds, on every host, for this data
        collectively(comm, lambda: check_model(spec, dataset, cfg.outputs == "logits"), spec)
    if comm.rank == 0:
        hosts = sorted(set(comm.hosts))
        print(f"preflight ok: {comm.size} rank(s) on {len(hosts)} host(s) ({', '.join(hosts)}); "
              + ", ".join(f"{k} {v}" for k, v in versions.items())
              + f"; {dataset.name} ({dataset.train_size} training examples, "
              f"{shard_size} per worker) readable on every host", flush=True)


def at_job_size(cfg: Config, comm: Comm) -> Config:
    """``cfg`` (built for the size the launcher's environment gave) for this job's size:
    itself, or, where MPI counts otherwise (a launcher whose variables mpitrain does not
    read), rebuilt for MPI's size and validated again, on every rank alike."""
    if cfg.world_size == comm.size:
        return cfg
    return collectively(comm, lambda: cfg.replace(world_size=comm.size).validate())


def load_model(name: str, comm: Comm):
    """The ModelSpec of ``name``; a user's model is imported (and checked) on every
    rank, collectively: a rank that cannot load it fails the job, named, on all ranks."""
    return collectively(comm, lambda: models.get(name))


def collectively(comm: Comm, make, spec=None):
    """``make()`` on every rank; a UsageError on any rank is raised on all of them
    (rank 0 prints it once) instead of leaving the others waiting. So is an error that
    ``spec``'s user code raised (see :func:`mpitrain.models.blame_user_code`)."""
    result, error = None, None
    try:
        result = make()
    except UsageError as e:
        error = e
    except Exception as e:
        error = models.blame_user_code(spec, e)
        if error is None:
            raise
    comm.agree(error)
    return result


def check_model(spec, dataset, from_logits: bool) -> None:
    """Build the model as training would (output shape, softmax vs --outputs)."""
    check_outputs(spec.build(tuple(dataset.input_shape), dataset.num_classes), spec.name,
                  from_logits, dataset.input_shape)


def load_data(cfg: Config, comm: Comm, spec, arrays=None):
    """(config, this rank's splits, shard size, worker index); a worker keeps its shard.
    ``arrays``: the data ``mpitrain.fit`` was given, instead of ``cfg.data.path``.

    With --batches-per-epoch the batch size is only known now, from the data size.
    """
    role = comm.role
    # (a parameter server of a share, --servers K, reads the test split too: the ranks
    # agree on the data's shape through what they read)
    splits = (("train",) if role.trains else ()) + (("test",) if not role.trains or
                                                    role.serves else ())
    given = cfg.data
    shape = {**spec.synthetic, "n_train": given.synthetic_size}
    if given.image_size:
        shape["image_size"] = given.image_size
    worker_index = max(0, comm.rank - cfg.asynchronous.servers) if comm.size > 1 else 0
    dataset = data.load(cast(str, given.dataset), given.data_dir, comm, splits, seed=cfg.seed,
                        synthetic_shape=shape, user_data=given.path, image_size=given.image_size,
                        shard=(cfg.workers, worker_index) if role.trains else None,
                        arrays=arrays, eval_examples=cfg.eval_examples,
                        read_timeout=cfg.faults.timeout, stream=given.stream)
    if cfg.batches_per_epoch:
        shard = dataset.train_size // cfg.workers
        cfg = cfg.replace(batch_size=max(1, -(-shard // cfg.batches_per_epoch)))
    shard_size = check_shards(dataset.train_size, cfg.workers, cast(int, cfg.batch_size))
    check_run_length(cfg, shard_size)
    return cfg, dataset, shard_size, worker_index


def check_run_length(cfg: Config, shard_size: int) -> None:
    """UsageError if the run would count more updates than its counters hold (steps and
    server versions travel as int32 in every message's header)."""
    per_epoch = batches_per_epoch(shard_size, cast(int, cfg.batch_size))
    epochs = cast(int, cfg.epochs)
    steps = min(per_epoch * epochs, cfg.max_steps or per_epoch * epochs)
    updates = steps * (cfg.workers if cfg.mode == "async" else 1)
    if updates > MAX_COUNT:
        raise UsageError(f"--epochs {cfg.epochs} of {per_epoch:,} step(s) each make "
                         f"{updates:,} updates, more than the {MAX_COUNT:,} a run counts; "
                         "use fewer --epochs, or --steps")


def prepare_resume(cfg: Config, explicit: frozenset, comm: Comm):
    """(config, checkpoint, rescale) of the run being resumed; rank 0 reads them, all
    agree. ``rescale`` (a :class:`~mpitrain.run.resume.Rescale`, else None) says how the
    run continues on another number of ranks.

    Only rank 0 needs the run directory (it may exist on rank 0's host only);
    the others receive the configuration. The checkpoint stays on rank 0, which
    hands its contents to the others when training starts.
    """
    resumed, checkpoint, error = None, None, None
    if comm.rank == 0:
        try:
            resumed = resumed_config(cfg, set(explicit), comm.size)
            checkpoint = Checkpoint.load(Path(cast(str, cfg.resume)))
        except (UsageError, ResultsError) as e:
            error = e
    comm.agree(error)
    cfg, rescale = comm.allgather_objects(resumed)[0]
    return cfg, checkpoint, rescale


def check_resumable(ctx: Context, comm: Comm) -> bool:
    """True if the resumed run's training is complete but its results were never
    written (it was killed after its final checkpoint): the session then only
    writes them. A run that finished cannot be resumed without more epochs (all
    ranks raise alike)."""
    facts = None
    if ctx.resume_from is not None:  # rank 0 holds the checkpoint and the directory
        facts = (steps_done(ctx.resume_from, ctx.cfg), run_status(Path(cast(str, ctx.cfg.resume))))
    done, status = comm.allgather_objects(facts)[0] or (None, None)
    if done is not None and done >= ctx.total_steps and status != "ok":
        return True
    if done is not None and done >= ctx.total_steps:
        capped = ctx.total_steps < ctx.steps_per_epoch * cast(int, ctx.cfg.epochs)
        asks = f"--steps {ctx.cfg.max_steps}" if capped else f"--epochs {ctx.cfg.epochs}"
        raise UsageError(f"--resume {ctx.cfg.resume}: that run already did {done} steps "
                         f"({done / ctx.steps_per_epoch:.3g} epochs); {asks} asks for "
                         f"{ctx.total_steps}: pass a larger {asks.split()[0]} to train on")
    return False


def run_status(run_dir: Path) -> str:
    """What the run's status.json says (``running`` if it was killed), or ''."""
    try:
        status = json.loads(read_bounded(run_dir / "status.json")).get("status", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return status if isinstance(status, str) else ""


def final_results(ctx: Context) -> Summary:
    """The summary of a run whose training the checkpoint already completed: rank 0
    evaluates the checkpoint's state; nothing is trained."""
    ckpt, nan = ctx.resume_from, float("nan")
    if ckpt is None:  # the ranks that do not serve
        return Summary(0.0, ctx.total_steps, float(cast(int, ctx.cfg.epochs)), nan, nan, nan)
    ctx.replica.set_state(ckpt.state)
    loss, accuracy = ctx.replica.evaluate(cast(np.ndarray, ctx.data.x_test),
                                          cast(np.ndarray, ctx.data.y_test))
    ctx.console.note("the run's training was already complete (killed after its final "
                     "checkpoint): writing its results")
    return Summary(ckpt.wall_time_s, ckpt.step, float(cast(int, ctx.cfg.epochs)), loss, accuracy,
                   nan)


def steps_done(checkpoint: Checkpoint, cfg: Config) -> int:
    """Steps each worker had done at ``checkpoint``. An async checkpoint's step is the
    server's update count (all workers' pushes), so there it is the slowest worker's."""
    if cfg.async_mode and checkpoint.worker_steps:
        return min(checkpoint.worker_steps.values())
    return checkpoint.step


def open_results(cfg: Config, comm: Comm, name: str, metadata: dict,
                 kept: Optional[str] = None) -> ResultsWriter:
    """Rank 0's writer, the resumed run's directory (or ``kept``: the one an earlier
    start-up attempt opened) or a new one, with ``metadata`` written to ``name`` in it;
    null elsewhere. Collective: a directory that cannot be written (a read-only or full
    disk) is one error on every rank, printed once."""
    results: ResultsWriter = NullResults()
    error: Optional[ResultsError] = None
    if comm.role.serves:
        try:
            if cfg.resume or kept:
                results = RunResults.reopen(Path(kept or cast(str, cfg.resume)))
            else:
                results = RunResults(Path(cfg.results_dir),
                                     f"{models.run_name(cfg.model)}-{cfg.mode}-np{comm.size}")
            results.write_json(name, metadata)
        except ResultsError as e:
            error = e
    comm.agree(error)
    return results


def record_failure(ctx: Context, error: MpitrainError, sampler,
                   summary: Optional[Summary] = None) -> None:
    """Write what the run has: its status, telemetry, its runs.csv row with the reason.

    When every rank stops together (interrupted, diverged) the telemetry of all
    ranks is gathered as usual; otherwise only this rank's is written. After a failed
    write (a full disk) the status and the row come first, in the room the run's
    reserve gave back, marked not restartable, and no telemetry file is written; what
    does not fit is left out, the error itself being what the user must see.
    """
    status = "interrupted" if isinstance(error, Interrupted) else "failed"
    unwritable = isinstance(error, WriteError)
    row = run_row(ctx.cfg, ctx.data, summary or error.summary, status,
                  str(error), ctx.rescaled)
    facts = {"restartable": False} if unwritable else {}
    # until the row is written, status.json says so: should this rank be killed meanwhile
    # (the gather below waits for peers that mpirun may be killing), the launcher writes it
    _if_there_is_room(lambda: ctx.results.set_status(status, str(error), **facts,
                                                     runs_csv="pending"))
    try:
        if error.everywhere:
            gathered = telemetry.collect(ctx.comm, ctx.role.value, sampler, ctx.timer,
                                         ctx.results,
                                         lost=lost_in_this_job(ctx.lost, ctx.comm.pids))
            row.update(telemetry.node_summary(gathered, ctx.comm.hosts))
        elif not unwritable:
            gathered = telemetry.write_local(ctx.comm, ctx.role.value, sampler, ctx.timer,
                                             ctx.results)
            row.update(telemetry.node_summary(gathered, ctx.comm.hosts))
    except MpitrainError:
        pass  # peers gone: the row is still written; the original error is what matters
    _if_there_is_room(lambda: ctx.results.add_run_row(row))
    _if_there_is_room(lambda: ctx.results.set_status(status, str(error), **facts,
                                                     runs_csv="written"))


def _if_there_is_room(write) -> None:
    try:
        write()
    except WriteError:
        pass  # the disk is full or read-only: the run's error says so


def start_sampler(cfg: Config, comm: Comm):
    """This rank's telemetry sampler; the lowest rank on each host also samples the host."""
    if cfg.telemetry.sample_interval <= 0:
        return telemetry.NullSampler()
    leader = comm.ranks_on_host()[0] == comm.rank
    return telemetry.Sampler(comm.rank, comm.host, comm.role.value, cfg.telemetry.sample_interval,
                             node_leader=leader).start()
