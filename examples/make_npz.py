"""Write an .npz for --data / examples/cnn_batchnorm.py from a folder of MNIST IDX files.

    python examples/make_npz.py ../shared/data/mnist mnist.npz
"""

import sys
from pathlib import Path

import numpy as np

from mpitrain.data.sources import read_mnist_dir

if __name__ == "__main__":
    source, target = sys.argv[1:3]
    np.savez(target, **read_mnist_dir(Path(source)))
    print(target)
