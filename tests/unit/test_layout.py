"""The layout keeps its promise: the tools in mpitrain/tools train nothing. They load no
TensorFlow, no MPI and none of the training runtime (comm, session, trainers, replica,
telemetry), so ``mpitrain plot|report|sweep|check`` start in a second."""

import subprocess
import sys

from conftest import REPO

TOOLS = ("plots", "report", "sweep", "preflight", "hostfile")
RUNTIME = ("tensorflow", "keras", "mpi4py", "mpitrain.comm", "mpitrain.session",
           "mpitrain.trainer", "mpitrain.sync_trainer", "mpitrain.async_trainer",
           "mpitrain.replica", "mpitrain.telemetry", "mpitrain.data", "mpitrain.lifecycle")


def test_tools_load_nothing_of_the_training_runtime():
    code = ("import sys\n"
            + "".join(f"import mpitrain.tools.{name}\n" for name in TOOLS)
            + f"print(sorted(m for m in {RUNTIME!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
