"""The largest batch that fits (seed 004), measured: ``search`` (the probes and the bracket), ``memory_model`` (the
fitted line), ``output`` (table, Markdown, run directory), ``command`` (the CLI's max-batch). Imports execution,
measure, results, plan and below."""

from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model
from harness.studies.max_batch.output import RunWriter, markdown, summary_lines, table, write_run
from harness.studies.max_batch.search import MaxBatchResult, Probe, find_max_batch, probe_spec, resolve_cap

__all__ = ["MaxBatchResult", "MemoryModel", "Probe", "RunWriter", "find_max_batch", "fit_memory_model", "markdown",
           "probe_spec", "resolve_cap", "summary_lines", "table", "write_run"]
