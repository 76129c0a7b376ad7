"""`wim serve`: the HTTP service on local Ray (Ray Serve's `serve run` with our environment)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
    """Replace this process with `serve run CONFIG`, so the config's deployments apply."""
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
    os.execve(serve, [str(serve), "run", str(args.config)], env)
    return 0  # not reached
