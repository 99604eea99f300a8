"""``mechdiff headmap``: HeadMap locating (``locate``), fine-tuning (``finetune``) and the study (``compare``).

Argument parsing only: every option is a field of `mechdiff.studies.headmap.settings.HeadMapSettings`
(defaults there; ``compare --task FILE`` reads a task file's ``[headmap]`` section, flags override it),
and each action calls `mechdiff.studies.headmap.study`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields, replace

from ..methods.headmap import TrainConfig
from ..studies.headmap.settings import RUNS, HeadMapSettings
from ._options import add_model_options, load_from_args

D = HeadMapSettings()


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"registry name or path of the model ({D.model})")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    add_model_options(p)


def _locate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=None, help=f"lowest-loss samples used for locating ({D.n})")
    p.add_argument("--pool", type=int, default=None, help=f"prompts the samples are selected from ({D.pool})")
    p.add_argument("--k", type=int, default=None, help=f"heads kept per layer ({D.k})")
    p.add_argument("--batch-size", type=int, default=None, help=f"rows per forward pass ({D.batch_size})")
    p.add_argument("--seed", type=int, default=None, help=f"pool seed ({D.seed})")


def _train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help=f"training steps ({D.steps})")
    p.add_argument("--batch", type=int, default=None, help=f"prompts per step ({D.batch})")
    p.add_argument("--lr", type=float, default=None, help=f"LoRA learning rate without a sweep ({D.lr})")
    p.add_argument(
        "--headmap-lr", type=float, default=None, help=f"HeadMap maps' learning rate without a sweep ({D.headmap_lr})"
    )
    p.add_argument("--rank", type=int, default=None, help=f"HeadMap map rank r ({D.rank})")
    p.add_argument("--eval-n", type=int, default=None, help=f"held-out evaluation prompts ({D.eval_n})")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated training seeds; seed s initialises from s, trains on data seed "
        f"data_seed + s and draws the random head sets from derive(s, ...) "
        f"({','.join(map(str, D.seeds))}; locate and finetune use the first)",
    )
    p.add_argument("--data-seed", type=int, default=None, help=f"training batches' seed offset ({D.data_seed})")


def register(sub: argparse._SubParsersAction) -> None:
    from ..tasks.base import trainable_tasks

    p = sub.add_parser("headmap", help="HeadMap: layer-conditioned locating of task heads and HeadMap fine-tuning")
    hs = p.add_subparsers(dest="headmap_command", required=True, metavar="ACTION")

    loc = hs.add_parser("locate", help="select the lowest-loss samples and locate k heads per layer")
    _common(loc)
    loc.add_argument("--task", default="entity-tracking", choices=trainable_tasks())
    loc.add_argument("--out", required=True, help="directory: circuit.json, heads.png, curve.png")
    _locate_options(loc)
    loc.set_defaults(func=main_locate)

    ft = hs.add_parser("finetune", help="train HeadMap maps on located heads (optionally with a LoRA)")
    _common(ft)
    ft.add_argument("--task", default="entity-tracking", choices=trainable_tasks())
    ft.add_argument("--circuit", required=True, help="circuit.json from `mechdiff headmap locate`")
    ft.add_argument(
        "--lora-rank",
        type=int,
        default=TrainConfig.lora_rank,
        help="also train a LoRA of this rank (HeadMap+LoRA; 0: none)",
    )
    ft.add_argument("--out", required=True, help="directory: result.json")
    _train_options(ft)
    ft.set_defaults(func=main_finetune)

    cmp_ = hs.add_parser("compare", help="the study: locate on two tasks, HeadMap vs LoRA and ablations, report.md")
    _common(cmp_)
    cmp_.add_argument(
        "--task",
        default=None,
        help="task file (tasks/headmap.toml); its [headmap] values are defaults that flags override",
    )
    cmp_.add_argument(
        "--out",
        default="results/headmap-smollm2",
        help="directory: report.md, tables, figures; stages cached in OUT/stages",
    )
    cmp_.add_argument(
        "--transfer-task",
        default=None,
        choices=trainable_tasks(),
        help=f"task whose located circuit is transferred to entity tracking ({D.transfer_task})",
    )
    cmp_.add_argument(
        "--path-patching",
        default=None,
        help=f"comma-separated path-patching circuit files to compare the located heads with "
        f"({','.join(D.path_patching)})",
    )
    cmp_.add_argument(
        "--lora-small", type=int, default=None, help=f"rank of the LoRA near HeadMap's parameter count ({D.lora_small})"
    )
    cmp_.add_argument("--lora-large", type=int, default=None, help=f"rank of the larger LoRA ({D.lora_large})")
    cmp_.add_argument("--transfer-n", type=int, default=None, help="samples for locating on the transfer task (n)")
    cmp_.add_argument(
        "--lora-zoo",
        default=None,
        help=f"a saved LoRA of the same recipe to evaluate instead of training one (run lora-zoo; {D.lora_zoo})",
    )
    cmp_.add_argument(
        "--lrs",
        default=None,
        help="comma-separated learning rates swept for HeadMap and LoRA alike on the first seed, "
        "each method then training at its best on the validation prompts (empty: --lr and "
        "--headmap-lr)",
    )
    cmp_.add_argument(
        "--val-n",
        type=int,
        default=None,
        help=f"validation prompts of training objects the rate is chosen on ({D.val_n})",
    )
    cmp_.add_argument("--val-seed", type=int, default=None, help=f"validation prompts' seed ({D.val_seed})")
    cmp_.add_argument("--train-only", action="store_true", help="stop after the training runs (no report)")
    cmp_.add_argument("--runs", default=None, help=f"training runs, in order (of {','.join(RUNS)}; default all)")
    _locate_options(cmp_)
    _train_options(cmp_)
    cmp_.set_defaults(func=main_compare)


def settings_from(args: argparse.Namespace, task_file: bool = False) -> HeadMapSettings:
    """The task file's ``[headmap]`` section (``compare --task``) or the defaults, then every flag given."""
    from ..studies.headmap.settings import check_runs, load_settings

    settings = load_settings(args.task) if task_file and args.task else HeadMapSettings()
    flags = {f.name: getattr(args, f.name) for f in fields(HeadMapSettings) if getattr(args, f.name, None) is not None}
    for name, kind in (("path_patching", str), ("runs", str), ("seeds", int), ("lrs", float)):  # comma lists
        if name in flags:
            flags[name] = tuple(kind(x.strip()) for x in flags[name].split(",") if x.strip())
    settings = replace(settings, **flags)
    check_runs(settings)
    return settings


