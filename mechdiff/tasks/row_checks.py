"""Checks of one row of a pairs file against a tokenizer: its answers' tokens, its character spans located on
tokens, and the record a prompt and its answers make. :mod:`mechdiff.tasks.jsonl` (the task's own rows) and
:mod:`mechdiff.tasks.declared` (the desiderata a task declares) both check their rows with them."""

from __future__ import annotations

from typing import Any, Sequence

from .records import Example

LAST = "last"


class ImportErrors(ValueError):
    """Every bad row of a pairs file, one line each (``FILE:LINE: what is wrong``)."""


def answer_ids(tokenizer: Any, prompt: str, answer: str) -> tuple[int, ...]:
    """The answer's token ids: the tokens ``tokenizer(prompt + answer)`` appends to ``tokenizer(prompt)`` (one
    or more); refused where the answer adds no token or merges with the prompt's last token."""
    if not isinstance(answer, str) or not answer:
        raise ValueError(f"answer {answer!r} is not a non-empty string")
    ids = list(tokenizer(prompt)["input_ids"])
    full = list(tokenizer(prompt + answer)["input_ids"])
    if full[: len(ids)] != ids:
        raise ValueError(
            f"answer {answer!r} merges with the prompt's last token ({tokenizer.decode(ids[-1:])!r} becomes "
            f"{tokenizer.decode(full[len(ids) - 1 : len(ids)])!r}); start the answer on a token boundary "
            "(mind the leading space)"
        )
    if len(full) == len(ids):
        raise ValueError(f"answer {answer!r} adds no token after its prompt")
    return tuple(int(i) for i in full[len(ids) :])


def answer_id(tokenizer: Any, prompt: str, answer: str) -> int:
    """The answer's token id, where ``tokenizer(prompt + answer)`` is ``tokenizer(prompt)`` plus exactly one token."""
    ids = answer_ids(tokenizer, prompt, answer)
    if len(ids) != 1:
        raise ValueError(f"answer {answer!r} is {len(ids)} tokens after its prompt, not one")
    return ids[0]


def encode_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s token ids and each token's character span (a fast tokenizer's offset mapping)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "locating positions by character needs a fast tokenizer (offset mapping); load it with use_fast=True"
        )
    enc = tokenizer(text, return_offsets_mapping=True)
    return [int(i) for i in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]


def locate(text: str, offsets: Sequence[tuple[int, int]], span: Sequence[int], name: str) -> int:
    """The token holding the last character of ``text[start:end]``; the span (without surrounding
    whitespace) must start at a token's first character and end at a token's last one."""
    if (
        not isinstance(span, (list, tuple))
        or len(span) != 2
        or not all(isinstance(v, int) for v in span)
        or not 0 <= span[0] < span[1] <= len(text)
    ):
        raise ValueError(f"position {name!r}: {span!r} is not [start, end) with 0 <= start < end <= {len(text)}")
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if start == end:
        raise ValueError(f"position {name!r}: span {list(span)} holds only whitespace")
    real = [(t, a, b) for t, (a, b) in enumerate(offsets) if b > a]
    holding = [t for t, a, b in real if a <= end - 1 < b]
    starts = {a for _, a, _ in real} | {a + 1 for _, a, _ in real if text[a].isspace()}
    if not holding or start not in starts or end not in {b for _, _, b in real}:
        pieces = [text[a:b] for _, a, b in real if a < end and b > start]
        raise ValueError(
            f"position {name!r}: {text[span[0] : span[1]]!r} at {list(span)} is not on token boundaries "
            f"(the tokens there are {pieces}); move the span to whole tokens"
        )
    return holding[0]


def several(ids: tuple[int, ...]) -> tuple[int, ...]:
    """``ids`` where they are several tokens, else ``()`` (a one-token answer's record is what it always was)."""
    return ids if len(ids) > 1 else ()


def example_of(
    prompt: str,
    ids: Sequence[int],
    answer: tuple[str, tuple[int, ...]],
    positions: dict,
    alternatives: Sequence[tuple[str, tuple[int, ...]]],
    template: str,
    classes: dict,
) -> Example:
    """A record of one prompt, its answer ``(text, token ids)`` and alternatives (each ``(text, token ids)``)."""
    many = any(len(a_ids) > 1 for _, a_ids in alternatives)
    return Example(
        prompt,
        tuple(ids),
        answer[0],
        answer[1][0],
        positions,
        tuple(text for text, _ in alternatives),
        tuple(a_ids[0] for _, a_ids in alternatives),
        template,
        classes,
        several(answer[1]),
        tuple(a_ids for _, a_ids in alternatives) if many else (),
    )
