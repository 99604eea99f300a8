"""Indirect-object identification (IOI; Wang et al. 2022, "Interpretability in the Wild").

A prompt names two people, then repeats one of them (the subject S) as the giver; the answer is
the other (the indirect object IO)::

    When Mary and John went to the store, John gave a drink to      ->  " Mary"

Positions: ``IO`` and ``S1`` (the two names in the first clause), ``S2`` (the repeated subject) and
``last`` (the final token, Wang et al.'s END). The metric is the logit difference IO - S
(``alternative_ids`` holds S). Every template is used both ways: IO first (ABBA) and S first (BABA).

Templates: Wang et al.'s BABA/ABBA templates (their ``ioi_dataset.py``), cut before the final IO, so
prompts of different templates have different token lengths (`TEMPLATES`: 14, 15, 17 and 20
tokens in SmolLM2's tokenizer). A record's ``template`` field is its template's text: mean ablation and batching
group records by (template, token length), so a position-wise mean never mixes templates. ABBA and BABA
prompts of one template share a group (their reference prompts, ABC corruptions, are the same
distribution: three distinct names).

Counterfactual pairs are ABC corruptions: the same template, place and object with three new
names (none of the clean prompt's), so no name repeats and nothing points to the clean IO; the
target is the clean IO. Every name, place and object is one token after a space, so all prompts of
one template have one token length and a pair's two prompts are equal in length. Every position is
located from the tokenizer's offsets (never by search).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from .base import Example, Pair, Task, derived_class_names

PLAN = Path(__file__).resolve().parent / "plans" / "ioi.toml"
GROUP_NAMES = {"NM": "name mover", "SI": "S-inhibition", "IND": "induction / duplicate token"}
#: ``{A}`` and ``{B}``: the two names of the first clause (IO and S in either order); ``{S}``: the giver.
#: Wang et al.'s templates, ending before the answer (the first is mechdiff's earlier IOI template).
ALL_TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {obj} to",
    "After {A} and {B} went to the {place}, {S} gave a {obj} to",
    "Then, {A} and {B} went to the {place}. {S} gave a {obj} to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
    "While {A} and {B} were working at the {place}, {S} gave a {obj} to",
    "Then, {A} and {B} were working at the {place}. {S} decided to give a {obj} to",
    "When {A} and {B} got a {obj} at the {place}, {S} decided to give it to",
    "Then, {A} and {B} were thinking about going to the {place}. {S} wanted to give a {obj} to",
)
#: The default set: four of them, each of its own token length in SmolLM2's tokenizer (14, 15, 17 and 20
#: tokens). Every (template, length) group is its own batch and its own mean-ablation group, so scoring
#: costs grow with the number of templates; pass ``templates=ALL_TEMPLATES`` for all eight.
TEMPLATES = (ALL_TEMPLATES[0], ALL_TEMPLATES[3], ALL_TEMPLATES[6], ALL_TEMPLATES[7])
FIELDS = ("A", "B", "S", "place", "obj")
NAMED = ("IO", "S1", "S2", "last")  # every record's named positions
NAMES = (
    "Mary",
    "John",
    "Tom",
    "James",
    "Anna",
    "Paul",
    "Sarah",
    "Mark",
    "Lisa",
    "David",
    "Emma",
    "Peter",
    "Kate",
    "Michael",
    "Laura",
    "Robert",
    "Alice",
    "Daniel",
    "Jane",
    "Steven",
    "Susan",
    "Kevin",
    "Rachel",
    "Brian",
    "Linda",
    "George",
    "Amy",
    "Richard",
    "Helen",
    "Jack",
    "Karen",
    "Adam",
    "Claire",
    "Simon",
)
PLACES = ("store", "park", "school", "office", "garden", "restaurant", "hospital", "station", "beach", "market")
OBJECTS = ("drink", "book", "ball", "key", "gift", "letter", "ring", "flower", "bag", "phone")


def _single(tokenizer: Any, word: str) -> Optional[int]:
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def vocabulary(tokenizer: Any) -> tuple[list[str], list[str], list[str]]:
    """Names, places and objects that are one token after a space for ``tokenizer``."""
    names, places, objs = ([w for w in ws if _single(tokenizer, w) is not None] for ws in (NAMES, PLACES, OBJECTS))
    if len(names) < 5 or not places or not objs:
        raise ValueError(
            f"only {len(names)} names, {len(places)} places and {len(objs)} objects are single tokens "
            "for this tokenizer; IOI needs at least 5 names and one place and object"
        )
    return names, places, objs


def _fill(template: str, values: dict[str, str]) -> tuple[str, dict[str, tuple[int, int]]]:
    """``template`` filled with ``values``, and the character span of each of ``A``, ``B`` and ``S``."""
    text, spans, at = "", {}, 0
    for m in re.finditer(r"\{(\w+)\}", template):
        key = m.group(1)
        if key not in FIELDS:
            raise ValueError(f"template {template!r} has an unknown field {{{key}}}; fields: {', '.join(FIELDS)}")
        text += template[at : m.start()]
        if key in ("A", "B", "S"):
            spans[key] = (len(text), len(text) + len(values[key]))
        text += values[key]
        at = m.end()
    missing = {"A", "B", "S"} - set(spans)
    if missing:
        raise ValueError(f"template {template!r} lacks {sorted(missing)}; an IOI template names {{A}}, {{B}} and {{S}}")
    return text + template[at:], spans


def build(
    tokenizer: Any, template: str, io: str, s: str, place: str, obj: str, io_first: bool, giver: Optional[str] = None
) -> Example:
    """One prompt: ``io`` and ``s`` in the first clause (``io`` first when ``io_first``), ``giver``
    (default ``s``) in the second; positions from the tokenizer's offsets; ``template`` recorded."""
    a, b = (io, s) if io_first else (s, io)
    text, spans = _fill(template, {"A": a, "B": b, "S": s if giver is None else giver, "place": place, "obj": obj})
    enc = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = [int(i) for i in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]

    def token(key: str) -> int:
        start, end = spans[key]
        hits = [t for t, (x, y) in enumerate(offsets) if y > x and x < end and y > start]
        if len(hits) != 1:
            raise ValueError(f"{text[start:end]!r} in {text!r} is {len(hits)} tokens, expected one")
        return hits[0]

    io_key, s_key = ("A", "B") if io_first else ("B", "A")
    positions = {"IO": token(io_key), "S1": token(s_key), "S2": token("S"), "last": len(ids) - 1}
    return Example(
        text,
        tuple(ids),
        " " + io,
        _single(tokenizer, io),
        positions,
        (" " + s,),
        (_single(tokenizer, s),),
        template=template,
    )


