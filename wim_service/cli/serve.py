"""`wim serve`: the HTTP service on local Ray (Ray Serve's `serve run` with our environment)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from wim_service.cli.lifecycle import run_subprocess

DEFAULT_SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the HTTP service on local Ray (Ray Serve's `serve run` with our environment)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_SERVE_CONFIG,
        help="Ray Serve config file; engine settings are its `args.engine` (default: %(default)s)",
    )
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    """Run `serve run CONFIG` (so the config's deployments apply) until a signal stops it.

    A child rather than an `exec`: `serve run` ended by SIGTERM leaves Ray's processes and
    the replicas' engines behind, and on Ctrl-C takes ~10 s to shut down; `run_subprocess`
    turns either signal into its Ctrl-C and kills whatever it has not ended in time."""
    from wim_service.assets.default_model import default_model_dir
    from wim_service.assets.punkt import punkt_data_dir

    # Prepare the offline assets once here rather than in every replica at once.
    default_model_dir()
    punkt_data_dir()
    env = {
        **os.environ,
        # Ray starts workers at nice 15 and the engines would inherit it.
        "RAY_worker_niceness": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    serve = Path(sys.executable).with_name("serve")
    return run_subprocess([str(serve), "run", str(args.config)], env)
