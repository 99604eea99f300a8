"""Arithmetic prompts with one-token answers (Goat's recipe in miniature).

A prompt asks for a sum or a difference and ends just before the answer::

    What is 73 - 68? Answer: 5

SmolLM2's tokenizer writes every digit as its own token and a space before a digit as a
separate token, so the prompt ends with the space (``"Answer: "``) and the answer is one
digit ``0``-``9``: one token. Problems are therefore chosen so that the result is a single
digit: ``a + b`` with one-digit operands, ``a - b`` with one- or two-digit operands.
Every generated example is checked: ``tokenizer(prompt + answer)`` must equal
``tokenizer(prompt) + [answer_id]``, otherwise generation fails loudly.

Problems come in *forms* (operator and operand digit counts); all prompts of one form have
the same token length, so a batch of one form needs no padding.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .base import Task, step_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEMPLATE = "What is {a} {op} {b}? Answer: "

#: (operator, digits of a, digits of b); every form admits single-digit results.
FORMS: tuple[tuple[str, int, int], ...] = (("+", 1, 1), ("-", 1, 1), ("-", 2, 1), ("-", 2, 2))


@dataclass(frozen=True)
class ArithmeticExample:
    """One problem: ``prompt`` (ends with a space), ``answer`` (one digit), token ids."""

    prompt: str
    answer: str
    answer_id: int
    input_ids: tuple[int, ...]
    a: int
    b: int
    op: str

    @property
    def positions(self) -> dict[str, int]:
        """The task protocol's named positions: the last token."""
        return {"last": len(self.input_ids) - 1}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _operands(rng: random.Random, form: tuple[str, int, int]) -> tuple[int, int]:
    """Operands of ``form`` whose result is 0-9 (rejection sampling over the digit ranges)."""
    op, da, db = form
    lo_a, hi_a = (0 if da == 1 else 10 ** (da - 1)), 10**da - 1
    lo_b, hi_b = (0 if db == 1 else 10 ** (db - 1)), 10**db - 1
    while True:
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        c = a + b if op == "+" else a - b
        if 0 <= c <= 9:
            return a, b


def make_example(tokenizer: "PreTrainedTokenizerBase", a: int, b: int, op: str) -> ArithmeticExample:
    """The example ``a op b``; raises if the answer is not exactly one token for ``tokenizer``."""
    c = a + b if op == "+" else a - b
    if not 0 <= c <= 9:
        raise ValueError(f"{a} {op} {b} = {c} is not a single digit")
    prompt, answer = TEMPLATE.format(a=a, op=op, b=b), str(c)
    ids = list(tokenizer(prompt)["input_ids"])
    full = list(tokenizer(prompt + answer)["input_ids"])
    if full[: len(ids)] != ids or len(full) != len(ids) + 1:
        raise ValueError(
            f"answer {answer!r} of {prompt!r} is not one token appended to the prompt for this tokenizer "
            f"(prompt {ids}, prompt+answer {full}); arithmetic needs a tokenizer that splits digits"
        )
    return ArithmeticExample(prompt, answer, full[-1], tuple(ids), a, b, op)


def generate(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    seed: int = 0,
    form: tuple[str, int, int] | None = None,
    forms: Sequence[tuple[str, int, int]] = FORMS,
) -> list[ArithmeticExample]:
    """``n`` problems of one ``form`` (or of a form drawn from ``forms``), deterministic in ``seed``."""
    if n < 1:
        raise ValueError("n must be at least 1")
    rng = random.Random(seed)
    form = form or rng.choice(list(forms))
    out = []
    for _ in range(n):
        a, b = _operands(rng, form)
        out.append(make_example(tokenizer, a, b, form[0]))
    if len({len(e.input_ids) for e in out}) != 1:
        raise ValueError(f"prompts of form {form} differ in token length; this tokenizer does not split digits")
    return out


def batch_tensors(records: Sequence[ArithmeticExample]) -> dict[str, Any]:
    """``{"input_ids": [batch, pos], "answer_ids": [batch]}`` for records of one form."""
    import torch

    return {
        "input_ids": torch.tensor([r.input_ids for r in records], dtype=torch.long),
        "answer_ids": torch.tensor([r.answer_id for r in records], dtype=torch.long),
    }


def train_batch(
    tokenizer: "PreTrainedTokenizerBase", batch_size: int, data_seed: int, step: int, **_: Any
) -> dict[str, Any]:
    """Training batch of ``step``: one form per step, drawn by the step's seed."""
    seed = step_seed(data_seed, step)
    form = random.Random(seed).choice(list(FORMS))
    return batch_tensors(generate(tokenizer, batch_size, seed=seed, form=form))


TASK = Task(
    name="arithmetic",
    description="one-digit sums and differences (Goat's recipe in miniature)",
    examples=lambda tokenizer, n, seed=0: generate(tokenizer, n, seed=seed),
    positions=("last",),
    train_batch=train_batch,
)
