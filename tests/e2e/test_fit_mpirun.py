"""``mpitrain.fit`` from a user's script under real mpirun: called twice in one job (a
sync run, then an async one, each with a setting of its own), rank 0 gets each run's
result, the other rank None. (-np 2 keeps it quick; examples/ run fit at -np 3 in the
slow tier.) The script imports Keras before mpitrain, with TF_ENABLE_ONEDNN_OPTS unset,
so TensorFlow loads with its own default: where that leaves oneDNN's kernels off (CPUs
without AVX-512 VNNI or AMX, such as this machine's), rank 0 names the ranks."""

import json

from conftest import mpi_env, mpirun_cmd, read_rows, run_bounded

SCRIPT = """
import json, sys
import numpy as np
import keras
import mpitrain

def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes)])

rng = np.random.default_rng(0)
y = rng.integers(0, 4, 600)
x = np.eye(4, 16, dtype=np.float32)[y] + 0.1 * rng.random((600, 16), dtype=np.float32)
results = []
for mode, compiler in (("sync", "graph"), ("async", "auto")):
    result = mpitrain.fit(build, train=(x[:500], y[:500]), test=(x[500:], y[500:]),
                          mode=mode, epochs=3, batch_size=25, lr=0.5, compiler=compiler,
                          results_dir=sys.argv[1], quiet=True)
    results.append(None if result is None else [result.test_accuracy, str(result.run_dir)])
print("RESULTS", json.dumps(results), flush=True)
"""


def test_fit_twice_in_one_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = mpi_env()
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)  # (importing mpitrain set it in this process)
    result = run_bounded(mpirun_cmd(2, script, tmp_path / "results", module=None), 300, env)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("RESULTS ")]
    served = [r for r in printed if r != [None, None]]
    assert len(printed) == 2 and len(served) == 1, printed  # rank 0 alone gets results
    (sync_accuracy, sync_dir), (async_accuracy, async_dir) = served[0]
    rows = read_rows(tmp_path / "results" / "runs.csv")
    assert [(r["mode"], r["status"]) for r in rows] == [("sync", "ok"), ("async", "ok")]
    assert [r["run"] for r in rows] == [sync_dir.rsplit("/", 1)[1], async_dir.rsplit("/", 1)[1]]
    assert sync_accuracy > 0.9 and async_accuracy > 0.9  # 4 classes: chance 0.25
    config = json.loads((tmp_path / "results" / sync_dir.rsplit("/", 1)[1] / "config.json")
                        .read_text())
    assert config["config"]["compiler"] == "graph"
    without = [rank for rank, facts in enumerate(config["ranks"]) if facts["onednn"] is False]
    hints = [line for line in result.stdout.splitlines() if "without oneDNN's kernels" in line]
    if without:  # once per run, naming them
        assert len(hints) == 2 and f"rank(s) {', '.join(map(str, without))}:" in hints[0], hints
    else:
        assert hints == []
