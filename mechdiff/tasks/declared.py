"""DCM desiderata an imported task declares: named sets of pairs, each with its own target.

A desideratum of an imported task is one pair per row of the task (so a study's drawn prompt sets hold for
it too: DCM reads the desideratum's pairs of the rows drawn for its ``dcm`` set). Row ``i``'s pair patches the
row's clean prompt from a counterfactual prompt (the row's own ``counterfactual``, or one the desideratum
gives) and asks the patched run for the desideratum's ``target``. A desideratum is declared one of three ways:

- ``NAME=COLUMN`` (``mechdiff dataset import --desideratum``): each row's ``COLUMN`` holds the target (a
  string); the counterfactual prompt is the row's own;
- ``NAME=FILE.jsonl``: a JSONL of its own, line ``i`` for row ``i``: ``{"target": ...}`` and optionally its
  own ``"counterfactual"`` prompt (and ``"counterfactual_positions"``), checked like the pairs file;
- in the rows: ``"desiderata": {"NAME": {"target": ..., "counterfactual": ...}}`` (every row the same names).

Without any, a task whose rows all give a ``counterfactual_answer`` (different from the answer on some row)
declares ``counterfactual``: target the counterfactual prompt's answer, as it always did. A desideratum whose
target is the clean answer on every row is refused: patching has nothing to move.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .records import Pair, answer_tokens, canonical_json, record_dict, target_tokens
from .row_checks import LAST, ImportErrors, answer_ids, encode_offsets, example_of, length_problem, locate, several

COUNTERFACTUAL = "counterfactual"
DESIDERATA_DIR = "desiderata"
INLINE = "desiderata"  # the rows' own key
ENTRY_KEYS = {"target", "counterfactual", "counterfactual_positions"}
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
USAGE = (
    "write NAME=COLUMN (each row's COLUMN holds the target) or NAME=FILE.jsonl (one "
    '{"target": ..., "counterfactual": ...} a row of the pairs file)'
)


@dataclass(frozen=True)
class Declared:
    """One declared desideratum: its target from a ``column`` of the rows, a ``file`` of its own, or (neither)
    the rows' own ``desiderata`` objects."""

    name: str
    column: Optional[str] = None
    file: Optional[Path] = None

    @property
    def source(self) -> str:
        """Where the targets come from, as ``task.json`` records it."""
        if self.file is not None:
            return f"file {self.file}"
        return f"column {self.column}" if self.column is not None else "the rows' desiderata"


def parse_declaration(text: str) -> Declared:
    """``NAME=COLUMN`` or ``NAME=FILE.jsonl`` (a path ending in ``.jsonl``); refused with the usage otherwise."""
    name, sep, where = (s.strip() for s in text.partition("="))
    if not sep or not where or not NAME.fullmatch(name):
        raise ValueError(f"desideratum {text!r}: {USAGE}; NAME is letters, digits, '_', '-', '.'")
    if where.endswith(".jsonl"):
        if not Path(where).is_file():
            raise FileNotFoundError(f"desideratum {name}: file {where} does not exist")
        return Declared(name, file=Path(where))
    return Declared(name, column=where)


def non_blank_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line: the rows, as `read_pairs` counts."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]


def inline_declarations(path: Path) -> list[Declared]:
    """The desiderata the rows name in their ``desiderata`` objects (every row must name the same; refused,
    with the line, otherwise)."""
    seen: Optional[tuple[list[str], int]] = None
    errors = []
    for line_no, line in non_blank_lines(path):
        row = _json(line)
        if not isinstance(row, dict):
            continue  # a malformed line: the row checks name it
        own = row.get(INLINE)
        names = sorted(own) if isinstance(own, dict) else []
        if own is not None and not isinstance(own, dict):
            errors.append(f'{path}:{line_no}: {INLINE} must be an object {{name: {{"target": ...}}}}')
        elif seen is None:
            seen = (names, line_no)
        elif names != seen[0]:
            errors.append(f"{path}:{line_no}: {INLINE} {names} differ from line {seen[1]}'s {seen[0]}")
    if errors:
        raise ImportErrors(f"{len(errors)} bad row(s) in {path}; nothing was written:\n" + "\n".join(errors), errors)
    bad = [n for n in (seen[0] if seen else []) if not NAME.fullmatch(n)]
    if bad:
        raise ImportErrors(f"{path}: desideratum names {bad} must be letters, digits, '_', '-', '.'")
    return [Declared(n) for n in (seen[0] if seen else [])]


