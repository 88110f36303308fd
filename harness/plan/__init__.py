"""Spec -> the ordered list of trials a run executes, and the checks of a spec that need more than its fields.

Its modules, re-exported here: ``checks`` (``load`` and ``checked_spec``, what the commands use: the field rules of
``harness.spec`` and then the checks that need the neutral model, the dataset files, the adapter registry or this
machine's devices; ``unsupported_reason``), ``planner`` (``plan``: the trials in run order, their numbers derived
once), ``trial`` (``Trial``, the resolved trial a worker is given), ``entries`` (the framework entries by label) and
``support`` (the one rule that decides whether an adapter can train a trial). Every failure is a ``SpecError``: one
line naming the file and the field (for the model, the layer's path, e.g. ``model.layers.3.body``), which the CLI
prints before exiting with status 2. Imports ``harness.neutral`` and ``harness.spec``, and the adapter registry
(which imports no framework).
"""

from harness.plan.checks import (
    accumulation_conflict,
    check,
    check_data_parallel,
    check_devices,
    check_image_folder,
    checked_spec,
    load,
    model_info,
    spec_conditions,
    trained_model,
    unsupported_reason,
)
from harness.plan.entries import check_framework_name, entry_for
from harness.plan.planner import (
    Variant,
    available_cpus,
    data_parallel_devices,
    data_parallel_label,
    data_parallel_settings,
    plan,
    scaled_learning_rate,
    variant_label,
    variants,
)
from harness.plan.trial import Trial

__all__ = ["Trial", "Variant", "accumulation_conflict", "available_cpus", "check", "check_data_parallel",
           "check_devices", "check_framework_name", "check_image_folder", "checked_spec", "data_parallel_devices",
           "data_parallel_label", "data_parallel_settings", "entry_for", "load", "model_info", "plan",
           "scaled_learning_rate", "spec_conditions", "trained_model", "unsupported_reason", "variant_label",
           "variants"]
