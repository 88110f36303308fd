"""Run directories and what is made from them, all from typed records (``harness.record``): ``store`` (run.json and
trials.jsonl, written durably, read through one loader), ``data`` (``load_run``: pandas frames), ``derived`` (MFU,
energy per sample), ``stats`` (medians and intervals), ``metrics`` (what each reported number means and how it is
read), ``tables`` (``ReportData``, the report's one input), the report's sections (``overview``, ``notes``,
``batch_studies`` and one module per study), ``plots``, ``report`` (report.md), ``html`` (report.html), ``pair`` (two
runs side by side), ``export`` and ``mlflow_export``. Imports ``harness.record`` and below, never
``harness.execution``."""
