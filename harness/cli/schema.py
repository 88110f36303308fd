"""``harness schema``: the JSON Schema of a trial record (trials.jsonl)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    schema = sub.add_parser("schema", help="print the JSON Schema of a trial record (trials.jsonl)")
    schema.add_argument("--out", help="write it to this file instead")
    schema.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.results.schema import trial_schema_json

    if args.out:
        Path(args.out).write_text(trial_schema_json(), encoding="utf-8")
        print(f"schema: {args.out}")
    else:
        print(trial_schema_json(), end="")
    return 0
