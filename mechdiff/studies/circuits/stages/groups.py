"""The groups of a circuit that DCM, CMAP and completeness look at, read from the circuit and a few of the task's
prompts (`group_choice`), and the position classes of several tokens a DCM or CMAP stage's key names
(`class_groups`). Shared by the matrix, DCM and CMAP stages and by the trajectory study."""

from __future__ import annotations

from typing import Any, Optional

from ....circuits.circuit import Circuit


def analysis_groups(task: Any, records: list, circuit: Circuit, wanted: list[str]) -> list[str]:
    """The groups DCM and CMAP look at (`group_choice`)."""
    return group_choice(task, records, circuit, wanted)[0]


def group_choice(
    task: Any, records: list, circuit: Circuit, wanted: list[str], check: bool = True
) -> tuple[list[str], dict[str, str]]:
    """``wanted`` where given (those of the circuit that have heads), else (or where ``wanted`` names none of the
    task's positions: another task's defaults) every non-empty group of ``circuit``; with ``check`` (DCM and
    CMAP) those whose position the prompts of ``records`` carry (a few of the task's prompts), as a named token
    of every prompt or as a position class of any number of tokens (DCM and CMAP patch each of them), and each
    group left out, with why (the report says it)."""
    if wanted and set(wanted) & {*task.positions, *circuit.groups}:
        groups = [g for g in wanted if circuit.groups.get(g)]
    else:
        groups = [g for g, heads in circuit.groups.items() if heads]
    if not check:
        return groups, {}
    from ....tasks.base import batch_tensors, grouped_batches, take

    batches = [batch_tensors(take(records, rows)) for rows in grouped_batches(records, 4)]
    left_out = {g: why for g in groups if (why := _position_missing(batches, circuit.positions[g]))}
    return [g for g in groups if g not in left_out], left_out


def class_groups(records: list, wanted: list[str], at: Optional[dict[str, str]] = None) -> dict[str, list[str]]:
    """Key inputs naming the positions a DCM or CMAP stage may patch that are classes of several tokens in the
    prompts of ``records`` (``wanted`` where it names their positions, each group read at ``at``'s position where
    given; else every position of the prompts): DCM and CMAP patch every token of them since #40's item 5 (earlier
    such groups were left out). Empty where every such position is one named token, so the keys of studies
    without class groups stay what they were. Read from the prompts, not a circuit, so that a plan knows the key
    before the circuit is computed."""
    from ....circuits.scoring import is_one_token
    from ....tasks.base import batch_tensors, grouped_batches, take

    at = at or {}
    batches = [batch_tensors(take(records, rows)) for rows in grouped_batches(records, 4)]
    named = {n for b in batches for n in (*b["positions"], *b.get("position_classes", {}))}
    names = [at.get(g, g) for g in wanted if at.get(g, g) in named] or sorted(named)

    def wide(name: str, b: dict) -> bool:  # as the engine reads a position: a named token first (is_one_token)
        return not is_one_token(b, name) if name in b["positions"] else name in b.get("position_classes", {})

    found = [g for g in names if any(wide(g, b) for b in batches)]
    return {"class_groups": found} if found else {}


def _position_missing(batches: list[dict], name: str) -> str:
    """Why DCM and CMAP cannot patch position ``name`` in the prompts of ``batches`` ("" where they can): it is
    neither a named position nor a position class of them, or a named token absent from some prompt."""
    for batch in batches:
        where = batch["positions"].get(name)
        if where is None and name not in batch.get("position_classes", {}):
            return f"its position `{name}` is neither a named position nor a position class of the task's prompts"
        if where is not None and where.dim() == 1 and bool((where < 0).any()):
            return f"its position `{name}` is missing from some prompts"
    return ""
