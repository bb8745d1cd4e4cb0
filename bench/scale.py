"""Scale: accuracy at equal epochs, epochs to a target accuracy, and rank 0's memory at
2, 4, 8 and 16 workers, sync and async (each staleness compensation); the analytical
step-time model that carries them to 64 and 256 workers; what grows with the number of
ranks (``--ranks``); and LR on the emulated cluster of nine nodes (``--cluster``).

Every point is a real mpitrain run with its defaults on the real MNIST (one host,
oversubscribed: -np 3, 5, 9, 17; the runs of one -np share a launch). A run's
test accuracy after each epoch is in its curve.csv: the table gives the final
accuracy at the run's epochs, the first epoch (and step, and training seconds) at
which the target was reached, the gap to 2 workers of the same mode and to sync at
the same worker count, the async staleness, and rank 0's peak RSS (telemetry.csv).
Targets: LR 91% in 3 epochs, LeNet 97% in 2 (two epochs of the 20,000-image subset;
the issue's 98.5% needs more epochs than a benchmark here can afford at 16 workers),
ResNet-20 98% in 2.

ResNet-20 trains on the same MNIST (28x28x1; its first convolution takes one channel):
its default data, ``--dataset synthetic``, is random images with random labels, which
no model learns (test accuracy stays at chance), and CIFAR-10 needs a download; MNIST
is the real image set a machine without the internet has. Its 16 runs cost more than
LR's and LeNet's together, so the default ``--models lr,lenet`` leaves it out:
``--models lr,lenet,resnet`` (or ``--models resnet``) adds it.

The model (no run: arithmetic, its inputs printed beside it) is for a real cluster,
one worker per node: a worker's compute per step ``c`` (measured at 2 workers: the
compute phase of timing.csv), the model's bytes ``M``, a link of ``B`` bytes/s and
``alpha`` s latency per message (1 GbE 50 us, 10 GbE 20 us, 25 GbE 10 us: assumed,
typical TCP figures). Sync, ring allreduce: ``step = c + 2(n-1)/n M/B + 2(n-1)
alpha``. Async, ``k`` servers: a worker makes ``1 / (c + 2 M/B + 2 alpha)`` updates a
second, a server's link carries ``k B / (2 M)`` (a gradient in, weights out per
update); past ``n* = k B (c + 2 M/B + 2 alpha) / (2 M)`` workers the server is the
bottleneck and async stops scaling.

Async runs with each ``--staleness-compensation``: auto (the default: dc for these
models), sqrt and none, all under the default staleness bound; where that bound binds
(``staleness_bound("auto", workers)``), "async unbounded" (``--staleness none``,
compensation auto) beside them; marked "(before)", sync and async with the defaults before
these rules, given as options (``BEFORE``); and for the Adam models, marked
"(warm-up)", sync with the warm-up the default gives only SGD and momentum
(``WARMED_UP``), the measurement behind that rule; for LR (Nesterov momentum at 0.05),
marked "(sgd)", sync and async with plain SGD at ten times the rate, its default before
(``PLAIN_SGD``): the same long-run step without momentum. At 8 and 16 workers, marked
"(longer)", sync planned for ``LONGER`` times the epochs: where a large global batch
needs more epochs, the epoch at which it reaches the target (a run's learning rate
follows its plan, so a run of the base epochs is not the longer run's first part);
the check is the issue's: at most 1.25x the 2-worker sync run's epochs.

``--ranks 3,5,9,17,33``: at each -np one launch of LR for one epoch, sync then async,
timed on every rank (:func:`rank_side`: the real runs, with hooks that only read the
clock): start-up (mpirun's start to the last rank's process, and to the last rank in
its trainer: MPI, data, TensorFlow and the model up; and the CPU a rank spent on it),
rank 0's final evaluation and checkpoint (``finish_s``), rank 0's end-of-run gather
of every rank's telemetry and its writing, the size and rows of the run's telemetry
files, mpirun's exit after the last run, ``mpitrain check`` (the preflight job) and
the launcher's probe of the hostfile's host; each against -np with its growth
exponent fitted (``value ~ np^b``, least squares on the logs: b <= 1 is linear or
better). On one host every rank's CPU shares two cores, so per-rank work alone grows
wall time linearly here; the exponent is what tells a per-rank cost (b near 1) from
one that grows faster, and a rank's own CPU (b near 0) what one rank pays. A -np
needs about
``RANK_MB`` of free memory a rank: one that does not fit is left out and named.
``--quick`` reports its own launch's timings (one -np, no exponent).

``--cluster 8,16``: LR sync and async, 3 epochs, on the emulated cluster
(scripts/netns-cluster: network namespaces, links shaped to 1 GbE) of nine nodes, rank
0 alone on node0 and the workers spread over node1..node8 (one or two a node); beside
it the launcher's probe of 1, 3, 5 and 9 of those nodes (the median of three). The
nodes share this machine's cores: the links are emulated, the compute is not.

``--write-docs`` puts each section this run measured into docs/scaling.md's generated
block, named by the command that measured it, and keeps the sections it did not.

    python -m bench scale [--quick] [--workers 2,4,8,16] [--models lr,lenet[,resnet]|none]
                          [--ranks 3,5,9,17,33] [--cluster 8,16] [--write-docs]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mpitrain.config.sections import WARMUP_FRACTION, staleness_bound

from .common import (RUNS_IN_ONE_LAUNCH, available_mb, bench_parser, launch_mpitrain, last_run,
                     mnist_dir, on_every_rank, out_dir, run_table, runs_in_one_launch,
                     slots_file, table, train_many, write_block, write_csv)

#: when this process's Python was up (on a rank of a timed launch: :func:`rank_side`)
STARTED = time.time()

#: per model: the epochs of every run, the target accuracy, the async compensations, and
#: arguments of its own (ResNet-20: MNIST instead of its random-label synthetic default)
MODELS = {
    "lr": {"epochs": 3, "target": 0.91, "compensations": ["auto", "sqrt", "none"]},
    "lenet": {"epochs": 2, "target": 0.97, "compensations": ["auto", "sqrt", "none"]},
    "resnet": {"epochs": 2, "target": 0.98, "compensations": ["auto", "sqrt", "none"],
               "args": ["--dataset", "mnist"]},
}
#: momentum-SGD models whose runs (sync and async) go again with plain SGD at ten times
#: the rate: the same long-run step, without what momentum makes of a large global
#: batch's few steps (async: its servers trade the momentum for asynchrony's own)
PLAIN_SGD = {"lr": ["--optimizer", "sgd", "--lr", "0.5"]}
#: the defaults before the large-batch rules, as options: sync without warm-up (and
#: LR's constant rate and plain SGD), async uncompensated and unbounded, with the
#: optimizer's own momentum and (LR) pipelined, as 'auto' then chose
BEFORE = {
    "lr": {"sync": ["--warmup-epochs", "0", "--lr-schedule", "constant", *PLAIN_SGD["lr"]],
           "async": [*PLAIN_SGD["lr"], "--staleness-compensation", "none", "--pipeline",
                     "on", "--lr-schedule", "constant", "--staleness", "none"]},
    "lenet": {"async": ["--staleness-compensation", "none", "--pipeline", "off",
                        "--momentum-correction", "off", "--staleness", "none"]},
}  # (LeNet's sync: as now, no warm-up)
#: models whose optimizer (Adam) gets no warm-up by default: their sync runs again with the
#: warm-up SGD and momentum get (a fifth of the run)
WARMED_UP = ("lenet", "resnet")
#: the longer sync runs at 8 workers and more: this many times the model's epochs
LONGER = 1.5
#: ...whose epochs to the target may be at most this many times 2 workers'
EPOCHS_TO_TARGET_BOUND = 1.25
#: docs/scaling.md's generated block (``--write-docs``) lies between these lines
DOCS = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
BEGIN, END = "<!-- bench scale: begin -->", "<!-- bench scale: end -->"
#: links of the model: (name, bytes/s, latency s)
LINKS = [("1 GbE", 125e6, 50e-6), ("10 GbE", 1.25e9, 20e-6), ("25 GbE", 3.125e9, 10e-6)]
MODEL_WORKERS = [2, 4, 8, 16, 64, 256]
#: free memory (MB) a rank of an LR run needs (its TensorFlow runtime; the libraries'
#: pages are shared between the ranks of a host): -np that do not fit are left out
RANK_MB = 400
#: the telemetry files a run writes, whose size grows with the ranks
TELEMETRY_FILES = ("telemetry.csv", "timing.csv", "comm.csv", "staleness.csv")
#: probes of each number of hosts, of which the table gives the median
PROBE_REPEATS = 3
#: the emulated cluster of ``--cluster``: nodes (rank 0 alone on node0), link
CLUSTER_NODES, CLUSTER_LINK = 9, "1gbit"


def main(argv=None, out=None) -> dict:
    parser = bench_parser("scale", __doc__, "LR at 2 workers, one epoch (smoke)")
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--models", default="lr,lenet",
                        help="models of the accuracy runs (lr, lenet, resnet), or none")
    parser.add_argument("--ranks", default="",
                        help="-np of the start-up, gather and telemetry runs (e.g. "
                             "3,5,9,17,33); default: none")
    parser.add_argument("--cluster", default="",
                        help="workers of the LR runs on the emulated cluster (e.g. 8,16)")
    parser.add_argument("--write-docs", action="store_true",
                        help="put the sections measured into docs/scaling.md's block")
    parser.add_argument("--rank-side", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        on_every_rank(rank_side, *args.rank_side)
        return {}
    out = out or out_dir()
    command = "python -m bench scale " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-docs").strip()
    sections: Dict[str, str] = {}
    found: List[Dict] = []
    accuracy = accuracy_section(args, out, command, sections, found)
    if args.ranks or args.quick:
        ranks_section(args, out, command, sections, found, accuracy)
    if args.cluster:
        cluster_section([int(w) for w in args.cluster.split(",")], out, command, sections,
                        found)
    (out / "scale.md").write_text("\n".join(sections.values()))
    if args.write_docs and not args.quick:
        write_docs(DOCS, sections)
    return {"checks": found}


def accuracy_section(args, out: Path, command: str, sections: Dict[str, str],
                     found: List[Dict]) -> List[Dict]:
    """The accuracy runs of ``--models`` at ``--workers``, a section per model (its table
    and its step-time model's); returns each launch's timings (``--quick``'s ranks)."""
    workers = [2] if args.quick else [int(w) for w in args.workers.split(",")]
    models = ["lr"] if args.quick else [m for m in args.models.split(",") if m != "none"]
    if not models:
        return []
    rows, launches = [], []
    for n in workers:
        runs = {}
        for model in models:
            runs.update(model_runs(model, n, args.quick))
        done, moments = launch_timed(n + 1, runs, out / f"np{n + 1}",
                                     slots_file(out, n + 1))
        launches.append({"np": n + 1, "done": done, "moments": moments})
        rows += [point(name, n, row) for name, row in done.items()]
    relate(rows)
    write_csv(out / "scale.csv", rows)
    print(table(rows, ACCURACY_COLUMNS))
    model_rows = step_model(rows, models)
    write_csv(out / "scale_model.csv", model_rows)
    print(table(model_rows, list(model_rows[0])))
    for model in models:
        sections[model] = model_section(model, command, rows, model_rows)
    found += checks(rows)
    return launches


def model_runs(model: str, workers: int, quick: bool) -> Dict[str, List[str]]:
    """The accuracy runs of one model at one worker count: {name: mpitrain arguments}."""
    spec = MODELS[model]
    data = ["--data-dir", mnist_dir(), *spec.get("args", [])]
    base = [model, "--epochs", "1" if quick else str(spec["epochs"]), *data]
    runs = {f"{model}-sync": base}
    for comp in spec["compensations"][:1] if quick else spec["compensations"]:
        runs[f"{model}-async-{comp}"] = [*base, "--async", "--staleness-compensation", comp]
    if quick:
        return runs
    if staleness_bound("auto", workers) is not None:  # where the default bound binds
        runs[f"{model}-async-unbounded"] = [*base, "--async", "--staleness", "none"]
    for mode, before in BEFORE.get(model, {}).items():  # the defaults before these rules
        runs[f"{model}-{mode}-before"] = [*base, *(["--async"] if mode == "async" else []),
                                         *before]
    if model in WARMED_UP:
        runs[f"{model}-sync-warmup"] = [*base, "--warmup-epochs",
                                        f"{WARMUP_FRACTION * spec['epochs']:g}"]
    if workers >= 8:
        longer = str(math.ceil(LONGER * spec["epochs"]))
        runs[f"{model}-sync-longer"] = [model, "--epochs", longer, *data]
    if model in PLAIN_SGD:
        runs[f"{model}-sync-sgd"] = [*base, *PLAIN_SGD[model]]
        runs[f"{model}-async-sgd"] = [*base, "--async", *PLAIN_SGD[model]]
    return runs


ACCURACY_COLUMNS = ["model", "mode", "workers", "epochs", "accuracy", "vs_2_workers_pp",
                    "vs_sync_pp", "target", "epoch_to_target", "step_to_target",
                    "seconds_to_target", "staleness_mean", "rank0_peak_rss_mb"]


def model_section(model: str, command: str, rows: List[Dict], model_rows: List[Dict]) -> str:
    """One model's section of the generated block: its measured rows, then its model's."""
    mine = [r for r in rows if r["model"] == model]
    keep = [r for r in model_rows if r["model"] == model and r["workers"] in (16, 64, 256)]
    return (f"### {model}\n\nFrom `{command}`.\n\n" + md(mine, ACCURACY_COLUMNS)
            + "\n\nStep-time model:\n\n" + md(keep, list(model_rows[0])) + "\n")


def launch_timed(np_: int, runs: Dict[str, List[str]], results: Path, hostfile: Path,
                 mpirun_args: Sequence[str] = (), timeout: float = 3600
                 ) -> Tuple[Dict[str, Dict[str, str]], Dict]:
    """:func:`bench.common.train_many`'s one launch of ``runs``, every rank timed by
    :func:`rank_side`: (each run's runs.csv row by name, :func:`launch_moments`)."""
    program = runs_in_one_launch(runs, results)
    times = results / "times"
    times.mkdir(parents=True, exist_ok=True)
    began = time.time()
    launch_mpitrain(np_, ["-m", "bench.scale", "--rank-side", program[1], str(times)],
                    timeout * len(runs), hostfile, list(mpirun_args), sys.executable)
    ended = time.time()
    return ({name: last_run(results / name) for name in runs},
            launch_moments(times, np_, began, ended))


def rank_side(runs_json: str, times: str) -> None:
    """On every rank of a timed launch: the runs of ``runs_json`` through the suite's
    cli_runs helper (one after another, as :func:`bench.common.train_many` runs them),
    this rank's moments written to ``times``/rank-R.json after each run: its Python's
    start, each run's entry into its trainer (start-up is over: MPI, the data,
    TensorFlow and the model are up on this rank; with the CPU seconds used by the
    first) and the start and end of each run's
    telemetry gather (on rank 0: waiting for every rank's rows, then writing the files).
    The real functions run; the hooks only read the clock. No collective of its own."""
    import runpy

    from mpitrain.run import session
    from mpitrain.results import telemetry

    moments = {"python": STARTED, "train": [], "gather": []}
    trainer, collect = session.trainer, telemetry.collect

    def timed_trainer(async_mode):
        train = trainer(async_mode)

        def timed(ctx):
            moments["train"].append(time.time())
            moments.setdefault("train_cpu", time.process_time())  # the first run's
            return train(ctx)
        return timed

    def timed_collect(comm, *args, **kwargs):
        began = time.time()
        try:
            return collect(comm, *args, **kwargs)
        finally:
            moments["gather"].append([began, time.time()])
            (Path(times) / f"rank-{comm.rank}.json").write_text(json.dumps(moments))

    session.trainer, telemetry.collect = timed_trainer, timed_collect
    sys.argv = [str(RUNS_IN_ONE_LAUNCH), runs_json]
    runpy.run_path(str(RUNS_IN_ONE_LAUNCH), run_name="__main__")


def launch_moments(times: Path, np_: int, began: float, ended: float) -> Dict:
    """A timed launch's costs from its ranks' moments (:func:`rank_side`) and mpirun's
    start and exit (``began``, ``ended``): the seconds to the last rank's Python running
    (``spawn_s``) and to the last rank in the first run's trainer (``startup_s``), the
    CPU seconds a rank had used by then (``startup_cpu_s``, the ranks' mean: what each
    rank's start-up costs, whoever else shares its cores); for
    each run, rank 0's wait in its telemetry gather for the last rank to call it
    (``gather_wait_s``: that rank's own end of the run) and the gather from then to the
    files written (``gather_s``); and from the last rank's last gather to mpirun's exit
    (``exit_s``). Raises if a rank left no moments."""
    ranks = [json.loads(p.read_text()) for p in sorted(times.glob("rank-*.json"))]
    if len(ranks) != np_:
        raise RuntimeError(f"{times}: moments of {len(ranks)} rank(s) of {np_}")
    zero = json.loads((times / "rank-0.json").read_text())
    # a run's gather begins for rank 0 when it calls it and ends when it has written the
    # files; the last rank's call splits that into waiting for it and the gather itself
    last_in = [max(r["gather"][i][0] for r in ranks) for i in range(len(zero["gather"]))]
    return {"spawn_s": round(max(r["python"] for r in ranks) - began, 3),
            "startup_s": round(max(r["train"][0] for r in ranks) - began, 3),
            "startup_cpu_s": round(sum(r["train_cpu"] for r in ranks) / len(ranks), 3),
            "gather_s": [round(end - max(start, last), 3)
                         for (start, end), last in zip(zero["gather"], last_in)],
            "gather_wait_s": [round(max(0.0, last - start), 3)
                              for (start, _), last in zip(zero["gather"], last_in)],
            "exit_s": round(ended - max(r["gather"][-1][1] for r in ranks), 3)}


def ranks_section(args, out: Path, command: str, sections: Dict[str, str],
                  found: List[Dict], accuracy: List[Dict]) -> None:
    """``--ranks``: at each -np, LR sync and async for one epoch in one timed launch, then
    ``mpitrain check`` and the launcher's host probe; each cost against -np with its
    growth exponent. ``--quick`` without ``--ranks``: the accuracy launch's costs."""
    rows, skipped = [], []
    if args.ranks:
        for np_ in (int(n) for n in args.ranks.split(",")):
            free = available_mb()
            if free < np_ * RANK_MB:
                skipped.append(f"-np {np_}: {free:.0f} MB free, {np_ * RANK_MB} needed")
                print(f"left out {skipped[-1]}", flush=True)
                continue
            base = ["lr", "--epochs", "1", "--data-dir", mnist_dir()]
            hostfile = slots_file(out, np_)
            done, moments = launch_timed(np_, {"lr-sync": base, "lr-async": [*base, "--async"]},
                                         out / f"ranks-np{np_}", hostfile)
            rows += launch_rows(np_, done, moments,
                                {**preflight_s(np_, hostfile), "probe_s": probe_s(hostfile)})
    else:
        for launch in accuracy:
            rows += launch_rows(launch["np"], launch["done"], launch["moments"])
    write_csv(out / "scale_ranks.csv", rows)
    print(table(rows, RANKS_COLUMNS))
    fits = growth_rows(rows)
    if fits:
        print(table(fits, list(fits[0])))
    found += [{"benchmark": "scale", "ratio": f"growth exponent with -np of {f['cost']}",
               "value": f["exponent"], "target": "<= 1", "met": f["exponent"] <= 1}
              for f in fits]
    note = "".join(f"\n\nLeft out: {s}." for s in skipped)
    sections["ranks"] = (f"### ranks\n\nFrom `{command}`.\n\n" + md(rows, RANKS_COLUMNS)
                         + ("\n\nGrowth with -np (`value ~ np^exponent`):\n\n"
                            + md(fits, list(fits[0])) if fits else "") + note + "\n")


RANKS_COLUMNS = ["np", "run", "startup_s", "startup_cpu_s", "spawn_s", "train_s", "finish_s",
                 "gather_wait_s", "gather_s", "telemetry_kb", "samples", "sampled_s",
                 "samples_per_rank_s", "timing_rows", "comm_rows", "staleness_rows", "exit_s",
                 "check_s", "check_cpu_s", "probe_s", "accuracy", "status"]
#: the costs whose growth with -np is fitted: the launch's (on one run of each -np), and
#: each run's (fitted for each mode apart)
LAUNCH_COSTS = ("startup_s", "startup_cpu_s", "spawn_s", "exit_s", "check_s", "check_cpu_s",
                "probe_s")
RUN_COSTS = ("gather_wait_s", "gather_s", "finish_s", "telemetry_kb", "samples_per_rank_s",
             "timing_rows", "comm_rows", "staleness_rows")


def launch_rows(np_: int, done: Dict[str, Dict[str, str]], moments: Dict,
                launcher: Optional[Dict[str, float]] = None) -> List[Dict]:
    """One row per run of a timed launch: its own costs; the launch's (start-up, mpirun's
    exit) on the run they belong to (start-up: the first; mpirun's exit: the last), and
    the ``launcher``'s (the preflight and the probe at this -np) on the first."""
    rows = []
    for i, (name, row) in enumerate(done.items()):
        rows.append({"np": np_, "run": name.split("-", 1)[1], "train_s": float(row["wall_time_s"]),
                     "finish_s": float(row["finish_s"] or 0), "gather_s": moments["gather_s"][i],
                     "gather_wait_s": moments["gather_wait_s"][i],
                     **telemetry_size(Path(row["run_dir"]), np_),
                     "accuracy": round(float(row["test_accuracy"]), 4),
                     "status": row["status"]})
    rows[0].update(startup_s=moments["startup_s"], spawn_s=moments["spawn_s"],
                   startup_cpu_s=moments["startup_cpu_s"])
    rows[-1]["exit_s"] = moments["exit_s"]
    rows[0].update(launcher or {})
    return rows


def telemetry_size(run_dir: Path, np_: int) -> Dict:
    """The run's telemetry files: their kilobytes, and the rows of each. telemetry.csv's
    ``samples`` grow with the run's length as well as the ranks (each rank samples
    itself every second, and once at its end): ``samples_per_rank_s`` divides them by
    the ranks and by the seconds sampled (plus that last sample's one)."""
    size, rows = 0, {}
    for name in TELEMETRY_FILES:
        path = run_dir / name
        if path.is_file():
            size += path.stat().st_size
            with open(path, newline="") as f:
                rows[name] = sum(1 for _ in f) - 1
    times = run_table(run_dir, "telemetry")["time_s"]
    sampled = round(float(times.max()), 3) if times.size else 0.0
    samples = rows.get("telemetry.csv", 0)
    return {"telemetry_kb": round(size / 1024, 1), "samples": samples, "sampled_s": sampled,
            "samples_per_rank_s": round(samples / np_ / (1 + sampled), 3),
            "timing_rows": rows.get("timing.csv", ""), "comm_rows": rows.get("comm.csv", ""),
            "staleness_rows": rows.get("staleness.csv", "")}


def growth_rows(rows: List[Dict]) -> List[Dict]:
    """Each cost's growth exponent against -np (:func:`exponent`) over the rows that have
    it: a launch's costs once per -np, a run's for each mode apart."""
    out = []
    cases = [(cost, None) for cost in LAUNCH_COSTS] + [
        (cost, mode) for cost in RUN_COSTS for mode in dict.fromkeys(r["run"] for r in rows)]
    for cost, mode in cases:
        points = [(r["np"], r[cost]) for r in rows
                  if mode in (None, r["run"]) and r.get(cost) not in (None, "")]
        b = exponent(points)
        if b is not None:
            out.append({"cost": cost if mode is None else f"{cost} ({mode})",
                        "np": " ".join(str(n) for n, _ in points),
                        "values": " ".join(f"{v:g}" for _, v in points), "exponent": b})
    return out


def exponent(points: Sequence[Tuple[float, float]]) -> Optional[float]:
    """b of ``value = a np^b`` fitted by least squares on the logs; None with fewer than
    two distinct -np or a value that is not positive."""
    if len({n for n, _ in points}) < 2 or any(v <= 0 for _, v in points):
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return round(slope, 2)


def preflight_s(np_: int, hostfile: Path) -> Dict[str, float]:
    """``mpitrain check -np NP`` on ``hostfile`` (the launch preflight and its short job:
    every rank's versions compared, the data loaded on every host): its seconds
    (``check_s``) and the CPU seconds of its processes per rank (``check_cpu_s``: mpirun
    waits for its ranks, so their CPU is in this process's children's once it ends)."""
    import resource

    from .common import REPO, mpi_env

    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    began, cpu = time.time(), children_cpu()
    result = subprocess.run(
        [sys.executable, "-m", "mpitrain", "check", "-np", str(np_), "-hostfile", str(hostfile),
         "lr", "--data-dir", mnist_dir()], capture_output=True, text=True, cwd=REPO,
        env=mpi_env(), timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"mpitrain check -np {np_} failed:\n{result.stderr[-2000:]}")
    return {"check_s": round(time.time() - began, 3),
            "check_cpu_s": round((children_cpu() - cpu) / np_, 3)}


def probe_s(hostfile: Path, hosts: Optional[int] = None,
            mpirun_args: Sequence[str] = ()) -> float:
    """Seconds the launcher's probe of the (first ``hosts``) hosts of ``hostfile`` takes
    (:func:`mpitrain.launch.probe.unreachable`: mpirun runs ``true`` on each, all at once);
    raises if one is unreachable."""
    from mpitrain.launch import hostfile as hostfiles
    from mpitrain.launch.command import launcher_for_this_python
    from mpitrain.launch.probe import unreachable

    listed = hostfiles.read(hostfile)[:hosts]
    began = time.time()
    gone = unreachable(listed, list(mpirun_args), launcher_for_this_python())
    if gone:
        raise RuntimeError(f"the launcher's probe found {gone} unreachable")
    return round(time.time() - began, 3)


def cluster_section(workers: List[int], out: Path, command: str, sections: Dict[str, str],
                    found: List[Dict]) -> None:
    """``--cluster``: LR sync and async (3 epochs) at each worker count on the emulated
    cluster of CLUSTER_NODES nodes, and the launcher's probe of 1, 3, 5 and 9 of them."""
    from .netns import Skipped, emulated_cluster

    rows, probes = [], []
    try:
        with emulated_cluster(CLUSTER_LINK, CLUSTER_NODES) as cluster:
            args = cluster["mpirun_args"]
            for n in workers:
                hostfile = cluster_hostfile(out, n)
                base = ["lr", "--epochs", str(MODELS["lr"]["epochs"]), "--data-dir", mnist_dir()]
                done = train_many(n + 1, {"sync": base, "async": [*base, "--async"]},
                                  out / f"cluster-np{n + 1}", hostfile=hostfile, mpirun_args=args)
                rows += [cluster_point(n, mode, row) for mode, row in done.items()]
            full = cluster_hostfile(out, CLUSTER_NODES - 1)
            # the median of PROBE_REPEATS: one probe that meets a transient failure is
            # repeated by the launcher itself, which alone can take seconds
            probes = [{"hosts": k, "probe_s": statistics.median(
                probe_s(full, k, args) for _ in range(PROBE_REPEATS))} for k in (1, 3, 5, 9)]
    except Skipped as why:
        print(f"skipped: {why}")
        found.append({"benchmark": "scale", "ratio": "emulated cluster", "value": "skipped",
                      "target": str(why)[:80], "met": None})
        return
    write_csv(out / "scale_cluster.csv", rows)
    print(table(rows, list(rows[0])))
    print(table(probes, list(probes[0])))
    b = exponent([(p["hosts"], p["probe_s"]) for p in probes])
    found.append({"benchmark": "scale", "ratio": "growth exponent with hosts of the "
                  "launcher's probe (emulated cluster)", "value": b, "target": "<= 1",
                  "met": b is not None and b <= 1})
    sections["emulated cluster"] = (
        f"### emulated cluster\n\nFrom `{command}`: {CLUSTER_NODES} nodes, links shaped to "
        f"{CLUSTER_LINK}, rank 0 alone on node0.\n\n" + md(rows, list(rows[0]))
        + f"\n\nThe launcher's probe of the first hosts (exponent {b}):\n\n"
        + md(probes, list(probes[0])) + "\n")


def cluster_hostfile(out: Path, workers: int) -> Path:
    """A hostfile of the emulated cluster: rank 0 alone on node0, ``workers`` spread
    evenly over node1..node(CLUSTER_NODES - 1)."""
    nodes = CLUSTER_NODES - 1
    per = math.ceil(workers / nodes)
    path = out / f"hostfile-cluster-{workers}"
    path.write_text("node0 slots=1\n" + "".join(f"node{i} slots={per}\n"
                                               for i in range(1, nodes + 1)))
    return path


def cluster_point(workers: int, mode: str, row: Dict[str, str]) -> Dict:
    """One run on the emulated cluster: epoch time, accuracy, rank 0's node's traffic."""
    epochs = float(row["epochs"])
    return {"mode": mode, "workers": workers, "np": int(row["np"]), "epochs": epochs,
            "s_per_epoch": round(float(row["wall_time_s"]) / epochs, 3),
            "accuracy": round(float(row["test_accuracy"]), 4),
            "staleness_mean": row.get("staleness_mean", ""),
            "node0_mb": round(float(row["node0_rx_mb"] or 0) + float(row["node0_tx_mb"] or 0), 1),
            "status": row["status"]}


def write_docs(path: Path, measured: Dict[str, str]) -> None:
    """Put the ``measured`` sections ({name: text}) into ``path``'s generated block, in
    place of the sections of the same name; the others stay, in their order."""
    text = path.read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in text else ""
    kept = block_sections(block)
    kept.update(measured)
    write_block(path, "\n".join(s.strip() + "\n" for s in kept.values()), "scale")


def block_sections(block: str) -> Dict[str, str]:
    """The generated block's sections by name: each from its ``### NAME`` line to the next."""
    found: Dict[str, str] = {}
    name = None
    for line in block.strip().splitlines(keepends=True):
        if line.startswith("### "):
            name = line[4:].strip()
            found[name] = ""
        if name is not None:
            found[name] += line
    return found


def point(name: str, workers: int, row: Dict[str, str]) -> Dict:
    """One run's row: accuracy, when it reached the target, staleness, rank 0's memory."""
    model, mode, *comp = name.split("-")
    if comp in (["before"], ["warmup"], ["sgd"], ["longer"]):
        mode, comp = f"{mode} ({ {'warmup': 'warm-up'}.get(comp[0], comp[0]) })", []
    target = MODELS[model]["target"]
    run_dir = Path(row["run_dir"])
    reached = first_reached(run_dir / "curve.csv", target)
    telemetry = run_table(run_dir, "telemetry")
    rss = telemetry["rss_mb"][telemetry["rank"] == 0]
    compute = run_table(run_dir, "timing", ("worker", "single"))
    steps = int(float(row["steps"]))
    return {"model": model, "mode": mode if not comp else f"async {comp[0]}",
            "workers": workers, "epochs": float(row["epochs"]),
            "accuracy": round(float(row["test_accuracy"]), 4), "target": target,
            "epoch_to_target": reached.get("epoch", ""), "step_to_target": reached.get("step", ""),
            "seconds_to_target": reached.get("wall_time_s", ""),
            "staleness_mean": row.get("staleness_mean", ""),
            "rank0_peak_rss_mb": round(float(rss.max()), 1) if rss.size else "",
            "compute_s_per_step": round(float(compute["compute_s"].sum())
                                        / max(1, steps * (workers if mode == "sync" else 1)), 6),
            "parameters": json.loads((run_dir / "config.json").read_text())["model"]["parameters"]}


def first_reached(curve: Path, target: float) -> Dict[str, str]:
    """The curve.csv row of the first evaluation at or above ``target`` ({} if none)."""
    with open(curve, newline="") as f:
        for row in csv.DictReader(f):
            if float(row["test_accuracy"]) >= target:
                return row
    return {}


def relate(rows: List[Dict]) -> None:
    """Each row's gap (percentage points) to the same model and mode at 2 workers, and
    (async) to sync at the same worker count."""
    by = {(r["model"], r["mode"], r["workers"]): r["accuracy"] for r in rows}
    for r in rows:
        two = by.get((r["model"], r["mode"], 2))
        sync = by.get((r["model"], "sync", r["workers"]))
        r["vs_2_workers_pp"] = "" if two is None else round(100 * (r["accuracy"] - two), 2)
        r["vs_sync_pp"] = "" if sync is None or r["mode"] == "sync" else \
            round(100 * (r["accuracy"] - sync), 2)


def step_model(rows: List[Dict], models: List[str]) -> List[Dict]:
    """The analytical model (the module's docstring) for each measured model, its compute
    per step ``c`` taken from its sync run at the fewest workers and its bytes ``M`` from
    the run's parameters (float32)."""
    out = []
    for model in models:
        sync = sorted((r for r in rows if r["model"] == model and r["mode"] == "sync"),
                      key=lambda r: r["workers"])
        if not sync:
            continue
        c, size = sync[0]["compute_s_per_step"], 4 * sync[0]["parameters"]
        for link, bandwidth, alpha in LINKS:
            out += [model_point(model, c, size, link, bandwidth, alpha, n)
                    for n in MODEL_WORKERS]
    return out


def model_point(model: str, c: float, size: float, link: str, bandwidth: float,
                alpha: float, n: int, servers: int = 1) -> Dict:
    """Predicted sync step, its parallel efficiency, and the async update rate with its
    server's ceiling, for ``n`` workers."""
    sync_step = c + 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * alpha
    round_trip = c + 2 * size / bandwidth + 2 * alpha
    ceiling = servers * bandwidth / (2 * size)
    return {"model": model, "link": link, "workers": n, "compute_s": round(c, 6),
            "sync_step_s": round(sync_step, 6), "sync_efficiency": round(c / sync_step, 3),
            "async_updates_per_s": round(min(n / round_trip, ceiling), 1),
            "async_server_bound": n / round_trip > ceiling,
            "async_saturates_at": math.floor(servers * bandwidth * round_trip / (2 * size))}


def checks(rows: List[Dict]) -> List[Dict]:
    """The issue's targets, one check per model and worker count: sync and default async
    within 1 pp of 2 workers; default async within 0.5 pp of sync."""
    found = []
    for r in rows:
        if r["workers"] == 2 or r["mode"] not in ("sync", "async auto"):
            continue
        found.append({"benchmark": "scale", "ratio": f"{r['model']} {r['mode']} "
                      f"{r['workers']} workers: accuracy - 2 workers' (pp)",
                      "value": r["vs_2_workers_pp"], "target": ">= -1",
                      "met": r["vs_2_workers_pp"] >= -1})
        if r["mode"] != "sync":
            found.append({"benchmark": "scale", "ratio": f"{r['model']} async "
                          f"{r['workers']} workers: accuracy - sync's (pp)",
                          "value": r["vs_sync_pp"], "target": ">= -0.5",
                          "met": r["vs_sync_pp"] >= -0.5})
    found += longer_checks(rows)
    if not found:  # (the smoke: one worker count, no gap to judge)
        found = [{"benchmark": "scale", "ratio": f"{r['model']} {r['mode']} accuracy",
                  "value": r["accuracy"], "target": "reported", "met": None} for r in rows]
    return found


def longer_checks(rows: List[Dict]) -> List[Dict]:
    """Where sync at equal epochs falls more than 1 pp short of 2 workers: the epochs its
    longer run needed to reach the target, against the 2-worker sync run's."""
    by = {(r["model"], r["mode"], r["workers"]): r for r in rows}
    found = []
    for r in rows:
        short = by.get((r["model"], "sync", r["workers"]))
        two = by.get((r["model"], "sync", 2), {}).get("epoch_to_target")
        if r["mode"] != "sync (longer)" or not two or short is None or \
                short["vs_2_workers_pp"] == "" or short["vs_2_workers_pp"] >= -1:
            continue
        reached = r["epoch_to_target"]
        ratio = round(float(reached) / float(two), 2) if reached != "" else ""
        found.append({"benchmark": "scale", "ratio": f"{r['model']} sync {r['workers']} "
                      "workers: epochs to target / 2 workers'", "value": ratio,
                      "target": f"<= {EPOCHS_TO_TARGET_BOUND}",
                      "met": ratio != "" and ratio <= EPOCHS_TO_TARGET_BOUND})
    return found


def md(rows: List[Dict], columns: List[str]) -> str:
    """``rows`` as a Markdown table of ``columns``."""
    from mpitrain.report.markdown import md_table

    return md_table(columns, [[str(r.get(c, "")) for c in columns] for r in rows])


if __name__ == "__main__":
    main()
