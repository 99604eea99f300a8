"""Records and pairs of any task, and how the engine batches and hashes them (the record half of the
task protocol, `mechdiff.tasks.base`, which re-exports every name here: import them from there).

A *record* is one prompt: its token ids, the answer token, optional alternative answer tokens
(``alternative_ids``, e.g. the subject name in IOI) and named token positions. A position is a
single token index (``int``; ``None`` where absent, batched as ``-1``) or a *position class*,
several indices (a tuple, batched as ``[batch, k]``). Entity tracking's
`EntityTrackingExample` is such a record;
`Example` is the generic one (IOI, knowledge relations, tasks imported from JSONL files).

A *pair* is a clean record (``base``), a counterfactual record (``source``) of the same token
length and the answer the patched clean run should give (``target`` / ``target_id``).
`check_pair` refuses a pair whose two prompts differ in length, naming both lengths.

Records of a task may differ in token length and template. The engine batches them through one helper,
`grouped_batches`: records are grouped by (template, token length) (`group_key`; a record's
template is its ``template`` field where it has one, else its length alone names the group), each group is
cut into batches without padding, and every stage puts per-prompt outcomes back in the records' order.

Every batch carries ``position_classes``: the record type's own (``position_masks``, entity tracking),
the classes a record names itself (``Example.classes``), or else a partition derived from its named
positions (`derived_classes`).

This module imports no task and no registry, so that a task's module (and the JSONL importer,
`mechdiff.tasks.jsonl`) can build records without importing `mechdiff.tasks.base`'s registry.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar, Union, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

Position = Union[int, tuple[int, ...], None]


@runtime_checkable
class Record(Protocol):
    """What the engine reads from one prompt."""

    input_ids: tuple[int, ...]
    answer_id: int
    positions: Mapping[str, Position]

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class PairRecord(Protocol):
    """What the engine reads from one counterfactual pair."""

    base: Record
    source: Record
    target_id: int

    def to_dict(self) -> dict[str, Any]: ...


# --------------------------------------------------------------------------------------
# Generic records
# --------------------------------------------------------------------------------------


def _position_from_json(value: Any) -> Position:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return int(value)


def _position_to_json(value: Position) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Example:
    """One prompt of any task: ``positions`` name -> token index, ``None`` or a tuple (a position class).

    ``template``: the phrasing the prompt was written from (its mean-ablation group, with its length);
    ``classes``: position classes the prompt names itself, name -> token indices (else they are derived
    from ``positions``, `derived_classes`). An answer of several tokens: ``answer_tokens`` holds every
    token (``answer_id`` its first) and ``alternative_tokens`` each alternative's tokens (``alternative_ids``
    their first); both stay empty where every answer is one token, so such a record is what it always was
    (read them through `answer_tokens` and `alternative_tokens`)."""

    prompt: str
    input_ids: tuple[int, ...]
    answer: str
    answer_id: int
    positions: dict[str, Position] = field(default_factory=dict)
    alternatives: tuple[str, ...] = ()
    alternative_ids: tuple[int, ...] = ()
    template: str = ""
    classes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    answer_tokens: tuple[int, ...] = ()
    alternative_tokens: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        check_answer_tokens(self)
        n = len(self.input_ids)
        for name, pos in [*self.positions.items(), *self.classes.items()]:
            for p in pos if isinstance(pos, tuple) else (() if pos is None else (pos,)):
                if not 0 <= p < n:
                    raise ValueError(f"position {name!r} = {p} lies outside the prompt's {n} tokens: {self.prompt!r}")

    def __hash__(self) -> int:
        return hash((self.prompt, self.input_ids, self.answer_id, self.alternative_ids, self.answer_tokens))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists; ``template``, ``classes``, ``answer_tokens`` and
        ``alternative_tokens`` only where given, so the hash of a record without them is what it always was)."""
        out = {
            "prompt": self.prompt,
            "input_ids": list(self.input_ids),
            "answer": self.answer,
            "answer_id": self.answer_id,
            "alternatives": list(self.alternatives),
            "alternative_ids": list(self.alternative_ids),
            "positions": {k: _position_to_json(v) for k, v in self.positions.items()},
        }
        if self.template:
            out["template"] = self.template
        if self.classes:
            out["classes"] = {k: list(v) for k, v in self.classes.items()}
        if self.answer_tokens:
            out["answer_tokens"] = list(self.answer_tokens)
        if self.alternative_tokens:
            out["alternative_tokens"] = [list(a) for a in self.alternative_tokens]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Example":
        """Inverse of `to_dict`."""
        return cls(
            d["prompt"],
            tuple(int(i) for i in d["input_ids"]),
            d["answer"],
            int(d["answer_id"]),
            {k: _position_from_json(v) for k, v in d.get("positions", {}).items()},
            tuple(d.get("alternatives", ())),
            tuple(int(i) for i in d.get("alternative_ids", ())),
            d.get("template", ""),
            {k: tuple(int(i) for i in v) for k, v in d.get("classes", {}).items()},
            tuple(int(i) for i in d.get("answer_tokens", ())),
            tuple(tuple(int(i) for i in a) for a in d.get("alternative_tokens", ())),
        )