def template_lengths(tokenizer: Any, templates: Sequence[str] = TEMPLATES) -> dict[str, int]:
    """Each template's prompt length in tokens (one length per template: every filler is one token)."""
    names, places, objs = vocabulary(tokenizer)
    return {t: len(build(tokenizer, t, names[0], names[1], places[0], objs[0], True).input_ids) for t in templates}


def _draws(
    tokenizer: Any, n: int, seed: int, templates: Sequence[str] = TEMPLATES
) -> list[tuple[str, str, str, str, str, bool]]:
    """``(template, io, s, place, obj, io_first)`` of each of ``n`` prompts: templates cycled, each in both
    orders (IO first in half), names, place and object drawn with ``random.Random(seed)``."""
    if n < 1:
        raise ValueError("n must be at least 1")
    if not templates:
        raise ValueError("give at least one template")
    names, places, objs = vocabulary(tokenizer)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        io, s = rng.sample(names, 2)
        io_first = (i // len(templates) + i % len(templates)) % 2 == 0  # each template's orders alternate
        out.append((templates[i % len(templates)], io, s, rng.choice(places), rng.choice(objs), io_first))
    return out


def generate(tokenizer: Any, n: int, seed: int = 0, templates: Sequence[str] = TEMPLATES) -> list[Example]:
    """``n`` IOI prompts over ``templates`` (cycled), deterministic in ``seed``."""
    return [build(tokenizer, *d) for d in _draws(tokenizer, n, seed, templates)]


def _pairs(tokenizer: Any, n: int, seed: int, kind: str, templates: Sequence[str] = TEMPLATES) -> list[Pair]:
    names, _, _ = vocabulary(tokenizer)
    rng = random.Random(f"{seed}:{kind}")
    out = []
    for template, io, s, place, obj, io_first in _draws(tokenizer, n, seed, templates):
        base = build(tokenizer, template, io, s, place, obj, io_first)
        pool = [x for x in names if x not in (io, s)]
        if kind == "abc":
            a, b, c = rng.sample(pool, 3)
            source = build(tokenizer, template, a, b, place, obj, io_first, giver=c)
            out.append(Pair(base, source, base.answer, base.answer_id, kind))
        else:
            new_io, new_s = rng.sample(pool, 2)
            source = build(tokenizer, template, new_io, new_s, place, obj, io_first)
            out.append(Pair(base, source, source.answer, source.answer_id, kind))
    return out


def abc_pairs(tokenizer: Any, n: int, seed: int = 0, templates: Sequence[str] = TEMPLATES) -> list[Pair]:
    """Clean prompts (`generate` with ``seed``) and their ABC corruptions: three new names (the
    giver is a third person), the same template, place and object; target the clean IO."""
    return _pairs(tokenizer, n, seed, "abc", templates)


def io_name_pairs(tokenizer: Any, n: int, seed: int = 0, templates: Sequence[str] = TEMPLATES) -> list[Pair]:
    """DCM desideratum: the source is the same prompt with two new names; target the source's IO
    (heads that carry the name to be copied move the answer to it)."""
    return _pairs(tokenizer, n, seed, "io_name", templates)


TASK = Task(
    name="ioi",
    description="indirect-object identification (Wang et al. 2022): who receives?",
    examples=generate,
    pairs=abc_pairs,
    desiderata={"io_name": io_name_pairs},
    plan=PLAN,
    metric="logit_diff",
    positions=tuple(derived_class_names(NAMED)),  # the named positions and the classes derived from them
    group_names=GROUP_NAMES,
    chance=lambda **_: 0.5,  # one of the two names
)
