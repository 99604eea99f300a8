"""Options and set-up shared by ``score``, ``prune``, ``compare``, ``curve`` and ``positions``: the prompts and
reference set (`mechdiff.studies.circuits.scoring.ScoringPrompts`), circuit files."""

from __future__ import annotations

import argparse

from ..circuits.circuit import Circuit, load_circuit_file
from ..models.architectures import ModelShape
from ..models.loading import load_config
from ..models.resolve import resolve_spec
from ..studies.circuits.scoring import REFERENCES, ScoringPrompts
from ._options import task_from_args, task_options


def add_scoring_options(parser: argparse.ArgumentParser) -> None:
    """The mean-ablation reference set and the activation store."""
    parser.add_argument(
        "--reference",
        default=REFERENCES[0],
        choices=list(REFERENCES),
        help="prompts whose position-wise means replace ablated heads",
    )
    parser.add_argument("--n-reference", type=int, default=None, help="reference prompts (default: --n)")
    parser.add_argument(
        "--reference-seed",
        type=int,
        default=None,
        help="default: the prompt set command-reference of --seed (mechdiff.runs.seeds: --seed + 1)",
    )
    parser.add_argument("--store", default=None, help="HDF5 activation store caching the means (optional)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def model_shape(name: str, args: argparse.Namespace) -> ModelShape:
    """A model's shape from its config alone: read before any weights load."""
    return ModelShape.from_config(load_config(resolve_spec(name), getattr(args, "cache_dir", None)))


def load_circuit(path: str, shape: ModelShape) -> Circuit:
    """Load a circuit file and check it fits a model of ``shape`` (errors name the file and the fix)."""
    return load_circuit_file(path, shape.n_layers, shape.n_heads)


def scoring_prompts(args: argparse.Namespace) -> ScoringPrompts:
    """The prompts ``args`` ask for, at ``args.batch_size`` as it stands: a caller resolves ``--batch-size auto``
    first, once its model is loaded (`load_from_args`, `resolve_batch_size`)."""
    return ScoringPrompts(
        task_from_args(args),
        args.n,
        args.seed,
        args.reference,
        args.n_reference,
        args.reference_seed,
        args.batch_size,
        not args.no_progress,
        args.store,
        task_options(args),
    )


def settings(args: argparse.Namespace) -> dict:
    """The run's settings, for the JSON output."""
    return {k: v for k, v in vars(args).items() if k != "func"}
