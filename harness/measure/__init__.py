"""What is measured beside the training loop: ``sampler`` (the thread and its phase windows), ``nvml`` and ``host``
(its backends; ``multi_gpu``: every GPU of a data-parallel trial), ``energy`` (energy, power and throttling over
windows), ``machine`` (what run.json records about the machine) and ``peaks`` (datasheet peak FLOP/s for MFU).
Imports nothing of the harness above ``harness.spec``."""