@dataclass(frozen=True)
class Pair:
    """A clean prompt (``base``), its counterfactual (``source``, same token length) and the target answer
    (``target_tokens``: every token of a target of several, ``target_id`` its first; empty for one token)."""

    base: Example
    source: Example
    target: str
    target_id: int
    kind: str = "counterfactual"
    target_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_pair(self.base, self.source)
        if self.target_tokens and (len(self.target_tokens) < 2 or self.target_tokens[0] != self.target_id):
            raise ValueError(
                f"target_tokens {list(self.target_tokens)} must be two or more tokens starting at target_id "
                f"{self.target_id} (leave it empty for a target of one token)"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {
            "base": self.base.to_dict(),
            "source": self.source.to_dict(),
            "target": self.target,
            "target_id": self.target_id,
            "kind": self.kind,
        }
        if self.target_tokens:
            out["target_tokens"] = list(self.target_tokens)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Pair":
        return cls(
            Example.from_dict(d["base"]),
            Example.from_dict(d["source"]),
            d["target"],
            int(d["target_id"]),
            d.get("kind", "counterfactual"),
            tuple(int(i) for i in d.get("target_tokens", ())),
        )


def check_answer_tokens(record: Any) -> None:
    """Refuse a record whose ``answer_tokens`` (``alternative_tokens``) are not empty or two or more tokens
    starting at ``answer_id`` (the matching ``alternative_ids``)."""
    tokens = getattr(record, "answer_tokens", ())
    if tokens and (len(tokens) < 2 or tokens[0] != record.answer_id):
        raise ValueError(
            f"answer_tokens {list(tokens)} must be two or more tokens starting at answer_id {record.answer_id} "
            "(leave it empty for an answer of one token)"
        )
    alternatives = getattr(record, "alternative_tokens", ())
    if alternatives and [a[:1] for a in alternatives] != [(i,) for i in record.alternative_ids]:
        raise ValueError(
            f"alternative_tokens {[list(a) for a in alternatives]} must give one token list per alternative, "
            f"each starting at its alternative_ids entry {list(record.alternative_ids)}"
        )


def answer_tokens(record: Any) -> tuple[int, ...]:
    """A record's answer as token ids (one or more): its ``answer_tokens`` where given, else ``(answer_id,)``."""
    return tuple(getattr(record, "answer_tokens", ()) or (record.answer_id,))


def alternative_tokens(record: Any) -> tuple[tuple[int, ...], ...]:
    """Each alternative answer of a record as token ids: its ``alternative_tokens`` where given, else one
    token each (``alternative_ids``)."""
    return tuple(getattr(record, "alternative_tokens", ()) or ((i,) for i in getattr(record, "alternative_ids", ())))


def target_tokens(pair: Any) -> tuple[int, ...]:
    """A pair's target as token ids: its ``target_tokens`` where given, else ``(target_id,)``."""
    return tuple(getattr(pair, "target_tokens", ()) or (pair.target_id,))


def answer_chance(records: Sequence[Any]) -> tuple[float, str]:
    """The chance level of top-1 accuracy on ``records`` where a task states none: one over the distinct answers
    (token sequences) the records hold, the accuracy of guessing among them (two answers: 0.5), and how it was
    derived, in words."""
    if not records:
        raise ValueError("no records to derive a chance level from")
    n = len({answer_tokens(r) for r in records})
    return 1 / n, f"chance: one over the {n} distinct answers of the {len(records)} accuracy prompts"


def answer_length(record: Any) -> int:
    """The most tokens any answer of a record (or a pair: its prompts and target) has: 1 for one-token answers."""
    if is_pair(record):
        return max(answer_length(record.base), answer_length(record.source), len(target_tokens(record)))
    return max([len(answer_tokens(record)), *(len(a) for a in alternative_tokens(record))])


def max_answer_length(records: Sequence[Any]) -> int:
    """`answer_length` over ``records`` (1 where there are none)."""
    return max((answer_length(r) for r in records), default=1)


def check_one_token(records: Sequence[Any], stage: str, task: str = "", does: str = "scores one answer token") -> None:
    """Refuse, naming ``stage`` and what it ``does``, records with an answer of several tokens: a stage that scores
    (or trains on) one answer token."""
    n = max_answer_length(records)
    if n > 1:
        raise ValueError(f"stage {stage} {does}; task {task or 'these records'} has answers of up to {n} tokens")


def check_pair(base: Record, source: Record, where: str = "") -> None:
    """Refuse a pair whose prompts differ in token length (patching writes position by position)."""
    if len(base.input_ids) != len(source.input_ids):
        raise ValueError(
            f"{where}clean and counterfactual prompts differ in token length: "
            f"{len(base.input_ids)} vs {len(source.input_ids)} tokens; a counterfactual pair needs "
            "prompts of equal length (reword one, or pad with a token both share)"
        )


# --------------------------------------------------------------------------------------
# Batching and hashing (what the engine calls)
# --------------------------------------------------------------------------------------


def is_pair(record: Any) -> bool:
    """True for a counterfactual pair (it has ``base`` and ``source``)."""
    return hasattr(record, "base") and hasattr(record, "source")


GroupKey = tuple[str, int]
"""A batching group: ``(template, token length)``; the template is ``""`` where records name none."""


def template_of(record: Any) -> str:
    """A record's template (a pair's: its clean prompt's): its ``template`` field where it is a non-empty
    string, else ``""`` (the group is then its token length alone)."""
    record = record.base if is_pair(record) else record
    template = getattr(record, "template", "")
    return template if isinstance(template, str) else ""


def group_key(record: Any) -> GroupKey:
    """``(template, token length)`` of a record or pair (a pair's prompts share one length, `check_pair`)."""
    base = record.base if is_pair(record) else record
    return template_of(record), len(base.input_ids)


def group_name(key: GroupKey) -> str:
    """``"template 'A', 12 tokens"`` or ``"12 tokens"`` (no template)."""
    template, n = key
    return f"template {template!r}, {n} tokens" if template else f"{n} tokens"


def grouped_batches(records: Sequence[Any], batch_size: int) -> list[list[int]]:
    """The one batching of every stage: indices into ``records`` (records or pairs), grouped by
    `group_key` in order of each group's first record, each group cut into consecutive batches
    of at most ``batch_size``. Every batch is of one token length and one template, so it is batched
    without padding; a stage writes each batch's per-prompt outcomes back at these indices. Records of
    one group (entity tracking, IOI) give exactly the slices ``[0, b), [b, 2b), ...``."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    groups: dict[GroupKey, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(group_key(r), []).append(i)
    return [rows[i : i + batch_size] for rows in groups.values() for i in range(0, len(rows), batch_size)]


def group_batches(records: Sequence[Any]) -> list[list[int]]:
    """`grouped_batches` with one batch per group (every record of a group in one batch)."""
    return grouped_batches(records, max(len(records), 1))


def record_order(batches: Sequence[Sequence[int]]) -> "np.ndarray":
    """The permutation that puts outcomes concatenated batch by batch (``batches``: indices into the
    records, as `grouped_batches` gives them) back in the records' order."""
    import numpy as np

    rows = [np.asarray(r, dtype=np.int64) for r in batches]
    return np.argsort(np.concatenate(rows), kind="stable") if rows else np.zeros(0, dtype=np.int64)


def take(records: Sequence[Any], rows: Sequence[int]) -> list:
    """``records`` at ``rows``."""
    return [records[i] for i in rows]


def check_reference(records: Sequence[Any], reference: Sequence[Any], what: str = "prompts") -> None:
    """Refuse ``records`` with a group (template, length) that no reference record shares: mean ablation
    takes each position's mean over reference prompts of the record's own template and length."""
    have = {group_key(r) for r in reference}
    missing = list(dict.fromkeys(group_key(r) for r in records if group_key(r) not in have))
    if missing:
        raise ValueError(
            f"no reference prompts for the {what} of {'; '.join(group_name(k) for k in missing)}: "
            "mean ablation averages over reference prompts of the same template and length; add "
            f"reference prompts of those groups (reference groups: "
            f"{'; '.join(group_name(k) for k in sorted(have)) or 'none'})"
        )


def batch_tensors(records: Sequence[Record]) -> dict[str, Any]:
    """Tensors for records of one token length (no padding; `grouped_batches` forms such batches).

    ``input_ids`` and ``attention_mask`` ``[batch, pos]``, ``answer_ids`` ``[batch]``,
    ``alternative_ids`` ``[batch, n_alt]`` when every record has the same number (> 0) of them,
    ``positions``: name -> ``[batch]`` (``-1`` where absent) or ``[batch, k]`` (a position class);
    ``position_classes``: name -> boolean ``[batch, pos]`` (the record type's ``position_masks``, the
    records' own ``classes``, else `derived_classes`); ``group``: the records' `group_key`
    (``None`` where they mix templates).
    """
    import torch

    records = list(records)
    if not records:
        raise ValueError("no records to batch")
    if any(is_pair(r) for r in records):
        raise TypeError("batch_tensors takes single records; for counterfactual pairs use pair_batch_tensors")
    lengths = {len(r.input_ids) for r in records}
    if len(lengths) != 1:
        raise ValueError(
            f"records have different token lengths {sorted(lengths)}; batch prompts of one length "
            "(grouped_batches groups records by template and length)"
        )
    names = list(records[0].positions)
    for r in records:
        if set(r.positions) != set(names):
            raise ValueError(f"records name different positions: {sorted(names)} vs {sorted(r.positions)}")
    input_ids = torch.tensor([r.input_ids for r in records], dtype=torch.long)
    keys = {group_key(r) for r in records}
    out = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "answer_ids": torch.tensor([r.answer_id for r in records], dtype=torch.long),
        "positions": {name: _position_tensor(records, name) for name in names},
        "group": next(iter(keys)) if len(keys) == 1 else None,
    }
    alternatives = [tuple(getattr(r, "alternative_ids", ())) for r in records]
    if alternatives[0] and len({len(a) for a in alternatives}) == 1:
        out["alternative_ids"] = torch.tensor(alternatives, dtype=torch.long)
    if max_answer_length(records) > 1:
        out.update(_answer_tensors(records, "alternative_ids" in out))
    masks = getattr(type(records[0]), "position_masks", None)
    if masks is not None:  # a task may define position classes of any size per prompt as "batch pos" masks
        out["position_classes"] = masks(records, input_ids.shape[1])
    elif any(getattr(r, "classes", None) for r in records):
        out["position_classes"] = own_classes(records, input_ids.shape[1])
    else:
        out["position_classes"] = derived_classes(records, input_ids.shape[1])
    return out


