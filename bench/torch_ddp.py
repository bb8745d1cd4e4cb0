"""PyTorch DistributedDataParallel on this machine: the CPU user's alternative to mpitrain.

    python -m torch.distributed.run --standalone --nproc-per-node W -m bench.torch_ddp \\
        --model {lenet,resnet,alexnet} --epochs E --batch-size B --lr LR \\
        --optimizer {sgd,momentum,adam} [--lr-schedule {constant,cosine}] \\
        [--image-size S] [--synthetic-size N] [--data-dir DIR] [--steps K] \\
        [--compute-steps K] [--seed S] [--threads N] [--powersgd-rank R] \
        [--bucket-cap-mb MB] --json-out FILE

One process per worker (torchrun), gradients averaged by DDP over gloo (PyTorch's
CPU backend) with its defaults: 25 MB buckets allreduced while back-propagation
runs, BatchNorm buffers broadcast from rank 0 at every forward pass. With
``--powersgd-rank R`` each bucket goes through PyTorch's ``powerSGD_hook`` instead
(rank R, error feedback and warm start on, its default compression rule, the first
``--powersgd-exact-steps`` steps allreduced exactly).

It trains what ``python -m mpitrain MODEL`` trains, the way mpitrain does:

* the same models (LeNet-5; He et al.'s ResNet-20 with BatchNorm, momentum 0.9 in
  Keras' terms and epsilon 1e-3; AlexNet as torchvision defines it, stride 1 below
  64 pixels), initialised as Keras initialises them (Glorot-uniform kernels, zero
  biases; ResNet's convolutions He-normal, truncated);
* the same data: real MNIST (``--data-dir``), or mpitrain's synthetic images (the
  same generator calls, so the same pixels and labels for the same seed); each
  worker trains on its own disjoint, equal shard (remainder dropped), reshuffled
  every epoch with mpitrain's generator; an epoch is one pass of every worker over
  its shard, the last batch smaller;
* the same optimizer (Keras' defaults: momentum 0.9; Adam's epsilon 1e-7), the
  learning rate multiplied by the number of workers (mpitrain's linear scaling),
  cosine decay to zero over the run's updates;
* TensorFlow's thread split: intra-op threads = the host's cores // workers.

``train_s`` runs from just before the first step to the end of the last one on
every worker (the slowest); ``epoch_s`` lists each epoch's seconds (rank 0). The
test set is evaluated once, after training, on rank 0 (``eval_s``, not in
``train_s``). Then ``--compute-steps`` steps run on every worker at once without
DDP's exchange (``no_sync``: gradient and update alone), timed as ``compute_step_s``
the way ``bench lower_bound`` times mpitrain's (the faster of two passes, the mean
over the workers): what the step costs on PyTorch's kernels. Rank 0 writes one JSON
result. Every collective is bounded (gloo's timeout); torchrun ends every worker
when one fails.
It imports nothing from mpitrain or TensorFlow.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from .tf_baselines import DEFAULT_MNIST, load_mnist, synthetic

MODELS = ("lenet", "resnet", "alexnet")
#: classes and test examples of mpitrain's synthetic data, per model (its registry)
SYNTHETIC = {"resnet": (10, 512), "alexnet": (1000, 256)}
#: seconds any collective may wait for a peer (gloo's timeout)
TIMEOUT_S = 300
EVAL_BATCH = 1000


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.torch_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True, help="per worker")
    p.add_argument("--lr", type=float, required=True, help="of one worker (scaled linearly)")
    p.add_argument("--optimizer", required=True, choices=("sgd", "momentum", "adam"))
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    p.add_argument("--image-size", type=int, default=32, help="synthetic data")
    p.add_argument("--synthetic-size", type=int, default=1280,
                   help="synthetic training examples per epoch")
    p.add_argument("--data-dir", default=os.environ.get("MPITRAIN_DATA_DIR", DEFAULT_MNIST))
    p.add_argument("--steps", type=int, default=0, help="stop after K steps per worker")
    p.add_argument("--compute-steps", type=int, default=0,
                   help="then time K steps without the exchange")
    p.add_argument("--seed", type=int, default=42)  # mpitrain's default
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads (default: the host's cores // workers)")
    p.add_argument("--powersgd-rank", type=int, default=0, help="0: plain allreduce")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket size (default: its own, 25 MB after a first of 1 MB)")
    p.add_argument("--powersgd-exact-steps", type=int, default=2,
                   help="PowerSGDState's start_powerSGD_iter (at least 2 with error "
                        "feedback)")
    p.add_argument("--json-out", required=True)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Models: mpitrain's zoo (mpitrain/models/zoo.py), in PyTorch
# ---------------------------------------------------------------------------------------
def lenet(nn):
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def alexnet(nn, size: int):
    side = size + 4 - 10 if size < 64 else (size + 4 - 11) // 4 + 1  # after conv 1
    for _ in range(3):  # three 3x3 stride-2 poolings
        side = (side - 3) // 2 + 1
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4 if size >= 64 else 1, padding=2), nn.ReLU(),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2), nn.Flatten(),
        nn.Dropout(0.5), nn.Linear(256 * side * side, 4096), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, SYNTHETIC["alexnet"][0]))


def resnet20(torch, nn):
    def conv_bn(cin, cout, stride=1, kernel=3):
        conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False)
        conv.he_normal = True  # Keras' he_normal, as mpitrain's ResNet-20
        return [conv, nn.BatchNorm2d(cout, eps=1e-3, momentum=0.1)]  # Keras' momentum 0.9

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, stride), nn.ReLU(),
                                      *conv_bn(cout, cout))
            self.shortcut = nn.Sequential(*conv_bn(cin, cout, stride, kernel=1)) \
                if stride != 1 else nn.Identity()

        def forward(self, x):
            return torch.relu(self.body(x) + self.shortcut(x))

    layers, cin = [*conv_bn(3, 16), nn.ReLU()], 16
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(Block(cin, filters, 2 if stage > 0 and block == 0 else 1))
            cin = filters
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, SYNTHETIC["resnet"][0])]
    return nn.Sequential(*layers)


def build(torch, args):
    nn = torch.nn
    model = {"lenet": lambda: lenet(nn), "alexnet": lambda: alexnet(nn, args.image_size),
             "resnet": lambda: resnet20(torch, nn)}[args.model]()
    for layer in model.modules():  # Keras' initialisers
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            if getattr(layer, "he_normal", False):
                fan_in = layer.weight[0].numel()
                std = math.sqrt(2.0 / fan_in) / 0.87962566103423978  # truncated at 2 std
                nn.init.trunc_normal_(layer.weight, 0.0, std, -2 * std, 2 * std)
            else:
                nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
    return model


# ---------------------------------------------------------------------------------------
# Data: mpitrain's (mpitrain/data/)
# ---------------------------------------------------------------------------------------
def datasets(args):
    """(train images, train labels, test images, test labels): float32 NCHW images;
    synthetic training images cycle through mpitrain's pool of 64 (index i % 64)."""
    if args.model == "lenet":
        data = load_mnist(Path(args.data_dir))

        def floats(x):
            return np.ascontiguousarray((x.astype(np.float32) / np.float32(255.0))
                                        .transpose(0, 3, 1, 2))
        return floats(data["x_train"]), data["y_train"], floats(data["x_test"]), data["y_test"]
    classes, n_test = SYNTHETIC[args.model]
    pools = []
    for split, n in (("train", args.synthetic_size), ("test", n_test)):
        pool, labels = synthetic(n, args.image_size, args.seed, split, classes)
        pools.append((np.ascontiguousarray(pool.transpose(0, 3, 1, 2)), labels))
    (train_pool, y_train), (test_pool, y_test) = pools
    return train_pool, y_train, test_pool[np.arange(len(y_test)) % len(test_pool)], y_test


