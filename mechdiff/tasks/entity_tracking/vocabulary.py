"""The entity-tracking vocabulary: objects and box labels that are one token for a tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from ..records import per_tokenizer
from .records import ALL_LETTERS, DEFAULT_VOCABULARY_PATH, MAX_BOXES, MIN_BOXES, Vocabulary

if TYPE_CHECKING:  # heavy imports only for type checkers
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("mechdiff.tasks.entity_tracking")


@dataclass(frozen=True)
class VocabularyReport:
    """What survived the single-token filter for one tokenizer.

    ``kept``/``dropped`` are objects (in vocabulary order); ``labels_kept``/``labels_dropped``
    are the letters A-Z. ``token_ids`` maps every kept object and label to its token id (the
    id of ``" " + word`` in context)."""

    kept: tuple[str, ...]
    dropped: tuple[str, ...]
    labels_kept: tuple[str, ...]
    labels_dropped: tuple[str, ...]
    token_ids: dict[str, int] = field(repr=False, compare=False)

    @property
    def n_total(self) -> int:
        """Number of distinct objects in the vocabulary."""
        return len(self.kept) + len(self.dropped)

    def summary(self) -> str:
        """One line for the log."""
        s = f"entity tracking vocabulary: kept {len(self.kept)} of {self.n_total} objects as single tokens"
        if self.dropped:
            s += f"; dropped {len(self.dropped)}: {', '.join(self.dropped)}"
        s += f"; kept {len(self.labels_kept)} of 26 box labels"
        if self.labels_dropped:
            s += f" (dropped {', '.join(self.labels_dropped)})"
        return s


# --------------------------------------------------------------------------------------
# Vocabulary and tokenizer checks
# --------------------------------------------------------------------------------------


def load_vocabulary(vocabulary: Vocabulary = None) -> tuple[str, ...]:
    """Objects from a sequence of words, a path to a one-word-per-line file, or (``None``)
    the packaged ``mechdiff/data/entity_tracking/objects.txt``. Words are stripped and
    lower-cased; blank lines and ``#`` comments are skipped; duplicates are removed keeping
    the first occurrence."""
    if vocabulary is None or isinstance(vocabulary, (str, os.PathLike)):
        path = Path(DEFAULT_VOCABULARY_PATH if vocabulary is None else vocabulary)
        if not path.is_file():
            raise FileNotFoundError(f"entity tracking vocabulary file not found: {path}")
        words: Iterable[str] = path.read_text(encoding="utf-8").splitlines()
    else:
        words = vocabulary
    out: list[str] = []
    seen: set[str] = set()
    for w in words:
        w = w.strip().lower()
        if not w or w.startswith("#"):
            continue
        if any(c.isspace() for c in w):
            raise ValueError(f"vocabulary entry {w!r} contains whitespace; give one word per entry")
        if w not in seen:
            seen.add(w)
            out.append(w)
    return tuple(out)


def _check_tokenizer(tokenizer: "PreTrainedTokenizerBase") -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "entity tracking needs a fast tokenizer (offset mapping); load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True)"
        )


def single_token_id(tokenizer: "PreTrainedTokenizerBase", word: str) -> int | None:
    """Token id of ``" " + word`` if it is one token, else ``None``.

    Tries ``tokenizer(" " + word, add_special_tokens=False)`` first. SentencePiece tokenizers
    that prepend a space (LLaMA) encode a leading space as its own token there, so a second
    test encodes ``"the " + word`` and checks it adds exactly one token to ``"the"``; that
    token is the one that appears in a prompt."""
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if len(ids) == 1:
        return int(ids[0])
    anchor = tokenizer("the", add_special_tokens=False)["input_ids"]
    both = tokenizer("the " + word, add_special_tokens=False)["input_ids"]
    if len(both) == len(anchor) + 1 and list(both[: len(anchor)]) == list(anchor):
        return int(both[-1])
    return None


def vocabulary_report(
    tokenizer: "PreTrainedTokenizerBase",
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> VocabularyReport:
    """Filter objects and box labels to those that are a single token (preceded by a space)
    for ``tokenizer``. ``letters`` restricts the candidate labels (default A-Z). Taken once per tokenizer
    object, vocabulary and letters (again where the tokenizer's vocabulary grew): every prompt set a study
    draws asks for it."""
    _check_tokenizer(tokenizer)
    objects = load_vocabulary(vocabulary)
    cand_letters = ALL_LETTERS if letters is None else tuple(dict.fromkeys(letters))
    for L in cand_letters:
        if L not in ALL_LETTERS:
            raise ValueError(f"box labels must be single capital letters A-Z, got {L!r}")
    return per_tokenizer(
        tokenizer, ("vocabulary", tuple(objects), cand_letters), lambda: _report(tokenizer, objects, cand_letters)
    )


def _report(
    tokenizer: "PreTrainedTokenizerBase", objects: Sequence[str], cand_letters: Sequence[str]
) -> VocabularyReport:
    """`vocabulary_report` computed."""
    token_ids: dict[str, int] = {}
    kept, dropped = [], []
    for w in objects:
        tid = single_token_id(tokenizer, w)
        if tid is None:
            dropped.append(w)
        else:
            kept.append(w)
            token_ids[w] = tid
    labels_kept, labels_dropped = [], []
    for L in cand_letters:
        tid = single_token_id(tokenizer, L)
        if tid is None:
            labels_dropped.append(L)
        else:
            labels_kept.append(L)
            token_ids[L] = tid
    return VocabularyReport(tuple(kept), tuple(dropped), tuple(labels_kept), tuple(labels_dropped), token_ids)


def check_n_boxes(n_boxes: int) -> None:
    if not isinstance(n_boxes, int) or isinstance(n_boxes, bool) or not MIN_BOXES <= n_boxes <= MAX_BOXES:
        raise ValueError(f"n_boxes must be an integer in {MIN_BOXES}..{MAX_BOXES} (inclusive), got {n_boxes!r}")


def prepare_vocabulary(
    tokenizer: "PreTrainedTokenizerBase",
    n_boxes: int,
    vocabulary: Vocabulary,
    letters: Sequence[str] | None,
    objects_needed: int,
    labels_needed: int,
) -> VocabularyReport:
    """Validate arguments and the vocabulary before any generation."""
    check_n_boxes(n_boxes)
    report = vocabulary_report(tokenizer, vocabulary, letters)
    logger.info(report.summary())
    if len(report.kept) < objects_needed:
        raise ValueError(
            f"only {len(report.kept)} of {report.n_total} objects are single tokens for this tokenizer; "
            f"need at least {objects_needed} (n_boxes={n_boxes}); give a vocabulary with more single-token nouns"
        )
    if len(report.labels_kept) < labels_needed:
        raise ValueError(
            f"only {len(report.labels_kept)} box labels ({''.join(report.labels_kept)}) are single tokens for "
            f"this tokenizer; need at least {labels_needed} (n_boxes={n_boxes}); allow more letters or use fewer boxes"
        )
    return report