BEFORE, LAST, AFTER = "before", "last", "after_"


def derived_class_names(names: Sequence[str]) -> list[str]:
    """The classes `derived_classes` gives records naming ``names``: ``before``, each name, ``after_<name>``
    for each, and ``last``."""
    out = [BEFORE]
    for n in names:
        out += [n] if n == LAST else [n, AFTER + n]
    return list(dict.fromkeys(out + [LAST]))


def derived_classes(records: Sequence[Record], n_pos: int) -> dict[str, "torch.Tensor"]:
    """Position classes from named positions, for record types without their own: a partition of every
    prompt's tokens (boolean ``"batch pos"`` each).

    - ``<name>``: the token(s) of each named position;
    - ``after_<name>``: the tokens after each of them up to the next named position (where a binding, e.g.
      entity tracking's separator after a label, sits);
    - ``before``: the tokens before the first named position;
    - ``last``: the last token (the read-out), whether or not a position is named ``last``.
    A token named twice belongs to the first name in the records' order (the other class is empty there).
    """
    import torch

    names = list(records[0].positions)
    classes = derived_class_names(names)
    clash = [n for n in names if n == BEFORE or n.startswith(AFTER)]
    if clash:
        raise ValueError(f"positions {clash} clash with derived class names ({BEFORE!r}, {AFTER!r}...); rename them")
    masks = {c: torch.zeros(len(records), n_pos, dtype=torch.bool) for c in classes}
    for row, r in enumerate(records):
        owner: dict[int, str] = {n_pos - 1: LAST}
        for name in names:
            pos = r.positions[name]
            for p in pos if isinstance(pos, tuple) else (() if pos is None else (pos,)):
                owner.setdefault(p, name)
        named = sorted(owner)
        masks[BEFORE][row, : named[0]] = True
        for i, p in enumerate(named):
            masks[owner[p]][row, p] = True
            end = named[i + 1] if i + 1 < len(named) else n_pos
            if owner[p] != LAST:
                masks[AFTER + owner[p]][row, p + 1 : end] = True
    return masks


