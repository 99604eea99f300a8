"""``mechdiff knowledge``: knowledge circuits (Yao et al. 2024) of one relation, on one or more checkpoints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..knowledge.data import available_relations
from ..knowledge.pipeline import KnowledgeSettings, run_study
from ._options import add_model_options, load_from_args


def _fractions(text: str) -> tuple:
    return tuple(float(x) / 100 for x in text.split(",") if x.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("knowledge", help="edge-level knowledge circuits of a relation (EAP-IG / EAP / ACDC), "
                                         "Hit@10 vs random, logit lens, head roles, across checkpoints")
    p.add_argument("--relation", default="country_language",
                   help=f"relation name ({', '.join(available_relations())}) or an LRE-format JSON file")
    p.add_argument("--task", default=None, help="task file (tasks/knowledge.toml); its [knowledge] values are "
                                                "defaults that flags override")
    p.add_argument("--models", default=None, help="comma-separated models: one circuit each on the facts all get "
                                                  "right, then edge/node overlap (default: smollm2-135m)")
    p.add_argument("--template", type=int, default=None, help="index of the relation's prompt template (0)")
    p.add_argument("--method", default=None, choices=["eap-ig", "eap", "iterative", "acdc"],
                   help="eap (default): one forward+backward per batch; iterative: EAP recomputed at the current "
                        "circuit while pruning (a pass per size); eap-ig: integrated gradients over edge masks; "
                        "acdc: exact pruning edge by edge (incremental, batched; see --acdc-prefilter for "
                        "SmolLM2-135M's 70 651 edges: benchmarks/acdc.py measures the cost)")
    p.add_argument("--ig-steps", type=int, default=None, help="EAP-IG interpolation steps (5)")
    p.add_argument("--ablation", default=None, choices=["zero", "mean"], help="what a removed edge carries (mean: the sender's mean output over the facts; "
                        "zero: nothing, as in the paper)")
    p.add_argument("--keep-first", action=argparse.BooleanOptionalAction, default=None,
                   help="never ablate position 0, the attention sink (every edge kept there)")
    p.add_argument("--selection", default=None, choices=["greedy", "topk"],
                   help="greedy: grow the circuit from the logits by score (default); topk: highest scores")
    p.add_argument("--signed", action=argparse.BooleanOptionalAction, default=None,
                   help="rank edges by score (positive first) instead of |score|")
    p.add_argument("--prune-unreached", action=argparse.BooleanOptionalAction, default=None,
                   help="drop edges from senders with no input edge (default; exact under zero ablation only)")
    p.add_argument("--tau", type=float, default=None, help="ACDC threshold on its metric (paper: 0.02, 0.01, 0.005)")
    p.add_argument("--acdc-metric", default=None, choices=["match_nll", "nll", "kl"],
                   help="ACDC metric (match_nll, the paper's: answer NLL over facts the full model gets top-1)")
    p.add_argument("--acdc-prefilter", type=float, default=None,
                   help="run ACDC only on the top this %% of edges by |EAP| (the rest removed; default: all)")
    p.add_argument("--acdc-batch", type=int, default=None, help="ACDC candidate edges per forward (0: by memory)")
    p.add_argument("--acdc-facts", type=int, default=None,
                   help="ACDC on at most this many facts the model gets top-1, of one token length (0: all)")
    p.add_argument("--k", type=int, default=None, help="Hit@k (10)")
    p.add_argument("--target", type=float, default=None, help="circuit Hit@k >= target x full model's (0.7)")
    p.add_argument("--sizes", default=None, help="candidate circuit sizes in %% of edges (0.1,0.2,0.5,1,2,5,10)")
    p.add_argument("--no-curve", action="store_true", help="skip the faithfulness curve (CPR/CMD)")
    p.add_argument("--n-random", type=int, default=None, help="random circuits of the same edge count (3)")
    p.add_argument("--max-facts", type=int, default=None, help="use at most this many facts (0: all)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="output directory (default results/knowledge-<model>/<relation>)")
    add_model_options(p)
    p.set_defaults(func=main)


def settings_from(args: argparse.Namespace) -> KnowledgeSettings:
    values = {}
    if args.task:
        import tomllib

        data = tomllib.loads(Path(args.task).read_text())
        values = dict(data.get("knowledge", {}))
        unknown = set(values) - set(KnowledgeSettings.__dataclass_fields__) - {"models"}
        if unknown:
            raise ValueError(f"{args.task}: unknown [knowledge] keys {sorted(unknown)}; valid: "
                             f"{sorted(KnowledgeSettings.__dataclass_fields__)} and models")
    flags = {"relation": args.relation if args.relation != "country_language" or "relation" not in values else None,
             "template": args.template, "method": args.method, "ig_steps": args.ig_steps,
             "ablation": args.ablation,
             "keep_first": args.keep_first, "selection": args.selection, "signed": args.signed,
             "prune_unreached": args.prune_unreached,
             "tau": args.tau, "acdc_metric": args.acdc_metric, "acdc_batch": args.acdc_batch,
             "acdc_facts": args.acdc_facts,
             "acdc_prefilter": None if args.acdc_prefilter is None else args.acdc_prefilter / 100,
             "k": args.k, "target": args.target, "n_random": args.n_random,
             "max_facts": args.max_facts, "batch_size": args.batch_size, "seed": args.seed,
             "sizes": _fractions(args.sizes) if args.sizes else None}
    values.update({k: v for k, v in flags.items() if v is not None})
    if args.no_curve:
        values["curve"] = False
    for key in ("sizes", "curve_sizes"):
        if key in values:
            values[key] = tuple(values[key])
    values.pop("models", None)
    return KnowledgeSettings(**values)


def main(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    names = args.models
    if names is None and args.task:
        import tomllib

        names = ",".join(tomllib.loads(Path(args.task).read_text()).get("knowledge", {}).get("models", []))
    names = [n for n in (names or "smollm2-135m").split(",") if n]
    models = [load_from_args(n, args) for n in names]
    out = Path(args.out or f"results/knowledge-{names[0]}/{settings.relation}")
    res = run_study(models, settings, out)
    hk = f"hit@{settings.k}"
    for name, r in res["results"].items():
        print(f"{name}: {r['n_facts']} facts; full {hk} {r['full'][hk]['value']:.3f}, circuit "
              f"{r['circuit'][hk]['value']:.3f} ({r['ratio_to_full']:.2f} of full) with {r['circuit_edges']} edges "
              f"({100 * r['circuit_fraction']:.2f}%), random {r['random']['mean']:.3f}; roles {r['role_counts']}")
    if "comparison" in res["study"]:
        print(json.dumps(res["study"]["comparison"]["overlap"], indent=1))
    print(f"wrote {out}")
    return 0
