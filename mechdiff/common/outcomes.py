"""Per-prompt outcomes in one compact format, kept in stage records and committed with a study's results.

One record is ``{"correct": "0110...", "prob": [0.51234, ...]}``: correctness as a string of 0/1, one
character a prompt, and the answer's probability (or another continuous per-prompt value) at 6 significant
digits, in the order of the stage's prompts. A study writes the records of all its stages into
``outcomes.json`` (`FORMAT`, ``{"stages": {stage: {label: record}}}``), so every paired interval the report
states can be recomputed from committed files (`read_outcomes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .io import write_text

FORMAT = "mechdiff-outcomes/1"
OUTCOMES_FILE = "outcomes.json"
DIGITS = 6


def bits(values: Sequence[Any] | np.ndarray) -> str:
    """0/1 outcomes as a string (``"0110"``)."""
    return "".join("1" if bool(v) else "0" for v in np.asarray(values).ravel())


def from_bits(text: str) -> np.ndarray:
    """The 0/1 outcomes of `bits` as a float array."""
    if set(text) - {"0", "1"}:
        raise ValueError("outcomes must be a string of 0 and 1")
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(float) - ord("0")


def rounded(values: Sequence[float] | np.ndarray, digits: int = DIGITS) -> list[float]:
    """Floats at ``digits`` significant digits (what the compact format keeps)."""
    return [float(f"{float(v):.{digits}g}") for v in np.asarray(values, dtype=float).ravel()]


def outcome_record(correct: Sequence[Any] | np.ndarray, prob: Optional[Sequence[float]] = None) -> dict:
    """One compact record: correctness, and the continuous per-prompt value where there is one."""
    out: dict[str, Any] = {"correct": bits(correct)}
    if prob is not None:
        if len(prob) != len(out["correct"]):
            raise ValueError(f"{len(out['correct'])} outcomes but {len(prob)} probabilities")
        out["prob"] = rounded(prob)
    return out


def read_record(record: Mapping[str, Any]) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(correct, prob)`` arrays of a compact record (``prob`` None where it kept none)."""
    prob = record.get("prob")
    return from_bits(record["correct"]), (np.asarray(prob, dtype=float) if prob is not None else None)


def read_first_and_rest(record: Mapping[str, Any]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """The 0/1 ``(first, rest)`` arrays of a record of answers of several tokens (the first answer token the top-1;
    every later one the top-1 given those before it, teacher forced); ``(None, None)`` where the record kept none
    (answers of one token, or a record made before the split was kept)."""
    if "first" not in record or "rest" not in record:
        return None, None
    return from_bits(record["first"]), from_bits(record["rest"])


def write_outcomes(run_dir: str | Path, stages: Mapping[str, Mapping[str, dict]]) -> Path:
    """``outcomes.json`` of a study: every stage's compact records by label, a line a stage (written atomically)."""
    path = Path(run_dir) / OUTCOMES_FILE
    kept = {k: dict(v) for k, v in stages.items() if v}
    lines = [f"  {json.dumps(stage)}: {json.dumps(records, separators=(',', ':'))}" for stage, records in kept.items()]
    body = ",\n".join(lines)
    return write_text(path, f'{{"format": {json.dumps(FORMAT)}, "stages": {{\n{body}\n}}}}\n')


def read_outcomes(run_dir: str | Path) -> dict[str, dict[str, dict]]:
    """The stages of a study's ``outcomes.json`` (checked format)."""
    path = Path(run_dir) / OUTCOMES_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
    return data["stages"]
