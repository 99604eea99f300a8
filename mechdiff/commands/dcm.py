"""``mechdiff dcm``: what each circuit group encodes (DCM masks per desideratum), and semantic patching."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.circuit import load_circuit_file
from ..common.io import check_writable
from ..methods.dcm import LAM_SCALES, PARAMETERISATIONS, RANDOM_POOLS, DCMConfig
from ..methods.dcm_cache import CACHE_MODES
from ..models.modelset import ModelSet
from ..studies.circuits.dcm import dcm_run
from ..tasks.entity_tracking.desiderata import load_desiderata
from ._options import add_model_options, add_task_option, model_kwargs, task_from_args, tokenizer_from_args

DEFAULTS = DCMConfig()  # every training default is DCMConfig's


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dcm", help="desiderata-based component masking of a circuit's groups (+ semantic patching)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    add_task_option(p)
    p.add_argument(
        "--desiderata",
        default=None,
        help="comma-separated names of the task's desiderata (entity tracking: positional, object, "
        "label; an imported task: counterfactual) or .jsonl files of entity-tracking pairs "
        "(default: every desideratum of the task)",
    )
    p.add_argument("--groups", default=None, help="comma-separated groups (default: all)")
    p.add_argument("--n", type=int, default=200, help="pairs per built-in desideratum (split train/val/test)")
    p.add_argument("--n-boxes", type=int, default=7, help="boxes per prompt (2-10)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="dataset, split and training seed")
    p.add_argument("--parameterisation", default=DEFAULTS.parameterisation, choices=list(PARAMETERISATIONS))
    p.add_argument("--lam", type=float, default=DEFAULTS.lam, help="sparsity weight (penalises patched heads)")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument("--epochs", type=int, default=DEFAULTS.epochs)
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="pairs per optimiser step")
    p.add_argument(
        "--micro-batch", type=int, default=DEFAULTS.micro_batch, help="pairs per forward/backward pass (memory)"
    )
    p.add_argument("--eval-batch", type=int, default=DEFAULTS.eval_batch, help="pairs per forward pass when evaluating")
    p.add_argument(
        "--eval-every", type=int, default=DEFAULTS.eval_every, help="optimiser steps between validation passes"
    )
    p.add_argument(
        "--lam-scale",
        default=DEFAULTS.lam_scale,
        choices=list(LAM_SCALES),
        help="loss: lam times the unpatched mean |logit(target)| (mechdiff's); absolute: lam as is (the paper's)",
    )
    p.add_argument(
        "--preset",
        default="",
        choices=["", "paper"],
        help="paper: the paper's training (absolute lam 0.01, lr 0.1, 32 pairs per step, 2 epochs in order, "
        "validation after batches 0, 4, 8... of each epoch, split 50/25/25); the training options "
        "above must then stay at their defaults",
    )
    p.add_argument("--n-random", type=int, default=DEFAULTS.n_random, help="random head sets for the baseline")
    p.add_argument(
        "--random-pool",
        default=DEFAULTS.random_pool,
        choices=list(RANDOM_POOLS),
        help="random baseline heads: each selected head's own layer (default), all heads of the model, or only the "
        "group's (degenerate when DCM selects the whole group)",
    )
    p.add_argument(
        "--semantic",
        default=None,
        help="comma-separated models to semantic-patch the selected heads into (the DCM model is included)",
    )
    p.add_argument(
        "--cache",
        default="file",
        choices=list(CACHE_MODES),
        help="how the pair cache holds what patched runs read: a scratch file under TMPDIR (every layer's keys and "
        "values: suffix runs), the sources' z in host memory (as the paper; full runs), or nothing (sources run "
        "again per batch); the same results but for float rounding (`mechdiff run --plan` compares them)",
    )
    p.add_argument("--out", default="results/dcm", help="output directory")
    add_model_options(p)
    p.set_defaults(func=main)


TRAINING = ("parameterisation", "lam", "lam_scale", "lr", "epochs", "batch_size", "eval_every")


def config_from_args(args: argparse.Namespace) -> DCMConfig:
    """The training settings the command line chose (every default is `DEFAULTS`; ``--preset paper``:
    `DCMConfig.paper`, refused beside a changed training option)."""
    bookkeeping = {
        "micro_batch": args.micro_batch,
        "eval_batch": args.eval_batch,
        "n_random": args.n_random,
        "random_pool": args.random_pool,
        "seed": args.seed,
    }
    if getattr(args, "preset", "") == "paper":
        changed = [f"--{k.replace('_', '-')}" for k in TRAINING if getattr(args, k) != getattr(DEFAULTS, k)]
        if changed:
            raise SystemExit(
                f"--preset paper fixes the training settings; drop {', '.join(changed)} "
                "(or drop --preset to set them yourself)"
            )
        return DCMConfig.paper(**bookkeeping)
    return DCMConfig(**{k: getattr(args, k) for k in TRAINING}, **bookkeeping)


def main(args: argparse.Namespace) -> int:
    if args.remote:
        raise SystemExit(
            "DCM trains masks through backward passes on this machine; it does not run on NDIF yet "
            "(--remote). Run it with --device cuda / --device-map auto."
        )
    task = task_from_args(args)
    others = [m for m in (args.semantic or "").split(",") if m and m != args.model]
    check_writable(args.out)
    models = ModelSet([args.model, *others], **model_kwargs(args))  # configs only: no weights yet
    circuit = load_circuit_file(args.circuit, models.shape.n_layers, models.shape.n_heads)
    config = config_from_args(args)
    # the desiderata (names, files) are checked and built with the tokenizer alone, before any weights load
    desiderata = load_desiderata(
        args.desiderata or ",".join(task.desiderata),
        tokenizer_from_args(args.model, args),
        args.n,
        args.n_boxes,
        args.seed,
        args.task,
    )
    dcm_run(
        models,
        circuit,
        args.circuit,
        desiderata,
        config,
        args.groups.split(",") if args.groups else None,
        task.name,
        args.n_boxes,
        Path(args.out),
        cache=args.cache,
    )  # prints each table as soon as it is ready
    return 0
