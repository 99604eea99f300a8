"""Fact editing: a LoRA that rewrites a handful of facts of one relation (Yao et al.'s editing analysis).

The edit is an edit file (`mechdiff.tasks.relation_data`): the edited subjects with their new objects, and
``"edits_of"``, the relation they rewrite. A training batch mixes edited facts (new objects) with the
relation's other facts (their own objects, so that the edit stays local), in every template of the relation,
all of one token length (no padding). Validation: the edited facts with their new objects
(``edit_accuracy``) and the other facts with theirs (``retain_accuracy``), both in template 0.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from .base import Batch, Example, Task, answer_batch, step_seed
from .relation_data import Fact, Relation, build_facts

EDIT = "edits/capital_swap"  # the edit the committed smollm2-capital-edit learned


def _example(fact: Fact) -> Example:
    return Example(
        fact.prompt,
        tuple(fact.ids),
        fact.object,
        fact.answer_id,
        {"subject_last": fact.last_subject, "last": len(fact.ids) - 1},
    )


@lru_cache(maxsize=8)
def _split(tokenizer: Any, edit: str, template: int) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(edited facts with new objects, the relation's other facts with their own) in one template."""
    rel = Relation.load(edit)
    if rel.edits_of is None:
        raise ValueError(f'{edit!r} is not an edit file: it needs "edits_of", the relation it rewrites')
    subjects = {s["subject"] for s in rel.samples}
    others = Relation.load(rel.edits_of)
    others.samples = [s for s in others.samples if s["subject"] not in subjects]
    return (
        tuple(_example(f) for f in build_facts(tokenizer, rel, template)),
        tuple(_example(f) for f in build_facts(tokenizer, others, template)),
    )


def _templates(edit: str) -> int:
    return len(Relation.load(edit).prompt_templates)


def train_batch(tokenizer: Any, batch_size: int, data_seed: int, step: int, edit: str = EDIT, **_: Any) -> Batch:
    """Step ``step``'s batch: one template and one token length drawn by the step's seed, half edited facts and
    half retained ones of that length (drawn with replacement)."""
    rng = random.Random(step_seed(data_seed, step))
    edited, kept = _split(tokenizer, edit, rng.randrange(_templates(edit)))
    length = rng.choice(sorted({len(e.input_ids) for e in edited}))
    edited = [e for e in edited if len(e.input_ids) == length]
    kept = [e for e in kept if len(e.input_ids) == length]
    n_edit = batch_size // 2 if kept else batch_size
    return answer_batch(
        [rng.choice(edited) for _ in range(n_edit)] + [rng.choice(kept) for _ in range(batch_size - n_edit)]
    )


def validation(tokenizer: Any, edit: str = EDIT) -> dict[str, list[Batch]]:
    """``edit_accuracy`` and ``retain_accuracy`` batches (template 0, one batch per token length)."""
    out = {}
    for name, examples in zip(("edit_accuracy", "retain_accuracy"), _split(tokenizer, edit, 0)):
        lengths = sorted({len(e.input_ids) for e in examples})
        out[name] = [answer_batch([e for e in examples if len(e.input_ids) == n]) for n in lengths]
    return out


def examples(tokenizer: Any, n: int, seed: int = 0, edit: str = EDIT) -> list[Example]:
    """The edited facts (new objects) in every template, then as many retained facts as ``n`` allows."""
    edited = [e for t in range(_templates(edit)) for e in _split(tokenizer, edit, t)[0]]
    kept = list(_split(tokenizer, edit, 0)[1])
    random.Random(seed).shuffle(kept)
    return (edited + kept)[:n]


TASK = Task(
    name="fact-edit",
    description="rewrite a few facts of a relation (knowledge circuits' editing analysis)",
    examples=examples,
    positions=("subject_last", "last"),
    options=("edit",),
    train_batch=train_batch,
)