def _setup(args: argparse.Namespace) -> None:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)


def main_locate(args: argparse.Namespace) -> int:
    from ..common.io import check_writable
    from ..studies.headmap.locate import locate_and_write

    _setup(args)
    settings = settings_from(args)
    out = check_writable(args.out)
    model = load_from_args(settings.model, args)
    circuit = locate_and_write(model, args.task, settings.locate_config(), out)
    print(f"located {sum(len(h) for h in circuit['groups'].values())} heads -> {out / 'circuit.json'}")
    return 0


def main_finetune(args: argparse.Namespace) -> int:
    from ..common.io import check_writable
    from ..studies.headmap.training import train_maps_and_write
    from ._scoring import load_circuit, model_shape

    _setup(args)
    settings = settings_from(args)
    out = check_writable(args.out)
    circuit = load_circuit(args.circuit, model_shape(settings.model, args))  # checked before the weights load
    model = load_from_args(settings.model, args)
    print(train_maps_and_write(model, circuit, settings.train_config(args.task, args.lora_rank), out))
    return 0


def main_compare(args: argparse.Namespace) -> int:
    from ..studies.headmap.study import HeadMapStudy

    _setup(args)
    from ..studies.base import plan_then_run

    study = HeadMapStudy(settings_from(args, task_file=True), args.out, lambda name: load_from_args(name, args))
    report = plan_then_run(study, train_only=args.train_only)
    if report is not None:
        print(report.read_text())
    return 0
