"""What every framework shares, so that each trains the same model on the same data: ``models`` (layers and blocks,
shapes, parameter counts, FLOPs, canonical weights and layouts; built from ``info``, ``shapes``, ``blocks`` and
``weights``), ``memory`` (the memory of a training step by data structure) and ``datasets`` (digits, synthetic
images and tokens, CIFAR-10; batch order and augmentation from (seed, epoch)). Imports only ``harness.spec``, numpy
and scikit-learn's bundled data; adapters import it in their worker processes."""
