"""The built-in models: logistic regression, LeNet-5, AlexNet and ResNet-20. Keras is
imported inside the builders so that the CLI (help, usage errors) answers without
loading TensorFlow."""

from __future__ import annotations

from ..errors import UsageError
from .registry import register

MNIST_LIKE = dict(image_size=28, channels=1, num_classes=10, n_test=512)


def _image_input(model: str, input_shape, min_side: int = 1) -> None:
    """UsageError unless ``input_shape`` is (H, W, C) images at least ``min_side`` wide
    (a convolutional model on feature vectors from --data would be a Keras traceback)."""
    if len(input_shape) != 3 or min(input_shape[:2]) < min_side:
        raise UsageError(f"{model} needs images of at least {min_side}x{min_side} (H, W, C), "
                         f"but the data's examples have shape {tuple(input_shape)}; use lr "
                         "(or your own model) for feature vectors, or give larger images "
                         "(--image-size for image folders)")


@register("lr", "logistic regression: 784 -> 10 softmax (7,850 parameters)",
          defaults=dict(optimizer="nesterov", lr=0.05, batch_size=100, epochs=30,
                        dataset="auto", lr_schedule="cosine"),
          **MNIST_LIKE)
def logistic_regression(input_shape, num_classes):
    """Nesterov momentum (0.9) at 0.05: the long-run step of plain SGD at 0.5, with more
    made of each step where a large sync global batch leaves few of them (docs/scaling.md,
    "Sync: a global batch that grows with the cluster"); async servers trade the momentum
    for asynchrony's own at the same long-run step. Cosine decay: a global batch of 8
    workers or more takes its linearly scaled rate to the edge of what this convex loss
    tolerates, and only a decaying rate ends the run at a minimum rather than oscillating
    about it."""
    import keras

    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes, name="logits"),
    ], name="logistic_regression")


@register("lenet", "LeNet-5: conv-pool-conv-pool-120-84-10 (61,706 parameters)",
          defaults=dict(optimizer="adam", lr=0.001, batch_size=64, epochs=8,
                        dataset="auto", lr_schedule="cosine"),
          **MNIST_LIKE)
def lenet(input_shape, num_classes):
    """Defaults chosen on the 20,000-image MNIST subset: Adam 1e-3 with cosine decay
    holds its single-node accuracy sync (linear lr scaling) and async at -np 4, where
    momentum SGD collapsed at the scaled lr and with stale gradients
    (docs/architecture.md, "LeNet's defaults")."""
    import keras

    _image_input("lenet", input_shape, 12)  # 12: the second pooling still has a 1x1 map
    L = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        L.Conv2D(6, 5, padding="same", activation="relu"),   # 28x28x6
        L.MaxPooling2D(2),                                     # 14x14x6
        L.Conv2D(16, 5, activation="relu"),                    # 10x10x16
        L.MaxPooling2D(2),                                     # 5x5x16
        L.Flatten(),
        L.Dense(120, activation="relu"),
        L.Dense(84, activation="relu"),
        L.Dense(num_classes, name="logits"),
    ], name="lenet5")


@register("alexnet", "AlexNet: 5 conv + 3 dense (61.1M parameters at 224x224x3, 1000 "
          "classes); synthetic ImageNet-shaped data",
          defaults=dict(optimizer="momentum", lr=0.01, batch_size=64, epochs=1,
                        dataset="synthetic", lr_schedule="constant"),
          image_size=224, channels=3, num_classes=1000, n_test=256)
def alexnet(input_shape, num_classes):
    """Krizhevsky et al.'s network as torchvision defines it (one tower, no LRN).

    At 224x224 the feature maps are 55, 27, 13, 6 wide, exactly as published.
    Below 64 pixels the first convolution's stride is 1 instead of 4 so that
    small test images (32x32) still leave a 2x2 map for the dense layers.
    """
    import keras

    L = keras.layers
    _image_input("alexnet", input_shape)
    size = int(input_shape[0])
    if size < 32:
        raise UsageError(f"--image-size {size} is too small for alexnet; use 32 or more")
    return keras.Sequential([
        keras.Input(input_shape),
        L.ZeroPadding2D(2),
        L.Conv2D(64, 11, strides=4 if size >= 64 else 1, activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Conv2D(192, 5, padding="same", activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Conv2D(384, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Flatten(),
        L.Dropout(0.5),
        L.Dense(4096, activation="relu"),
        L.Dropout(0.5),
        L.Dense(4096, activation="relu"),
        L.Dense(num_classes, name="logits"),
    ], name="alexnet")


@register("resnet", "ResNet-20 for CIFAR-style 32x32 images: 3 stages x 3 basic blocks, "
          "16/32/64 filters, BatchNorm (272,474 parameters at 32x32x3, 10 classes)",
          defaults=dict(optimizer="adam", lr=0.001, batch_size=64, epochs=10,
                        dataset="synthetic", lr_schedule="cosine"),
          image_size=32, channels=3, num_classes=10, n_test=512)
def resnet(input_shape, num_classes):
    """He et al.'s CIFAR ResNet-20 (Sec. 4.2): a 3x3 conv, then 3 stages of 3 basic
    blocks (two 3x3 conv + BatchNorm, identity shortcut; a strided 1x1 conv + BatchNorm
    shortcut where the stage halves the map), global average pooling, dense logits.

    Defaults: Adam 1e-3 with cosine decay, like lenet's, because it holds in sync
    (linearly scaled) and async (stale gradients) alike; momentum SGD at the
    paper's 0.1 diverged in async here. BatchNorm momentum 0.9 instead of Keras'
    0.99, so the moving statistics evaluation uses settle within ~50 steps."""
    import keras

    from .layers import FusedBatchNormalization

    L = keras.layers
    _image_input("resnet", input_shape)

    def conv_bn(x, filters, strides=1, relu=True, kernel=3):
        x = L.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                     kernel_initializer="he_normal")(x)
        x = FusedBatchNormalization(momentum=0.9)(x)  # statistics settle in short runs too
        return L.ReLU()(x) if relu else x

    inputs = keras.Input(input_shape)
    x = conv_bn(inputs, 16)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x if strides == 1 else conv_bn(x, filters, strides, relu=False,
                                                      kernel=1)
            y = conv_bn(x, filters, strides)
            y = conv_bn(y, filters, relu=False)
            x = L.ReLU()(L.Add()([y, shortcut]))
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet20")
