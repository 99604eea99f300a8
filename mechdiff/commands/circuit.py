"""``mechdiff circuit``: find a task's circuit of one model by path patching, step by step as its plan says
(entity tracking: groups A-D)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.discovery import DiscoverySettings
from ..patching.path import SCORES
from ..studies.circuits.discovery import discover_circuit, task_plan
from ..tasks.base import Task
from ..tasks.entity_tracking.pairs import COUNTERFACTUALS
from ..tasks.plan import Plan, default_plan
from ._options import (
    add_model_options,
    add_task_option,
    load_from_args,
    task_from_args,
    task_options,
    tokenizer_from_args,
)


def parse_k(text: str, plan: Plan | None = None) -> dict[str, int]:
    """``"A=10,B=4,C=6,D=3"`` -> ``{"A": 10, ...}`` (unnamed steps keep the plan's k)."""
    steps = list((plan or default_plan()).k)
    k: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        step, _, value = part.partition("=")
        if step not in steps or not value.isdigit():
            raise ValueError(f"bad --top-k item {part!r}; expected STEP=INT with STEP in {steps}, e.g. {steps[0]}=10")
        k[step] = int(value)
    return k


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("circuit", help="discover a task's circuit by exact path patching, as its plan says")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    add_task_option(p)
    p.add_argument("--plan", default=None, help="discovery plan TOML (default: the task's plan)")
    p.add_argument("--n", type=int, default=DiscoverySettings.n_prompts, help="number of path-patching pairs")
    p.add_argument("--n-boxes", type=int, default=7, help="entity tracking: boxes per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", default="", help="heads kept per step, overriding the plan's k, e.g. A=10,B=4,C=6,D=3")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--exact",
        dest="screen",
        action="store_false",
        default=False,
        help="exact path patching of every sender (default)",
    )
    mode.add_argument(
        "--screen",
        dest="screen",
        action="store_true",
        help="attribution screen, then exact path patching of the shortlist (for large models)",
    )
    p.add_argument(
        "--score",
        default=DiscoverySettings.score,
        choices=list(SCORES),
        help="a sender's score over the prompts: ratio_of_means (mechdiff's, stable where a clean probability is "
        "tiny) or mean_of_ratios (the paper's mean of per-prompt relative changes)",
    )
    p.add_argument(
        "--screen-multiple",
        type=float,
        default=DiscoverySettings.screen_multiple,
        help="path patch this many times k of the best-screened senders",
    )
    p.add_argument(
        "--senders-per-pass",
        type=senders_arg,
        default=DiscoverySettings.senders_per_pass,
        help="sender copies stacked in one forward pass, or auto (from free GPU memory, as "
        "--batch-size auto; 8 on CPU)",
    )
    p.add_argument(
        "--pairs-per-part",
        type=positive_int,
        default=None,
        help="hold at most this many pairs' activations at once (each part run again at every step); default: all",
    )
    p.add_argument(
        "--counterfactual",
        default=COUNTERFACTUALS[0],
        choices=list(COUNTERFACTUALS),
        help="entity tracking: each clean prompt's counterfactual, fresh (mechdiff's: a new context, another box, a "
        "query letter absent from it) or paper (the clean set's prompt querying box (j+1) mod n_boxes, its query "
        "letter a uniform A-Z draw)",
    )
    p.add_argument(
        "--clean-seed",
        type=int,
        default=None,
        help="entity tracking: draw the clean prompts by this seed and only the counterfactuals by --seed (the "
        "paper's per-model seeds); default: --seed draws both",
    )
    p.add_argument("--out", default=None, help="output directory (default results/circuits/<model>/)")
    add_model_options(p)
    p.set_defaults(func=main)


def pair_options(args: argparse.Namespace, task: Task) -> dict:
    """The pairs' options ``--counterfactual`` and ``--clean-seed`` set off their defaults; refused for a task
    whose pairs take no such choice."""
    given = {"counterfactual": args.counterfactual, "clean_seed": args.clean_seed}
    out = {k: v for k, v in given.items() if v is not None and v != COUNTERFACTUALS[0]}
    unknown = [k for k in out if k not in task.options]
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ValueError(
            f"mechdiff circuit: {flags}: task {task.name}'s pairs offer no such choice (entity tracking's do)"
        )
    return out


def senders_arg(text: str) -> int | str:
    """``--senders-per-pass``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--senders-per-pass must be a positive integer or auto, not {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"give a whole number of at least 1, not {text!r}")
    return int(text)


def main(args: argparse.Namespace) -> int:
    task = task_from_args(args)
    plan = task_plan(task, args.plan)
    settings = DiscoverySettings(
        k=parse_k(args.top_k, plan),
        screen=args.screen,
        screen_multiple=args.screen_multiple,
        senders_per_pass=args.senders_per_pass,
        n_prompts=args.n,
        n_boxes=args.n_boxes,
        seed=args.seed,
        score=args.score,
        pairs_per_part=args.pairs_per_part,
    )
    out = Path(args.out or f"results/circuits/{Path(args.model).name}")
    print(
        discover_circuit(
            args.model,
            task,
            plan,
            settings,
            {**task_options(args), **pair_options(args, task)},
            out,
            lambda: tokenizer_from_args(args.model, args),
            lambda tokenizer: load_from_args(args.model, args, tokenizer),
            args.dtype,
        )
    )
    return 0
