"""Checks of one row of a pairs file against a tokenizer: its answers' tokens, its character spans located on
tokens, and the record a prompt and its answers make. `mechdiff.tasks.jsonl` (the task's own rows) and
`mechdiff.tasks.declared` (the desiderata a task declares) both check their rows with them."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar

from .records import Example, derived_classes

LAST = "last"
T = TypeVar("T")


class ImportErrors(ValueError):
    """Every bad row of a pairs file, one line each (``FILE:LINE: what is wrong``): the message, and ``lines``, the
    problems it lists (the message itself where it names one problem), so that one import gathers every check's."""

    def __init__(self, message: str, lines: Sequence[str] = ()):
        super().__init__(message)
        self.lines = list(lines) or [message]


class RowErrors(ValueError):
    """Every problem of one row, each a message of its own (``problems``)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def checked(problems: list[str], check: Callable[..., T], *args: Any) -> Optional[T]:
    """``check(*args)``; None where it raises, its message appended to ``problems`` (so a row's other checks still
    run and every problem of the row is reported at once)."""
    try:
        return check(*args)
    except (ValueError, TypeError, KeyError) as e:
        problems.extend(e.problems if isinstance(e, RowErrors) else [str(e.args[0] if e.args else e)])
        return None


def pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token of ``ids`` as the text it decodes to (``' Mary'``)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def length_problem(tokenizer: Any, ids: Sequence[int], other: Sequence[int], names: tuple[str, str]) -> str:
    """Two prompts that must have one token length and do not: both lengths, where they first differ, and both
    token lists (so the word that splits differently is in view)."""
    a, b = pieces(tokenizer, ids), pieces(tokenizer, other)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (
        f"{names[0]} and {names[1]} differ in token length: {len(a)} vs {len(b)} tokens (first difference at token "
        f"{first}); {names[0]} tokens {a}; {names[1]} tokens {b}"
    )


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


def splits_a_word(tokenizer: Any, answer: str, ids: Sequence[int]) -> bool:
    """Whether ``answer`` (its token ids after its prompt: ``ids``) starts without a leading space and its first word
    runs over two or more tokens (``"Madrid"`` -> ``'Mad'`` + ``'rid'``): a piece the model rarely predicts there."""
    if not answer or answer[0].isspace() or len(ids) < 2:
        return False
    second = tokenizer.decode([int(ids[1])])
    return bool(second) and second[0].isalnum()


def answer_warnings(tokenizer: Any, pairs: Sequence[Any]) -> list[str]:
    """One line per kind of doubtful answer among imported ``pairs`` (`Pair`), with
    its count: answers without a leading space that split a word (`splits_a_word`; the answer and the
    counterfactual answer of each row), and rows whose answer shares its first token with a different
    counterfactual answer (path patching's first step reads the first token only, so it cannot tell them apart)."""
    from .records import alternative_tokens, answer_tokens

    split, shared, examples = 0, 0, ([], [])
    for p in pairs:
        answers = [(p.base.answer, answer_tokens(p.base))]
        answers += list(zip(p.base.alternatives, alternative_tokens(p.base)))
        cut = [a for a, ids in answers if splits_a_word(tokenizer, a, ids)]
        split += len(cut)
        examples[0].extend(cut)
        alt = alternative_tokens(p.base)
        if alt and alt[0] != answer_tokens(p.base) and alt[0][0] == answer_tokens(p.base)[0]:
            shared += 1
            examples[1].append(f"{p.base.answer!r}/{p.base.alternatives[0]!r}")
    lines = []
    if split:
        pieces = ", ".join(dict.fromkeys(repr(a) for a in examples[0][:3]))
        lines.append(
            f"{split} answers without a leading space split a word into tokens (e.g. {pieces}): the model is scored "
            'on a piece it rarely predicts there; give each answer its leading space (" Madrid", the prompt ending '
            "without one)"
        )
    if shared:
        lines.append(
            f"{shared} of {len(pairs)} rows have an answer that shares its first token with the counterfactual "
            f"answer (e.g. {', '.join(dict.fromkeys(examples[1][:3]))}): path patching's first step reads the first "
            "answer token only and cannot tell them apart"
        )
    return lines


def class_sizes(record: Example) -> dict[str, int]:
    """How many tokens each position class holds in ``record``: its own classes, else those derived from its named
    positions (`derived_classes`: ``before``, each name, ``after_<name>``, ``last``)."""
    if record.classes:
        return {c: len(tokens) for c, tokens in record.classes.items()}
    masks = derived_classes([record], len(record.input_ids))
    return {c: int(m.sum()) for c, m in masks.items()}


def on_last(record: Example) -> list[str]:
    """The named positions (other than ``last``) of ``record`` that fall on its final token: the class ``last``
    owns that token, so their own classes are empty there."""
    final = len(record.input_ids) - 1
    out = []
    for name, pos in record.positions.items():
        where = pos if isinstance(pos, tuple) else (pos,)
        if name != LAST and final in where:
            out.append(name)
    return out


def empty_classes(records: Sequence[Example]) -> dict[str, dict[str, tuple[int, int]]]:
    """Each position class empty in some record: template -> (records where it is empty, records of the
    template), by class (a record without a template counts under ``""``)."""
    totals: dict[str, int] = {}
    empty: dict[str, dict[str, int]] = {}
    for r in records:
        totals[r.template] = totals.get(r.template, 0) + 1
        for c, n in class_sizes(r).items():
            if not n:
                empty.setdefault(c, {}).setdefault(r.template, 0)
                empty[c][r.template] += 1
    return {c: {t: (n, totals[t]) for t, n in by.items()} for c, by in empty.items()}


def per_template(counts: dict[str, tuple[int, int]]) -> str:
    """``'a': 40 of 60 rows, 'b': 20 of 20`` (a record without a template: ``(no template)``)."""
    return ", ".join(
        f"{repr(t) if t else '(no template)'}: {n} of {total} rows" for t, (n, total) in sorted(counts.items())
    )


def class_warnings(pairs: Sequence[Any]) -> list[str]:
    """One line per named position that falls on the last token of some clean prompt and per class empty in some
    clean prompt, each with its counts per template: a class empty in every prompt never enters a circuit, and the
    study cannot tell it from a class that does nothing."""
    records = [p.base for p in pairs]
    lines = []
    last: dict[str, dict[str, tuple[int, int]]] = {}
    totals = {t: sum(r.template == t for r in records) for t in {r.template for r in records}}
    for r in records:
        for name in on_last(r):
            n, total = last.setdefault(name, {}).get(r.template, (0, totals[r.template]))
            last[name][r.template] = (n + 1, total)
    for name, counts in last.items():
        lines.append(
            f"position {name!r} falls on the last token ({per_template(counts)}): that token is always the class "
            f"{LAST!r}, so {name!r} holds no token there; name a token before the last"
        )
    for name, counts in empty_classes(records).items():
        every = all(n == total for n, total in counts.values()) and set(counts) == set(totals)
        lines.append(
            f"class {name!r} is empty ({per_template(counts)})"
            + (": in every prompt, so no circuit can use it" if every else "")
        )
    return lines


def task_empty_classes(task: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """`empty_classes` of the clean prompts of every row of a task that holds a fixed list of rows (an
    imported task, `Task` ``strata``); ``{}`` for a task that generates its prompts."""
    strata = getattr(task, "strata", None)
    if not strata:
        return {}
    return empty_classes(task.records(None, len(strata)))  # no tokenizer: the rows are already tokenized