def check_declarations(declared: Sequence[Declared]) -> None:
    """Refuse a name declared twice."""
    names = [d.name for d in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"desiderata {twice} are declared twice (on the command line and/or in the rows)")


def extra_keys(declared: Sequence[Declared]) -> frozenset[str]:
    """The row keys declared desiderata add to a pairs file's (their columns, and ``desiderata``)."""
    return frozenset({d.column for d in declared if d.column} | {INLINE})


def entries(path: Path, n_rows: int, d: Declared) -> list[tuple[str, int, Any]]:
    """Per row of the pairs file ``path``: ``(file, line, entry)``, the entry (``{"target": ...}``, maybe a
    counterfactual) of desideratum ``d``, and the file and line it came from."""
    if d.file is not None:
        lines = non_blank_lines(d.file)
        if len(lines) != n_rows:
            raise ImportErrors(
                f"desideratum {d.name}: {d.file} has {len(lines)} rows and {path} {n_rows}; line i of the "
                "desideratum's file is the pair of row i of the pairs file"
            )
        return [(str(d.file), no, _json(line)) for no, line in lines]
    out = []
    for no, line in non_blank_lines(path):
        row = _json(line)
        if not isinstance(row, dict):
            out.append((str(path), no, None))  # a malformed line: the row checks name it, and give it no pair
        elif d.column is not None:
            value = row.get(d.column)
            out.append((str(path), no, {"target": value} if value is not None else {}))
        else:
            out.append((str(path), no, row[INLINE][d.name]))
    return out


