"""Figures and the markdown report, from fake run directories and from runs written by
mpitrain's own writers (both made by the tests in tmp_path)."""

import csv
import json
import re
import time
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from mpitrain.errors import ResultsError
from mpitrain.report.plots import plot_runs
from mpitrain.report.run_figures import (fig_curves, fig_nodes, fig_rank_cpu, node_label,
                                         node_labels)
from mpitrain.report.run_files import load_run
from mpitrain.cli.commands import main as cli_main
from mpitrain.report.markdown import write_report
from mpitrain.results.schema import (COMM_COLUMNS, CURVE_COLUMNS, MEMBERSHIP_COLUMNS,
                                     STALENESS_COLUMNS, TELEMETRY_COLUMNS, TIMING_COLUMNS)

CURVE_FIGS = {"fig-curves-epoch.png", "fig-curves-time.png"}
SYNC_FIGS = CURVE_FIGS | {"fig-nodes.png", "fig-rank-cpu.png", "fig-time-breakdown.png",
                          "fig-time-per-epoch.png", "fig-comm.png"}
ASYNC_FIGS = SYNC_FIGS | {"fig-staleness.png"}
COMPARE_FIGS = {"fig-compare-curves-epoch.png", "fig-compare-curves-time.png",
                "fig-compare-batch-size.png", "fig-compare-workers.png"}


# --------------------------------------------------------------------------- fake runs


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def make_run(root, name, mode="sync", np_=3, batch=100, epochs=3, hosts=None):
    """A complete fake run directory in the formats mpitrain writes; returns its path."""
    run = Path(root) / name
    run.mkdir(parents=True)
    hosts = hosts or ["vm"] * np_
    workers = 1 if mode == "single" else np_ - 1
    roles = ["single"] if mode == "single" else ["server"] + ["worker"] * workers
    config = {"config": {"mode": mode, "model": "lr", "workers": workers, "world_size": np_,
                         "batch_size": batch, "epochs": epochs, "staleness": None},
              "dataset": {"name": "mnist", "train_size": 20000},
              "ranks": [{"host": h, "pid": 1000 + r} for r, h in enumerate(hosts)]}
    (run / "config.json").write_text(json.dumps(config, indent=2))
    write_csv(run / "curve.csv", CURVE_COLUMNS,
              [[0, 0, 0, "", 2.3, 0.1, ""]]
              + [[e, e * 50, 0.4 * e, 1 / (e + 1), 1.1 / (e + 1), 0.8 + e / 100, 50000]
                 for e in range(1, epochs + 1)])
    leaders = {h: r for r, h in reversed(list(enumerate(hosts)))}
    tel = []
    for i in range(1, 9):
        for r, host in enumerate(hosts):
            leader = leaders[host] == r
            host_cols = [90 + i, i * 2**20, i * 2**19, i * 10, i * 9] if leader else [""] * 5
            tel.append([round(0.25 * i + 0.01 * r, 3), r, host, roles[r], 40 + r + i,
                        600 + i + r] + host_cols)
    write_csv(run / "telemetry.csv", TELEMETRY_COLUMNS, tel)
    write_csv(run / "timing.csv", TIMING_COLUMNS,
              [[e, r, h, roles[r], 0.4, 0.25, 0.1, 0.03, 0.0] for e in range(1, epochs + 1)
               for r, h in enumerate(hosts)])
    kinds = {"single": ["control"], "sync": ["allreduce", "control"], "async": ["push", "pull"]}
    write_csv(run / "comm.csv", COMM_COLUMNS,
              [[r, h, roles[r], k, 31400 * 100, 100, 31400 * 90, 90, 0.01]
               for r, h in enumerate(hosts) for k in kinds[mode]])
    if mode == "async":
        write_csv(run / "staleness.csv", STALENESS_COLUMNS,
                  [[w, s, max(1, 50 - 8 * abs(s - w - 2)), 0] for w in range(1, np_)
                   for s in range(0, 9)] + [[1, 120, 1, 0]])
    return run