def epoch_batches(shard: int, batch: int, seed: int, worker: int, epoch: int):
    """mpitrain's data.shards.epoch_batches: one epoch's index arrays over a shard."""
    order = np.random.default_rng([seed, worker, epoch]).permutation(shard)
    for start in range(0, shard, batch):
        yield order[start:start + batch]


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------
def make_optimizer(torch, args, params, workers: int, updates: int):
    lr = args.lr * workers  # linear scaling, as mpitrain's default --lr-scaling linear
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr, eps=1e-7)  # Keras' epsilon
    else:
        optimizer = torch.optim.SGD(params, lr, momentum=0.9 if args.optimizer == "momentum"
                                    else 0.0)
    if args.lr_schedule == "cosine":  # Keras' CosineDecay to zero over every update
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, updates) / updates)))
    else:
        schedule = None
    return optimizer, schedule


def evaluate(torch, model, x, y) -> tuple:
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(y), EVAL_BATCH):
            logits = model(torch.from_numpy(x[s:s + EVAL_BATCH]))
            labels = torch.from_numpy(y[s:s + EVAL_BATCH]).long()
            loss += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
    model.train()
    return loss / len(y), correct / len(y)


def main(argv=None) -> None:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, workers = dist.get_rank(), dist.get_world_size()
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)  # every replica starts alike (DDP broadcasts rank 0's too)
    x_train, y_train, x_test, y_test = datasets(args)
    shard = len(y_train) // workers
    start = rank * shard
    pool = len(x_train) if args.model != "lenet" else 0
    steps_per_epoch = -(-shard // args.batch_size)
    full = steps_per_epoch * args.epochs
    steps = min(full, args.steps) if args.steps else full
    model = DistributedDataParallel(build(torch, args), bucket_cap_mb=args.bucket_cap_mb)
    if args.powersgd_rank:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        model.register_comm_hook(psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_exact_steps), psgd.powerSGD_hook)
    optimizer, schedule = make_optimizer(torch, args, model.parameters(), workers, full)
    loss_fn = torch.nn.functional.cross_entropy

    def step(idx):
        idx = idx + start
        x = torch.from_numpy(x_train[idx % pool] if pool else x_train[idx])
        loss = loss_fn(model(x), torch.from_numpy(y_train[idx]).long())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    done, epoch_s, loss = 0, [], None
    dist.barrier()
    t0 = last = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        for idx in epoch_batches(shard, args.batch_size, args.seed, rank, epoch):
            loss = step(idx)
            if schedule is not None:
                schedule.step()
            done += 1
            if done == steps:
                break
        now = time.perf_counter()
        epoch_s.append(now - last)
        last = now
        if done == steps:
            break
    train_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(train_s, op=dist.ReduceOp.MAX)  # the slowest worker's
    result = {}
    if rank == 0:
        t_eval = time.perf_counter()
        test_loss, test_accuracy = evaluate(torch, model.module, x_test, y_test)
        result = {"model": args.model, "workers": workers, "threads": threads,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "batch_size": args.batch_size, "global_batch": workers * args.batch_size,
                  "steps_per_worker": done, "steps_per_epoch": steps_per_epoch,
                  "epochs": done / steps_per_epoch,
                  "train_s": float(train_s), "epoch_s": epoch_s,
                  "eval_s": time.perf_counter() - t_eval, "test_accuracy": test_accuracy,
                  "test_loss": test_loss, "train_loss": float(loss.detach()),
                  "torch": torch.__version__, "backend": dist.get_backend()}
    dist.barrier()
    if args.compute_steps:
        result["compute_step_s"] = compute_only(torch, dist, model, step, shard, args)
    if rank == 0:
        Path(args.json_out).write_text(json.dumps(result) + "\n")
    dist.destroy_process_group()


def compute_only(torch, dist, model, step, shard: int, args) -> float:
    """Seconds per step of the gradient and update alone, every worker at once (DDP's
    ``no_sync``: no allreduce), timed as ``bench lower_bound`` times mpitrain's: two
    passes of ``--compute-steps`` steps, each after 3 warm-up steps and to a barrier,
    the faster pass per worker, the mean over the workers."""
    steps = args.compute_steps
    order = np.arange(steps + 3) * args.batch_size % max(1, shard - args.batch_size)
    passes = []
    with model.no_sync():
        for _ in range(2):
            for i, first in enumerate(order):
                if i == 3:
                    dist.barrier()
                    t0 = time.perf_counter()
                step(np.arange(first, first + args.batch_size))
            dist.barrier()
            passes.append((time.perf_counter() - t0) / steps)
    seconds = torch.tensor([min(passes)], dtype=torch.float64)
    dist.all_reduce(seconds)  # a sum: gloo has no average
    return float(seconds) / dist.get_world_size()


if __name__ == "__main__":
    main()
