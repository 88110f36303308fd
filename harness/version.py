"""The harness's version (``harness.__version__``; setup.cfg reads it from here), in a module that imports nothing:
the modules of the harness that record it (run.json's ``harness_version``) import it from here, never from the
``harness`` package itself, whose lazy ``load_run`` hook reaches up to ``harness.results`` (no circle through the top
level; tests/test_layout.py checks it)."""

__version__ = "0.1.0"
