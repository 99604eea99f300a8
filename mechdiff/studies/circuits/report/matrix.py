"""The circuits report's circuit x model section: the matrix (over items where rows share one), by answer length,
and completeness."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....report.rows import (
    circuit_x_model_rows,
    completeness_rows,
)
from ....report.tables import estimate_columns
from .kit import Study, _fresh, shared_items, study_table


def _normalised_over_items(row: dict, kept: dict, items: np.ndarray) -> dict:
    """A matrix row's normalised faithfulness, (m(C) - m(empty)) / (m(M) - m(empty)) (`normalised_figures`), for
    accuracy and the task's metric, with its interval over ``items`` from the per-prompt outcomes (``kept``: the
    ``full``, ``circuit`` and ``empty`` records); a figure the stage left undefined (NaN) stays so."""
    from ....common.inference import ratio
    from ....common.outcomes import from_bits

    if "empty" not in kept:
        return {}
    out = {}
    for key in (k for k in row if k.startswith("faithfulness_normalised") and not k.endswith(("_low", "_high"))):
        metric = key.removeprefix("faithfulness_normalised").lstrip("_") or "correct"
        per = []
        for part in ("circuit", "full", "empty"):
            rec = kept[part]
            value = rec.get(metric) if metric != "correct" else rec.get("correct")
            if value is None:
                break
            per.append(from_bits(value) if isinstance(value, str) else np.asarray(value, dtype=float))
        if len(per) == 3 and not np.isnan(row[key]) and per[0].size == items.size:
            c, f, e = per
            out.update(estimate_columns(key, ratio(c - e, f - e, items)))
    return out


def _matrix_over_items(study: "Study", matrix: dict) -> Optional[list[dict]]:
    """The circuit x model rows with the model's and each circuit's accuracy and faithfulness intervals over items,
    from the stage's per-prompt outcomes, where the matrix prompts' rows share items (None otherwise: the stage's
    own intervals, one row an item). The random draws' figures stay as the stage made them."""
    from ....common.inference import proportion, ratio
    from ....common.outcomes import read_record

    out = []
    for rec in matrix.values():
        kept = rec.result.get("outcomes") or {}
        for r in rec.result["rows"]:
            o = kept.get(r["circuit"])
            if o is None:
                return None
            full, circ = read_record(o["full"])[0], read_record(o["circuit"])[0]
            items = shared_items(study, "matrix", full.size)
            if items is None:
                return None
            out.append(
                {
                    **r,
                    **estimate_columns("full_accuracy", proportion(full, items)),
                    **estimate_columns("accuracy", proportion(circ, items)),
                    **estimate_columns("faithfulness", ratio(circ, full, items)),
                    **_normalised_over_items(r, o, items),
                    "items": len(set(items.tolist())),
                }
            )
    return out or None


def matrix_section(study: "Study", matrix: dict) -> tuple[str, list[dict]]:
    clustered = _matrix_over_items(study, matrix)
    rows = clustered or [r for rec in matrix.values() for r in rec.result["rows"]]
    s = study.spec.scoring
    how = (
        "intervals over items, since rows of one item share a clean prompt: accuracy by the cluster bootstrap over "
        "items hulled with the exact interval of as many items, faithfulness F(C)/F(M) by the cluster bootstrap"
        if clustered
        else "exact binomial CI), faithfulness F(C)/F(M) (bootstrap CI"
    )
    text = study_table(
        study,
        circuit_x_model_rows(rows),
        "circuit_x_model",
        f"Circuit x model on {s.n} {_fresh(study, 'matrix')} per model: accuracy with every other (head, "
        f"position) mean-ablated ({how}), and "
        f"{s.random_draws} random circuits drawn layer- and position-matched to each model's own circuit, each on "
        f"{s.random_prompts or s.n} of the prompts (their mean, its interval resampling draws and prompts; the range "
        "of the draws' accuracies; the circuit's rank among the draws, draws at least as accurate, its p = (1 + "
        "rank) / (1 + draws) and the draws' 5th, 50th and 95th accuracy percentiles, on those prompts)",
    )
    text += _matrix_by_answer_length(study, matrix)
    comp_rows = completeness_rows({name: rec.result.get("completeness") for name, rec in matrix.items()})
    if comp_rows:
        text += "\n" + study_table(
            study,
            comp_rows,
            "completeness",
            "Completeness |F(C\\K) - F(M\\K)| of each model's own circuit (accuracy): random K "
            f"({s.completeness_draws} draws, each pair in K with probability 0.5) and K = one group",
        )
    return text, rows


