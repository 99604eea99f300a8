"""Options shared by subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from ..models.loading import LoadedModel, load_model, load_tokenizer
from ..models.memory import auto_batch_size
from ..models.remote import check_remote
from ..models.resolve import resolve_spec
from ..tasks.base import Task, get_task, task_names
from ..tasks.relation_data import available_relations

#: What ``--metric`` of the scoring commands (prune, score, positions) says: prob is the task's continuous metric.
METRIC_HELP = (
    "accuracy, or prob: the task's continuous metric (the answer's probability, the logit difference on a "
    "logit_diff task; answer_prob is read as prob)"
)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device, --device-map, --remote and --cache-dir, identical on every stage."""
    parser.add_argument("--dtype", default="float32", help="float32 (as the paper), bfloat16 or float16")
    parser.add_argument("--device", default=None, help="one device for the whole model: cpu (default), cuda, cuda:1")
    parser.add_argument(
        "--device-map",
        default=None,
        help="auto (accelerate: shard the model over this machine's GPUs), balanced, or a device",
    )
    parser.add_argument(
        "--remote",
        action="store_true",
        help="run every forward pass on NDIF through nnsight (API key from $NDIF_API_KEY; hub models NDIF hosts only)",
    )
    parser.add_argument("--cache-dir", default=None, help="Hugging Face cache directory for hub ids")


def add_task_option(parser: argparse.ArgumentParser) -> None:
    """--task: a registered task or a directory written by `mechdiff dataset import`."""
    parser.add_argument(
        "--task",
        default="entity-tracking",
        help=f"a registered task ({', '.join(task_names(include_relations=False))}), a knowledge "
        f"relation ({', '.join(available_relations())}) or its JSON file, or a directory "
        "written by `mechdiff dataset import`",
    )


def task_from_args(args: argparse.Namespace) -> Task:
    """The task ``--task`` names (checked before any model loads)."""
    return get_task(getattr(args, "task", "entity-tracking"))


def task_options(args: argparse.Namespace) -> dict:
    """The generator options a command's arguments carry (entity tracking: ``n_boxes``)."""
    return {"n_boxes": getattr(args, "n_boxes", None)}


def add_dataset_options(parser: argparse.ArgumentParser, n: int = 500) -> None:
    add_task_option(parser)
    parser.add_argument("--n-boxes", type=int, default=7, help="boxes per prompt (2-10)")
    parser.add_argument("--n", type=int, default=n, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument(
        "--batch-size",
        type=batch_size_arg,
        default=32,
        help="prompts per forward pass, or auto (from free GPU memory; 32 on CPU)",
    )


def batch_size_arg(text: str) -> int | str:
    """``--batch-size``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-size must be a positive integer or auto, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("--batch-size must be at least 1")
    return value


def model_kwargs(args: argparse.Namespace) -> dict:
    """How every model of a command loads: the keyword arguments of ``load_model`` / ``ModelSet``.

    Checks ``--remote`` (API key set) before anything loads.
    """
    remote = getattr(args, "remote", False)
    check_remote(remote)
    return {
        "dtype": args.dtype,
        "device_map": args.device_map,
        "device": getattr(args, "device", None),
        "remote": remote,
        "cache_dir": args.cache_dir,
    }


def tokenizer_from_args(name: str, args: argparse.Namespace) -> Any:
    """The tokenizer of model ``name`` alone, no weights: a command builds (and so checks) its prompts with it
    before the weights load, then hands it to `load_from_args`."""
    check_remote(getattr(args, "remote", False))  # --remote checked first
    return load_tokenizer(resolve_spec(name), getattr(args, "cache_dir", None))


def load_from_args(name: str, args: argparse.Namespace, tokenizer: Any = None) -> LoadedModel:
    """Model ``name`` as the arguments say (``tokenizer``: its tokenizer, already loaded)."""
    model = load_model(name, tokenizer=tokenizer, **model_kwargs(args))
    resolve_batch_size(args, model)
    return model


def resolve_batch_size(args: argparse.Namespace, model: LoadedModel) -> None:
    """Replace ``--batch-size auto`` by a size chosen from the model's free memory (once a model is loaded)."""
    if getattr(args, "batch_size", None) == "auto":
        args.batch_size = auto_batch_size(model)
