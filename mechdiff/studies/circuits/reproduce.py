"""The paper's reproduction table: the released LLaMA-7B circuit scored on each model, beside the
published figures (Prakash et al., ICLR 2024, Table 1: accuracy of the full model and of the
LLaMA-7B circuit with every other head mean-ablated, on LLaMA-7B, Vicuna-7B, Goat-7B, FLoAT-7B).

    mechdiff run tasks/entity_tracking_llama7b.toml

Weights are checked before anything loads (`mechdiff.models.weights.check_weights`): a missing checkpoint is named
with the ways to provide it.
"""

from __future__ import annotations

import json
import logging
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional, Sequence

from ...runs.seeds import prompt_seed
from ...runs.stages import StageRecord

#: The circuits study these functions read (`mechdiff.studies.circuits.study.CircuitsStudy`: its spec, models,
#: tokenizer, cache, digests and run directory); typed loosely so that this module imports no study.
Study = Any

log = logging.getLogger(__name__)

PUBLISHED = "llama-7b-entity-tracking-circuit.json"


def published_figures(path: str | Path = "") -> dict:
    """The paper's reported figures: ``path``, else the copy shipped in ``mechdiff/data/published``."""
    if path:
        return json.loads(Path(path).read_text())
    return json.loads(files("mechdiff").joinpath("data", "published", PUBLISHED).read_text())


# ------------------------------------------------------------------------------------- the table


def reproduction_rows(
    study: Study, circuit_path: str, published: dict, n: int, names: Optional[Sequence[str]] = None
) -> list[dict]:
    """One row per model: full-model and circuit accuracy (95% CIs) and faithfulness, measured here,
    beside the published accuracies (NaN where the paper has no figure for the model)."""
    from ...circuits.circuit import Circuit
    from ...circuits.measures import faithfulness
    from ...circuits.scoring import Scorer
    from ...report.tables import estimate_columns
    from ...tasks.entity_tracking import generate, reference_records

    circuit = Circuit.load(circuit_path)
    reported = published.get("reported", {})
    full_pub, circ_pub = reported.get("accuracy_full", {}), reported.get("accuracy_llama_circuit", {})
    t = study.spec.task
    rows = []
    for name in names if names is not None else study.spec.model_names:
        lm = study.model(name)
        circuit.validate(lm.shape.n_layers, lm.shape.n_heads)
        records = generate(study.tokenizer, n, t.n_boxes, prompt_seed(t.seed, "reproduction"))
        reference = reference_records(study.tokenizer, n, t.n_boxes, prompt_seed(t.seed, "reproduction-reference"))
        scorer = Scorer.build(lm, records, reference, study.spec.eval.batch_size, study.progress, store=study.store)
        res = faithfulness(scorer, circuit)
        row = {"model": name, "n_prompts": res["n_prompts"]}
        row.update(estimate_columns("full_accuracy", res["full"]["accuracy"]))
        row["published_full_accuracy"] = full_pub.get(name, float("nan"))
        row.update(estimate_columns("circuit_accuracy", res["circuit"]["accuracy"]))
        row["published_circuit_accuracy"] = circ_pub.get(name, float("nan"))
        row.update(estimate_columns("faithfulness", res["circuit"]["faithfulness"]))
        pub_full, pub_circ = full_pub.get(name), circ_pub.get(name)
        row["published_faithfulness"] = pub_circ / pub_full if pub_full and pub_circ is not None else float("nan")
        rows.append(row)
    return rows


CAPTION = (
    "The released LLaMA-7B entity-tracking circuit (Prakash et al. 2024, 72 heads in groups A-D) scored "
    "on each model: accuracy of the full model and of the circuit (every other head mean-ablated), "
    "measured here with 95% bootstrap CIs, beside the published figures (Table 1)."
)


def write_reproduction(study: Study, records: list[StageRecord]) -> Path:
    """``reproduction.{md,csv,tex,json}`` from the stage records; prints the table."""
    from ...report.tables import to_markdown, write_table

    published = published_figures(study.spec.reproduce.published)
    rows = [rec.result["row"] for rec in records]
    write_table(rows, study.dir / "reproduction", caption=CAPTION)
    print(to_markdown(rows))
    print(f"\n{CAPTION}\npublished: {published.get('source', '')}")
    return study.dir / "reproduction.md"
