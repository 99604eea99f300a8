"""``tables/heads.json``: every score a study's circuit stage has for each (head, position class) pair, so a
committed run (whose stage records are not committed) keeps them for ``report.html``."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from ..circuits.circuit import Circuit
from .tables import write_table

#: The stem of the per-pair table under ``tables/``; runs written before it existed lack it.
HEADS_TABLE = "heads"


def _pairs(circuit: Circuit) -> set[str]:
    return {f"{h.name}@{circuit.positions[g]}" for g, hs in circuit.groups.items() for h in hs}


def head_rows(found: Mapping[str, dict], pruned: Optional[Mapping[str, dict]] = None) -> list[dict]:
    """One row per (model, head, position class) pair the circuit stage scored or selected.

    ``found``: each model's circuit stage result; ``pruned``: each model's pruning stage result. Curve method:
    ``attribution`` and ``rank`` for the pairs the stage kept in its ranking (the top two circuit sizes),
    ``selection_frequency`` over the bootstrap resamples (0 where never selected). Path method: the path-patching
    score of each head at its step's sender position."""
    rows = []
    for model, result in found.items():
        circuit = Circuit.from_dict(result["circuit"])
        members = _pairs(circuit)
        kept = _pairs(Circuit.from_dict(pruned[model]["circuit"])) if pruned and model in pruned else None
        info: dict[str, dict] = {}
        for rank, (pair, score) in enumerate(result.get("ranking", []), 1):
            info.setdefault(pair, {})["attribution"], info[pair]["rank"] = score, rank
        stability = result.get("stability", {})
        for part in ("selected", "others"):
            for pair, freq in stability.get(part, {}).items():
                info.setdefault(pair, {})["selection_frequency"] = freq
        for step, scores in result.get("exact", {}).items():
            for head, score in scores.items():
                info.setdefault(f"{head}@{circuit.positions.get(step, step)}", {})["path_patching"] = score
        for pair in members:
            info.setdefault(pair, {})
        for pair in sorted(info, key=lambda p: (info[p].get("rank", 1 << 30), p)):
            head, position = pair.split("@", 1)
            row = {"model": model, "head": head, "position": position, "in_circuit": pair in members}
            if kept is not None:
                row["kept_after_pruning"] = pair in kept
            if stability:
                row["selection_frequency"] = info[pair].get("selection_frequency", 0.0)
            rows.append({**row, **{k: v for k, v in info[pair].items() if k != "selection_frequency"}})
    return rows


def write_heads_table(rows: list[dict], tables_dir: Path) -> dict[str, Path]:
    """``heads.json`` and ``heads.csv`` (thousands of rows: no Markdown or LaTeX)."""
    return write_table(rows, tables_dir / HEADS_TABLE, formats=("json", "csv"))
