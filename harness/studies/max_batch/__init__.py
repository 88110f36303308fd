"""The largest batch that fits (seed 004), measured: ``search`` (the bracket and its rules), ``checks`` (what is
checked before the first probe: data parallelism, and whether the adapter can train the trial, by the plan's rule),
``probe`` (one probe: its spec, peak, cap and records), ``recommend`` (the recommendation below the limit),
``runcheck`` (run checks: the spec's trial as ``harness run`` runs it, and the numbers of the recommendation's
margin), ``memory_model`` (the fitted line), ``output`` (table, Markdown, run directory), ``command`` (the CLI's
max-batch). Imports execution, measure, results, plan and below."""

from harness.studies.max_batch.checks import check_data_parallel, check_search, check_supported
from harness.studies.max_batch.memory_model import MemoryModel, fit_memory_model
from harness.studies.max_batch.output import RunWriter, markdown, summary_lines, table, write_run
from harness.studies.max_batch.probe import MaxBatchResult, Probe, probe_spec, resolve_cap
from harness.studies.max_batch.search import find_max_batch

__all__ = ["MaxBatchResult", "MemoryModel", "Probe", "RunWriter", "check_data_parallel", "check_search",
           "check_supported", "find_max_batch", "fit_memory_model", "markdown", "probe_spec", "resolve_cap",
           "summary_lines", "table", "write_run"]
