"""docs/benchmarks.md's results table is generated from the benchmarks' summaries:
each benchmark from its newest full-size run, the cases of one ratio on one line, the
short ones named; the block between its markers replaced, the rest of the page kept."""

import pytest

from bench import docs
from bench.common import write_block

SUMMARY = """# Benchmark summary ({date})

Command: `python -m bench {command}`\x20\x20
Machine: vm, 2 cores, Python 3.11.7; took 3.0 min.\x20\x20
Commit: `abc1234`

| benchmark | ratio | value | target | |
| --- | --- | --- | --- | --- |
{rows}

Minutes per benchmark: engines 3.0.

## engines.csv

| model | engine |
| --- | --- |
| lr | mpi |
"""


def summary(tmp_path, name, date, command, rows):
    path = tmp_path / name / "summary.md"
    path.parent.mkdir()
    path.write_text(SUMMARY.format(date=date, command=command, rows="\n".join(rows)))
    return docs.Summary(path)


ENGINES = ["| engines | lr: mpi / horovod epoch time (same TensorFlow, 2.18.1) | 0.7 | <= 0.6 "
           "| **short** |",
           "| engines | lenet: mpi / horovod epoch time (same TensorFlow, 2.18.1) | 0.5 | <= 0.6 "
           "| met |",
           "| engines | lr: mpi / horovod epoch time's floor: our workers' compute alone / "
           "theirs | 0.3 | reported |  |",
           "| engines | lr: mpi / horovod epoch time (each on its own stack: TensorFlow 2.21.0 / "
           "2.18.1) | 0.4 | reported |  |",
           "| engines | lr: mpi / horovod epoch time's floor: our workers' compute alone / "
           "theirs (each on its own stack: TensorFlow 2.21.0 / 2.18.1) | 0.2 | reported |  |"]


def test_each_benchmark_comes_from_its_newest_full_run(tmp_path):
    old = summary(tmp_path, "a", "2026-01-01 10:00", "all",
                  [*ENGINES, "| comm | mpitrain / raw MPI allreduce bandwidth (worst) | 0.95 "
                   "| >= 0.9 | met |"])
    new = summary(tmp_path, "b", "2026-01-02 10:00", "engines", ENGINES)
    quick = summary(tmp_path, "c", "2026-01-03 10:00", "engines --quick", ENGINES)
    failed = summary(tmp_path, "d", "2026-01-04 10:00", "comm",
                     ["| comm | ran to completion | failed: boom | runs | **short** |"])
    assert (new.commit, new.machine) == ("commit abc1234", "2 cores, Python 3.11.7; took 3.0 min")
    chosen = docs.newest_per_benchmark([quick, failed, new, old])
    assert chosen == {"engines": new, "comm": old}
    assert (old.all, new.all) == (True, False)  # what the default reads: `bench all` runs


def test_a_summary_given_with_names_gives_only_those(tmp_path):
    both = ["| comm | mpitrain / raw MPI allreduce bandwidth (worst) | 0.95 | >= 0.9 | met |",
            *ENGINES]
    old = summary(tmp_path, "a", "2026-01-01 10:00", "all", both)
    new = summary(tmp_path, "b", "2026-01-02 10:00", "comm,engines", both)
    runs = docs.given([str(old.path), f"{new.path}:engines"])
    assert runs[1].benchmarks == ["engines"]
    chosen = docs.newest_per_benchmark(runs)
    assert {name: s.path for name, s in chosen.items()} == {"comm": old.path,
                                                             "engines": new.path}


def test_the_cases_of_a_ratio_share_a_line_and_the_short_ones_are_named(tmp_path):
    rows = summary(tmp_path, "a", "2026-01-01 10:00", "all", ENGINES).rows
    lines = docs.grouped([r for r in rows if docs.shown(r)])
    assert lines == [
        {"benchmark": "engines", "ratio": "mpi / horovod epoch time (same TensorFlow, 2.18.1)",
         "value": "lr 0.7, lenet 0.5", "target": "<= 0.6", "verdict": "**short**: lr"},
        {"benchmark": "engines", "ratio": "mpi / horovod epoch time (each on its own stack: "
         "TensorFlow 2.21.0 / 2.18.1)", "value": "lr 0.4", "target": "reported", "verdict": ""}]
    assert docs.case_of("allreduce lenet polled us: MPICH 5.0.2 / best") == \
        ("allreduce MODEL polled us: MPI / best", "lenet MPICH 5.0.2")


def test_the_block_between_the_markers_is_replaced_and_nothing_else(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- bench results: begin -->\nold\n<!-- bench results: end -->\n"
                    "outro\n")
    write_block(page, "new table\n", "results")
    assert page.read_text() == ("intro\n<!-- bench results: begin -->\nnew table\n"
                                "<!-- bench results: end -->\noutro\n")
    with pytest.raises(ValueError, match="bench scale: begin"):
        write_block(page, "x", "scale")


def test_regenerating_without_arguments_reads_the_runs_the_table_names(tmp_path, monkeypatch):
    page = tmp_path / "benchmarks.md"
    kept = tmp_path / "figures"
    kept.mkdir()
    old = summary(tmp_path, "a", "2026-01-01 10:00", "all",
                  [*ENGINES, "| comm | mpitrain / raw MPI allreduce bandwidth (worst) | 0.95 "
                   "| >= 0.9 | met |"])
    new = summary(tmp_path, "b", "2026-01-02 10:00", "engines,comm", ENGINES)
    monkeypatch.setattr(docs, "DOCS", page)
    monkeypatch.setattr(docs, "KEPT", kept)
    page.write_text("<!-- bench results: begin -->\n<!-- bench results: end -->\n")
    chosen = docs.newest_per_benchmark(docs.given([str(old.path), f"{new.path}:engines"]))
    page.write_text("<!-- bench results: begin -->\n" + docs.block(chosen) +
                    "\n<!-- bench results: end -->\n")
    again = docs.newest_per_benchmark(docs.in_the_table(page.read_text()))
    # the block links the copies it kept of the runs, and names what each gave
    assert {name: s.path for name, s in again.items()} == {
        "comm": kept / "summary-a.md", "engines": kept / "summary-b.md"}
    assert (kept / "summary-b.md").read_text() == new.path.read_text()
