"""What tasks there are: the registered ones (prompts generated), the knowledge relations, and the task directories
``mechdiff dataset import`` wrote (rows, items, templates, token lengths, metric, positions, DCM desiderata), read
from their files, no tokenizer loaded (``mechdiff tasks``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import TASKS, get_task
from .jsonl import TASK_FILE
from .relation_data import Relation, available_relations
from .row_checks import empty_classes
from .task_directory import read_task_directory


@dataclass(frozen=True)
class RegisteredTask:
    """A registered task: its prompts are generated (entity tracking's by seed and options)."""

    name: str
    metric: str
    positions: tuple[str, ...]
    desiderata: tuple[str, ...]
    description: str


@dataclass(frozen=True)
class RelationTask:
    """A knowledge relation (``mechdiff/data/knowledge``): its facts and the templates that phrase them."""

    name: str
    kind: str
    facts: int
    templates: int


@dataclass(frozen=True)
class ImportedTaskSummary:
    """A task directory: its rows, items, rows per template, prompt lengths in tokens, metric, named positions, own
    classes and DCM desiderata (name -> where its targets come from and how many rows move), from ``task.json``
    and its rows."""

    directory: Path
    name: str
    source: str
    model: str
    rows: int
    items: int
    item_field: Optional[str]
    templates: dict[str, int]
    lengths: tuple[int, ...]
    metric: str
    positions: tuple[str, ...]
    classes: tuple[str, ...]
    desiderata: dict[str, str]
    #: Each class empty in some clean prompt: template -> (prompts where it is empty, prompts of the template).
    empty: dict[str, dict[str, tuple[int, int]]]


def registered_tasks() -> list[RegisteredTask]:
    """Every registered task (`TASKS`), in registry order."""
    out = []
    for name in TASKS:
        task = get_task(name)
        out.append(RegisteredTask(name, task.metric, task.positions, tuple(task.desiderata), task.description))
    return out


def relation_tasks() -> list[RelationTask]:
    """Every knowledge relation shipped with mechdiff, each a task by its name."""
    out = []
    for name in available_relations():
        r = Relation.load(name)
        out.append(RelationTask(name, r.relation_type, len(r.samples), len(r.prompt_templates)))
    return out


def task_directories(root: str | Path) -> list[Path]:
    """The task directories under ``root`` (each holding `TASK_FILE`), sorted; ``root``
    itself where it is one."""
    root = Path(root)
    if (root / TASK_FILE).is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.rglob(TASK_FILE) if not any(part.startswith(".") for part in p.parts))


def imported_summary(directory: str | Path) -> ImportedTaskSummary:
    """What a task directory holds (its rows read back, checked as a study reads them)."""
    task = read_task_directory(directory)
    meta = task.meta
    desiderata = {name: f"{d['target']}, {d['moved']} rows move" for name, d in (meta.get("desiderata") or {}).items()}
    return ImportedTaskSummary(
        Path(directory),
        meta["name"],
        meta.get("source", ""),
        meta.get("model", ""),
        len(task.pairs),
        len(set(task.item_keys)),
        meta.get("item"),
        dict(sorted(Counter(p.base.template for p in task.pairs).items())),
        tuple(sorted({len(p.base.input_ids) for p in task.pairs})),
        meta["metric"],
        tuple(meta["positions"]),
        tuple(meta.get("classes") or ()),
        desiderata,
        empty_classes([p.base for p in task.pairs]),
    )
