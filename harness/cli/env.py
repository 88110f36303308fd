"""``harness env``: what a run would record about this machine, as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    sub.add_parser("env", help="print what a run would record about this machine (JSON)").set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.measure import machine

    print(json.dumps(machine.collect(), indent=2))
    return 0
