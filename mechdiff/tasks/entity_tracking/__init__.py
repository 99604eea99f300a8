"""Entity-tracking datasets (Prakash et al., ICLR 2024, "Fine-Tuning Enhances Existing
Mechanisms: A Case Study on Entity Tracking").

A prompt binds ``n_boxes`` objects to box labels and queries one box::

    The apple is in Box F, the computer is in Box Q, the bell is in Box A. Box Q contains the

and the answer is ``" computer"`` (leading space, one token for the tokenizer).

Everything position-related is computed from the tokenizer's offset mapping: the prompt is
built piece by piece, the character span of every object and label is recorded, and each
span is mapped to the single token that covers it. The token found there must decode to the
piece and must be the piece's own token id, otherwise generation fails loudly. Nothing is
located by searching for a substring (a label ``"B"`` would otherwise be found inside
``"Box"``, a label ``"T"`` inside ``"The"``).

Public API
----------
- `generate` -> list of `EntityTrackingExample`
- `path_patching_pairs` (mechdiff's counterfactuals, or the paper's: `paper_path_patching_pairs`),
  `positional_pairs`, `object_value_pairs`, `label_value_pairs` -> list of
  `CounterfactualPair`
- `vocabulary_report` -> `VocabularyReport` (which objects/labels survive the
  single-token filter for a tokenizer)
- `to_hf_dataset`, `write_jsonl`, `read_jsonl`, `dataset_hash`,
  `batch_tensors`, `pair_batch_tensors`

Modules (split by concern): `.records` (the record types and constants), `.vocabulary`
(single-token objects and labels), `.building` (one prompt, `generate`), `.pairs`
(counterfactual kinds), `.export` (JSONL, ``datasets``, hashing, batching), `.desiderata`
(``mechdiff dcm --desiderata``: names and ``.jsonl`` files of pairs), `.task` (the
`Task` registered as ``entity-tracking``).
"""

from __future__ import annotations

from .building import build_example, check_same_length, generate, span_to_token  # noqa: F401 (tests)
from .export import batch_tensors, dataset_hash, pair_batch_tensors, read_jsonl, to_hf_dataset, write_jsonl
from .pairs import (
    COUNTERFACTUALS,
    PAIR_GENERATORS,
    counterfactual_pairs,
    label_value_pairs,
    object_value_pairs,
    paper_path_patching_pairs,
    path_patching_pairs,
    positional_pairs,
)
from .records import (
    ALL_LETTERS,
    DEFAULT_N_BOXES,
    DEFAULT_VOCABULARY_PATH,
    MAX_BOXES,
    MIN_BOXES,
    PAIR_KINDS,
    SCALAR_POSITIONS,
    CounterfactualPair,
    EntityTrackingExample,
    Record,
    Vocabulary,
)
from .task import GROUP_NAMES, PLAN, TASK, reference_records
from .vocabulary import VocabularyReport, load_vocabulary, single_token_id, vocabulary_report  # noqa: F401

__all__ = [
    "ALL_LETTERS",
    "COUNTERFACTUALS",
    "CounterfactualPair",
    "DEFAULT_N_BOXES",
    "DEFAULT_VOCABULARY_PATH",
    "EntityTrackingExample",
    "GROUP_NAMES",
    "MAX_BOXES",
    "MIN_BOXES",
    "PAIR_GENERATORS",
    "PAIR_KINDS",
    "PLAN",
    "Record",
    "SCALAR_POSITIONS",
    "TASK",
    "Vocabulary",
    "VocabularyReport",
    "batch_tensors",
    "build_example",
    "counterfactual_pairs",
    "dataset_hash",
    "generate",
    "label_value_pairs",
    "load_vocabulary",
    "object_value_pairs",
    "pair_batch_tensors",
    "paper_path_patching_pairs",
    "path_patching_pairs",
    "positional_pairs",
    "read_jsonl",
    "reference_records",
    "to_hf_dataset",
    "vocabulary_report",
    "write_jsonl",
]
