"""Command line: ``mpitrain MODEL [options]`` (also ``python -m mpitrain``).

The training options are generated from :class:`mpitrain.config.Config`, so
their defaults and help live in one place. Usage errors are one line
(``mpitrain: error: ...``), printed once (by rank 0 under mpirun), exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

from . import datasets, exits
from .. import models
from ..comm import bound_finalize, launcher_rank, launcher_world_size
from ..config import SECTION_TITLES, Config, resolve, settings_with_flags
from ..errors import Dropped, MpitrainError, UsageError
from .exits import PROG
TOOLS = ("plot", "report", "check", "sweep", "launch", "data")
#: the grid lists ``mpitrain sweep`` takes on its command line: (grid key, option, type)
SWEEP_LISTS = (("model", "models", str), ("mode", "modes", str), ("np", "np", int),
               ("batch_size", "batch_sizes", int), ("batches_per_epoch", "batches_per_epoch", int),
               ("epochs", "epochs", int))
EPILOG = """\
Run under MPI: rank 0 is the parameter server (evaluates, writes results),
ranks 1..N-1 are workers. Examples:
  mpirun -np 1 python -m mpitrain lr                               # single node
  mpirun -np 4 -hostfile hostfiles/local python -m mpitrain lr     # sync, 3 workers
  mpirun -np 4 -hostfile hostfiles/local python -m mpitrain lr --async
  mpirun -np 3 -hostfile hostfiles/local python -m mpitrain ./my_model.py:build \
      --data my.npz                                                # your model
  mpitrain data pack ./images/ shards/                             # data larger than
  mpirun -np 3 -hostfile hostfiles/local python -m mpitrain lenet \
      --data shards/                                               # memory, streamed
MODEL is a registered name or your own FILE.py:FUNCTION / module:FUNCTION,
FUNCTION(input_shape, num_classes) returning a keras.Model that outputs logits.
Add -q to Open MPI 4's mpirun to hide its own banner when a run fails; Open MPI 5
needs --bind-to none for more ranks than cores; MPICH's mpiexec reads HOST:N hostfiles.
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _print_message(self, message, file=None):
        # --help and --version print once, on rank 0, not once per rank
        if launcher_rank() == 0:
            super()._print_message(message, file)


def _model_help(spec, key: str, doc: str) -> str:
    default = spec.defaults.get(key)
    return doc + (f" (default for {spec.name}: {default})" if default is not None else "")


def _add_training_options(parser: argparse.ArgumentParser, spec) -> None:
    """The training options, flat (dest: each setting's key), listed by section; one not
    given stays out of the namespace (see :func:`explicit_settings`), its default is the
    setting's."""
    groups = {}
    for s in settings_with_flags():
        if s.section not in groups:
            groups[s.section] = parser.add_argument_group(f"{SECTION_TITLES[s.section]} options")
        kwargs = dict(s.cli)
        if s.default is None:
            kwargs["help"] = _model_help(spec, s.key, s.doc)
        elif kwargs.get("action") == "store_true":
            kwargs["help"] = s.doc
        else:
            kwargs["help"] = f"{s.doc} (default: {s.default})"
        groups[s.section].add_argument(str(s.flag), dest=s.key, default=argparse.SUPPRESS,
                                       **kwargs)


def user_model_in(argv: List[str]) -> Optional[str]:
    """The user's model spec (FILE.py:FUNCTION, module:FUNCTION) ``argv`` trains, if any."""
    return argv[0] if argv and models.is_spec(argv[0]) else None


