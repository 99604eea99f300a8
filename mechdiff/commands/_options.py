"""Options shared by subcommands."""

from __future__ import annotations

import argparse

from ..io import write_json  # noqa: F401  (re-exported for the commands)
from ..models.loading import LoadedModel, load_model


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device-map and --cache-dir, identical on every stage."""
    parser.add_argument("--dtype", default="float32", help="float32 (as the paper), bfloat16 or float16")
    parser.add_argument("--device-map", default=None, help="e.g. cpu, cuda:0 or auto (accelerate sharding)")
    parser.add_argument("--cache-dir", default=None, help="Hugging Face cache directory for hub ids")


def add_dataset_options(parser: argparse.ArgumentParser, n: int = 500) -> None:
    parser.add_argument("--n-boxes", type=int, default=7, help="boxes per prompt (2-10)")
    parser.add_argument("--n", type=int, default=n, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--batch-size", type=int, default=32)


def load_from_args(name: str, args: argparse.Namespace) -> LoadedModel:
    return load_model(name, dtype=args.dtype, device_map=args.device_map, cache_dir=args.cache_dir)

