"""harness: train the same model under PyTorch, TensorFlow and MXNet across batch sizes, and measure it honestly.

The core package never imports a framework; adapters (the top-level ``adapters`` package) do, in worker processes.
"""

__version__ = "0.1.0"
