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
- :func:`generate` -> list of :class:`EntityTrackingExample`
- :func:`path_patching_pairs`, :func:`positional_pairs`, :func:`object_value_pairs`,
  :func:`label_value_pairs` -> list of :class:`CounterfactualPair`
- :func:`vocabulary_report` -> :class:`VocabularyReport` (which objects/labels survive the
  single-token filter for a tokenizer)
- :func:`to_hf_dataset`, :func:`write_jsonl`, :func:`read_jsonl`, :func:`dataset_hash`,
  :func:`batch_tensors`, :func:`pair_batch_tensors`
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

if TYPE_CHECKING:  # heavy imports only for type checkers
    import datasets
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MIN_BOXES = 2
MAX_BOXES = 10
DEFAULT_N_BOXES = 7
DEFAULT_VOCABULARY_PATH = Path(__file__).resolve().parent.parent / "data" / "entity_tracking" / "objects.txt"
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
        """Inverse of :meth:`to_dict`."""
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
    :data:`PAIR_KINDS`."""

    base: EntityTrackingExample
    source: EntityTrackingExample
    target: str
    target_id: int
    kind: str

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
        """Inverse of :meth:`to_dict`."""
        return cls(
            base=EntityTrackingExample.from_dict(d["base"]),
            source=EntityTrackingExample.from_dict(d["source"]),
            target=d["target"],
            target_id=int(d["target_id"]),
            kind=d["kind"],
        )


Record = Union[EntityTrackingExample, CounterfactualPair]


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


def _single_token_id(tokenizer: "PreTrainedTokenizerBase", word: str) -> int | None:
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
    for ``tokenizer``. ``letters`` restricts the candidate labels (default A-Z)."""
    _check_tokenizer(tokenizer)
    objects = load_vocabulary(vocabulary)
    cand_letters = ALL_LETTERS if letters is None else tuple(dict.fromkeys(letters))
    for L in cand_letters:
        if L not in ALL_LETTERS:
            raise ValueError(f"box labels must be single capital letters A-Z, got {L!r}")
    token_ids: dict[str, int] = {}
    kept, dropped = [], []
    for w in objects:
        tid = _single_token_id(tokenizer, w)
        if tid is None:
            dropped.append(w)
        else:
            kept.append(w)
            token_ids[w] = tid
    labels_kept, labels_dropped = [], []
    for L in cand_letters:
        tid = _single_token_id(tokenizer, L)
        if tid is None:
            labels_dropped.append(L)
        else:
            labels_kept.append(L)
            token_ids[L] = tid
    return VocabularyReport(tuple(kept), tuple(dropped), tuple(labels_kept), tuple(labels_dropped), token_ids)


def _check_n_boxes(n_boxes: int) -> None:
    if not isinstance(n_boxes, int) or isinstance(n_boxes, bool) or not MIN_BOXES <= n_boxes <= MAX_BOXES:
        raise ValueError(f"n_boxes must be an integer in {MIN_BOXES}..{MAX_BOXES} (inclusive), got {n_boxes!r}")


def _prepare(
    tokenizer: "PreTrainedTokenizerBase",
    n_boxes: int,
    vocabulary: Vocabulary,
    letters: Sequence[str] | None,
    objects_needed: int,
    labels_needed: int,
) -> VocabularyReport:
    """Validate arguments and the vocabulary before any generation."""
    _check_n_boxes(n_boxes)
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


# --------------------------------------------------------------------------------------
# Building one example
# --------------------------------------------------------------------------------------


