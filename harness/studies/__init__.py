"""What a user asks for, built on execution, measure and results: ``sweep`` (every trial of a spec), ``max_batch``
(the largest batch that fits), ``compare`` (two runs, with regressions) and ``history`` (a metric over nights).
Imported only by ``harness.cli``."""
