"""`wim`: run WiM on a document from the command line, serve it, benchmark and evaluate it,
prepare offline assets. One module per subcommand, each with `add_parser` and `main`.

wim run --context examples/harbor_report.txt --query "What is the night gate code?"
wim run --context doc.txt --query "..." --json --relevance classifier
wim serve                      # the HTTP service on local Ray (what ./run.sh runs)
wim bench                      # the side-by-side benchmark of docs/benchmarks.md
wim eval                       # answer quality: plain long context vs RAG vs WiM
wim setup                      # convert the default model, write the punkt data
wim sim --trace FILE           # replay a trace over simulated replicas, per placement policy
wim calibrate --out FILE      # measure this machine's engine profile (what `wim sim` reads)

Ctrl-C or SIGTERM stops a command together with every process it started, its vLLM engines and
for `wim serve` its Ray cluster, within 7 s (status 130 / 143; see cli/lifecycle.py).
"""

from __future__ import annotations

import argparse

from wim_service.cli import bench, calibrate, run, serve, setup, sim
from wim_service.cli import eval as evaluate

SUBCOMMANDS = (run, serve, bench, evaluate, setup, sim, calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wim", description="Writing-in-the-Margins long-document question answering."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.main(args)  # set by the subcommand's add_parser
    return status
