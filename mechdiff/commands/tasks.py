"""``mechdiff tasks``: the registered tasks, the knowledge relations and the task directories under ``tasks/`` (or
the directories given), each with what a study of it reads: rows, items, templates, token lengths, metric,
positions and DCM desiderata (`mechdiff.tasks.catalog`); loads no tokenizer."""

from __future__ import annotations

import argparse

from ..tasks.catalog import (
    ImportedTaskSummary,
    imported_summary,
    registered_tasks,
    relation_tasks,
    task_directories,
)
from ..tasks.row_checks import per_template
from .models import table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tasks",
        help="list the registered tasks, knowledge relations and imported task directories, with rows, items, "
        "templates, token lengths, metric and desiderata",
    )
    p.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help="task directories, or folders to search for them (default: tasks, under the current directory)",
    )
    p.set_defaults(func=main)


def lengths(values: tuple[int, ...]) -> str:
    """``5-11`` (every length from 5 to 11), else the lengths listed."""
    if len(values) > 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


def describe(s: ImportedTaskSummary) -> str:
    """One imported task, a few lines."""
    unit = f"values of {s.item_field!r}" if s.item_field else "distinct clean prompts"
    templates = ", ".join(f"{t or '(none)'} {n}" for t, n in s.templates.items())
    classes = f"its own: {', '.join(s.classes)}" if s.classes else "derived from the positions"
    desiderata = "; ".join(f"{n} ({where})" for n, where in s.desiderata.items()) or "none"
    return "\n".join(
        [
            f"{s.directory}  (task {s.name}; imported from {s.source or '?'} for {s.model or '?'}; "
            f"--task {s.directory})",
            f"  rows {s.rows} over {s.items} items ({unit}); metric {s.metric}",
            f"  templates (rows): {templates}; prompt lengths {lengths(s.lengths)} tokens",
            f"  positions {', '.join(s.positions)}; classes {classes}",
            f"  DCM desiderata: {desiderata}",
            *[f"  class {c} is empty in some prompts ({per_template(n)})" for c, n in s.empty.items()],
        ]
    )


def main(args: argparse.Namespace) -> int:
    rows = [["NAME", "METRIC", "DCM DESIDERATA", "DESCRIPTION"]]
    rows += [[t.name, t.metric, ", ".join(t.desiderata) or "-", t.description] for t in registered_tasks()]
    print("Registered tasks (prompts generated; --task NAME):")
    print(table(rows))
    rows = [["NAME", "KIND", "FACTS", "TEMPLATES"]]
    rows += [[r.name, r.kind, str(r.facts), str(r.templates)] for r in relation_tasks()]
    print("\nKnowledge relations (--task NAME, or a relation JSON file):")
    print(table(rows))
    roots = args.dirs or ["tasks"]
    found = [d for root in roots for d in task_directories(root)]
    print(f"\nImported tasks (under {', '.join(roots)}; `mechdiff dataset import` writes them):")
    if not found:
        print("  none")
    for d in found:
        print(describe(imported_summary(d)))
    return 0
