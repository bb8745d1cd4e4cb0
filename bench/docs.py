"""docs/benchmarks.md's results table, generated from the benchmarks' own summaries.

    python -m bench.docs                          # after a full run
    python -m bench.docs SUMMARY.md[:NAME,...] ...  # from the runs given

Without arguments it reads the newest ``summary.md`` of a full ``python -m bench all``
run (in results/bench/ or kept in docs/figures/bench/) if that run is newer than every
run the table now comes from; else the table's own runs again (so it changes nothing
by itself). Given summaries, it takes each
benchmark's rows from the newest of them that ran it, or only the benchmarks named
after its colon (a run of one section measured after the last full run, say);
``--quick`` runs and benchmarks that failed are never used. It writes the rows as one
table between docs/benchmarks.md's ``<!-- bench results: begin -->`` and
``<!-- bench results: end -->`` lines, the mechanism ``python -m bench scale
--write-docs`` fills docs/scaling.md with. The table holds every ratio with a target,
the cases of one ratio (models, process counts, MPIs, servers) on one line, and the
ratios that are reported beside a judged one to label what it is not (each engine on
its own TensorFlow); every other figure is in the summaries, which the block links,
each with its date, commit and load. A summary read from results/ is copied into
docs/figures/bench/ so the link stays valid in the repository.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .common import REPO, write_block

DOCS = REPO / "docs" / "benchmarks.md"
KEPT = REPO / "docs" / "figures" / "bench"
NAME = "results"
#: reported ratios shown beside the judged ones: what a judged ratio is not
ALSO_SHOWN = ("(each on its own stack", "(not PSS's algorithm)")
#: what varies between the cases of one ratio, and the word that stands for it in the
#: table: the model, the process count, the MPI, the number of servers
CASES = [(re.compile(r"\b(lr|lenet|resnet|alexnet)\b"), "MODEL"),
         (re.compile(r"-np \d+"), "-np N"),
         (re.compile(r"\b(?:Open MPI|MPICH) [\d.]+"), "MPI"),
         (re.compile(r"\b\d+ servers\b"), "K servers")]

class Summary:
    """One summary.md: its date, command, machine line, commit and check rows."""

    def __init__(self, path: Path, only: Optional[List[str]] = None):
        self.path = path
        self.only = only
        text = path.read_text()
        head = re.search(r"^# Benchmark summary \((.*)\)", text, re.M)
        self.date = head.group(1) if head else path.parent.name
        command = re.search(r"^Command: `(.*)`", text, re.M)
        self.command = command.group(1) if command else ""
        machine = re.search(r"^Machine: (.*)$", text, re.M)
        self.machine = re.sub(r"^[^,]*, ", "", machine.group(1).strip(" .")) if machine else ""
        commit = re.search(r"^Commit: `([0-9a-f]+)`(.*)$", text, re.M)
        self.commit = (f"commit {commit.group(1)}{commit.group(2).rstrip(' .')}" if commit
                       else kept_since(path))
        self.rows = [dict(zip(("benchmark", "ratio", "value", "target", "verdict"), cells))
                     for cells in check_rows(text)]
        self.failed = {r["benchmark"] for r in self.rows if r["value"].startswith("failed")}

    @property
    def full(self) -> bool:
        return "--quick" not in self.command.split()

    @property
    def benchmarks(self) -> List[str]:
        """The benchmarks this summary gives: every one it ran to its end (or those of
        ``only`` among them)."""
        return [b for b in dict.fromkeys(r["benchmark"] for r in self.rows)
                if b not in self.failed and (self.only is None or b in self.only)]

    @property
    def all(self) -> bool:
        """A run of every benchmark (``python -m bench all``)."""
        return self.command.split()[3:4] == ["all"]


def kept_since(path: Path) -> str:
    """For a summary written before summary.md recorded its commit: the commit that
    added it to the repository ("kept in abc1234"), or ""."""
    import subprocess

    try:
        found = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--",
                                str(path)], cwd=REPO, text=True, capture_output=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"no commit recorded; kept in {found}" if found else ""


def check_rows(text: str) -> List[List[str]]:
    """The cells of the checks table (the first table of a summary.md)."""
    rows = []
    for line in text.split("\n## ", 1)[0].splitlines():
        if line.startswith("| ") and not line.startswith(("| benchmark |", "| --- |")):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return [row + [""] * (5 - len(row)) for row in rows if len(row) >= 4]


def last_full_run() -> List["Summary"]:
    """The newest full-size ``python -m bench all`` summary, in results/bench/ or kept."""
    found = [Summary(p) for p in [*(REPO / "results" / "bench").glob("*/summary.md"),
                                  *KEPT.glob("summary-*.md")]]
    runs = sorted((s for s in found if s.full and s.all), key=lambda s: s.date)
    return runs[-1:]


def in_the_table(text: str) -> List["Summary"]:
    """The runs the page's table was generated from, each with the benchmarks it gave
    (the block's list of runs), so that regenerating it changes nothing by itself."""
    block = text.split(f"<!-- bench {NAME}: begin -->", 1)[-1].split("\n|", 1)[0]
    return [Summary(DOCS.parent / link, names.split(", "))
            for link, names in re.findall(r"(?m)^- \*\*\w\*\*: \[[^\]]*\]\(([^)]+)\).*\): "
                                          r"([\w, ]+)$", block)
            if (DOCS.parent / link).is_file()]


def default_runs() -> List["Summary"]:
    """What ``python -m bench.docs`` reads without arguments: the runs the table already
    comes from, unless a full run is newer than all of them; then that run alone."""
    current, full = in_the_table(DOCS.read_text()), last_full_run()
    if full and all(full[0].date > s.date for s in current):
        return full
    return current or full


def given(argv: List[str]) -> List["Summary"]:
    """The summaries named on the command line, PATH or PATH:NAME,NAME."""
    summaries = []
    for arg in argv:
        path, _, names = arg.partition(":")
        summaries.append(Summary(Path(path).resolve(), names.split(",") if names else None))
    return summaries


def newest_per_benchmark(summaries: List[Summary]) -> Dict[str, Summary]:
    """{benchmark: the newest full-size summary that ran it to its end}."""
    chosen = {}
    for summary in sorted((s for s in summaries if s.full), key=lambda s: s.date):
        for name in summary.benchmarks:
            chosen[name] = summary
    return chosen


def shown(row: Dict[str, str]) -> bool:
    """A ratio with a target, or the epoch time of a comparison reported beside one."""
    if not row["target"].startswith("reported"):
        return True
    ratio = row["ratio"]
    return any(mark in ratio for mark in ALSO_SHOWN) and "epoch time" in ratio and \
        "floor" not in ratio and "accuracy" not in ratio


def case_of(ratio: str) -> tuple:
    """(the ratio with its cases replaced by CASES' words, the cases it names): one
    ratio's cases share the first ("MODEL: mpi / horovod epoch time")."""
    found = []
    for pattern, word in CASES:
        found += pattern.findall(ratio)
        ratio = pattern.sub(word, ratio)
    return re.sub(r"^MODEL: ", "", ratio), " ".join(found)


def grouped(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """A benchmark's rows, the cases of one ratio and target on one line ("lr 0.35,
    lenet 0.45"), the short ones named in its verdict."""
    groups: Dict[tuple, List[tuple]] = {}
    for row in rows:
        ratio, case = case_of(row["ratio"])
        groups.setdefault((row["benchmark"], ratio, row["target"]), []).append((case, row))
    lines = []
    for (benchmark, ratio, target), members in groups.items():
        values = ", ".join(f"{case}{':' if ' ' in case else ''} {row['value']}".strip()
                           for case, row in members)
        short = [case for case, row in members if "short" in row["verdict"]]
        verdict = ("**short**" + (": " + ", ".join(short) if len(members) > 1 else "")
                   if short else "met" if any(row["verdict"] for _, row in members) else "")
        lines.append({"benchmark": benchmark, "ratio": ratio, "value": values,
                      "target": target, "verdict": verdict})
    return lines


def kept_copy(summary: Summary) -> Path:
    """The summary's path in docs/figures/bench/ (copied there if it is not)."""
    if summary.path.parent == KEPT:
        return summary.path
    target = KEPT / f"summary-{summary.path.parent.name}.md"
    if not target.exists():
        KEPT.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(summary.path, target)
    return target


def block(chosen: Dict[str, Summary], order: Optional[List[str]] = None) -> str:
    """The generated Markdown: where each benchmark's rows come from, then the table."""
    runs: Dict[Path, List[str]] = {}
    for name, summary in chosen.items():
        runs.setdefault(summary.path, []).append(name)
    by_path = {s.path: s for s in chosen.values()}
    lines = ["Generated by `python -m bench.docs` from these runs' `summary.md`:", ""]
    letters = {}
    for i, (path, names) in enumerate(runs.items()):
        summary, letter = by_path[path], chr(ord("A") + i)
        letters[path] = letter
        link = kept_copy(summary).relative_to(DOCS.parent)
        commit = f", {summary.commit}" if summary.commit else ""
        lines.append(f"- **{letter}**: [{summary.date}]({link.as_posix()}), `{summary.command}`"
                     f" ({summary.machine}{commit}): {', '.join(names)}")
    lines += ["", "| benchmark | ratio | value | target | verdict | run |",
              "| --- | --- | --- | --- | --- | --- |"]
    names = [n for n in (order or []) if n in chosen] + [n for n in chosen if n not in
                                                         (order or [])]
    for name in names:
        summary = chosen[name]
        rows = [r for r in summary.rows if r["benchmark"] == name and shown(r)]
        for row in grouped(rows):
            lines.append(f"| {row['benchmark']} | {row['ratio']} | {row['value']} | "
                         f"{row['target']} | {row['verdict']} | {letters[summary.path]} |")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    chosen = newest_per_benchmark(given(argv) if argv else default_runs())
    if not chosen:
        print("bench.docs: no full-size summary.md found (python -m bench all writes one)",
              file=sys.stderr)
        return 1
    from . import BENCHMARKS

    write_block(DOCS, block(chosen, list(BENCHMARKS)), NAME)
    print(f"bench.docs: {DOCS.relative_to(REPO)} written from "
          + ", ".join(sorted({str(s.path.relative_to(REPO)) for s in chosen.values()})))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