RUN_SPECS = [("20260101-000000-lr-single-np1", "single", 1, 100),
             ("20260101-000100-lr-sync-np3", "sync", 3, 100),
             ("20260101-000200-lr-sync-np4", "sync", 4, 100),
             ("20260101-000300-lr-async-np4", "async", 4, 100),
             ("20260101-000400-lr-async-np4", "async", 4, 200)]


def make_results(root, specs=RUN_SPECS, missing=()):
    """Run directories plus runs.csv listing them (and the names in ``missing``, dir-less)."""
    header = ["run", "model", "mode", "np", "workers", "batch_size", "epochs", "wall_time_s",
              "test_accuracy", "test_loss", "train_loss", "dataset", "status", "node0_host",
              "node0_cpu_avg", "node0_cpu_max", "node0_rss_mb_avg", "node0_rss_mb_max",
              "node0_rx_mb", "node0_tx_mb", "mpi_bytes", "staleness_mean", "staleness_max",
              "pushes", "engine"]
    rows = []
    for name, mode, np_, batch in list(specs) + [(m, "sync", 2, 100) for m in missing]:
        if name not in missing:
            make_run(root, name, mode, np_, batch)
        rows.append([name, "lr", mode, np_, 1 if mode == "single" else np_ - 1, batch, 3, 1.2,
                     0.83, 0.27, 0.25, "mnist", "ok", "vm", 95, 100, 600 * np_, 610 * np_,
                     0.5, 0.4, 123456, 3.2 if mode == "async" else "",
                     120 if mode == "async" else "", 300 if mode == "async" else "", "mpi4py"])
    write_csv(Path(root) / "runs.csv", header, rows)
    return Path(root)


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 5000, path
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500


def snapshot(directory):
    return {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}


# --------------------------------------------------------------------------- one run


def test_sync_run_figures_touch_only_their_pngs(tmp_path):
    run = make_run(tmp_path, "20260101-000000-lr-sync-np3", "sync", 3)
    before = snapshot(run)
    paths = plot_runs([run])
    assert {p.name for p in paths} == SYNC_FIGS
    for path in paths:
        assert path.parent == run
        assert_png(path)
    after = snapshot(run)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == SYNC_FIGS


def test_async_run_has_staleness_histogram(tmp_path):
    run = make_run(tmp_path, "20260101-000000-lr-async-np4", "async", 4)
    out = tmp_path / "figs"
    paths = plot_runs([run], out_dir=out)
    assert {p.name for p in paths} == ASYNC_FIGS
    assert all(p.parent == out for p in paths)
    assert_png(out / "fig-staleness.png")


@pytest.mark.parametrize("np_,staleness,bound", [
    (4, None, None), (4, "auto", None), (17, "auto", 4), (17, "none", None), (17, 3, 3)])
def test_a_runs_staleness_bound_is_its_setting_at_its_workers(tmp_path, np_, staleness,
                                                              bound):
    """config.json keeps --staleness as given (auto, none, K; null before auto): the report
    and the histogram's line show the bound it set at the run's workers."""
    run = make_run(tmp_path, f"20260101-000000-lr-async-np{np_}", "async", np_)
    meta = json.loads((run / "config.json").read_text())
    meta["config"]["staleness"] = staleness
    (run / "config.json").write_text(json.dumps(meta))
    assert load_run(run).staleness_bound == bound


def test_optional_files_missing_skip_their_figures(tmp_path):
    run = make_run(tmp_path, "20260101-000000-lr-sync-np3", "sync", 3)
    for name in ("telemetry.csv", "timing.csv", "comm.csv"):
        (run / name).unlink()
    assert {p.name for p in plot_runs([run])} == CURVE_FIGS


