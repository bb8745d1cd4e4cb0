"""Smoke of the benchmarks that compare mpitrain with other engines (Horovod,
MultiWorkerMirroredStrategy, ParameterServerStrategy, PyTorch DDP, real Horovod's API):
each runs its --quick mode end to end and writes both sides' rows (see test_bench.py)."""

import os
from pathlib import Path

import pytest

from conftest import ENGINE_COMPARISONS, bench, read_rows


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_engine_comparisons_run():
    out, summary = bench(ENGINE_COMPARISONS)
    # each baseline runs as TensorFlow ships and, where that is not already oneDNN's
    # kernels (as mpitrain runs), with them
    for csv_name, ours, baseline in (("engines.csv", ("mpi", "mpi-horovod-env", "horovod"),
                                      "mwms"),
                                     ("async_engines.csv",
                                      ("mpitrain-async", "mpitrain-async-defaults"),
                                      "ParameterServerStrategy")):
        rows = {row["engine"]: row for row in read_rows(out / csv_name)}
        assert all(rows[engine]["onednn"] == "True" for engine in ours)
        shipped = rows[baseline]["onednn"]
        assert set(rows) == {*ours, baseline, *([f"{baseline}-onednn"]
                                                if shipped == "False" else [])}
        assert rows.get(f"{baseline}-onednn", {"onednn": "True"})["onednn"] == "True"
        assert (out / csv_name).with_suffix(".png").stat().st_size > 0
    # every ratio's floor (our compute alone) beside it, and the CSVs as tables
    assert "lr: mpi / horovod epoch time's floor" in summary
    # judged on one TensorFlow; each engine on its own stack only reported, labelled
    tf = {row["engine"]: row["tensorflow"] for row in read_rows(out / "engines.csv")}
    assert tf["mpi-horovod-env"] == tf["horovod"] and tf["mpi"] == tf["mwms"], tf
    assert f"lr: mpi / horovod epoch time (same TensorFlow, {tf['horovod']}) | " in summary
    if tf["mpi"] != tf["horovod"]:
        assert f"lr: mpi / horovod epoch time (each on its own stack: TensorFlow " \
               f"{tf['mpi']} / {tf['horovod']}) | <= " not in summary  # reported, not judged
        assert f"lr: mpi / horovod epoch time (each on its own stack: TensorFlow " \
               f"{tf['mpi']} / {tf['horovod']}) | " in summary
    assert "## engines.csv" in summary and "| lr | mpi | 2 |" in summary
    check_ddp(out, summary)


def check_ddp(out: Path, summary: str) -> None:
    """PyTorch DDP against mpitrain: both sides at 1 and 2 workers (LeNet; the smoke's
    ResNet at 2 only), with the compute-only steps beside them; skipped only where
    set-up was told not to install PyTorch."""
    if "| ddp | PyTorch DDP | skipped |" in summary:
        if os.environ.get("CI") and not os.environ.get("MPITRAIN_NO_TORCH"):
            pytest.fail("bench ddp was skipped: no .venv-torch (bash setup.sh installs it)")
        return
    rows = read_rows(out / "ddp.csv")
    assert {(r["model"], r["side"], r["workers"]) for r in rows} == {
        (model, side, workers) for model, counts in (("lenet", "12"), ("resnet", "2"))
        for side in ("mpitrain", "ddp") for workers in counts}
    for r in rows:
        assert float(r["epoch_time_s"]) > 0 and 0 <= float(r["test_accuracy"]) <= 1
        if r["workers"] == "2":  # the compute-only step of each side
            assert float(r["compute_only_ms"]) > 0
    assert "| ddp | lenet: mpitrain / DDP epoch time, 2 workers, whole run |" in summary
    assert "| ddp | resnet: compute-only step, TensorFlow (mpitrain) / PyTorch" in summary
