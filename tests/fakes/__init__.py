"""Stand-ins for hardware libraries, shared by the tests: ``tests.fakes.nvml`` is a fake of the pynvml module."""