def test_telemetry_with_header_only_is_not_an_error(tmp_path):
    run = make_run(tmp_path, "20260101-000000-lr-single-np1", "single", 1)
    (run / "telemetry.csv").write_text("time_s,rank,host,role,cpu_percent,rss_mb\n")
    names = {p.name for p in plot_runs([run])}
    assert "fig-nodes.png" not in names and "fig-curves-epoch.png" in names


def test_ps_node_is_marked_in_the_legend(tmp_path):
    assert node_label(0, "hostA", True) == "node0 (PS) – hostA"
    assert "(PS)" not in node_label(1, "hostB", False)
    run = load_run(make_run(tmp_path, "r", "async", 4, hosts=["a", "a", "b", "b"]))
    assert node_labels(run) == {"a": "node0 (PS) – a", "b": "node1 – b"}
    legend = fig_nodes(run).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["node0 (PS) – a", "node1 – b"]
    single = load_run(make_run(tmp_path, "s", "single", 1))
    assert "(PS)" not in node_labels(single)["vm"]


# --------------------------------------------------------------------------- several runs


def test_several_runs_make_comparison_figures(tmp_path):
    root = make_results(tmp_path)
    dirs = [root / name for name, *_ in RUN_SPECS]
    paths = plot_runs(dirs)
    assert {p.name for p in paths} == COMPARE_FIGS
    assert len({p.parent for p in paths}) == 1
    assert re.fullmatch(r"comparison-\d{8}-\d{6}(-\d+)?", paths[0].parent.name)
    assert paths[0].parent.parent == root
    for path in paths:
        assert_png(path)
    assert not any((d / "fig-curves-epoch.png").exists() for d in dirs)


def test_comparison_without_a_sweep_skips_sweep_figures(tmp_path):
    a = make_run(tmp_path, "a", "sync", 3)
    b = make_run(tmp_path, "b", "async", 4)
    paths = plot_runs([a, b], out_dir=tmp_path / "cmp")
    assert {p.name for p in paths} == {"fig-compare-curves-epoch.png",
                                       "fig-compare-curves-time.png"}


# --------------------------------------------------------------------------- report


# (slow: 32 figures; the report of mpitrain's own files stays in the quick tier)
@pytest.mark.slow
def test_report_tables_and_links(tmp_path):
    root = make_results(tmp_path, RUN_SPECS[:4], missing=["20260101-000500-lr-sync-np2"])
    report = write_report(root)
    assert report == root / "report" / "report.md"
    text = report.read_text()
    assert "| run | model | mode | np | workers | batch | epochs | wall time (s) |" in text
    for name, *_ in RUN_SPECS[:4]:
        assert f"| `{name}` | lr |" in text
    assert "20260101-000500-lr-sync-np2" in text and "Warning" in text and "missing" in text
    assert "node0 (PS)" in text and "staleness mean" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    written = {p.resolve() for p in root.glob("*/fig-*.png")}
    assert {(report.parent / link).resolve() for link in links} == written
    assert len(links) == len(written) == 3 + 7 + 7 + 7 + 8  # no batch-size sweep here
    for link in links:
        assert_png(report.parent / link)
    assert (root / RUN_SPECS[0][0] / "fig-nodes.png").is_file()


