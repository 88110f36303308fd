"""Models of your own for specs/own_model.yaml: each function returns a framework's own model object, built with that
framework's own initialisation (the harness seeds the framework first). The harness trains it with the spec's loss,
optimizer, batches, precision and timing; the model's output is the logits (docs/guide/own-model.md)."""


def torch_cnn(classes: int = 10, width: int = 16):
    """A small PyTorch CNN for 8x8 one-channel images (NCHW, as the harness hands images to PyTorch)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * width * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))


def keras_cnn(classes: int = 10, width: int = 16):
    """The same shape of CNN as a Keras 3 functional model for 8x8x1 images (NHWC): it runs on every Keras backend
    (JAX, PyTorch, TensorFlow), where the harness starts it from the same weights."""
    import keras

    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(2 * width, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


def gluon_cnn(classes: int = 10, width: int = 16):
    """The same shape of CNN as an MXNet Gluon ``HybridBlock`` for 8x8 one-channel images (NCHW, as the harness hands
    images to Gluon). No layer names its input size: Gluon infers the shapes at the first forward pass (deferred
    initialisation), which the harness runs on the dataset's input. ``import mxnet`` works on numpy >= 1.24 only once
    the harness's MXNet adapter is imported (it restores numpy's removed aliases), as it is before this is called."""
    from mxnet.gluon import nn

    net = nn.HybridSequential()
    net.add(nn.Conv2D(width, 3, padding=1, activation="relu"), nn.MaxPool2D(2),
            nn.Conv2D(2 * width, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"),
            nn.Flatten(), nn.Dense(64, activation="relu"), nn.Dense(classes))
    return net


def flax_cnn(classes: int = 10, width: int = 16):
    """The same shape of CNN as a Flax linen module for 8x8x1 images (NHWC, as the harness hands images to JAX): its
    ``__call__(x, train)`` takes Flax's training flag, which runs the batchnorm on the batch's moments and updates its
    running statistics (the ``batch_stats`` collection) while training, and normalises with them otherwise."""
    from flax import linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.relu(nn.Conv(width, (3, 3), padding="SAME")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.Conv(2 * width, (3, 3), padding="SAME")(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
            x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
            return nn.Dense(classes)(x)

    return CNN()
