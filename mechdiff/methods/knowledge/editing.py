"""The circuit of the same prompts before and after an edit (Yao et al.'s editing analysis).

Two single-model knowledge studies (``mechdiff knowledge``) found circuits for the same prompts: ``before`` on
the unedited model with the original objects, ``after`` on the edited model with the new ones (an edit file,
`mechdiff.tasks.relation_data`). `compare_edit` reads both, checks that their discovery ran on the same
prompts, and measures:

- **overlap** of edges, nodes and heads, each with the hypergeometric p (random sets of the same sizes share
  at least as many) and the central 95% range of the intersection under that null;
- **what moved**: edges and heads only before / only after, by receiver kind and layer;
- **what the heads carry** (logit lens): for every head in either circuit, the rank of the new and of the
  original object in its output at the last token, in both models (median over the edited prompts);
- **each circuit in each model** (zero ablation, the paper's): the rank of the model's own object (original
  before the edit, new after it) on each prompt, with only the circuit's edges.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.stats import hypergeom

from ...circuits.overlap import hypergeom_p
from ...models.loading import LoadedModel
from ...tasks.relation_data import Fact, batches
from .analysis import logit_lens
from .evaluate import evaluate
from .forward import Ablation
from .graph import EdgeCircuit, Graph


def study_facts(result: dict) -> list[str]:
    """The prompts a study's circuit was found on (ACDC's facts when ACDC ran, else every fact)."""
    acdc = result.get("acdc")
    return list(acdc["facts"]) if acdc else [f["prompt"] for f in result["facts"]]


def load_study(path: Path) -> tuple[dict, EdgeCircuit]:
    """``results.json`` and the circuit of a single-model study directory (an error naming what is missing)."""
    for name in ("results.json", "circuit.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{path / name} is missing: give the directory of a single-model "
                "`mechdiff knowledge` study (it holds results.json and circuit.json)"
            )
    return json.loads((path / "results.json").read_text()), EdgeCircuit.load(path / "circuit.json")


def overlap_row(what: str, first: set, second: set, total: int) -> dict:
    """Sizes, intersection, Jaccard, hypergeometric p and the null's central 95% range of the intersection."""
    inter = len(first & second)
    null = hypergeom(M=total, n=len(first), N=len(second))
    return {
        "what": what,
        "before": len(first),
        "after": len(second),
        "intersection": inter,
        "jaccard": inter / len(first | second) if first | second else float("nan"),
        "null_95": f"[{int(null.ppf(0.025))}, {int(null.ppf(0.975))}]",
        "p_value": hypergeom_p(inter, total, len(first), len(second)),
    }


def _kind(edge: str) -> str:
    """``Q``/``K``/``V`` (attention input), ``MLP`` or ``LOGITS``: what an edge feeds."""
    receiver = edge.partition("->")[2]
    if receiver == "LOGITS" or receiver.startswith("MLP"):
        return "LOGITS" if receiver == "LOGITS" else "MLP"
    return receiver.partition(".")[2].upper()


def moved(graph: Graph, before: EdgeCircuit, after: EdgeCircuit) -> list[dict]:
    """Edges only before / only after / in both, counted by what they feed."""
    eb, ea = set(before.edges), set(after.edges)
    rows = []
    for what, edges in (("only before", eb - ea), ("only after", ea - eb), ("both", ea & eb)):
        kinds = Counter(_kind(e) for e in edges)
        rows.append({"edges": what, "n": len(edges), **{k: kinds.get(k, 0) for k in ("Q", "K", "V", "MLP", "LOGITS")}})
    return rows


def head_lens(
    models: dict[str, LoadedModel], graph: Graph, answers: dict[str, Sequence[Fact]], heads: Sequence[str]
) -> list[dict]:
    """Median rank (0 = top) of each object in each head's output at the last token, in each model."""
    out = {h: {"head": h} for h in heads}
    for mname, model in models.items():
        for aname, facts in answers.items():
            nodes = logit_lens(model, graph, batches(list(facts), len(facts)), list(heads))["nodes"]
            for h in heads:
                out[h][f"{mname}: {aname}"] = float(np.median(nodes[h]))
    return list(out.values())


def cross_ranks(
    models: dict[str, LoadedModel], circuits: dict[str, EdgeCircuit], answers: dict[str, Sequence[Fact]]
) -> list[dict]:
    """Per circuit and model: the rank of that model's object (``answers[model]``) on each prompt, zero ablation."""
    rows = []
    for cname, circuit in circuits.items():
        for mname, model in models.items():
            facts = list(answers[mname])
            ev = evaluate(model, circuit.graph, batches(facts, len(facts)), circuit.mask(), Ablation("zero"))
            rows.append(
                {
                    "circuit": cname,
                    "model": mname,
                    "object": "original" if mname == "before" else "new",
                    "ranks": " ".join(str(int(r)) for r in ev.rank),
                    "hits@10": int(ev.hit.sum()),
                    "prompts": len(facts),
                }
            )
    return rows


def compare_edit(
    before_dir: Path, after_dir: Path, models: dict[str, LoadedModel], original: Sequence[Fact], edited: Sequence[Fact]
) -> dict:
    """Overlap, moved edges and the heads' logit lens of the circuits in ``before_dir`` and ``after_dir``.

    ``models``: ``{"before": unedited model, "after": edited model}``; ``original`` / ``edited``: the edit's
    prompts with their original / new objects (the prompts both studies' discovery ran on)."""
    (rb, cb), (ra, ca) = load_study(Path(before_dir)), load_study(Path(after_dir))
    prompts = {f.prompt for f in edited}
    for name, r in (("before", rb), ("after", ra)):
        if set(study_facts(r)) != prompts:
            raise ValueError(
                f"the {name} study ({before_dir if name == 'before' else after_dir}) found its circuit on "
                f"{sorted(study_facts(r))}, not on the edit's prompts {sorted(prompts)}; run it with "
                "--relation <edit file> (and --unedited for the model before the edit)"
            )
    g = cb.graph
    nb, na = {n for n in cb.nodes() if n != "LOGITS"}, {n for n in ca.nodes() if n != "LOGITS"}
    hb, ha = set(cb.heads()), set(ca.heads())
    overlap = [
        overlap_row("edges", set(cb.edges), set(ca.edges), g.n_edges),
        overlap_row("nodes", nb, na, g.n_senders),
        overlap_row("heads", hb, ha, g.n_layers * g.n_heads),
    ]
    heads = sorted(hb | ha, key=g.senders.index)  # layer order
    lens = head_lens(models, g, {"new": edited, "original": original}, heads)
    for row in lens:
        row["in"] = "both" if row["head"] in hb & ha else ("before" if row["head"] in hb else "after")
        row["role before"] = rb["roles"].get(row["head"], {}).get("role", "")
        row["role after"] = ra["roles"].get(row["head"], {}).get("role", "")
    cross = (
        cross_ranks(models, {"before": cb, "after": ca}, {"before": original, "after": edited})
        if rb["settings"]["ablation"] == ra["settings"]["ablation"] == "zero"
        else None
    )
    return {
        "models": {k: m.name for k, m in models.items()},
        "prompts": sorted(prompts),
        "overlap": overlap,
        "moved": moved(g, cb, ca),
        "heads": lens,
        "cross": cross,
        "hit": {"before": rb["circuit"], "after": ra["circuit"], "full_before": rb["full"], "full_after": ra["full"]},
    }
