"""Position classes of entity-tracking prompts, for scans of where a model computes the task.

Every token of a prompt falls in exactly one class (boolean masks ``"batch pos"``). The queried
segment (the one whose label the final clause asks for) is split from the other segments, so a scan
can tell "the model reads the queried box" from "the model reads every box"::

    The plane is in Box Z, the rose is in Box J, ... the radio is in Box Q. Box Z contains the
    |   |     |        |  |         |      |        |              |     | |   |  |       |
    first  query_object  query_label_context  ... objects_other  ...  query_box ... last
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

CLASSES: tuple[str, ...] = (
    "first",  # the first token
    "query_object",  # the object of the queried segment
    "query_label_context",  # the queried label where the context binds it
    "query_segment_words",  # "is in Box" of the queried segment
    "query_segment_after",  # the tokens after the queried label up to the next object (", the" or ".")
    "objects_other",  # the objects of the other segments
    "labels_other",  # the labels of the other segments
    "words_other",  # "is in Box" of the other segments
    "separators_other",  # ", the" between the other segments
    "query_box",  # " Box" of the final clause
    "query_label",  # the queried label in the final clause
    "query_contains",  # the tokens between the final label and the last token (" contains")
    "last",  # the read-out position
)


def position_classes(records: Sequence[Any], n_pos: int) -> dict[str, torch.Tensor]:
    """``{class: BoolTensor "batch pos"}`` for entity-tracking records (their ``positions`` give the
    objects, labels, query label and last token); the classes partition every prompt's tokens. Filled as numpy
    arrays (a slice assignment there costs a tenth of torch's; batches of every stage build these masks)."""
    masks = {name: np.zeros((len(records), n_pos), dtype=bool) for name in CLASSES}
    for row, r in enumerate(records):
        _fill_row({k: m[row] for k, m in masks.items()}, r.positions, r.query_index, n_pos)
    return {name: torch.from_numpy(m) for name, m in masks.items()}


def _fill_row(m: dict[str, np.ndarray], pos: dict, query_index: int, n_pos: int) -> None:
    objects, labels = list(pos["objects"]), list(pos["labels"])
    last, q_label = pos["last"], pos["query_label"]
    query_start = q_label - 1  # " Box" of the final clause
    m["first"][0] = True
    for i, (obj, lab) in enumerate(zip(objects, labels)):
        queried = i == query_index
        m["query_object" if queried else "objects_other"][obj] = True
        m["query_label_context" if queried else "labels_other"][lab] = True
        m["query_segment_words" if queried else "words_other"][obj + 1 : lab] = True
        end = objects[i + 1] if i + 1 < len(objects) else query_start
        m["query_segment_after" if queried else "separators_other"][lab + 1 : end] = True
        if i == 0:
            m["separators_other"][1:obj] = True  # anything between the first token and the first object
    m["query_box"][query_start:q_label] = True
    m["query_label"][q_label] = True
    m["query_contains"][q_label + 1 : last] = True
    m["last"][last] = True
    if last != n_pos - 1:
        raise ValueError(f"the last token is at {last} but prompts have {n_pos} tokens")
