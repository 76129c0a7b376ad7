"""`wim eval` (placeholder until the evaluation harness lands)."""

from __future__ import annotations

import argparse


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="a small evaluation")


async def run_eval(args: argparse.Namespace) -> int:
    raise SystemExit("wim eval: not implemented yet")