def test_membership_changes_are_marked_and_their_cost_reported(tmp_path):
    """A launched run that restarted twice (membership.csv, two sessions more in its
    telemetry): each change is a dotted line where the run went on (the checkpoint's
    epoch, or its training clock), each later session begins where the one before
    ended on the telemetry's axis, marked, and the report lists the changes and what
    they cost."""
    root = make_results(tmp_path, RUN_SPECS[1:2])
    run_dir = root / RUN_SPECS[1][0]
    with open(run_dir / "telemetry.csv") as f:
        rows = list(csv.reader(f))[1:]
    write_csv(run_dir / "telemetry.csv", TELEMETRY_COLUMNS, rows * 3)  # three sessions
    write_csv(run_dir / "membership.csv", MEMBERSHIP_COLUMNS, [
        ["2026-01-01T00:03:00", "failure", "c", "", 4, 3, 50, 0.4, 12, 20.5,
         "a rank was killed"],
        ["2026-01-01T00:06:00", "grow", "", "c", 3, 4, 100, 0.8, 0, 15.0, "host(s) c answer"]])
    run = load_run(run_dir)
    last = max(float(r[0]) for r in rows)
    assert run.restarts == pytest.approx([last, 2 * last])
    assert sorted(run.tables["telemetry"]["time_s"]) == list(run.tables["telemetry"]["time_s"])

    def dotted(fig):
        return [(ax.get_title(), line.get_xdata()[0], line.get_label())
                for ax in fig.axes for line in ax.lines if line.get_linestyle() == ":"]

    by_epoch = dotted(fig_curves(run, "epoch"))
    assert [(x, label) for title, x, label in by_epoch if title == "Test accuracy"] == [
        (1, "restart after a failure"), (2, "restart to take hosts in")]
    by_time = dotted(fig_curves(run, "time"))
    assert [x for title, x, _ in by_time if title == "Test accuracy"] == [0.4, 0.8]
    assert [x for _, x, _ in dotted(fig_rank_cpu(run))] == pytest.approx([last, 2 * last])
    assert len(dotted(fig_nodes(run))) == 3 * 2  # each of its three plots
    text = write_report(root).read_text()
    assert "## Membership changes" in text
    assert "| failure | c | – | 4 → 3 | 50 | 12 | 20.5 | a rank was killed |" in text
    assert (f"`{run.name}`: 2 change(s), 35.5 s without training and 12 step(s) trained "
            "again") in text


def test_report_skips_names_that_are_not_directory_names(tmp_path):
    write_csv(tmp_path / "runs.csv", ["run", "mode"], [["../escape", "sync"]])
    text = write_report(tmp_path).read_text()
    assert "escape" in text and "skipped" in text
    assert not (tmp_path.parent / "escape").exists()


def test_report_skips_a_failed_attempt_with_nothing_to_plot(tmp_path):
    """``mpitrain launch`` records every attempt: one that failed before its first
    evaluation is a warning in the report, not the report's failure (an ok run with no
    curve rows still is: see the errors below)."""
    ok = make_run(tmp_path, "20260101-000100-lr-sync-np3")
    failed = tmp_path / "20260101-000000-lr-sync-np3"
    failed.mkdir()
    (failed / "config.json").write_text((ok / "config.json").read_text())
    write_csv(failed / "curve.csv", CURVE_COLUMNS, [])
    write_csv(tmp_path / "runs.csv", ["run", "mode", "np", "status", "reason"],
              [[failed.name, "sync", 3, "failed", "rank 1 raised"],
               ["20260101-000100-lr-sync-np3", "sync", 3, "ok", ""]])
    text = write_report(tmp_path).read_text()
    assert f"run `{failed.name}` ended failed with nothing to plot" in text
    assert "has no rows" in text and "`20260101-000100-lr-sync-np3`" in text


# --------------------------------------------------------------------------- errors


def truncate_last_line(run):
    text = (run / "curve.csv").read_text()
    (run / "curve.csv").write_text(text[: text.rindex(",", 0, len(text) - 12)] + "\n")


def drop_final_newline(run):
    (run / "curve.csv").write_text((run / "curve.csv").read_text().rstrip("\n"))


def non_numeric_cell(run):
    text = (run / "timing.csv").read_text().splitlines()
    text[3] = text[3].replace("0.25", "0.2x5", 1)
    (run / "timing.csv").write_text("\n".join(text) + "\n")


def missing_column(run):
    lines = (run / "comm.csv").read_text().splitlines()
    (run / "comm.csv").write_text("\n".join(l.split(",", 1)[1] for l in lines) + "\n")


