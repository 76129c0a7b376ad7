"""`wim calibrate`: measure this machine's engine costs into an engine profile, the file
placement and `wim sim` read (`wim_service.engine.calibration`).

wim calibrate --out profile.json --kv-cache-gib 2
wim calibrate --restore-only --profile profile.json --out profile.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wim_service.cli.lifecycle import refused, run_command
from wim_service.engine.config import EngineConfig
from wim_service.placement.profile import EngineProfile


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure an engine profile on this machine",
        description="Start one engine with the engine flags, time prefills, decode steps, WiM "
        "queries and KV restores on it, and write the engine profile fitted to them (what "
        "placement and `wim sim` read). Run it on an otherwise idle machine.",
    )
    parser.add_argument("--out", type=Path, help="where the profile is written (required)")
    parser.add_argument(
        "--restore-only",
        action="store_true",
        help="measure only the restore cost (a temporary KV store) and write --profile with "
        "it to --out (the engine flags must match the profile's engine)",
    )
    parser.add_argument(
        "--profile", type=Path, help="with --restore-only: the profile (default: the shipped one)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes, each once: a rough profile in a few minutes (a smoke test)",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    try:
        return calibrate_profile(args)
    except (OSError, ValueError) as exc:  # pydantic's errors and ProfileError included
        return refused(exc)


def calibrate_profile(args: argparse.Namespace) -> int:
    if args.out is None:
        raise ValueError("calibrate needs --out FILE")
    if args.profile is not None and not args.restore_only:
        raise ValueError("--profile is read with --restore-only only")
    try:  # vLLM: imported only when calibrating
        from wim_service.engine.calibration.fit import describe
        from wim_service.engine.calibration.run import calibrate
    except ImportError as exc:  # a build without the engine's extras (vLLM)
        raise ValueError(f"cannot calibrate here: {exc}") from None

    config = EngineConfig.from_cli_args(args)
    restore_into = None
    if args.restore_only:
        if args.profile is not None and not args.profile.is_file():
            raise ValueError(f"no profile file {args.profile}")
        restore_into = EngineProfile.load(args.profile)

    async def write_profile() -> int:
        profile = await calibrate(config, quick=args.quick, restore_into=restore_into)
        args.out.write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
        print("\n".join(describe(profile)))
        print(f"wrote the engine profile to {args.out}")
        return 0

    # A signal stops it as it stops every command that starts an engine (`cli/lifecycle.py`).
    return run_command(write_profile())
