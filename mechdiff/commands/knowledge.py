"""``mechdiff knowledge``: knowledge circuits (Yao et al. 2024) of one relation, on one or more checkpoints.

Argument parsing only: the settings are `mechdiff.studies.knowledge.settings.KnowledgeSettings` (a task
file's ``[knowledge]`` section, then the flags given), the study is `mechdiff.studies.knowledge.study.KnowledgeStudy`
(the kind ``mechdiff run`` runs for a task file with ``[study] kind = "knowledge"``), here on the one relation given.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from ..methods.knowledge.acdc import METRICS
from ..studies.knowledge.report import relation_summary
from ..studies.knowledge.settings import ABLATIONS, METHODS, SELECTIONS, KnowledgeSettings, load_settings
from ..studies.knowledge.study import KnowledgeStudy
from ..tasks.relation_data import available_relations
from ._options import add_model_options, load_from_args

D = KnowledgeSettings()


def _fractions(text: str) -> tuple:
    return tuple(float(x) / 100 for x in text.split(",") if x.strip())


def _percent(sizes: tuple) -> str:
    return ",".join(f"{100 * x:g}" for x in sizes)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "knowledge",
        help="edge-level knowledge circuits of a relation (EAP-IG / EAP / ACDC), "
        "Hit@10 vs random, logit lens, head roles, across checkpoints",
    )
    p.add_argument(
        "--relation",
        default=None,
        help=f"relation name ({', '.join(available_relations())}) or an LRE-format JSON file ({D.relation})",
    )
    p.add_argument(
        "--task",
        default=None,
        help="task file (tasks/knowledge.toml); its [knowledge] values are defaults that flags override",
    )
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated models: one circuit each on the facts all get "
        f"right, then edge/node overlap ({','.join(D.models)})",
    )
    p.add_argument(
        "--unedited",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with an edit file as --relation (edits/capital_swap): its prompts with their original objects, "
        "the facts before the edit",
    )
    p.add_argument("--template", type=int, default=None, help=f"index of the relation's prompt template ({D.template})")
    p.add_argument(
        "--method",
        default=None,
        choices=METHODS,
        help=f"eap ({D.method} by default): one forward+backward per batch; iterative: EAP recomputed at "
        "the current circuit while pruning (a pass per size); eap-ig: integrated gradients over edge "
        "masks; acdc: exact pruning edge by edge (incremental, batched; --acdc-prefilter for "
        "SmolLM2-135M's 70 651 edges: benchmarks/acdc.py measures the cost)",
    )
    p.add_argument("--ig-steps", type=int, default=None, help=f"EAP-IG interpolation steps ({D.ig_steps})")
    p.add_argument(
        "--ablation",
        default=None,
        choices=ABLATIONS,
        help="what a removed edge carries (mean: the sender's mean output over the facts; "
        f"zero: nothing, as in the paper; default {D.ablation})",
    )
    p.add_argument(
        "--keep-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="never ablate position 0, the attention sink (every edge kept there)",
    )
    p.add_argument(
        "--selection",
        default=None,
        choices=SELECTIONS,
        help=f"greedy: grow the circuit from the logits by score; topk: highest scores ({D.selection})",
    )
    p.add_argument(
        "--signed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rank edges by score (positive first) instead of |score|",
    )
    p.add_argument(
        "--prune-unreached",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="drop edges from senders with no input edge (default; exact under zero ablation only)",
    )
    p.add_argument(
        "--tau", type=float, default=None, help=f"ACDC threshold on its metric ({D.tau}; paper: 0.02, 0.01, 0.005)"
    )
    p.add_argument(
        "--acdc-metric",
        default=None,
        choices=METRICS,
        help=f"ACDC metric ({D.acdc_metric}; match_nll, the paper's: the answer's NLL over the facts the "
        "full model gets top-1)",
    )
    p.add_argument(
        "--acdc-prefilter",
        type=float,
        default=None,
        help="ACDC tries only the top this %% of edges by |EAP|, removing the others untried (default: all)",
    )
    p.add_argument(
        "--acdc-batch",
        type=int,
        default=None,
        help=f"ACDC candidate edges per forward ({D.acdc_batch}; 0: sized by memory)",
    )
    p.add_argument(
        "--acdc-facts",
        type=int,
        default=None,
        help="ACDC on at most this many facts the model gets top-1, of one token length (0: all)",
    )
    p.add_argument("--k", type=int, default=None, help=f"Hit@k ({D.k})")
    p.add_argument("--target", type=float, default=None, help=f"circuit Hit@k >= target x full model's ({D.target})")
    p.add_argument("--sizes", default=None, help=f"candidate circuit sizes in %% of edges ({_percent(D.sizes)})")
    p.add_argument("--no-curve", action="store_true", help="skip the faithfulness curve (CPR/CMD)")
    p.add_argument("--n-random", type=int, default=None, help=f"random circuits of the same edge count ({D.n_random})")
    p.add_argument("--max-facts", type=int, default=None, help="use at most this many facts (0: all)")
    p.add_argument("--batch-size", type=int, default=None, help=f"facts per forward pass ({D.batch_size})")
    p.add_argument("--seed", type=int, default=None, help=f"seed the random circuits' seeds derive from ({D.seed})")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default results/knowledge-<model>/<relation>); "
        "stages are cached in OUT/stages and reused on a rerun",
    )
    add_model_options(p)
    p.set_defaults(func=main)


def settings_from(args: argparse.Namespace) -> KnowledgeSettings:
    """The task file's ``[knowledge]`` section (or the defaults), then every flag given."""
    settings = load_settings(args.task) if args.task else KnowledgeSettings()
    flags = {f.name: getattr(args, f.name) for f in fields(KnowledgeSettings) if hasattr(args, f.name)}
    flags["sizes"] = _fractions(args.sizes) if args.sizes else None
    flags["acdc_prefilter"] = None if args.acdc_prefilter is None else args.acdc_prefilter / 100
    flags["models"] = tuple(n for n in args.models.split(",") if n) if args.models else None
    flags["curve"] = False if args.no_curve else None
    return replace(settings, **{k: v for k, v in flags.items() if v is not None})


def main(args: argparse.Namespace) -> int:
    from ..studies.base import plan_then_run

    settings = replace(settings_from(args), relations=())  # the one relation of --relation (or the file's)
    out = Path(args.out or f"results/knowledge-{settings.models[0]}/{settings.relation}")
    study = KnowledgeStudy(settings, out, lambda name: load_from_args(name, args))
    plan_then_run(study)
    print(relation_summary(study.outcome[settings.relation], settings.k))
    print(f"wrote {out}")
    return 0
