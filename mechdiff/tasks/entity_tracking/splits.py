"""Deterministic train/eval split of the entity-tracking object vocabulary.

Objects are sorted alphabetically and every 4th one (indices 3, 7, 11, ...) is held out
for evaluation; the rest are used for fine-tuning (training and validation prompts). So no
object seen during fine-tuning ever appears in an evaluation prompt of a zoo checkpoint.
"""

from __future__ import annotations

from ..base import SPLITS
from .records import Vocabulary
from .vocabulary import load_vocabulary

HOLDOUT_EVERY = 4


def _sorted(vocabulary: Vocabulary = None) -> list[str]:
    return sorted(set(load_vocabulary(vocabulary)))


def eval_objects(vocabulary: Vocabulary = None) -> list[str]:
    """Held-out objects (every 4th of the sorted vocabulary), used by evaluation tables."""
    return [w for i, w in enumerate(_sorted(vocabulary)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]


def train_objects(vocabulary: Vocabulary = None) -> list[str]:
    """Objects used for fine-tuning (training and validation prompts): the complement of `eval_objects`."""
    return [w for i, w in enumerate(_sorted(vocabulary)) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]


def split_objects(split: str, vocabulary: Vocabulary = None) -> list[str]:
    """Objects of ``split``: ``"eval"``, ``"train"`` or ``"all"`` (the whole sorted vocabulary)."""
    if split == "eval":
        return eval_objects(vocabulary)
    if split == "train":
        return train_objects(vocabulary)
    if split == "all":
        return _sorted(vocabulary)
    raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def split_options(split: str) -> dict[str, list[str]]:
    """The generator options of ``split`` (`mechdiff.tasks.base.Task.splits`): its objects as the vocabulary."""
    return {"vocabulary": split_objects(split)}
