"""One trial in one process: ``launcher`` (starts the worker, reads its events, samples it, classifies how it ended),
``worker`` (the shared training loop, run in the worker's interpreter) and ``limits`` (CPU memory caps).
Imports ``harness.measure``, ``harness.plan``, ``harness.neutral``, ``harness.spec`` and the adapter registry; the
worker side must stay importable with numpy, pydantic and PyYAML alone."""
