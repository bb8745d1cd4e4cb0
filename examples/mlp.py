"""A custom MLP on feature vectors, trained with mpitrain.fit: data made in the script.

    mpirun -np 3 -hostfile hostfiles/local python examples/mlp.py [--mode async]

The data is a synthetic 4-class problem on 20 features (two informative
directions plus noise), generated identically on every rank from one seed: the
pattern for any tabular (N, D) dataset you already hold in numpy.
"""

import argparse

import mpitrain  # first: TensorFlow then loads with oneDNN's kernels (see the README)

import keras
import numpy as np


def build(input_shape, num_classes):
    L = keras.layers
    return keras.Sequential([keras.Input(input_shape), L.Dense(64, activation="relu"),
                             L.Dropout(0.1), L.Dense(64, activation="relu"),
                             L.Dense(num_classes)], name="mlp")


def make_data(n, seed=0, features=20, classes=4):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    angle = 2 * np.pi * y / classes
    x = rng.normal(0, 0.6, (n, features)).astype(np.float32)
    x[:, 0] += 2 * np.cos(angle)
    x[:, 1] += 2 * np.sin(angle)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    x, y = make_data(6000)
    result = mpitrain.fit(build, train=(x[:5000], y[:5000]), test=(x[5000:], y[5000:]),
                          mode=args.mode, epochs=args.epochs, batch_size=32,
                          results_dir=args.results_dir, quiet=True)
    if result:  # rank 0
        print(f"test accuracy {result.test_accuracy:.4f} after {result.steps} steps; "
              f"results in {result.run_dir}")


if __name__ == "__main__":
    main()