CORRUPTIONS = [
    ("curve.csv", truncate_last_line),
    ("curve.csv", drop_final_newline),
    ("timing.csv", non_numeric_cell),
    ("comm.csv", missing_column),
    ("telemetry.csv", lambda run: (run / "telemetry.csv").write_text("")),
    ("curve.csv", lambda run: (run / "curve.csv").write_text("epoch,wall_time_s,train_loss,"
                                                               "test_loss,test_accuracy\n")),
    ("staleness.csv", lambda run: (run / "staleness.csv").write_bytes(b"\x89PNG\x00\xff\xfe")),
    ("config.json", lambda run: (run / "config.json").write_text('{"config": {"mode": ')),
    ("config.json", lambda run: (run / "config.json").unlink()),
    ("curve.csv", lambda run: (run / "curve.csv").unlink()),
]


@pytest.mark.parametrize("filename, corrupt", CORRUPTIONS,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(CORRUPTIONS)])
def test_bad_files_raise_one_line_naming_the_file(tmp_path, filename, corrupt):
    run = make_run(tmp_path, "20260101-000000-lr-async-np3", "async", 3)
    corrupt(run)
    with pytest.raises(ResultsError) as info:
        plot_runs([run])
    message = str(info.value)
    assert filename in message and "\n" not in message and "; " in message
    assert not list(run.glob("fig-*.png"))


def test_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for target, expected in ((tmp_path / "empty", "not an mpitrain run"),
                             (tmp_path / "nowhere", "not a directory")):
        with pytest.raises(ResultsError, match=expected) as info:
            plot_runs([target])
        assert target.name in str(info.value)
    make_results(tmp_path / "results", RUN_SPECS[:1])
    with pytest.raises(ResultsError, match="run mpitrain report on it"):
        plot_runs([tmp_path / "results"])
    with pytest.raises(ResultsError, match="no run directories"):
        plot_runs([])


def test_command_lines_print_one_error_line(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "nowhere")]) == 1
    assert cli_main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("mpitrain: error: ") for line in err)
    assert "nowhere" in err[0] and "runs.csv" in err[1]


