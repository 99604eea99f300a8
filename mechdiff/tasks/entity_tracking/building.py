"""Building entity-tracking prompts piece by piece, every position from the tokenizer's offsets,
and the plain datasets (`generate`)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from .records import DEFAULT_N_BOXES, EntityTrackingExample, Vocabulary
from .vocabulary import VocabularyReport, check_n_boxes, prepare_vocabulary, single_token_id

if TYPE_CHECKING:  # heavy imports only for type checkers
    from transformers import PreTrainedTokenizerBase


# --------------------------------------------------------------------------------------
# Building one example
# --------------------------------------------------------------------------------------


def span_to_token(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
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
    check_n_boxes(n)
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
            tid = single_token_id(tokenizer, w)
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
        toks = span_to_token(offsets, *span)
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


def check_same_length(examples: Iterable[EntityTrackingExample], n_boxes: int) -> None:
    lengths = {len(e.input_ids) for e in examples}
    if len(lengths) > 1:
        raise ValueError(
            f"prompts with n_boxes={n_boxes} tokenize to different lengths {sorted(lengths)}; downstream code "
            "batches them without padding. Use a vocabulary whose objects are single tokens in context."
        )


# --------------------------------------------------------------------------------------
# Plain datasets
# --------------------------------------------------------------------------------------


def sample_base(
    rng: random.Random, report: VocabularyReport, n_boxes: int, query_index: int, tokenizer: "PreTrainedTokenizerBase"
) -> EntityTrackingExample:
    objects = rng.sample(report.kept, n_boxes)
    labels = rng.sample(report.labels_kept, n_boxes)
    return build_example(tokenizer, objects, labels, query_index, token_ids=report.token_ids)


def check_n(n: int) -> None:
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
    check_n(n)
    report = prepare_vocabulary(tokenizer, n_boxes, vocabulary, letters, n_boxes, n_boxes)
    rng = random.Random(seed)
    out = [sample_base(rng, report, n_boxes, i % n_boxes, tokenizer) for i in range(n)]
    check_same_length(out, n_boxes)
    return out
