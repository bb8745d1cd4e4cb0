"""A small CNN with BatchNorm on your own .npz, trained with mpitrain.fit.

    mpirun -np 3 -hostfile hostfiles/local python examples/cnn_batchnorm.py my.npz [--mode async] [--epochs 3]

The .npz holds x_train, y_train, x_test, y_test (images, integer labels); make one
from MNIST with `python examples/make_npz.py ../shared/data/mnist mnist.npz`.
With 2 workers, 3 epochs on the 20,000-image MNIST subset reach ~98.7% (sync).
"""

import argparse

import mpitrain  # first: TensorFlow then loads with oneDNN's kernels (see the README)

import keras
import numpy as np


def build(input_shape, num_classes):
    """Two conv blocks and a dense block, each with BatchNorm; logits out.

    BatchNorm momentum 0.9 (Keras' default is 0.99): the moving statistics that
    evaluation uses settle within a few hundred steps, which a short run needs."""
    L = keras.layers

    def block(filters):
        return [L.Conv2D(filters, 3, padding="same", use_bias=False),
                L.BatchNormalization(momentum=0.9), L.ReLU(), L.MaxPooling2D(2)]

    return keras.Sequential([
        keras.Input(input_shape), *block(32), *block(32), L.Flatten(),
        L.Dense(64, use_bias=False), L.BatchNormalization(momentum=0.9), L.ReLU(),
        L.Dense(num_classes),
    ], name="cnn_batchnorm")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("npz")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="stop early (smoke runs)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    with np.load(args.npz) as f:  # every rank loads the same arrays
        train, test = (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])
    result = mpitrain.fit(build, train=train, test=test, mode=args.mode, epochs=args.epochs,
                          steps=args.steps, lr_schedule="cosine",
                          results_dir=args.results_dir, quiet=True)
    if result:  # rank 0
        print(f"test accuracy {result.test_accuracy:.4f}, test loss {result.test_loss:.4f}, "
              f"{result.epochs:g} epochs in {result.wall_time_s:.1f} s; results in "
              f"{result.run_dir}")


if __name__ == "__main__":
    main()
