"""Which batch size (``harness advise``): ``noise`` (the gradient noise scale from recorded squared gradient norms),
``predict`` (candidates, the throughput curve and its knee, steps, time and energy to a target per size), ``command``
(the stages: memory, throughput, noise scale, prediction; advice.json), ``output`` (advice.md, the answer first).
Imports execution, results, plan and below. Guide: docs/guide/which-batch-size.md."""

from harness.studies.advise.command import OBJECTIVES, Options, advise
from harness.studies.advise.noise import NoiseScale, noise_scale
from harness.studies.advise.predict import candidates, fastest_and_knee, predict, steps_to_target

__all__ = ["OBJECTIVES", "NoiseScale", "Options", "advise", "candidates", "fastest_and_knee", "noise_scale",
           "predict", "steps_to_target"]