def build_parser(user_model: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole CLI; ``user_model`` adds a training command for that model spec."""
    from .. import __version__

    parser = _Parser(prog=PROG, description="MPI data-parallel training for TensorFlow: "
                     "sync allreduce or an async parameter server.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)
    user = ([models.ModelSpec(user_model, None,  # type: ignore[arg-type]  # (--help's: never built)
                              f"your model {user_model}",
                              dict(models.USER_DEFAULTS))] if user_model else [])
    for spec in models.specs() + user:
        sub = commands.add_parser(spec.name, help=f"train {spec.summary}",
                                  description=spec.summary)
        _add_training_options(sub, spec)
    plot = commands.add_parser("plot", help="figures of one run, or a comparison of several",
                               description="Figures of one run (written into its directory) "
                               "or a comparison of several runs (into a new directory).")
    plot.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    plot.add_argument("-o", "--out-dir", type=Path, help="where comparison figures go")
    report = commands.add_parser("report", help="all figures and a markdown report of a "
                                 "results directory", description="Figures of every run in "
                                 "RESULTS_DIR and RESULTS_DIR/report/report.md.")
    report.add_argument("results_dir", type=Path, metavar="RESULTS_DIR")
    check = commands.add_parser(
        "check", help="preflight a launch without training", allow_abbrev=False,
        description="Check a launch without training: the hostfile (syntax, slots), -np "
        "against the slots and the mode, then a short job on those hosts that compares "
        "every rank's versions and loads the data on every host. Run it as "
        "'mpitrain check -np 4 -hostfile hostfiles/cluster2 lr --async' (no mpirun).")
    check.add_argument("-np", "--np", dest="np", type=int, default=1, help="ranks (default 1)")
    check.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE")
    check.add_argument("--oversubscribe", action="store_true",
                       help="allow more ranks than slots (as mpirun --oversubscribe)")
    check.add_argument("--no-launch", action="store_true",
                       help="only the checks that need no MPI job")
    check.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    # check's own options may come before or after the model; every other option is the
    # training command's (parse_args: what check does not know is the training's)
    check.add_argument("training", nargs="*", metavar="MODEL [OPTIONS]",
                       help="the training command to check (default: lr)")
    sweep = commands.add_parser(
        "sweep", help="run a grid of trainings (models x modes x -np x batch sizes)",
        description="Run every combination, one mpirun after another, into one results "
        "directory with a manifest; run it again to resume a sweep that was stopped "
        "(finished runs are skipped). Ends by writing the report. Give a TOML spec "
        "(see experiments/) and/or the lists below (which override the spec's).")
    sweep.add_argument("spec", nargs="?", type=Path, help="a TOML sweep spec")
    for _, name, _ in SWEEP_LISTS:
        sweep.add_argument(f"--{name.replace('_', '-')}", metavar="A,B,...",
                           help=f"comma-separated {name.replace('_', ' ')}")
    sweep.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                       help="an mpitrain option for every run, e.g. --set steps=20 "
                       "--set image_size=64 (repeatable)")
    sweep.add_argument("--results-dir", type=Path, help="default: results/sweep-<name>")
    sweep.add_argument("--cluster", choices=("local", "cloudlab", "slurm"), default="local",
                       help="local: hostfiles/local; cloudlab: hostfiles/single, cluster, "
                       "cluster2 for -np 1, 3, 4; slurm: the allocation the sweep runs in")
    sweep.add_argument("--hostfile", help="one hostfile for every run instead")
    from ..launch import command as launch

    launch.add_parser(commands)
    datasets.add_parser(commands)
    return parser


def run_tool(args) -> int:
    """The commands that do not train (no MPI, no TensorFlow)."""
    if args.command == "plot":
        from ..report.plots import plot_runs

        for path in plot_runs(args.run_dirs, args.out_dir):
            print(path)
    elif args.command == "report":
        from ..report.markdown import write_report

        print(write_report(args.results_dir))
    elif args.command == "check":
        return run_check(args)
    elif args.command == "sweep":
        return run_sweep(args)
    elif args.command == "data":
        return datasets.run(args)
    elif args.command == "launch":
        from ..launch import command as launch

        if launch.is_script(args.training):  # the user's own script, not mpitrain's CLI
            return launch.run(args, None)
        return launch.run(args, parse_config(args.training or ["lr"],
                                             world_size=launch.world_size(args)))
    return 0


def run_sweep(args) -> int:
    """``mpitrain sweep``: the grid from a spec and/or lists, run resumably."""
    from ..launch import sweep

    spec = sweep.load_spec(args.spec) if args.spec else {"grid": {}}
    grid = dict(spec.get("grid", {}))
    for key, name, kind in SWEEP_LISTS:
        value = sweep.parse_list(getattr(args, name), kind)
        if value:
            grid[key] = value
    options = dict(spec.get("options", {}))
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item}: expected OPTION=VALUE")
        options[key.replace("-", "_")] = sweep.parse_value(value)
    name = spec.get("name") or (args.spec.stem if args.spec else "sweep")
    results = args.results_dir or Path("results") / f"sweep-{name}"
    runs = sweep.expand(grid)
    for run in runs:  # every run's options are checked before any starts
        parse_config(run.args(options), world_size=run.np)
    failed = sweep.Sweep(runs, results, options, args.cluster, args.hostfile).run()
    return 1 if failed else 0


def parse_args(argv: List[str]):
    """The command line parsed; ``check``'s training command (``args.training``) is its
    model and every option check does not know, in their order, wherever check's own
    options stand (``mpitrain check -np 2 ./m.py:build --no-launch --async``)."""
    parser = build_parser(user_model_in(argv))
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) != "check":
        return parser.parse_args(argv) if unknown else args  # (its usual error)
    args.training = list(args.training) + unknown
    return args


def run_check(args) -> int:
    """``mpitrain check``: launch-side checks, then a short job that checks every rank."""
    training = list(args.training) or ["lr"]
    # usage errors in its options; inside the job (no -np given), at the job's size
    cfg = parse_config(training, world_size=None if args.in_job else args.np)
    if args.in_job:
        from ..run import session

        session.preflight(cfg)
        return 0
    from ..launch.preflight import check_launch

    for line in check_launch(args.np, args.hostfile, args.oversubscribe, cfg.async_mode,
                             cfg.asynchronous.servers):
        print(line)
    if args.no_launch:
        return 0
    import subprocess

    from ..launch import command as launch, dialect
    from ..launch import hostfile
    from ..launch.probe import require_reachable

    runner = launch.launcher_for_this_python()
    if args.hostfile:  # a host mpirun cannot reach is named, not left to ssh's own line
        require_reachable(hostfile.read(args.hostfile), [], runner)
    given = hostfile.for_launcher(args.hostfile, runner.hostfile_format) \
        if args.hostfile else None
    cmd = runner.command(args.np, given, args.oversubscribe or not args.hostfile,
                         cfg.keep_cpu_binding)
    training = [models.canonical(training[0]), *training[1:]]  # from any working directory
    cmd += [sys.executable, "-m", "mpitrain", "check", "--in-job", *training]
    bound = cfg.faults.bounds.check_job
    try:
        return subprocess.run(cmd, timeout=bound, env=dialect.launch_environment()).returncode
    except subprocess.TimeoutExpired:
        raise UsageError(f"the check job did not finish in {bound:g} s; a host "
                         "is unreachable or a rank is stuck starting") from None


def parse_config(argv: List[str], args=None, world_size: Optional[int] = None) -> Config:
    """The run's Config from ``argv``, built once (see :func:`mpitrain.config.resolve`);
    UsageError on bad arguments.

    Built for ``world_size`` (default: the launcher's) to fail fast, before MPI and
    TensorFlow load (the session checks it against MPI's own size). With --resume it
    is what the command line asks of the run; the session builds the run's config
    from its config.json (only rank 0 may see the run directory).
    """
    args = args or parse_args(argv)
    if args.command in TOOLS:
        raise UsageError(f"expected a model to train, not {args.command!r}")
    user_model = models.is_spec(args.command)
    cfg = Config.of(model=models.canonical(args.command),
                    model_given=args.command if user_model else None,
                    **{s.key: getattr(args, s.key, s.default) for s in settings_with_flags()})
    if cfg.resume:  # what is typed is checked as typed; the run's own settings later
        return cfg.checked()
    if user_model and launcher_rank() == 0:
        # Before MPI and TensorFlow: the file is there, parses and defines the function.
        # Rank 0 alone (it prints; the job ends with it): the other ranks go on to the
        # collective load in the session, so a host where the file differs is named.
        models.precheck(cfg.model)
    cfg = resolve(cfg, models.defaults_for(cfg.model), world_size or launcher_world_size())
    from ..launch.preflight import check_engine

    check_engine(cfg.sync.allreduce)
    return cfg


def explicit_settings(args) -> frozenset:
    """Keys of the settings given on the command line (for --resume), from what argparse
    parsed (``args``), not from the tokens: an abbreviated flag (``--epoch 5``) or
    ``--epochs=5`` counts as given, as it does for training.
    """
    return frozenset(s.key for s in settings_with_flags() if hasattr(args, s.key))


def main(argv: Optional[List[str]] = None, ends_process: bool = True) -> int:
    """Entry point of ``mpitrain`` and ``python -m mpitrain``; returns the exit code.
    ``ends_process``: no other run follows in this process (see
    :func:`mpitrain.run.session.run`)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.command in TOOLS:
            return run_tool(args)
        cfg = parse_config(argv, args)
        from ..run import (session)  # imports TensorFlow and MPI: only once arguments are valid

        bound_finalize()  # every rank of a training run reaches its end together
        session.run(cfg, explicit_settings(args), ends_process)
        return 0
    except Dropped as error:
        exits.report(error)
        # the job goes on without this rank: it leaves at once, without MPI_Finalize
        # (which would still find its last push pending; under --enable-recovery
        # Open MPI lets a rank leave so)
        os._exit(error.exit_code)
    except MpitrainError as error:
        return exits.report(error)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: B902 - a crash on one rank must not hang the others
        if isinstance(error, SystemExit):
            raise
        return exits.crash()
