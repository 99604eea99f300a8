"""Multiple-choice arithmetic word problems, with the loss on the answer letter.

A prompt states a small word problem, lists four choices and ends just before the letter::

    Tom has 23 apples and gets 14 more. How many apples does Tom have now?
    A. 36
    B. 37
    C. 47
    D. 39
    Answer: B

The answer is the letter (``" B"``, one token). Every number is two digits (SmolLM2 writes
each digit as its own token), and names and objects are kept only where they are single
tokens both at the start of a sentence and after a space, so all prompts have the same token
length and batch without padding; `generate` fails loudly otherwise. Example ``i`` puts
the correct value under letter ``i % 4``, so every letter is the answer equally often.
Problems are additions (``a + b``, result 20-98) and subtractions (``a - b``, result 10-89);
distractors are the result +-1, +-2, +-10 (distinct, two-digit). Names are split like the
entity-tracking objects: ``split="train"`` and ``split="eval"`` use disjoint names.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .base import Task, step_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LETTERS = ("A", "B", "C", "D")
NAMES = (
    "Tom",
    "Anna",
    "Sam",
    "Ben",
    "Lucy",
    "Mark",
    "Emma",
    "John",
    "Mary",
    "Jack",
    "Kate",
    "Paul",
    "Peter",
    "Sarah",
    "David",
    "Laura",
    "James",
    "Alice",
    "Mike",
    "Jane",
    "Tim",
    "Lisa",
    "Max",
    "Amy",
)
OBJECTS = (
    "apples",
    "pens",
    "books",
    "cards",
    "coins",
    "eggs",
    "stamps",
    "cookies",
    "toys",
    "shells",
    "stickers",
    "balls",
    "flowers",
    "rocks",
    "cups",
    "boxes",
)
TEMPLATES = {
    "+": "{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
    "-": "{name} has {a} {obj} and gives away {b}. How many {obj} does {name} have now?",
}
OFFSETS = (1, -1, 2, -2, 10, -10)


@dataclass(frozen=True)
class ChoiceExample:
    """One problem: ``prompt`` (ends with ``"Answer:"``), ``answer`` (``" B"``), choices, token ids."""

    prompt: str
    answer: str
    answer_id: int
    input_ids: tuple[int, ...]
    choices: tuple[int, ...]
    correct: int  # index into choices / LETTERS

    @property
    def positions(self) -> dict[str, int]:
        """The task protocol's named positions: the last token."""
        return {"last": len(self.input_ids) - 1}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _single(tokenizer: "PreTrainedTokenizerBase", text: str) -> bool:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1


def vocabulary(tokenizer: "PreTrainedTokenizerBase", split: str = "all") -> tuple[list[str], list[str]]:
    """Names and objects that are single tokens for ``tokenizer``; names split alternately train/eval."""
    names = [n for n in NAMES if _single(tokenizer, n) and _single(tokenizer, " " + n)]
    objects = [o for o in OBJECTS if _single(tokenizer, " " + o)]
    if split == "train":
        names = names[0::2]
    elif split == "eval":
        names = names[1::2]
    elif split != "all":
        raise ValueError(f"unknown split {split!r}; choose train, eval or all")
    if len(names) < 2 or len(objects) < 2:
        raise ValueError(f"only {len(names)} names and {len(objects)} objects are single tokens for this tokenizer")
    return names, objects


def render(name: str, obj: str, a: int, b: int, op: str, choices: Sequence[int]) -> str:
    """The prompt text (ends with ``"Answer:"``)."""
    lines = [TEMPLATES[op].format(name=name, a=a, b=b, obj=obj)]
    lines += [f"{letter}. {value}" for letter, value in zip(LETTERS, choices)]
    return "\n".join(lines) + "\nAnswer:"


def _problem(rng: random.Random) -> tuple[int, int, str, int]:
    if rng.random() < 0.5:
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        return a, b, "+", a + b
    a = rng.randint(30, 99)
    b = rng.randint(10, a - 10)
    return a, b, "-", a - b


def _choices(rng: random.Random, value: int, correct: int) -> tuple[int, ...]:
    pool = [value + o for o in OFFSETS if 10 <= value + o <= 99]
    wrong = rng.sample(pool, len(LETTERS) - 1)
    return tuple(wrong[:correct] + [value] + wrong[correct:])


def make_example(
    tokenizer: "PreTrainedTokenizerBase",
    name: str,
    obj: str,
    a: int,
    b: int,
    op: str,
    choices: Sequence[int],
    correct: int,
) -> ChoiceExample:
    """One example; raises if the answer letter is not one token appended to the prompt."""
    prompt, answer = render(name, obj, a, b, op, choices), " " + LETTERS[correct]
    ids = list(tokenizer(prompt)["input_ids"])
    full = list(tokenizer(prompt + answer)["input_ids"])
    if full[: len(ids)] != ids or len(full) != len(ids) + 1:
        raise ValueError(f"answer {answer!r} is not one token appended to {prompt!r} for this tokenizer")
    return ChoiceExample(prompt, answer, full[-1], tuple(ids), tuple(choices), correct)


def generate(tokenizer: "PreTrainedTokenizerBase", n: int, seed: int = 0, split: str = "all") -> list[ChoiceExample]:
    """``n`` problems, deterministic in ``seed``; example ``i`` has the answer under letter ``i % 4``."""
    if n < 1:
        raise ValueError("n must be at least 1")
    names, objects = vocabulary(tokenizer, split)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, op, value = _problem(rng)
        correct = i % len(LETTERS)
        out.append(
            make_example(
                tokenizer, rng.choice(names), rng.choice(objects), a, b, op, _choices(rng, value, correct), correct
            )
        )
    lengths = {len(e.input_ids) for e in out}
    if len(lengths) != 1:
        raise ValueError(
            f"prompts tokenize to different lengths {sorted(lengths)}; this tokenizer does not "
            "split digits or a name/object is not one token in context"
        )
    return out


def batch_tensors(records: Sequence[ChoiceExample]) -> dict[str, Any]:
    """``{"input_ids": [batch, pos], "answer_ids": [batch]}`` (all prompts have one length)."""
    import torch

    return {
        "input_ids": torch.tensor([r.input_ids for r in records], dtype=torch.long),
        "answer_ids": torch.tensor([r.answer_id for r in records], dtype=torch.long),
    }


TASK = Task(
    name="multiple-choice",
    description="multiple-choice arithmetic word problems (the answer letter)",
    examples=lambda tokenizer, n, seed=0, split="all": generate(tokenizer, n, seed=seed, split=split),
    positions=("last",),
    options=("split",),
    train_batch=lambda tokenizer, batch_size, data_seed, step, **_: batch_tensors(
        generate(tokenizer, batch_size, seed=step_seed(data_seed, step), split="train")
    ),
    pool_batch=lambda tokenizer, n, seed: batch_tensors(generate(tokenizer, n, seed=seed, split="train")),
    eval_batch=lambda tokenizer, n, seed: batch_tensors(generate(tokenizer, n, seed=seed, split="eval")),
)
