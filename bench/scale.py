"""Scale: accuracy at equal epochs, epochs to a target accuracy, and rank 0's memory at
2, 4, 8 and 16 workers, sync and async (each staleness compensation); and the
analytical step-time model that carries them to 64 and 256 workers.

Every point is a real mpitrain run with its defaults on the real MNIST (one host,
oversubscribed: -np 3, 5, 9, 17; the runs of one -np share a launch). A run's
test accuracy after each epoch is in its curve.csv: the table gives the final
accuracy at the run's epochs, the first epoch (and step, and training seconds) at
which the target was reached, the gap to 2 workers of the same mode and to sync at
the same worker count, the async staleness, and rank 0's peak RSS (telemetry.csv).
Targets: LR 91% in 3 epochs, LeNet 97% in 2 (two epochs of the 20,000-image subset;
the issue's 98.5% needs more epochs than a benchmark here can afford at 16 workers).

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
models), sqrt and none; and, marked "(before)", sync and async with the defaults
before these rules, given as options (``BEFORE``).

    python -m bench scale [--quick] [--workers 2,4,8,16] [--models lr,lenet] [--write-docs]
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Dict, List

from .common import bench_parser, out_dir, run_table, table, train_many, write_csv

#: per model: the epochs of every run, the target accuracy, the async compensations
MODELS = {
    "lr": {"epochs": 3, "target": 0.91, "compensations": ["auto", "sqrt", "none"]},
    "lenet": {"epochs": 2, "target": 0.97, "compensations": ["auto", "sqrt", "none"]},
}
#: the defaults before the large-batch rules, as options: sync without warm-up (and
#: LR's constant rate), async uncompensated and (LR) pipelined, as 'auto' then chose
BEFORE = {
    "lr": {"sync": ["--warmup-epochs", "0", "--lr-schedule", "constant"],
           "async": ["--staleness-compensation", "none", "--pipeline", "on",
                     "--lr-schedule", "constant"]},
    "lenet": {"sync": ["--warmup-epochs", "0"],
              "async": ["--staleness-compensation", "none", "--pipeline", "off"]},
}
#: docs/scaling.md's generated block (``--write-docs``) lies between these lines
DOCS = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
BEGIN, END = "<!-- bench scale: begin -->", "<!-- bench scale: end -->"
#: the model's figures: parameters (float32), for M
PARAMETERS = {"lr": 7_850, "lenet": 61_706, "resnet": 272_474, "alexnet": 61_100_840}
#: links of the model: (name, bytes/s, latency s)
LINKS = [("1 GbE", 125e6, 50e-6), ("10 GbE", 1.25e9, 20e-6), ("25 GbE", 3.125e9, 10e-6)]
MODEL_WORKERS = [2, 4, 8, 16, 64, 256]


def main(argv=None, out=None) -> dict:
    parser = bench_parser("scale", __doc__, "LR at 2 workers, one epoch (smoke)")
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--models", default="lr,lenet")
    parser.add_argument("--write-docs", action="store_true",
                        help="put the tables into docs/scaling.md's generated block")
    args = parser.parse_args(argv)
    out = out or out_dir()
    workers = [2] if args.quick else [int(w) for w in args.workers.split(",")]
    models = ["lr"] if args.quick else args.models.split(",")
    rows = []
    for n in workers:
        runs = {}
        for model in models:
            spec = MODELS[model]
            epochs = ["--epochs", "1" if args.quick else str(spec["epochs"])]
            runs[f"{model}-sync"] = [model, *epochs]
            for comp in spec["compensations"][:1] if args.quick else spec["compensations"]:
                runs[f"{model}-async-{comp}"] = [model, *epochs, "--async",
                                                 "--staleness-compensation", comp]
            if not args.quick:  # the same runs with the defaults before these rules
                runs[f"{model}-sync-before"] = [model, *epochs, *BEFORE[model]["sync"]]
                runs[f"{model}-async-before"] = [model, *epochs, "--async",
                                                 *BEFORE[model]["async"]]
        done = train_many(n + 1, runs, out / f"np{n + 1}", hostfile=slots_file(out, n + 1))
        rows += [point(name, n, row) for name, row in done.items()]
    relate(rows)
    write_csv(out / "scale.csv", rows)
    columns = ["model", "mode", "workers", "epochs", "accuracy", "vs_2_workers_pp",
               "vs_sync_pp", "target", "epoch_to_target", "step_to_target",
               "seconds_to_target", "staleness_mean", "rank0_peak_rss_mb"]
    print(table(rows, columns))
    model_rows = step_model(rows, models)
    write_csv(out / "scale_model.csv", model_rows)
    print(table(model_rows, list(model_rows[0])))
    (out / "scale.md").write_text(markdown(rows, columns, model_rows))
    if args.write_docs:
        write_docs(DOCS, (out / "scale.md").read_text())
    return {"checks": checks(rows)}


def write_docs(path: Path, block: str) -> None:
    """Replace what lies between BEGIN and END in ``path`` with ``block``."""
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{block.strip()}\n{END}{tail}")


def slots_file(out: Path, np_: int) -> Path:
    """A hostfile giving this machine ``np_`` slots (hostfiles/local has 4)."""
    path = out / f"hostfile-np{np_}"
    path.write_text(f"localhost slots={np_}\n")
    return path


def point(name: str, workers: int, row: Dict[str, str]) -> Dict:
    """One run's row: accuracy, when it reached the target, staleness, rank 0's memory."""
    model, mode, *comp = name.split("-")
    if comp == ["before"]:
        mode, comp = f"{mode} (before)", []
    target = MODELS[model]["target"]
    reached = first_reached(Path(row["run_dir"]) / "curve.csv", target)
    telemetry = run_table(row["run_dir"], "telemetry")
    rss = telemetry["rss_mb"][telemetry["rank"] == 0]
    compute = run_table(row["run_dir"], "timing", ("worker", "single"))
    steps = int(float(row["steps"]))
    return {"model": model, "mode": mode if not comp else f"async {comp[0]}",
            "workers": workers, "epochs": float(row["epochs"]),
            "accuracy": round(float(row["test_accuracy"]), 4), "target": target,
            "epoch_to_target": reached.get("epoch", ""), "step_to_target": reached.get("step", ""),
            "seconds_to_target": reached.get("wall_time_s", ""),
            "staleness_mean": row.get("staleness_mean", ""),
            "rank0_peak_rss_mb": round(float(rss.max()), 1) if rss.size else "",
            "compute_s_per_step": round(float(compute["compute_s"].sum())
                                        / max(1, steps * (workers if mode == "sync" else 1)), 6)}


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
    per step ``c`` taken from its sync run at the fewest workers."""
    out = []
    for model in models:
        sync = sorted((r for r in rows if r["model"] == model and r["mode"] == "sync"),
                      key=lambda r: r["workers"])
        c = sync[0]["compute_s_per_step"] if sync else 0.0
        for link, bandwidth, alpha in LINKS:
            out += [model_point(model, c, PARAMETERS[model] * 4, link, bandwidth, alpha, n)
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
    if not found:  # (the smoke: one worker count, no gap to judge)
        found = [{"benchmark": "scale", "ratio": f"{r['model']} {r['mode']} accuracy",
                  "value": r["accuracy"], "target": "reported", "met": None} for r in rows]
    return found


def markdown(rows: List[Dict], columns: List[str], model_rows: List[Dict]) -> str:
    """scale.md: the measured table and the model's, as docs/scaling.md takes them."""
    from mpitrain.tools.report import md_table

    def cells(rs, cs):
        return md_table(cs, [[str(r.get(c, "")) for c in cs] for r in rs])
    keep = [r for r in model_rows if r["workers"] in (16, 64, 256)]
    return ("## Measured\n\n" + cells(rows, columns) + "\n\n## Model\n\n"
            + cells(keep, list(model_rows[0])) + "\n")
