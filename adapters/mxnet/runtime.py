"""MXNet 1.9.1 imported for the MXNet adapter's modules (``adapter``, ``layers``, ``training``): import ``mx`` and
its submodules from here, never ``mxnet`` first."""

from __future__ import annotations

import builtins
import warnings

import numpy as np

# MXNet 1.9.1 is the last release (the project was retired to the Apache Attic in 2023) and it references the numpy
# aliases that numpy 1.24 removed (np.bool, np.int, np.float, np.complex, np.object, np.str) at import time. Restore
# the missing ones, as the builtins they always aliased, before importing it. Probing them warns (FutureWarning on
# numpy 1.25+), hence the filter; importing MXNet itself raises DeprecationWarnings from numpy and distutils.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    for _alias in ("bool", "int", "float", "complex", "object", "str"):
        if not hasattr(np, _alias):
            setattr(np, _alias, getattr(builtins, _alias))
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    from mxnet.contrib import amp
    from mxnet.gluon import nn

__all__ = ["amp", "autograd", "gluon", "mx", "nd", "nn"]
