"""DCM desiderata as ``mechdiff dcm --desiderata`` names them: a task's desiderata by name, or ``.jsonl`` files
of entity-tracking counterfactual pairs (what `write_jsonl` wrote), read and checked here, beside
entity tracking's other data code."""

from __future__ import annotations

import os
from pathlib import Path

from ..base import PairRecord
from .export import read_jsonl
from .records import CounterfactualPair


def read_desideratum(path: str | os.PathLike) -> list[CounterfactualPair]:
    """The counterfactual pairs of a user-defined desideratum file (``.jsonl``); raises ``ValueError`` when it
    is empty or holds anything else (``OSError`` when it cannot be read)."""
    records = read_jsonl(path)
    if not records or not all(isinstance(r, CounterfactualPair) for r in records):
        raise ValueError(f"{path} must hold counterfactual pairs (write them with write_jsonl)")
    return records  # type: ignore[return-value]


def load_desiderata(
    spec: str, tokenizer, n: int, n_boxes: int, seed: int, task: str = "entity-tracking"
) -> dict[str, list[PairRecord]]:
    """The desiderata of ``spec`` (comma-separated) by name: the task's desiderata by name generate ``n`` pairs
    each with ``tokenizer`` alone (no weights: a command checks them before any model loads); ``.jsonl`` paths
    are user-defined entity-tracking desiderata (`read_desideratum`), named by file stem."""
    from ..desiderata import desideratum_pairs  # the module imports the task registry: imported when called

    out: dict[str, list[PairRecord]] = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.endswith(".jsonl"):
            out[Path(item).stem] = read_desideratum(item)  # type: ignore[assignment]
        else:
            out[item] = desideratum_pairs(item, tokenizer, n, n_boxes=n_boxes, seed=seed, task=task)
    if not out:
        raise ValueError("no desiderata given; e.g. --desiderata positional,object,label")
    return out