def _span_to_token(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the (non-special) tokens whose character span overlaps [start, end)."""
    return [t for t, (a, b) in enumerate(offsets) if b > a and a < end and b > start]


def build_example(
    tokenizer: "PreTrainedTokenizerBase",
    objects: Sequence[str],
    labels: Sequence[str],
    query_index: int,
    query_label: str | None = None,
    token_ids: Mapping[str, int] | None = None,
) -> EntityTrackingExample:
    """Build one example from explicit objects and labels (segment ``k`` puts
    ``objects[k]`` in ``Box labels[k]``) and the queried segment.

    ``query_label`` overrides the letter in the final clause (default
    ``labels[query_index]``); if it is absent from ``labels`` the example's
    ``positions["query_label_context"]`` is ``None``. ``token_ids`` (word -> id of
    ``" " + word``) is computed if not given. Raises ValueError if a piece is not exactly
    one token in the prompt."""
    objects, labels = tuple(objects), tuple(labels)
    n = len(objects)
    _check_n_boxes(n)
    if len(labels) != n:
        raise ValueError(f"got {n} objects but {len(labels)} labels")
    if len(set(objects)) != n or len(set(labels)) != n:
        raise ValueError(f"objects and labels must be unique within a prompt: {objects}, {labels}")
    if not 0 <= query_index < n:
        raise ValueError(f"query_index {query_index} out of range for {n} boxes")
    qlabel = labels[query_index] if query_label is None else query_label
    if token_ids is None:
        token_ids = {}
        for w in (*objects, *labels, qlabel):
            tid = _single_token_id(tokenizer, w)
            if tid is None:
                raise ValueError(f"{' ' + w!r} is not a single token for this tokenizer")
            token_ids[w] = tid

    # Build the prompt piece by piece, recording the character span of every piece.
    text = ""
    obj_spans: list[tuple[int, int]] = []
    lab_spans: list[tuple[int, int]] = []

    def add(piece: str) -> tuple[int, int]:
        nonlocal text
        start = len(text)
        text += piece
        return start, len(text)

    for k, (obj, lab) in enumerate(zip(objects, labels)):
        if k:
            add(", ")
        add("The " if k == 0 else "the ")
        obj_spans.append(add(obj))
        add(" is in Box ")
        lab_spans.append(add(lab))
    add(". Box ")
    q_span = add(qlabel)
    add(" contains the")
    prompt = text

    enc = tokenizer(prompt, return_offsets_mapping=True)
    input_ids = tuple(int(i) for i in enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]

    def locate(piece: str, span: tuple[int, int]) -> int:
        toks = _span_to_token(offsets, *span)
        if len(toks) != 1:
            raise ValueError(
                f"{piece!r} at characters {span} of {prompt!r} spans {len(toks)} tokens, expected exactly 1"
            )
        t = toks[0]
        decoded = tokenizer.decode([input_ids[t]]).strip()
        if decoded != piece or input_ids[t] != token_ids[piece]:
            raise ValueError(
                f"token {t} of {prompt!r} decodes to {decoded!r} (id {input_ids[t]}), expected {piece!r} "
                f"(id {token_ids[piece]}); the tokenizer merges it with its neighbours"
            )
        return t

    obj_pos = tuple(locate(o, s) for o, s in zip(objects, obj_spans))
    lab_pos = tuple(locate(l, s) for l, s in zip(labels, lab_spans))
    q_pos = locate(qlabel, q_span)
    ctx_pos = lab_pos[labels.index(qlabel)] if qlabel in labels else None
    answer_obj = objects[query_index]
    return EntityTrackingExample(
        prompt=prompt,
        answer=" " + answer_obj,
        answer_id=token_ids[answer_obj],
        objects=objects,
        labels=labels,
        query_index=query_index,
        query_label=qlabel,
        input_ids=input_ids,
        positions={
            "last": len(input_ids) - 1,
            "query_label": q_pos,
            "query_label_context": ctx_pos,
            "objects": obj_pos,
            "labels": lab_pos,
        },
    )


def _check_same_length(examples: Iterable[EntityTrackingExample], n_boxes: int) -> None:
    lengths = {len(e.input_ids) for e in examples}
    if len(lengths) > 1:
        raise ValueError(
            f"prompts with n_boxes={n_boxes} tokenize to different lengths {sorted(lengths)}; downstream code "
            "batches them without padding. Use a vocabulary whose objects are single tokens in context."
        )


# --------------------------------------------------------------------------------------
# Plain datasets
# --------------------------------------------------------------------------------------


def _sample_base(
    rng: random.Random, report: VocabularyReport, n_boxes: int, query_index: int, tokenizer: "PreTrainedTokenizerBase"
) -> EntityTrackingExample:
    objects = rng.sample(report.kept, n_boxes)
    labels = rng.sample(report.labels_kept, n_boxes)
    return build_example(tokenizer, objects, labels, query_index, token_ids=report.token_ids)


def _check_n(n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")


def generate(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[EntityTrackingExample]:
    """``n`` entity-tracking examples with ``n_boxes`` boxes each.

    Objects are drawn (unique within a prompt) from the single-token part of ``vocabulary``,
    labels (unique) from the single-token letters in ``letters`` (default A-Z). Example ``i``
    queries segment ``i % n_boxes``, so every box is queried equally often. Deterministic in
    ``seed`` (``random.Random(seed)``). All examples have the same token length."""
    _check_n(n)
    report = _prepare(tokenizer, n_boxes, vocabulary, letters, n_boxes, n_boxes)
    rng = random.Random(seed)
    out = [_sample_base(rng, report, n_boxes, i % n_boxes, tokenizer) for i in range(n)]
    _check_same_length(out, n_boxes)
    return out


# --------------------------------------------------------------------------------------
# Counterfactual pairs
# --------------------------------------------------------------------------------------


def _pairs(
    kind: str,
    make_source: Callable[[random.Random, EntityTrackingExample, VocabularyReport], tuple[EntityTrackingExample, str]],
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int,
    seed: int,
    vocabulary: Vocabulary,
    letters: Sequence[str] | None,
    labels_needed: int,
) -> list[CounterfactualPair]:
    """Shared driver: the bases are exactly ``generate(tokenizer, n, n_boxes, seed, ...)``; the
    sources come from a second generator seeded with ``f"{seed}:{kind}"``."""
    _check_n(n)
    # The sources' objects are disjoint from their base's, so twice the objects are needed.
    report = _prepare(tokenizer, n_boxes, vocabulary, letters, 2 * n_boxes, labels_needed)
    base_rng = random.Random(seed)
    src_rng = random.Random(f"{seed}:{kind}")
    out: list[CounterfactualPair] = []
    for i in range(n):
        base = _sample_base(base_rng, report, n_boxes, i % n_boxes, tokenizer)
        source, target_obj = make_source(src_rng, base, report)
        out.append(CounterfactualPair(base, source, " " + target_obj, report.token_ids[target_obj], kind))
    _check_same_length([e for p in out for e in (p.base, p.source)], n_boxes)
    return out


def _other_objects(rng: random.Random, base: EntityTrackingExample, report: VocabularyReport) -> list[str]:
    pool = [o for o in report.kept if o not in base.objects]
    return rng.sample(pool, base.n_boxes)


def path_patching_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """Pairs for path patching. The source is a different context (objects disjoint from the
    base's, fresh random labels) whose query segment index differs from the base's and whose
    final query label is a letter ABSENT from the source context and different from the
    base's query label; so ``source.positions["query_label_context"]`` is ``None``.
    ``source.query_index`` is the segment that would have been queried and ``source.answer``
    its object (meaningless for the model). ``target`` is the base answer (metric: the
    probability of the base answer)."""

    def make(rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport) -> tuple[EntityTrackingExample, str]:
        objects = _other_objects(rng, base, rep)
        labels = rng.sample(rep.labels_kept, base.n_boxes)
        q = rng.choice([k for k in range(base.n_boxes) if k != base.query_index])
        absent = rng.choice([L for L in rep.labels_kept if L not in labels and L != base.query_label])
        source = build_example(tokenizer, objects, labels, q, query_label=absent, token_ids=rep.token_ids)
        return source, base.answer[1:]

    # n_boxes letters in the source, plus one absent from it that also differs from the base query label.
    return _pairs("path_patching", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes + 2)


def positional_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM positional desideratum. The source has objects disjoint from the base's, queries
    segment ``j != base.query_index``, and its query label does not occur in the base context
    (so the label reading predicts nothing and the object reading predicts an object not in
    the base). ``target = base.objects[j]``: the source's query position applied to the
    base's context."""

    def make(rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport) -> tuple[EntityTrackingExample, str]:
        n_b = base.n_boxes
        objects = _other_objects(rng, base, rep)
        j = rng.choice([k for k in range(n_b) if k != base.query_index])
        q_label = rng.choice([L for L in rep.labels_kept if L not in base.labels])
        labels = rng.sample([L for L in rep.labels_kept if L != q_label], n_b - 1)
        labels.insert(j, q_label)
        source = build_example(tokenizer, objects, labels, j, token_ids=rep.token_ids)
        return source, base.objects[j]

    return _pairs("positional", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes + 1)


def object_value_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM object-value desideratum. The source is a different context (objects disjoint
    from the base's, fresh random labels, random query segment); ``target`` is the source's
    answer, the value fetched in the source run, which never occurs in the base context."""

    def make(rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport) -> tuple[EntityTrackingExample, str]:
        objects = _other_objects(rng, base, rep)
        labels = rng.sample(rep.labels_kept, base.n_boxes)
        q = rng.randrange(base.n_boxes)
        source = build_example(tokenizer, objects, labels, q, token_ids=rep.token_ids)
        return source, source.answer[1:]

    return _pairs("object_value", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes)


def label_value_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM box-label-value desideratum. The source (objects disjoint from the base's) queries
    segment ``j`` with label ``L = base.labels[k]`` where ``k != base.query_index`` and
    ``k != j``; ``target = base.objects[k]`` (the base's object in the box labelled with the
    source's query label), which is never the base answer. With 2 boxes ``j`` equals the
    base's query index (no third segment exists); otherwise ``j`` is uniform."""

    def make(rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport) -> tuple[EntityTrackingExample, str]:
        n_b = base.n_boxes
        i = base.query_index
        j = i if n_b == 2 else rng.randrange(n_b)
        k = rng.choice([s for s in range(n_b) if s not in (i, j)])
        q_label = base.labels[k]
        objects = _other_objects(rng, base, rep)
        labels = rng.sample([L for L in rep.labels_kept if L != q_label], n_b - 1)
        labels.insert(j, q_label)
        source = build_example(tokenizer, objects, labels, j, token_ids=rep.token_ids)
        target = base.objects[base.labels.index(source.query_label)]
        return source, target

    return _pairs("label_value", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes)


PAIR_GENERATORS: dict[str, Callable[..., list[CounterfactualPair]]] = {
    "path_patching": path_patching_pairs,
    "positional": positional_pairs,
    "object_value": object_value_pairs,
    "label_value": label_value_pairs,
}


def counterfactual_pairs(
    kind: str,
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """Dispatch on ``kind`` (one of :data:`PAIR_KINDS`)."""
    if kind not in PAIR_GENERATORS:
        raise ValueError(f"unknown counterfactual kind {kind!r}; choose one of {', '.join(PAIR_KINDS)}")
    return PAIR_GENERATORS[kind](tokenizer, n, n_boxes=n_boxes, seed=seed, vocabulary=vocabulary, letters=letters)


# --------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------


def _record_dict(r: Record) -> dict[str, Any]:
    if isinstance(r, EntityTrackingExample):
        return {"type": "example", **r.to_dict()}
    if isinstance(r, CounterfactualPair):
        return {"type": "pair", **r.to_dict()}
    raise TypeError(f"expected EntityTrackingExample or CounterfactualPair, got {type(r).__name__}")


def _record_from_dict(d: Mapping[str, Any]) -> Record:
    d = dict(d)
    kind = d.pop("type", None)
    if kind == "example":
        return EntityTrackingExample.from_dict(d)
    if kind == "pair":
        return CounterfactualPair.from_dict(d)
    raise ValueError(f"unknown record type {kind!r} (expected 'example' or 'pair')")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def write_jsonl(records: Sequence[Record], path: str | os.PathLike) -> None:
    """Write examples and/or pairs, one JSON object per line (with a ``"type"`` field)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(_canonical(_record_dict(r)) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read what :func:`write_jsonl` wrote; equal to the records written."""
    with Path(path).open(encoding="utf-8") as f:
        return [_record_from_dict(json.loads(line)) for line in f if line.strip()]


def dataset_hash(records: Sequence[Record]) -> str:
    """sha256 hex digest of a canonical JSON of the records (order matters). Includes the
    input ids, so the same prompts under another tokenizer hash differently."""
    payload = _canonical([_record_dict(r) for r in records])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _flat_example(e: EntityTrackingExample, prefix: str = "") -> dict[str, Any]:
    p = e.positions
    return {
        f"{prefix}prompt": e.prompt,
        f"{prefix}answer": e.answer,
        f"{prefix}answer_id": e.answer_id,
        f"{prefix}objects": list(e.objects),
        f"{prefix}labels": list(e.labels),
        f"{prefix}query_index": e.query_index,
        f"{prefix}query_label": e.query_label,
        f"{prefix}input_ids": list(e.input_ids),
        f"{prefix}pos_last": p["last"],
        f"{prefix}pos_query_label": p["query_label"],
        f"{prefix}pos_query_label_context": p["query_label_context"],
        f"{prefix}pos_objects": list(p["objects"]),
        f"{prefix}pos_labels": list(p["labels"]),
    }


def to_hf_dataset(records: Sequence[Record]) -> "datasets.Dataset":
    """A ``datasets.Dataset`` with one row per record. Examples give columns prompt, answer,
    answer_id, objects, labels, query_index, query_label, input_ids, pos_last,
    pos_query_label, pos_query_label_context (null when absent), pos_objects, pos_labels.
    Pairs give the same columns prefixed ``base_`` and ``source_`` plus target, target_id,
    kind. All records must be of one type."""
    import datasets

    records = list(records)
    if not records:
        raise ValueError("no records to export")
    if all(isinstance(r, EntityTrackingExample) for r in records):
        rows = [_flat_example(r) for r in records]
    elif all(isinstance(r, CounterfactualPair) for r in records):
        rows = [
            {**_flat_example(r.base, "base_"), **_flat_example(r.source, "source_"),
             "target": r.target, "target_id": r.target_id, "kind": r.kind}
            for r in records
        ]
    else:
        raise TypeError("records must be all EntityTrackingExample or all CounterfactualPair")
    features = _hf_features(records[0])
    return datasets.Dataset.from_list(rows, features=features)


def _hf_features(first: Record) -> "datasets.Features":
    import datasets

    def ex(prefix: str) -> dict[str, Any]:
        i64, s = datasets.Value("int64"), datasets.Value("string")
        return {
            f"{prefix}prompt": s,
            f"{prefix}answer": s,
            f"{prefix}answer_id": i64,
            f"{prefix}objects": datasets.List(s),
            f"{prefix}labels": datasets.List(s),
            f"{prefix}query_index": i64,
            f"{prefix}query_label": s,
            f"{prefix}input_ids": datasets.List(i64),
            f"{prefix}pos_last": i64,
            f"{prefix}pos_query_label": i64,
            f"{prefix}pos_query_label_context": i64,
            f"{prefix}pos_objects": datasets.List(i64),
            f"{prefix}pos_labels": datasets.List(i64),
        }

    if isinstance(first, EntityTrackingExample):
        return datasets.Features(ex(""))
    return datasets.Features(
        {**ex("base_"), **ex("source_"), "target": datasets.Value("string"),
         "target_id": datasets.Value("int64"), "kind": datasets.Value("string")}
    )


def batch_tensors(records: Sequence[EntityTrackingExample]) -> dict[str, Any]:
    """Batch tensors for examples of one token length (no padding).

    Returns ``input_ids`` LongTensor [batch, pos], ``attention_mask`` (all ones) [batch, pos],
    ``answer_ids`` [batch], and ``positions``: name -> LongTensor [batch] for ``last``,
    ``query_label``, ``query_label_context`` (``-1`` where the query label is absent from the
    context, e.g. path-patching sources), plus ``objects`` and ``labels`` [batch, n_boxes].
    """
    import torch

    records = list(records)
    if not records:
        raise ValueError("no records to batch")
    if not all(isinstance(r, EntityTrackingExample) for r in records):
        raise TypeError("batch_tensors takes EntityTrackingExample records; for pairs use pair_batch_tensors")
    lengths = {len(r.input_ids) for r in records}
    if len(lengths) != 1:
        raise ValueError(f"records have different token lengths {sorted(lengths)}; batch each n_boxes separately")
    n_boxes = {r.n_boxes for r in records}
    if len(n_boxes) != 1:
        raise ValueError(f"records have different n_boxes {sorted(n_boxes)}; batch each n_boxes separately")
    input_ids = torch.tensor([r.input_ids for r in records], dtype=torch.long)

    def pos(name: str) -> "torch.Tensor":
        vals = [r.positions[name] for r in records]
        return torch.tensor([-1 if v is None else v for v in vals], dtype=torch.long)

    positions = {name: pos(name) for name in SCALAR_POSITIONS}
    positions["objects"] = torch.tensor([r.positions["objects"] for r in records], dtype=torch.long)
    positions["labels"] = torch.tensor([r.positions["labels"] for r in records], dtype=torch.long)
    from .entity_tracking_positions import position_classes

    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "answer_ids": torch.tensor([r.answer_id for r in records], dtype=torch.long),
        "positions": positions,
        "position_classes": position_classes(records, input_ids.shape[1]),
    }


def pair_batch_tensors(pairs: Sequence[CounterfactualPair]) -> dict[str, Any]:
    """``{"base": batch_tensors(bases), "source": batch_tensors(sources), "target_ids":
    LongTensor [batch]}``; bases and sources must share one token length."""
    import torch

    pairs = list(pairs)
    base = batch_tensors([p.base for p in pairs])
    source = batch_tensors([p.source for p in pairs])
    if base["input_ids"].shape != source["input_ids"].shape:
        raise ValueError(
            f"base and source shapes differ: {tuple(base['input_ids'].shape)} vs {tuple(source['input_ids'].shape)}"
        )
    return {"base": base, "source": source, "target_ids": torch.tensor([p.target_id for p in pairs], dtype=torch.long)}


__all__ = [
    "ALL_LETTERS",
    "DEFAULT_N_BOXES",
    "DEFAULT_VOCABULARY_PATH",
    "MAX_BOXES",
    "MIN_BOXES",
    "PAIR_GENERATORS",
    "PAIR_KINDS",
    "CounterfactualPair",
    "EntityTrackingExample",
    "Record",
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
    "path_patching_pairs",
    "positional_pairs",
    "read_jsonl",
    "to_hf_dataset",
    "vocabulary_report",
    "write_jsonl",
]
