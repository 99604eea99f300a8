"""The knowledge kind's resource plan: what it reads beside the settings (each relation's facts per token length,
what a finished run found) and its stages' costs in the order a run meets them, each counted by its stage's module
(`facts_cost`, `discovery_cost`, `scoring_cost`, `analysis_cost`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ...tasks.relation_data import Fact, Relation, build_facts
from ..planner import StageCost, planning_tokenizer
from .analysis import analysis_cost
from .discovery import discovery_cost
from .facts import FactSet, fact_lengths, facts_cost, plan_graph
from .scoring import scoring_cost
from .settings import KnowledgeSettings


def relation_costs(
    meter: Any, s: KnowledgeSettings, lengths: dict[int, int], known: dict, prefix: str
) -> list[StageCost]:
    """The stages of one relation (its facts ``lengths``): facts, then each model's discovery, scoring and
    analysis. Every fact is assumed right in every model unless ``known["kept"]`` gives the kept facts' lengths;
    ``known["tried"]``: per model, the sizes scoring tried."""
    graph = plan_graph(meter.dims)
    every = FactSet(meter, graph, lengths, s.batch_size)
    kept = FactSet(meter, graph, known.get("kept") or lengths, s.batch_size)
    out = [facts_cost(meter, s, graph, every, f"{prefix}facts")]
    for m in s.models:
        tried = known.get("tried", {}).get(m)
        out += [
            discovery_cost(meter, s, graph, kept, f"{prefix}discovery:{m}"),
            scoring_cost(meter, s, graph, kept, f"{prefix}scoring:{m}", tried),
            analysis_cost(meter, s, graph, kept, f"{prefix}analysis:{m}"),
        ]
    return out


def knowledge_found(run_dir: str | Path, facts: Sequence[Fact]) -> dict:
    """What a plan assumes and a finished relation's stage records (in ``run_dir``) know: the kept facts' token
    lengths (``"kept"``, of the relation's ``facts``) and, per model, the sizes scoring tried (``"tried"``)."""
    out: dict = {"tried": {}}
    for path in sorted((Path(run_dir) / "stages").glob("*.json")):
        rec = json.loads(path.read_text())
        kind, _, model = rec["name"].partition(":")
        if kind == "facts":
            out["kept"] = fact_lengths([facts[i] for i in rec["result"]["kept"]])
        elif kind == "scoring":
            out["tried"][model] = len(rec["result"]["sweep"])
    return out


def plan_facts(s: KnowledgeSettings) -> tuple[dict[str, dict[int, int]], str]:
    """Each relation's facts per token length (`fact_lengths`, after ``max_facts``) under the first model's
    tokenizer, else the stand-in's (`planning_tokenizer`), and which tokenizer counted them."""
    tokenizer, used = planning_tokenizer(s.models[0])
    out = {}
    for relation in tuple(s.relations) or (s.relation,):
        rs = replace(s, relation=relation, template=s.templates.get(relation, s.template))
        rel = Relation.load(relation)
        facts = build_facts(tokenizer, rel.unedited() if rs.unedited else rel, rs.template)
        out[relation] = fact_lengths(facts[: s.max_facts] if s.max_facts else facts)
    return out, used
