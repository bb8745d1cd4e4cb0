#!/usr/bin/env bash
# Set up mpitrain on a fresh Debian/Ubuntu machine, then run the main job.
#
#   bash setup.sh            install everything, then train sync LR on 4 ranks
#   bash setup.sh --no-run   install only
#
# Installs Open MPI (apt-get) when mpirun or mpicc is missing, creates .venv and
# installs mpitrain into it with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
packages=()
command -v mpirun >/dev/null 2>&1 || packages+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || packages+=(libopenmpi-dev)
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || packages+=(python3-venv)
if [ -z "${MPITRAIN_NO_HOROVOD:-}" ]; then  # Horovod is compiled from source
    command -v cmake >/dev/null 2>&1 || packages+=(cmake)
    command -v g++ >/dev/null 2>&1 || packages+=(g++)
fi
if [ ${#packages[@]} -gt 0 ]; then
    echo "setup: installing ${packages[*]} with apt-get"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"

# Horovod (--allreduce horovod): built from source against the TensorFlow and
# Open MPI installed above (~90 s on 2 cores; pip caches the wheel, so a rerun
# takes seconds). 0.28.1 builds against TensorFlow 2.15-2.18 only, hence the pin.
if [ -z "${MPITRAIN_NO_HOROVOD:-}" ] && ! .venv/bin/python -c "import horovod.tensorflow" 2>/dev/null; then
    echo "setup: building Horovod 0.28.1 (set MPITRAIN_NO_HOROVOD=1 to skip)"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS="-j$(nproc)" \
        .venv/bin/python -m pip install -q --no-build-isolation -e ".[horovod]"
fi

if [ "$(id -u)" -eq 0 ]; then
    # Open MPI refuses to start as root unless told it is deliberate (containers, CI).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    grep -q OMPI_ALLOW_RUN_AS_ROOT .venv/bin/activate ||
        echo 'export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1' >> .venv/bin/activate
fi
echo "setup: done ($(.venv/bin/python -m mpitrain --version), $(mpirun --version | head -1))"

if [ "${1:-}" != "--no-run" ]; then
    echo "setup: running the main job: mpirun -np 4 -hostfile hostfiles/local python -m mpitrain lr"
    mpirun -q -np 4 -hostfile hostfiles/local .venv/bin/python -m mpitrain lr
fi
