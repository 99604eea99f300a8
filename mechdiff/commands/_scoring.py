"""Options and set-up shared by ``score``, ``prune`` and ``compare``: prompts, reference set, scorer."""

from __future__ import annotations

import argparse

from ..circuits.circuit import Circuit, load_circuit_file
from ..circuits.scoring import Scorer
from ..models.architectures import ModelShape
from ..models.loading import LoadedModel, load_config
from ..models.resolve import resolve_spec
from ..studies.seeds import prompt_seed
from ._options import task_from_args, task_options


def add_scoring_options(parser: argparse.ArgumentParser) -> None:
    """The mean-ablation reference set and the activation store."""
    parser.add_argument("--reference", default="path_patching", choices=["path_patching", "fresh"],
                        help="prompts whose position-wise means replace ablated heads")
    parser.add_argument("--n-reference", type=int, default=None, help="reference prompts (default: --n)")
    parser.add_argument("--reference-seed", type=int, default=None,
                        help="default: the prompt set command-reference of --seed (mechdiff.studies.seeds: --seed + 1)")
    parser.add_argument("--store", default=None, help="HDF5 activation store caching the means (optional)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def model_shape(name: str, args: argparse.Namespace) -> ModelShape:
    """A model's shape from its config alone: read before any weights load."""
    return ModelShape.from_config(load_config(resolve_spec(name), getattr(args, "cache_dir", None)))


def load_circuit(path: str, shape: ModelShape) -> Circuit:
    """Load a circuit file and check it fits a model of ``shape`` (errors name the file and the fix)."""
    return load_circuit_file(path, shape.n_layers, shape.n_heads)


def build_scorer(model: LoadedModel, args: argparse.Namespace, **record_options) -> Scorer:
    """The scorer for ``args.n`` prompts (prompt set ``command-scoring`` of ``args.seed``) of ``args.task`` and the reference set of ``args``:
    ``path_patching`` the task's reference prompts (entity tracking: the path-patching sources), ``fresh``
    new prompts of the task. ``record_options`` go to the scored prompts only (e.g. held-out objects)."""
    task, options = task_from_args(args), task_options(args)
    records = task.records(model.tokenizer, args.n, prompt_seed(args.seed, "command-scoring"), **options,
                           **record_options)
    ref_seed = prompt_seed(args.seed, "command-reference") if args.reference_seed is None else args.reference_seed
    n_ref = args.n_reference or args.n
    reference = (task.reference_records(model.tokenizer, n_ref, ref_seed, **options) if args.reference == "path_patching"
                 else task.records(model.tokenizer, n_ref, ref_seed, **options))
    return Scorer.build(model, records, reference, args.batch_size, progress=not args.no_progress, store=args.store)


def settings(args: argparse.Namespace) -> dict:
    """The run's settings, for the JSON output."""
    return {k: v for k, v in vars(args).items() if k != "func"}
