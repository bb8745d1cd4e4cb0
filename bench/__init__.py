"""mpitrain benchmarks: every comparison measured side by side in one run, printed as ratios.

Run ``python -m bench --help``. Results land in ``results/bench/<timestamp>/``.
"""

#: every benchmark, one line each, in the order ``python -m bench all`` runs them: NAME is
#: bench/NAME.py, whose ``main(argv, out)`` returns {"checks": [...]}; its --quick smoke
#: runs in the test suite (tests/e2e/test_bench.py)
BENCHMARKS = {
    "comm": "allreduce bus bandwidth vs raw mpi4py and memcpy (LR, LeNet, AlexNet sizes)",
    "engines": "sync epoch time and accuracy: mpitrain vs Horovod vs MultiWorkerMirrored",
    "async_engines": "async epoch time and accuracy: mpitrain vs ParameterServerStrategy",
    "ddp": "sync epoch time, scaling and accuracy: mpitrain vs PyTorch DDP (gloo), 1-2 workers",
    "horovod_api": "Horovod's synthetic benchmark: mpitrain.horovod vs Horovod vs mpitrain's CLI",
    "scaling": "throughput at 1/2/3 workers per model and mode; peak memory per rank",
    "sync_step": "sync LR step time at -np 1..4 and the allreduce's share of a step",
    "async_ps": "async server update rate vs the raw-MPI bound; async vs sync epoch time",
    "server_memory": "the async server's peak memory at 2 vs 16 workers (AlexNet 224x224)",
    "sampler": "epoch time with the telemetry sampler on vs off",
    "netns": "LR and LeNet epoch time on the emulated 3-node cluster, 10 GbE vs 1 GbE",
    "compression": "--compression fp16, powersgd, topk vs float32 on the emulated cluster, 1 GbE",
    "elastic": "a node lost and returned under mpitrain launch -np 2:4: seconds, accuracy",
    "servers": "async --servers 1/2/3 on the emulated cluster at 1 GbE: updates/s vs BytePS's model",
    "lower_bound": "sync step / compute-only step at 2 workers (LeNet, AlexNet)",
    "overlap": "AlexNet sync step time with --overlap on vs off, shared memory and 1 GbE",
    "startup": "CPU of importing TensorFlow and Keras: mpitrain's way vs plain",
    "mpis": "Open MPI 4.1 vs Open MPI 5 vs MPICH: allreduce, LR/LeNet sync and async epochs",
    "scale": "accuracy, epochs to target and rank 0's memory at 2-16 workers; step-time model",
    "streaming": "data streamed from shards vs in memory: RSS at 20 GB, throughput, accuracy",
}
