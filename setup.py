from setuptools import Extension, find_packages, setup

setup(
    name="mpitrain",
    version="0.1.0",
    description="MPI data-parallel training for TensorFlow: sync allreduce or an async "
                "parameter server, with telemetry, results and plots",
    packages=find_packages(include=["mpitrain", "mpitrain.*"]),
    python_requires=">=3.10",
    install_requires=[
        "mpi4py>=4.0,<5",
        "numpy>=1.26,<3",
        # Any TensorFlow with Keras 3 (2.16+); pip picks the newest one that has
        # wheels for this Python (3.13: 2.20+). Horovod, the optional second sync
        # engine, needs <= 2.18: setup.sh builds it in its own environment.
        "tensorflow-cpu>=2.16,<3; platform_machine=='x86_64'",
        "tensorflow>=2.16,<3; platform_machine!='x86_64'",
        # tf.summary needs it; TensorFlow stopped installing it in 2.20
        "tensorboard>=2.16,<3",
        "tomli>=2; python_version<'3.11'",  # sweep specs (tomllib is 3.11+)
        "psutil>=5.9,<8",
        "scikit-learn>=1.3,<2",  # bundled 8x8 digits: the offline fallback dataset
        "matplotlib>=3.7,<4",  # mpitrain plot / report
        "Pillow>=9,<13",  # --data image folders
    ],
    extras_require={
        "test": ["pytest>=7,<10", "pytest-timeout>=2.1,<3", "pytest-xdist>=3.8,<4", "matplotlib>=3.7,<4",
                 "hypothesis>=6.100,<7"],
        # the linter and the type checker tests/unit/test_lint.py runs (ruff.toml, mypy.ini);
        # pinned: a new release's new findings must not fail a suite that did not change
        "lint": ["ruff==0.16.9", "mypy==2.4.0"],
        # --allreduce horovod; build it against the installed TensorFlow and MPI:
        # HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1
        # HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 pip install --no-build-isolation ...
        "horovod": ["horovod==0.28.1"],
    },
    entry_points={"console_scripts": ["mpitrain=mpitrain.cli.commands:main"]},
    # float16 conversions with F16C for --compression fp16 (mpitrain/kernels/half.py); optional:
    # without a compiler the install goes on and numpy converts (slower, same bits)
    ext_modules=[Extension("mpitrain.kernels._half", ["mpitrain/kernels/_half.c"], optional=True,
                           extra_compile_args=["-O3"]),
                 # the async server's fused optimizer updates (mpitrain/models/optim.py);
                 # optional the same way (numpy does them: slower, same bits). No fused
                 # multiply-adds: each product is rounded as numpy rounds it; no errno
                 # from sqrtf (never negative here), so Adam's square roots vectorize
                 Extension("mpitrain.kernels._optim", ["mpitrain/kernels/_optim.c"],
                           optional=True,
                           extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"])],
)
