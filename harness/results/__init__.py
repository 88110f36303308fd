"""Run directories and what is made from them: ``store`` (run.json and trials.jsonl, written durably), ``stats``
(medians and intervals), ``metrics`` (what each reported number means and where it is read), ``tables``, ``plots``
and ``report`` (report.md). Imports ``harness.measure`` and below, never ``harness.execution``."""
