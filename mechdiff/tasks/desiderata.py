"""DCM desiderata by name: the aliases a study file may use and the pairs a task generates for one.

A desideratum is a task's own set of counterfactual pairs (`desideratum`);
this module is the one place that reads a name a user wrote (``object_value``) as the task's (``object``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .base import PairRecord, Task, get_task

#: Other spellings of entity tracking's desiderata (the paper's names) -> the task's own names.
DESIDERATUM_ALIASES = {"object_value": "object", "label_value": "label", "position": "positional"}


def desideratum_name(name: str) -> str:
    """The task's own name of desideratum ``name`` (an alias resolved; any other name unchanged)."""
    return DESIDERATUM_ALIASES.get(name, name)


def chosen_desiderata(named: Sequence[str], own: Sequence[str]) -> list[str]:
    """The desiderata a study trains: those of ``named`` the task declares (``own``; an alias counts as its task's
    name), else every one the task declares."""
    return [d for d in named if d in own or desideratum_name(d) in own] or list(own)


def desideratum_pairs(
    name: str,
    tokenizer,
    n: int,
    n_boxes: Optional[int] = None,
    seed: int = 0,
    vocabulary: Optional[Sequence[str]] = None,
    task: str | Task = "entity-tracking",
    prompt_set: Optional[str] = None,
) -> list[PairRecord]:
    """Pairs of a desideratum the task (a name or a `Task`) defines (entity
    tracking: ``positional``, ``object``, ``label``); ``n_boxes``, ``vocabulary`` and ``prompt_set`` (a drawn
    set's name) go to tasks that take them (``None``: the task's own default)."""
    t = task if isinstance(task, Task) else get_task(task)
    key = desideratum_name(name)
    if key not in t.desiderata:
        raise ValueError(
            f"unknown desideratum {name!r}; task {t.name} defines {sorted(t.desiderata) or 'none'} "
            "(or pass your own list of counterfactual pairs)"
        )
    return t.desideratum(key, tokenizer, n, seed=seed, n_boxes=n_boxes, vocabulary=vocabulary, prompt_set=prompt_set)