def test_command_lines_write_figures_and_the_report(tmp_path, capsys):
    root = make_results(tmp_path, RUN_SPECS[:2])
    run = root / RUN_SPECS[0][0]
    assert cli_main(["plot", str(run)]) == 0
    assert cli_main(["report", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert {Path(line).name for line in out[:-1]} == SYNC_FIGS
    assert out[-1] == str(root / "report" / "report.md") and Path(out[-1]).is_file()


def test_report_errors_name_runs_csv(tmp_path):
    with pytest.raises(ResultsError, match="runs.csv"):
        write_report(tmp_path)
    root = make_results(tmp_path / "results", RUN_SPECS[:1])
    text = (root / "runs.csv").read_text().replace(",single,1,", ",single,one,")
    (root / "runs.csv").write_text(text)
    with pytest.raises(ResultsError, match=r"runs\.csv: line 2: column np is 'one'"):
        write_report(root)


def test_a_report_before_any_run_has_finished_says_so(tmp_path):
    """The first run of a results directory still training: no runs.csv yet, which is
    not 'not a results directory' (issue 53, item 7)."""
    run = tmp_path / "results" / "20260101-000000-lr-sync-np3"
    run.mkdir(parents=True)
    (run / "status.json").write_text('{"status": "running"}')
    with pytest.raises(ResultsError, match=r"results: no run has finished here yet "
                                           r"\(runs.csv is written as each run ends\)"):
        write_report(tmp_path / "results")


# --------------------------------------------------------------------------- written by mpitrain


class _RankComm:
    """What telemetry.write_local needs of a communicator: a rank, its host, its traffic."""

    def __init__(self, rank, host, kinds):
        from mpitrain.comm import Traffic

        self.rank, self.host, self.traffic = rank, host, Traffic()
        for kind in kinds:
            self.traffic.add_sent(kind, 31400 * (rank + 1))
            self.traffic.add_recv(kind, 31400)


def write_like_mpitrain(root, mode, hosts):
    """One run written by mpitrain's own writers, as a real run leaves it: RunResults
    (config.json, curve.csv), telemetry.write_local with a real Sampler and PhaseTimer
    per rank (telemetry.csv, timing.csv, comm.csv), session.run_row and
    telemetry.node_summary (its runs.csv row) and, for async, the staleness table."""
    from mpitrain import models
    from mpitrain.run import session
    from mpitrain.results import telemetry
    from mpitrain.config import Config, resolve
    from mpitrain.data import Dataset
    from mpitrain.results.run_dir import RunResults
    from mpitrain.train import Summary
    from mpitrain.train.protocol import PhaseTimer

    np_ = len(hosts)
    cfg = resolve(Config.of(model="lr", async_mode=mode == "async", epochs=2),
                  models.get("lr").defaults, np_)
    dataset = Dataset("mnist", "test", 10, (28, 28, 1), 600)
    results = RunResults(root, f"lr-{cfg.mode}-np{np_}")
    results.write_json("config.json", {
        "config": cfg.to_dict(), "dataset": {"name": "mnist", "train_size": 600},
        "ranks": [{"host": host, "pid": 1000 + rank} for rank, host in enumerate(hosts)]})
    for epoch in range(3):
        results.add_curve_row({"epoch": epoch, "step": 3 * epoch, "wall_time_s": 0.5 * epoch,
                               "train_loss": 1 / epoch if epoch else None,
                               "test_loss": 2.3 / (epoch + 1), "test_accuracy": 0.1 + 0.3 * epoch,
                               "examples_per_s": 1200.0 if epoch else None})
    roles = ["single"] if np_ == 1 else ["server"] + ["worker"] * (np_ - 1)
    kinds = ["push", "pull"] if mode == "async" else ["allreduce", "control"]
    merged = {"telemetry": [], "timing": [], "comm": []}
    for rank, host in enumerate(hosts):
        sampler = telemetry.Sampler(rank, host, roles[rank], 0.02, hosts.index(host) == rank)
        sampler.start()
        time.sleep(0.1)
        timer = PhaseTimer()
        for epoch in (1, 2):
            for phase in PhaseTimer.PHASES:
                with timer(phase):
                    time.sleep(0.002)
            timer.end_epoch(epoch)
        rows = telemetry.write_local(_RankComm(rank, host, kinds), roles[rank], sampler, timer,
                                     results)
        for key in merged:
            merged[key] += rows[key]
    extra = {}
    if mode == "async":
        results.write_csv("staleness.csv", STALENESS_COLUMNS,
                          [{"worker": w, "staleness": s, "count": 3} for w in range(1, np_)
                           for s in range(3)])
        extra = {"staleness_mean": 1.0, "staleness_max": 2, "pushes": 6, "applied": 6}
    summary = Summary(1.0, 6, 2, 0.8, 0.7, 0.5, extra)
    results.add_run_row({**session.run_row(cfg, dataset, summary),
                         **telemetry.node_summary(merged, hosts)})
    return results.dir


def test_report_on_results_written_by_mpitrain(tmp_path):
    """The readers accept what the writers write: a report of runs made by mpitrain's
    own writer code (not hand-made files), with every figure a run of its kind has."""
    root = tmp_path / "results"
    runs = {write_like_mpitrain(root, "single", ["a"]): SYNC_FIGS,
            write_like_mpitrain(root, "sync", ["a", "a", "b"]): SYNC_FIGS,
            write_like_mpitrain(root, "async", ["a", "b", "b"]): ASYNC_FIGS}
    text = write_report(root).read_text()
    for run, figures in runs.items():
        assert f"`{run.name}`" in text
        assert {p.name for p in run.glob("fig-*.png")} == figures
    assert "node0 (PS)" in text and "staleness mean" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links and all((root / "report" / link).is_file() for link in links)
