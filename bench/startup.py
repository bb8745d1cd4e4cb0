"""Start-up: the CPU time of importing TensorFlow and Keras, mpitrain's way vs plain.

Every rank of every launch imports them, and on this machine that is most of a
short run. Fresh interpreters, interleaved so machine noise hits both alike:

* plain: ``import tensorflow, keras``;
* optional hidden: the same with scikit-learn and matplotlib hidden (Keras
  imports them at start-up if installed; mpitrain before its lazy API packages);
* mpitrain: :func:`mpitrain.models.import_keras` (optional imports hidden, API
  packages loaded lazily).

Each then builds LeNet and runs one training step, so that what an import defers
and a step needs is counted too. Prints the median CPU seconds and the ratio
mpitrain / plain and mpitrain / optional hidden (reported, no target).

    python -m bench startup [--quick] [--repeats N]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from .common import REPO, bench_parser, mpi_env, out_dir, table, write_csv

IMPORTS = {"plain": "import tensorflow, keras",
           "optional hidden": "import sys; sys.modules.update(sklearn=None, matplotlib=None)\n"
                              "import tensorflow, keras",
           "mpitrain": "from mpitrain.models import import_keras; import_keras()"}

PROBE = """
import json, resource, sys, time
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
{how}
imported = cpu()
import numpy as np, tensorflow as tf
from mpitrain.models import get
model = get("lenet").build((28, 28, 1), 10)
x, y = np.zeros((32, 28, 28, 1), np.float32), np.zeros(32, np.int64)
with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
tape.gradient(loss, model.trainable_variables)
print(json.dumps({{"import_s": imported, "step_s": cpu(), "modules": len(sys.modules)}}))
"""


def measure(how: str) -> dict:
    """CPU seconds of one fresh interpreter: after the import, after one step."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(how=how)], capture_output=True,
                         text=True, cwd=REPO, env=mpi_env(), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"start-up probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None, out=None) -> dict:
    parser = bench_parser("startup", __doc__, "1 repeat (smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    found = {name: [] for name in IMPORTS}
    for _ in range(repeats):
        for name, how in IMPORTS.items():
            found[name].append(measure(how))
    rows = [{"import": name,
             "import_cpu_s": round(statistics.median(r["import_s"] for r in runs), 3),
             "import_and_step_cpu_s": round(statistics.median(r["step_s"] for r in runs), 3),
             "modules_loaded": runs[-1]["modules"], "runs": len(runs)}
            for name, runs in found.items()]
    path = (out or out_dir()) / "startup.csv"
    write_csv(path, rows)
    print(f"CPU seconds of a fresh interpreter, median of {repeats} interleaved runs:")
    print(table(rows, list(rows[0])))
    step = {row["import"]: row["import_and_step_cpu_s"] for row in rows}
    checks = []
    for base in ("plain", "optional hidden"):
        ratio = round(step["mpitrain"] / step[base], 3)
        print(f"import and first LeNet step, mpitrain / {base} = {ratio:.3f} "
              f"({step[base] - step['mpitrain']:.2f} s of CPU less per rank and launch)")
        checks.append({"benchmark": "startup", "ratio": f"CPU of import + first step, "
                       f"mpitrain / {base} import", "value": ratio, "target": "reported",
                       "met": None})
    print(f"results: {path}")
    return {"checks": checks}


if __name__ == "__main__":
    main()  # returns the checks for bench/__main__.py; exit status 0
