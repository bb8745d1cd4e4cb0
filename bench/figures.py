"""Figures for a benchmark output directory: one PNG per benchmark CSV present.

    python -m bench.figures results/bench/<timestamp>

``python -m bench`` calls :func:`draw` at the end of every run.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List


def _rows(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _grouped_bars(ax, groups: List[str], series: Dict[str, List[float]], ylabel: str):
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def _comm(rows, ax):
    groups = [f"{r['model']}\nnp {r['np']}" for r in rows]
    _grouped_bars(ax, groups, {
        "mpitrain": [float(r["mpitrain_busbw_GBs"]) for r in rows],
        "raw mpi4py": [float(r["raw_busbw_GBs"]) for r in rows],
        "memcpy": [float(r["memcpy_GBs"]) for r in rows]}, "GB/s")
    ax.set_yscale("log")
    ax.set_title("allreduce bus bandwidth vs raw MPI and memcpy")


def _engines(rows, ax, title):
    models = list(dict.fromkeys(r["model"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    times = {(r["model"], r["engine"]): float(r["epoch_time_s"]) for r in rows}
    _grouped_bars(ax, models, {e: [times.get((m, e), 0.0) for m in models] for e in engines},
                  "epoch time (s)")
    ax.set_yscale("log")
    ax.set_title(title)


def _scaling(rows, ax):
    lines = defaultdict(list)
    for r in rows:
        mode = "sync" if r["mode"] == "single" else r["mode"]
        lines[f"{r['model']} {mode}"].append((int(r["workers"]), float(r["speedup_vs_1_worker"])))
    for label, points in lines.items():
        ax.plot(*zip(*sorted(points)), marker="o", label=label)
    cap = sorted({(int(r["workers"]), int(r["physical_cap"])) for r in rows})
    ax.plot(*zip(*cap), "k--", label="physical cap (cores)")
    ax.set_xlabel("workers")
    ax.set_ylabel("speed-up over 1 worker")
    ax.legend(fontsize=7)
    ax.set_title("scaling")


def _memory(rows, ax):
    groups = [f"{r['model']}\n{r['mode']} np {r['np']}" for r in rows]
    _grouped_bars(ax, groups, {"server / single": [float(r["server_peak_mb"]) for r in rows],
                               "worker": [float(r["worker_peak_mb"]) for r in rows]},
                  "peak RSS (MB)")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title("peak memory per rank")


def _sync_step(rows, ax):
    groups = [f"np {r['np']}" for r in rows]
    grad = [float(r["grad_ms"]) for r in rows]
    allreduce = [float(r["allreduce_ms"]) for r in rows]
    apply = [float(r["apply_ms"]) for r in rows]
    ax.bar(groups, grad, label="gradient")
    ax.bar(groups, allreduce, bottom=grad, label="allreduce (incl. waiting)")
    ax.bar(groups, apply, bottom=[g + a for g, a in zip(grad, allreduce)], label="apply")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    ax.set_title("sync LR step breakdown")


def _ddp(rows, ax):
    models = list(dict.fromkeys(r["model"] for r in rows))
    times = {(r["model"], r["side"], r["workers"]): float(r["epoch_time_s"]) for r in rows}
    series = {f"{side}, {w} worker{'s' if w != '1' else ''}": [times.get((m, side, w), 0.0)
                                                               for m in models]
              for w in ("1", "2") for side in ("mpitrain", "ddp")}
    _grouped_bars(ax, models, series, "epoch time (s)")
    ax.set_yscale("log")
    ax.set_title("mpitrain sync vs PyTorch DDP (gloo)")


DRAW = {
    "comm.csv": _comm,
    "engines.csv": lambda rows, ax: _engines(rows, ax, "sync engines (2 workers)"),
    "async_engines.csv": lambda rows, ax: _engines(rows, ax, "async engines (2 workers)"),
    "ddp.csv": _ddp,
    "scaling.csv": _scaling,
    "memory.csv": _memory,
    "sync_step.csv": _sync_step,
}


def draw(out: Path) -> List[Path]:
    """Write ``<name>.png`` next to every CSV in ``out`` that has a figure; return them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, fn in DRAW.items():
        path = out / name
        if not path.exists():
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        fn(_rows(path), ax)
        fig.tight_layout()
        png = path.with_suffix(".png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


if __name__ == "__main__":
    for png in draw(Path(sys.argv[1])):
        print(png)