def _json(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as e:
        return e  # reported with its line by `desideratum_pairs`


def desideratum_pairs(tokenizer: Any, path: Path, pairs: Sequence[Optional[Pair]], d: Declared) -> list[Pair]:
    """The pairs of desideratum ``d`` (one a row of ``pairs``, read from ``path``; a row whose pair is None, a bad
    row, is skipped); every bad entry is reported with its file and line, and a target that is the clean answer on
    every row is refused."""
    out, errors, rows = [], [], entries(path, len(pairs), d)
    for pair, (file, line_no, entry) in zip(pairs, rows):
        if pair is None:
            continue
        try:
            if isinstance(entry, Exception):
                raise ValueError(str(entry))
            out.append(entry_pair(tokenizer, pair, entry, d))
        except (ValueError, TypeError, KeyError) as e:
            errors.append(f"{file}:{line_no}: desideratum {d.name}: {e}")
    if errors:
        head = f"{len(errors)} bad row(s) of desideratum {d.name}; nothing was written:\n"
        raise ImportErrors(head + "\n".join(errors), errors)
    if not moved(out):
        raise ImportErrors(
            f"desideratum {d.name} ({d.source}): the target is the clean answer on every row "
            f"({rows[0][0]}, lines {rows[0][1]}-{rows[-1][1]}), so patching has "
            "nothing to move; give targets that differ from the answer (e.g. the counterfactual prompt's answer)"
        )
    return out


def moved(pairs: Sequence[Pair]) -> int:
    """How many pairs ask for a target other than the clean answer."""
    return sum(target_tokens(p) != answer_tokens(p.base) for p in pairs)


def entry_pair(tokenizer: Any, pair: Pair, entry: Any, d: Declared) -> Pair:
    """Row ``pair``'s pair of desideratum ``d``: its clean prompt patched from the entry's counterfactual (else
    the row's), target the entry's ``target``."""
    if not isinstance(entry, dict):
        raise ValueError('an entry must be an object {"target": ..., "counterfactual": ... (optional)}')
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; valid keys: {sorted(ENTRY_KEYS)}")
    target = entry.get("target")
    if not isinstance(target, str) or not target:
        where = f"column {d.column!r}" if d.column else "target"
        raise ValueError(f"{where} must hold the target answer, a non-empty string; got {target!r}")
    ids = answer_ids(tokenizer, pair.base.prompt, target)
    cf = entry.get("counterfactual")
    spans = entry.get("counterfactual_positions")
    source = pair.source if cf is None else own_source(tokenizer, pair, cf, spans, target)
    return Pair(pair.base, source, target, ids[0], d.name, several(ids))


def own_source(tokenizer: Any, pair: Pair, prompt: Any, spans: Optional[Mapping], target: str) -> Any:
    """The record of a desideratum's own counterfactual prompt: the clean prompt's token length, its positions
    located by ``spans`` (else at the clean prompt's token indices), its answer the target."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"counterfactual must be a non-empty string, got {prompt!r}")
    base = pair.base
    ids, offsets = encode_offsets(tokenizer, prompt)
    if len(ids) != len(base.input_ids):
        raise ValueError(length_problem(tokenizer, ids, base.input_ids, ("the counterfactual", "the clean prompt")))
    positions = dict(base.positions)
    if spans is not None:
        named = set(base.positions) - {LAST}
        if not isinstance(spans, dict) or not named <= set(spans) <= set(base.positions):
            raise ValueError(f"counterfactual_positions must name the positions {sorted(named)}, got {spans!r}")
        positions.update({n: locate(prompt, offsets, s, f"counterfactual {n}") for n, s in spans.items()})
    answer = (target, answer_ids(tokenizer, prompt, target))
    return example_of(prompt, ids, answer, positions, (), base.template, dict(base.classes))


def implicit_counterfactual(pairs: Sequence[Pair]) -> list[Pair]:
    """The ``counterfactual`` desideratum's pairs: target the counterfactual prompt's answer."""
    return [
        Pair(p.base, p.source, p.source.answer, p.source.answer_id, COUNTERFACTUAL, p.source.answer_tokens)
        for p in pairs
    ]


def declare(
    tokenizer: Any, path: Path, pairs: Sequence[Optional[Pair]], given: Sequence[Declared]
) -> tuple[dict[str, list[Pair]], dict[str, dict]]:
    """Every desideratum of a task (those ``given`` on the command line, those its rows name, else the implicit
    ``counterfactual``): name -> pairs (empty for the implicit one, read from the task's own pairs), and what
    ``task.json`` records of each. ``pairs``: each row's, None for a bad row (skipped, so every desideratum's
    problems of the other rows are found in the same pass); raises one `ImportErrors` listing every
    desideratum's problems."""
    declared = [*given, *inline_declarations(path)]
    check_declarations(declared)
    built, errors = {}, []
    for d in declared:
        try:
            built[d.name] = desideratum_pairs(tokenizer, path, pairs, d)
        except ImportErrors as e:
            errors += e.lines
    if errors:
        raise ImportErrors(f"{len(errors)} problem(s) of the declared desiderata:\n" + "\n".join(errors), errors)
    pairs = [p for p in pairs if p is not None]
    meta = {
        d.name: {"target": d.source, "pairs": f"{DESIDERATA_DIR}/{d.name}.jsonl", "moved": moved(built[d.name])}
        for d in declared
    }
    if not declared and all(p.base.alternative_ids for p in pairs):
        n = moved(implicit_counterfactual(pairs))
        if n:
            meta[COUNTERFACTUAL] = {"target": "counterfactual_answer", "pairs": None, "moved": n}
    return built, meta


def write_desiderata(directory: Path, built: Mapping[str, Sequence[Pair]]) -> None:
    """``desiderata/NAME.jsonl`` of each desideratum's pairs, one record a line, in row order."""
    if not built:
        return
    (directory / DESIDERATA_DIR).mkdir()
    for name, pairs in built.items():
        text = "".join(canonical_json(record_dict(p)) + "\n" for p in pairs)
        (directory / DESIDERATA_DIR / f"{name}.jsonl").write_text(text, encoding="utf-8")


def read_desiderata(directory: Path, meta: Mapping, pairs: Sequence[Pair]) -> dict[str, list[Pair]]:
    """Each declared desideratum's pairs, read back from the task directory (``meta``: ``task.json``); a task
    imported before desiderata were declared: ``counterfactual`` where every row gave a counterfactual answer."""
    declared = meta.get("desiderata")
    if declared is None:
        return {COUNTERFACTUAL: implicit_counterfactual(pairs)} if all(p.base.alternative_ids for p in pairs) else {}
    out = {}
    for name, d in declared.items():
        if d.get("pairs") is None:
            out[name] = implicit_counterfactual(pairs)
            continue
        lines = (directory / d["pairs"]).read_text(encoding="utf-8").splitlines()
        out[name] = [Pair.from_dict({k: v for k, v in json.loads(line).items() if k != "type"}) for line in lines]
        if len(out[name]) != len(pairs):
            raise ValueError(f"{directory / d['pairs']}: {len(out[name])} pairs for {len(pairs)} rows; import it again")
    return out
