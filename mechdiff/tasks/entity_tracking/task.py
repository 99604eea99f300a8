"""Entity tracking as a `Task`: records, discovery pairs, the ablation
reference set, the DCM desiderata and the A-D discovery plan."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from ..base import Batch, Task, answer_batch, step_seed
from .building import Vocabulary, generate
from .pairs import label_value_pairs, object_value_pairs, path_patching_pairs, positional_pairs
from .positions import CLASSES
from .records import DEFAULT_N_BOXES, EntityTrackingExample
from .splits import eval_objects, split_options, train_objects

PLAN = Path(__file__).resolve().parent.parent / "plans" / "entity_tracking.toml"
ReferenceKind = Literal["path_patching", "fresh"]
GROUP_NAMES = {"A": "value fetcher", "B": "position transmitter", "C": "position detector", "D": "structure reader"}


def reference_records(
    tokenizer: Any,
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    kind: ReferenceKind = "path_patching",
    vocabulary: Vocabulary = None,
) -> list[EntityTrackingExample]:
    """Prompts whose mean activations replace ablated heads: one per context, ``n_boxes`` boxes.

    ``path_patching``: the sources of `path_patching_pairs` (disjoint objects, a query
    label absent from the context, as the paper's ablation set); ``fresh``: `generate`.
    """
    if kind == "path_patching":
        return [p.source for p in path_patching_pairs(tokenizer, n, n_boxes=n_boxes, seed=seed, vocabulary=vocabulary)]
    if kind == "fresh":
        return generate(tokenizer, n, n_boxes=n_boxes, seed=seed, vocabulary=vocabulary)
    raise ValueError(f"unknown reference kind {kind!r}; use 'path_patching' or 'fresh'")


def _objects(split: str) -> tuple[str, ...]:
    return train_objects() if split == "train" else eval_objects()


def train_batch(
    tokenizer: Any,
    batch_size: int,
    data_seed: int,
    step: int,
    min_boxes: int = 2,
    max_boxes: int = 7,
    vocabulary: Optional[Sequence[str]] = None,
) -> Batch:
    """Training batch of ``step``: one box count per step (``min_boxes``..``max_boxes``), training objects."""
    seed = step_seed(data_seed, step)
    n_boxes = random.Random(seed).randint(min_boxes, max_boxes)
    objects = _objects("train") if vocabulary is None else vocabulary
    return answer_batch(generate(tokenizer, batch_size, n_boxes=n_boxes, seed=seed, vocabulary=objects))


TASK = Task(
    name="entity-tracking",
    description="Which object is in the queried box? (Prakash et al. 2024)",
    examples=generate,
    pairs=path_patching_pairs,
    reference=lambda tokenizer, n, seed=0, n_boxes=DEFAULT_N_BOXES, vocabulary=None: reference_records(
        tokenizer, n, n_boxes, seed, vocabulary=vocabulary
    ),
    desiderata={"positional": positional_pairs, "object": object_value_pairs, "label": label_value_pairs},
    plan=PLAN,
    metric="prob",
    positions=("last", "query_label", "query_label_context", "objects", "labels", *CLASSES),
    group_names=GROUP_NAMES,
    # counterfactual, clean_seed: the path-patching pairs' only (discovery_pairs), the paper's construction and seeds
    options=("n_boxes", "vocabulary", "letters", "counterfactual", "clean_seed"),
    splits=split_options,
    train_batch=train_batch,
    pool_batch=lambda tokenizer, n, seed: answer_batch(generate(tokenizer, n, 7, seed, _objects("train"))),
    eval_batch=lambda tokenizer, n, seed: answer_batch(generate(tokenizer, n, 7, seed, _objects("eval"))),
    chance=lambda n_boxes=DEFAULT_N_BOXES, **_: 1 / n_boxes,  # one of the n_boxes objects
)