def own_classes(records: Sequence[Record], n_pos: int) -> dict[str, "torch.Tensor"]:
    """The classes records name themselves (``classes``: name -> token indices), as ``"batch pos"`` masks;
    every record must name the same classes."""
    import torch

    names = list(records[0].classes)
    masks = {c: torch.zeros(len(records), n_pos, dtype=torch.bool) for c in names}
    for row, r in enumerate(records):
        if set(r.classes) != set(names):
            raise ValueError(f"records name different position classes: {sorted(names)} vs {sorted(r.classes)}")
        for c, where in r.classes.items():
            masks[c][row, list(where)] = True
    return masks


def token_tensors(answers: Sequence[Sequence[int]]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Answers of any token length as ``"batch a"`` token ids (right-padded with 0 to the longest) and
    their lengths ``"batch"``."""
    import torch

    width = max(len(a) for a in answers)
    tokens = torch.tensor([list(a) + [0] * (width - len(a)) for a in answers], dtype=torch.long)
    return tokens, torch.tensor([len(a) for a in answers], dtype=torch.long)


def _answer_tensors(records: Sequence[Record], alternatives: bool) -> dict[str, "torch.Tensor"]:
    """``answer_tokens``/``answer_lengths`` and (``alternatives``) ``alternative_tokens``/``alternative_lengths``."""
    tokens, lengths = token_tensors([answer_tokens(r) for r in records])
    out = {"answer_tokens": tokens, "answer_lengths": lengths}
    if alternatives:
        alts = [alternative_tokens(r) for r in records]
        k = len(alts[0])
        flat, flat_lengths = token_tensors([a for alt in alts for a in alt])
        out["alternative_tokens"] = flat.view(len(records), k, -1)
        out["alternative_lengths"] = flat_lengths.view(len(records), k)
    return out


def _position_tensor(records: Sequence[Record], name: str) -> "torch.Tensor":
    import torch

    values = [r.positions[name] for r in records]
    if any(isinstance(v, (tuple, list)) for v in values):
        sizes = {len(v) for v in values if v is not None}
        if len(sizes) != 1 or any(v is None for v in values):
            raise ValueError(
                f"position class {name!r} has different sizes {sorted(sizes)} across records; "
                "batch records whose classes have one size"
            )
        return torch.tensor([list(v) for v in values], dtype=torch.long)
    return torch.tensor([-1 if v is None else v for v in values], dtype=torch.long)


def pair_batch_tensors(pairs: Sequence[PairRecord]) -> dict[str, Any]:
    """``{"base": batch_tensors(bases), "source": batch_tensors(sources), "target_ids": [batch]}``; where a
    target has several tokens, also ``target_tokens`` ``[batch, a]`` and ``target_lengths`` (`token_tensors`)."""
    import torch

    pairs = list(pairs)
    for i, p in enumerate(pairs):
        check_pair(p.base, p.source, f"pair {i}: ")
    base = batch_tensors([p.base for p in pairs])
    source = batch_tensors([p.source for p in pairs])
    out = {"base": base, "source": source, "target_ids": torch.tensor([p.target_id for p in pairs], dtype=torch.long)}
    if any(len(target_tokens(p)) > 1 for p in pairs):
        out["target_tokens"], out["target_lengths"] = token_tensors([target_tokens(p) for p in pairs])
    return out


def record_dict(record: Any) -> dict[str, Any]:
    """``{"type": "example" | "pair", **record.to_dict()}``: the canonical form hashed and written."""
    return {"type": "pair" if is_pair(record) else "example", **record.to_dict()}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


#: `per_tokenizer`'s values: by tokenizer object, then by key and vocabulary size.
_PER_TOKENIZER: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_T = TypeVar("_T")


def per_tokenizer(tokenizer: Any, key: Any, compute: Callable[[], _T]) -> _T:
    """``compute()`` taken once per tokenizer object and ``key``, and again where the tokenizer's vocabulary grew
    (``len(tokenizer)``): what a task asks of one tokenizer at every prompt set a study draws. Computed at every
    call for a stand-in tokenizer without a size or one that cannot be weakly referenced."""
    try:
        held, full = _PER_TOKENIZER.setdefault(tokenizer, {}), (key, len(tokenizer))
    except TypeError:
        return compute()
    if full not in held:
        held[full] = compute()
    return held[full]


def dataset_hash(records: Sequence[Any]) -> str:
    """sha256 of a canonical JSON of the records (order matters; token ids included)."""
    return hashlib.sha256(canonical_json([record_dict(r) for r in records]).encode("utf-8")).hexdigest()


Batch = dict[str, Any]


def answer_batch(records: Sequence[Record]) -> Batch:
    """``{"input_ids": [batch, pos], "answer_ids": [batch]}``: what fine-tuning and HeadMap train on (one answer
    token each: records with longer answers are refused)."""
    check_one_token(
        records,
        "fine-tuning / HeadMap training batches",
        does="trains on one answer token (the next-token loss at the prompt's last position; every scoring stage, "
        "path patching and the scans included, takes answers of several tokens)",
    )
    t = batch_tensors(records)
    return {"input_ids": t["input_ids"], "answer_ids": t["answer_ids"]}
