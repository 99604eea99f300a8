"""``mechdiff finetune``: LoRA fine-tuning with the loss on the answer token, adapters saved with a recipe."""

from __future__ import annotations

import argparse
import logging

from ..methods.finetune import DEFAULT_TARGETS, FinetuneConfig
from ..models.registry import step_dirname
from ..studies.finetuning import finetune_and_write
from ..tasks.base import trainable_tasks
from ._options import add_model_options, load_from_args


def _save_spec(text: str) -> dict[str, int]:
    """Parse ``name=step,step,...`` into a dict; a bare step is saved as ``step-NNNN`` (read as ``OUT@STEP``)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, step = item.partition("=")
        if not sep:
            name, step = (step_dirname(int(item)) if item.strip().isdigit() else ""), item
        if not name.strip() or not step.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--save expects NAME=STEP or STEP, comma-separated; got {item!r}")
        out[name.strip()] = int(step)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    d = FinetuneConfig()
    p = sub.add_parser("finetune", help="LoRA fine-tuning (peft) on generated prompts; saves adapters + recipe")
    p.add_argument(
        "--base",
        default=d.base,
        help="registry name or path of the model to fine-tune "
        "(a LoRA adapter is merged first, so a new LoRA can be trained on top)",
    )
    p.add_argument("--task", default=d.task, choices=trainable_tasks())
    p.add_argument("--out", required=True, help="directory; each adapter goes to OUT/NAME")
    p.add_argument(
        "--save",
        type=_save_spec,
        default={},
        help="adapters to save: NAME=STEP or STEP (saved as OUT/step-NNNN, loadable as OUT@STEP), comma-separated",
    )
    p.add_argument("--save-every", type=int, default=0, help="also save OUT/step-NNNN every N steps (0: off)")
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated module names")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch_size, help="prompts per step")
    p.add_argument("--seed", type=int, default=d.seed, help="LoRA initialisation seed")
    p.add_argument("--data-seed", type=int, default=d.data_seed, help="training prompt seed")
    p.add_argument("--min-boxes", type=int, default=d.min_boxes)
    p.add_argument("--max-boxes", type=int, default=d.max_boxes)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-steps", default="", help="extra evaluation steps, comma-separated")
    p.add_argument("--eval-n", type=int, default=d.eval_n, help="validation prompts (training objects)")
    p.add_argument("--eval-boxes", type=int, default=d.eval_boxes)
    p.add_argument(
        "--stop-accuracy",
        type=float,
        default=None,
        help="stop once 7-box validation accuracy reaches this (after the last --save step)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (recorded in the recipe)")
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype not in ("float32", "fp32"):
        raise SystemExit("fine-tuning runs in float32 (adapters are stored in float16); drop --dtype")
    if args.remote:
        raise SystemExit("fine-tuning trains weights on this machine; --remote (NDIF) cannot. Use --device cuda")
    cfg = FinetuneConfig(
        base=args.base,
        task=args.task,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        target_modules=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        lr=args.lr,
        weight_decay=args.weight_decay,
        steps=args.steps,
        batch_size=args.batch,
        seed=args.seed,
        data_seed=args.data_seed,
        min_boxes=args.min_boxes,
        max_boxes=args.max_boxes,
        eval_every=args.eval_every,
        eval_steps=tuple(int(s) for s in args.eval_steps.split(",") if s.strip()),
        eval_n=args.eval_n,
        eval_boxes=args.eval_boxes,
        save_steps=args.save,
        save_every=args.save_every,
        stop_accuracy=args.stop_accuracy,
    )
    print(finetune_and_write(load_from_args(args.base, args), cfg, args.out))
    return 0