def _matrix_by_answer_length(study: "Study", matrix: dict) -> str:
    """Each circuit's accuracy and faithfulness (accuracy) per answer length on each model's matrix prompts, from the
    stage's per-prompt outcomes; empty where every answer has one length."""
    from ....common.inference import proportion, ratio
    from ....common.outcomes import read_first_and_rest, read_record
    from ....patching.evaluate import LENGTH_BINS, length_bins

    if study.task.answer_tokens < 2:
        return ""
    lengths = length_bins(study.prompt_records("matrix", study.spec.scoring.n))
    if len(set(lengths)) < 2:
        return ""
    items = np.asarray(study.set_items("matrix"))[: len(lengths)]
    rows = []
    for name, rec in matrix.items():
        for circuit, kept in (rec.result.get("outcomes") or {}).items():
            full, circ = read_record(kept["full"])[0], read_record(kept["circuit"])[0]
            split = dict(zip(("full", "circuit"), map(read_first_and_rest, (kept["full"], kept["circuit"]))))
            for b in (b for b in LENGTH_BINS if (lengths == b).any()):
                at = lengths == b
                rows.append(
                    {
                        "model": name,
                        "circuit": circuit,
                        "answer_tokens": b,
                        "n": int(at.sum()),
                        "items": len(set(items[at].tolist())),
                        **estimate_columns("model_accuracy", proportion(full[at], items[at])),
                        **estimate_columns("accuracy", proportion(circ[at], items[at])),
                        **estimate_columns("faithfulness", ratio(circ[at], full[at], items[at])),
                        **_first_and_rest_columns(split, at, items, b == LENGTH_BINS[0]),
                    }
                )
    if not rows:
        return ""
    return "\n" + study_table(
        study,
        rows,
        "circuit_x_model_by_answer_length",
        "Circuit x model by the answer's length in tokens on the same prompts (rows and items): the model's and the "
        "circuit's accuracy and faithfulness F(C)/F(M), each with its interval over items (exact where an item has one "
        "row, else a cluster bootstrap); where the stage kept them, the same by first "
        "token against the rest (`first_token`: the first answer token the top-1 after the prompt; `rest`: every "
        "later token the top-1 given the answer's tokens before it, teacher forced). The circuits cover the "
        "prompt's positions only, an answer's later tokens reached through what they write there",
    )


def _first_and_rest_columns(split: dict, at: np.ndarray, items: np.ndarray, one_token: bool) -> dict:
    """The model's and the circuit's first-token accuracy and their ratio on the prompts ``at``, and (answers of
    several tokens) the same of the rest; empty where the records kept no split (``split``: ``full`` and
    ``circuit`` -> ``(first, rest)`` or ``(None, None)``)."""
    from ....common.inference import proportion, ratio

    (full_first, full_rest), (circ_first, circ_rest) = split["full"], split["circuit"]
    if full_first is None or circ_first is None:
        return {}
    parts = [("first_token", full_first, circ_first)] + ([] if one_token else [("rest", full_rest, circ_rest)])
    out: dict = {}
    for part, model, circuit in parts:
        out.update(estimate_columns(f"model_accuracy_{part}", proportion(model[at], items[at])))
        out.update(estimate_columns(f"accuracy_{part}", proportion(circuit[at], items[at])))
        out.update(estimate_columns(f"faithfulness_{part}", ratio(circuit[at], model[at], items[at])))
    return out
