"""Entity-tracking records: one prompt (`EntityTrackingExample`), a counterfactual pair
(`CounterfactualPair`) and the constants they share. Both implement the task protocol
(`mechdiff.tasks.base`): ``input_ids``, ``answer_id``, named ``positions``; pairs ``base``,
``source``, ``target_id``."""

from __future__ import annotations

import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from ..base import check_pair

MIN_BOXES = 2
MAX_BOXES = 10
DEFAULT_N_BOXES = 7
DEFAULT_VOCABULARY_PATH = Path(__file__).resolve().parent.parent.parent / "data" / "entity_tracking" / "objects.txt"
ALL_LETTERS: tuple[str, ...] = tuple(string.ascii_uppercase)

#: The counterfactual kinds, in the order they are documented.
PAIR_KINDS: tuple[str, ...] = ("path_patching", "positional", "object_value", "label_value")

#: Position names that hold one token index per example (``batch_tensors`` turns each into a
#: ``[batch]`` LongTensor); ``objects``/``labels`` hold one index per segment.
SCALAR_POSITIONS: tuple[str, ...] = ("last", "query_label", "query_label_context")

Vocabulary = Union[Sequence[str], str, os.PathLike, None]


# --------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntityTrackingExample:
    """One prompt.

    ``positions`` maps ``"last"``, ``"query_label"`` (the label in the final "Box Lq contains
    the"), ``"query_label_context"`` (the label's occurrence in the context, ``None`` when the
    query label is absent from the context, as in a path-patching source) to token indices,
    and ``"objects"`` / ``"labels"`` to a tuple of token indices, one per segment. Indices
    index ``input_ids``, which are exactly ``tokenizer(prompt)["input_ids"]`` (special
    tokens included).

    ``query_label`` is the letter in the final clause; for ordinary examples it equals
    ``labels[query_index]``. ``answer`` is always ``" " + objects[query_index]``.
    """

    prompt: str
    answer: str
    answer_id: int
    objects: tuple[str, ...]
    labels: tuple[str, ...]
    query_index: int
    query_label: str
    input_ids: tuple[int, ...]
    positions: dict[str, Any] = field(compare=True)

    @staticmethod
    def position_masks(records: Sequence["EntityTrackingExample"], n_pos: int) -> dict[str, Any]:
        """The prompts' position classes as boolean ``"batch pos"`` masks (see `.positions`)."""
        from .positions import position_classes

        return position_classes(records, n_pos)

    def __hash__(self) -> int:  # positions is a dict: hash a canonical tuple instead
        return hash((self.prompt, self.answer_id, self.input_ids, self.query_index, self.query_label))

    @property
    def n_boxes(self) -> int:
        """Number of boxes (segments) in the prompt."""
        return len(self.objects)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "answer_id": self.answer_id,
            "objects": list(self.objects),
            "labels": list(self.labels),
            "query_index": self.query_index,
            "query_label": self.query_label,
            "input_ids": list(self.input_ids),
            "positions": {
                "last": self.positions["last"],
                "query_label": self.positions["query_label"],
                "query_label_context": self.positions["query_label_context"],
                "objects": list(self.positions["objects"]),
                "labels": list(self.positions["labels"]),
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EntityTrackingExample":
        """Inverse of `to_dict`."""
        p = d["positions"]
        return cls(
            prompt=d["prompt"],
            answer=d["answer"],
            answer_id=int(d["answer_id"]),
            objects=tuple(d["objects"]),
            labels=tuple(d["labels"]),
            query_index=int(d["query_index"]),
            query_label=d["query_label"],
            input_ids=tuple(int(i) for i in d["input_ids"]),
            positions={
                "last": int(p["last"]),
                "query_label": int(p["query_label"]),
                "query_label_context": None if p["query_label_context"] is None else int(p["query_label_context"]),
                "objects": tuple(int(i) for i in p["objects"]),
                "labels": tuple(int(i) for i in p["labels"]),
            },
        )


@dataclass(frozen=True)
class CounterfactualPair:
    """A base run, a source (counterfactual) run and the answer the patched base run should
    give (``target`` with leading space, ``target_id`` its token id). ``kind`` is one of
    `PAIR_KINDS`."""

    base: EntityTrackingExample
    source: EntityTrackingExample
    target: str
    target_id: int
    kind: str

    def __post_init__(self) -> None:
        check_pair(self.base, self.source)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "base": self.base.to_dict(),
            "source": self.source.to_dict(),
            "target": self.target,
            "target_id": self.target_id,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CounterfactualPair":
        """Inverse of `to_dict`."""
        return cls(
            base=EntityTrackingExample.from_dict(d["base"]),
            source=EntityTrackingExample.from_dict(d["source"]),
            target=d["target"],
            target_id=int(d["target_id"]),
            kind=d["kind"],
        )


Record = Union[EntityTrackingExample, CounterfactualPair]
