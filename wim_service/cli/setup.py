"""`wim setup`: prepare the offline assets (convert the default model, write the punkt data)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("setup", help="prepare the offline default model and punkt data")
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    from wim_service.assets.default_model import default_model_dir
    from wim_service.assets.punkt import punkt_data_dir

    print(f"default model: {default_model_dir()}")
    print(f"punkt data:    {punkt_data_dir()}")
    return 0
