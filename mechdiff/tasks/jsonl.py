"""Tasks from files: counterfactual pairs written by hand, imported once against a tokenizer.

One JSON object a line::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "counterfactual": "When Mary and John went to the store, Anna gave a drink to",
     "answer": " Mary", "counterfactual_answer": " John",
     "positions": {"IO": [5, 9], "S2": [38, 42]},
     "counterfactual_positions": {"IO": [5, 9], "S2": [38, 42]}}

``positions`` are character offsets ``[start, end)`` into ``clean``; a position is the token
holding the span's last character. The same names are located in ``counterfactual`` by the same
rule when the row carries ``counterfactual_positions``, else at the same token index. Every
record also gets ``last`` (the final token of the prompt) unless a row names it. ``counterfactual_answer``
(optional) is the answer the counterfactual prompt calls for: it becomes the clean record's
alternative answer (``logit_diff`` = answer - counterfactual answer; refused where it equals the answer on every
row) and, where a task declares no desideratum, the target of the ``counterfactual`` DCM desideratum. A task
declares its own desiderata (a column of the rows, a file of its own, or the rows' ``desiderata`` objects:
`mechdiff.tasks.declared`).

An answer may be several tokens (``" Buenos Aires"``): its tokens are those ``tokenizer(prompt + answer)``
appends to ``tokenizer(prompt)`` (`answer_ids`; an answer that merges with the prompt's last token is
refused). A one-token answer's record is what it always was; a longer one's also carries ``answer_tokens``
(and ``alternative_tokens``, ``target_tokens``), which evaluation scores by teacher forcing
(`mechdiff.patching.evaluate`).

Optional too: ``template`` (a name for the phrasing the row was written from: mean ablation averages
over reference prompts of the same template and token length, never across templates) and
``classes`` (position classes of the row's own, ``{"name": [[start, end], ...]}`` character spans on
token boundaries, each class every token its spans cover, no token in two; the same token indices in the
counterfactual; ``last`` is always the final token, and `REST` the tokens no class covers: `row_classes`).
Rows without ``classes`` get classes derived from their named positions
(`derived_classes`). Rows may have any token length; clean and counterfactual
of one row must have the same.

Every row belongs to an *item*, the unit a study's prompt sets are disjoint by
(`mechdiff.tasks.prompt_sets`): by default its clean prompt (rows sharing a clean prompt with other
counterfactuals are one item); ``import_pairs(..., item=FIELD)`` (``mechdiff dataset import --item FIELD``) makes
each row's value of its key ``FIELD`` (e.g. the country) its item instead, recorded in ``task.json`` (``item``)
and `ITEMS_FILE`.

`import_pairs` checks every row against the tokenizer before anything is written: answers
are tokens appended to their prompt, clean and counterfactual have equal token lengths, spans
start and end on token boundaries, and every row names the same positions. Every problem of every row
is reported in one pass, each with its line number (a row's checks that do not need each other all run, so a
bad span does not hide a bad answer; the ``--item`` field, the metric's and each declared desideratum's checks
run on the same pass), and where clean and counterfactual differ in token length both token lists are shown;
a named position on a prompt's last token (the class ``last`` owns it) and a class empty in some prompts are
warned about with their counts per template (`class_warnings`). The task
directory is written to a temporary directory and renamed into place, so a failed import leaves nothing behind.
`mechdiff.tasks.task_directory.read_task_directory` reads it back; `mechdiff.tasks.base.get_task` makes it a
`Task`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from ..common.metrics import TASK_METRICS
from .records import Pair, alternative_tokens, answer_tokens, canonical_json, per_tokenizer, record_dict
from .row_checks import (
    LAST,
    ImportErrors,
    RowErrors,
    answer_ids,
    answer_warnings,
    checked,
    class_warnings,
    encode_offsets,
    example_of,
    length_problem,
    locate,
    several,
)

KEYS = {
    "clean",
    "counterfactual",
    "answer",
    "counterfactual_answer",
    "positions",
    "counterfactual_positions",
    "template",
    "classes",
}
REQUIRED = ("clean", "counterfactual", "answer", "positions")
#: The class of the tokens a row's own classes leave uncovered.
REST = "rest"
TASK_FILE, PAIRS_FILE = "task.json", "pairs.jsonl"
#: Each row's item (its ``--item`` field's value, canonical JSON), one a line, where the task names a field.
ITEMS_FILE = "items.jsonl"
FORMAT = "mechdiff-task/1"


# --------------------------------------------------------------------------------------
# Tokenizer checks
# --------------------------------------------------------------------------------------


def span_tokens(text: str, offsets: Sequence[tuple[int, int]], spans: Any, name: str) -> tuple[int, ...]:
    """The tokens covered by ``spans`` (``[[start, end], ...]``, each on token boundaries, as `locate`)."""
    if not isinstance(spans, list) or not spans or not all(isinstance(sp, list) for sp in spans):
        raise ValueError(f"class {name!r}: {spans!r} is not a non-empty list of [start, end] spans")
    out: set[int] = set()
    for span in spans:
        last = locate(text, offsets, span, f"class {name}")
        start = span[0]
        while start < span[1] and text[start].isspace():
            start += 1
        out.update(t for t, (a, b) in enumerate(offsets) if b > a and b > start and t <= last)
    return tuple(sorted(out))


def row_classes(text: str, offsets: Sequence[tuple[int, int]], spans: Any, n_tokens: int) -> dict[str, tuple[int, ...]]:
    """A row's own classes (``{}`` where it names none): each class the tokens its spans cover, no token in two
    classes; ``last`` is always the final token (taken out of a class that covers it; a class named ``last``
    must be that token alone). Tokens no class covers are given to `REST` by `with_rest`."""
    if not isinstance(spans, dict):
        raise ValueError('classes must be an object {"name": [[start, end], ...]}')
    if not spans:
        return {}
    classes = {n: span_tokens(text, offsets, sp, n) for n, sp in spans.items()}
    final = n_tokens - 1
    if LAST in classes and classes[LAST] != (final,):
        raise ValueError(f"class {LAST!r} is always the final token {final}; its spans give {list(classes[LAST])}")
    owner: dict[int, str] = {}
    for name, tokens in classes.items():
        for t in tokens:
            if t in owner:
                piece = text[offsets[t][0] : offsets[t][1]]
                raise ValueError(
                    f"classes {owner[t]!r} and {name!r} both cover token {t} ({piece!r}); a token belongs to one class"
                )
            owner[t] = name
    out = {n: tuple(t for t in tokens if t != final) for n, tokens in classes.items() if n != LAST}
    empty = [n for n, tokens in out.items() if not tokens]
    if empty:
        raise ValueError(f"classes {empty} cover only the final token, which is always the class {LAST!r}")
    return {**out, LAST: (final,)}


def with_rest(pairs: list[Pair]) -> list[Pair]:
    """``pairs`` whose rows name their own classes, each given `REST`: the tokens no class covers (every
    row gets the class, empty where its classes cover every token), where some row leaves tokens uncovered."""

    def rest(p: Pair) -> tuple[int, ...]:
        covered = {t for tokens in p.base.classes.values() for t in tokens}
        return tuple(t for t in range(len(p.base.input_ids)) if t not in covered)

    if not any(p.base.classes and rest(p) for p in pairs):
        return pairs
    out = []
    for p in pairs:
        classes = {**p.base.classes, REST: tuple(sorted({*p.base.classes.get(REST, ()), *rest(p)}))}
        base, source = replace(p.base, classes=classes), replace(p.source, classes=dict(classes))
        out.append(replace(p, base=base, source=source))
    return out


# --------------------------------------------------------------------------------------
# Rows -> pairs
# --------------------------------------------------------------------------------------


def _row_pair(tokenizer: Any, row: Mapping[str, Any], extra: frozenset[str] = frozenset()) -> Pair:
    """One checked pair from one row; raises `RowErrors` naming every problem of the row (each check that
    does not need an earlier one's result runs: a bad span does not hide a bad answer). ``extra``: the keys declared
    desiderata add (their columns)."""
    problems: list[str] = []
    unknown = set(row) - KEYS - extra
    if unknown:
        problems.append(f"unknown keys {sorted(unknown)}; valid keys: {sorted(KEYS | extra)}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        problems.append(f"missing keys {missing}")
    template = row.get("template", "")
    if not isinstance(template, str):
        problems.append(f"template must be a string naming the row's phrasing, got {template!r}")
    texts = [row.get(k) for k in ("clean", "counterfactual")]
    bad_text = [k for k, t in zip(("clean", "counterfactual"), texts) if k in row and not isinstance(t, str)]
    if bad_text:
        problems.append(f"{' and '.join(bad_text)} must be a string, the prompt")
    if missing or bad_text:
        raise RowErrors(problems)
    pair = _checked_pair(tokenizer, row, template, problems)
    if problems or pair is None:
        raise RowErrors(problems)
    return pair


def _checked_pair(tokenizer: Any, row: Mapping[str, Any], template: str, problems: list[str]) -> Optional[Pair]:
    """The pair of a row whose prompts are strings: every check run, each problem appended to ``problems``; None
    where a part could not be built."""
    clean, cf = row["clean"], row["counterfactual"]
    ids, offsets = encode_offsets(tokenizer, clean)
    cf_ids, cf_offsets = encode_offsets(tokenizer, cf)
    if len(ids) != len(cf_ids):
        problems.append(length_problem(tokenizer, ids, cf_ids, ("clean", "counterfactual")))
    positions = _located(clean, offsets, row["positions"], "", problems)
    cf_spans = row.get("counterfactual_positions")
    cf_positions = dict(positions or {})
    if cf_spans is not None:
        if (
            not isinstance(cf_spans, dict)
            or not isinstance(row["positions"], dict)
            or set(cf_spans) != set(row["positions"])
        ):
            names = sorted(row["positions"]) if isinstance(row["positions"], dict) else []
            problems.append(
                f"counterfactual_positions must name the same positions as positions "
                f"({names}), got {sorted(cf_spans) if isinstance(cf_spans, dict) else cf_spans!r}"
            )
        else:
            cf_positions = _located(cf, cf_offsets, cf_spans, "counterfactual ", problems) or {}
    classes = checked(problems, row_classes, clean, offsets, row.get("classes", {}), len(ids))
    answer = row["answer"]
    a_ids = checked(problems, answer_ids, tokenizer, clean, answer)
    alts, cf_answer, cf_a_ids = (), answer, a_ids
    if row.get("counterfactual_answer") is not None:
        cf_answer = row["counterfactual_answer"]
        cf_a_ids = checked(problems, answer_ids, tokenizer, cf, cf_answer)
        alts = ((cf_answer, cf_a_ids),)
    if problems or positions is None or classes is None or a_ids is None or cf_a_ids is None:
        return None
    positions.setdefault(LAST, len(ids) - 1)
    cf_positions.setdefault(LAST, len(ids) - 1)
    base = example_of(clean, ids, (answer, a_ids), positions, alts, template, classes)
    source = example_of(
        cf, cf_ids, (cf_answer, cf_a_ids), cf_positions, ((answer, a_ids),) if alts else (), template, classes
    )
    return Pair(base, source, answer, a_ids[0], "counterfactual", several(a_ids))


def _located(
    text: str, offsets: Sequence[tuple[int, int]], spans: Any, what: str, problems: list[str]
) -> Optional[dict]:
    """Each named span's token (`locate`); every span that is not on token boundaries appended to
    ``problems``; None where any is bad."""
    if not isinstance(spans, dict):
        problems.append(f"{what}positions must be an object {{name: [start, end]}}")
        return None
    n = len(problems)
    out = {name: checked(problems, locate, text, offsets, span, f"{what}{name}") for name, span in spans.items()}
    return out if len(problems) == n else None


def check_rows(
    path: str | os.PathLike, tokenizer: Any, extra: frozenset[str] = frozenset()
) -> tuple[list[Optional[Pair]], list[int], list[str]]:
    """Every non-blank row of a pairs file checked: its pair (None where the row is bad), its line number, and
    every problem of every row (``FILE:LINE: what is wrong``, each problem a line of its own). ``extra``: the row
    keys declared desiderata add."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file {path} does not exist")
    pairs: list[Optional[Pair]] = []
    numbers: list[int] = []
    errors: list[str] = []
    names: Optional[tuple[tuple[set, set], int]] = None
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        numbers.append(line_no)
        problems: list[str] = []
        row = checked(problems, _json_object, line)
        pair = checked(problems, _row_pair, tokenizer, row, extra) if row is not None else None
        row_names = _row_names(row) if pair is not None else None  # the names of rows otherwise good, compared
        if row_names is not None and names is None:
            names = (row_names, line_no)
        elif row_names is not None and names is not None and row_names != names[0]:
            which = "positions" if row_names[0] != names[0][0] else "classes"
            i = 0 if which == "positions" else 1
            problems.append(
                f"{which} {sorted(row_names[i])} differ from line {names[1]}'s {sorted(names[0][i])}; "
                f"every row must name the same {which}"
            )
        errors += [f"{path}:{line_no}: {p}" for p in problems]
        pairs.append(None if problems else pair)
    return pairs, numbers, errors


def _json_object(line: str) -> dict:
    row = json.loads(line)  # json.JSONDecodeError is a ValueError
    if not isinstance(row, dict):
        raise ValueError("a line must be one JSON object")
    return row


def _row_names(row: Optional[Mapping]) -> Optional[tuple[set, set]]:
    """The position and class names a row gives (None where it gives no object of positions)."""
    if row is None or not isinstance(row.get("positions"), dict):
        return None
    classes = row.get("classes", {})
    return set(row["positions"]), set(classes) if isinstance(classes, dict) else set()


def read_pairs(path: str | os.PathLike, tokenizer: Any, extra: frozenset[str] = frozenset()) -> list[Pair]:
    """Every row of a pairs file as a checked `Pair`; raises
    `ImportErrors` listing every problem of every bad row (``FILE:LINE: ...``) if any is bad. ``extra``: the
    row keys declared desiderata add."""
    pairs, _, errors = check_rows(path, tokenizer, extra)
    if errors:
        raise ImportErrors(bad_rows_message(path, errors), errors)
    if not pairs:
        raise ImportErrors(f"{path} holds no rows")
    return with_rest([p for p in pairs if p is not None])


def bad_rows_message(path: str | os.PathLike, errors: Sequence[str]) -> str:
    """The one message of an import's problems: how many, then each on a line of its own."""
    return f"{len(errors)} problem(s) in {path}; nothing was written:\n" + "\n".join(errors)


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of the tokenizer's vocabulary (which ids the records hold), taken once per tokenizer object
    (`per_tokenizer`: a study checks its task against one tokenizer at every set it draws, 0.1-0.2 s of CPU a
    digest of SmolLM2's)."""
    return per_tokenizer(tokenizer, "digest", lambda: _digest(tokenizer))


def _digest(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(canonical_json(vocab).encode("utf-8")).hexdigest()


def import_pairs(
    path: str | os.PathLike,
    tokenizer: Any,
    out: str | os.PathLike,
    model: str = "",
    name: Optional[str] = None,
    plan: Optional[str | os.PathLike] = None,
    metric: str = "prob",
    force: bool = False,
    desiderata: Sequence[str] = (),
    item: Optional[str] = None,
    warn: Optional[Callable[[str], None]] = None,
) -> Path:
    """Check ``path`` against ``tokenizer`` and write the task directory ``out`` (``task.json``,
    ``pairs.jsonl``, each declared desideratum's pairs, the plan if given) atomically: into a temporary
    directory, then renamed. ``desiderata``: ``NAME=COLUMN`` or ``NAME=FILE.jsonl`` each
    (`mechdiff.tasks.declared`); ``item``: the row key whose value is a row's item (default: its clean
    prompt), written to `ITEMS_FILE`. ``warn``: called with each line of
    `answer_warnings` (answers that split a word or share their first token with
    the counterfactual answer); the rows are imported all the same."""
    from .declared import parse_declaration, write_desiderata

    out, path = Path(out), Path(path)
    if out.exists() and not force:
        raise ValueError(f"{out} exists; choose another --out or pass --force to replace it")
    if metric not in TASK_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(TASK_METRICS)}")
    given = [parse_declaration(d) for d in desiderata]
    plan_text = None
    if plan is not None:
        from .plan import load_plan

        load_plan(plan)  # checked before anything is written
        plan_text = Path(plan).read_text(encoding="utf-8")
    if item is not None and item in KEYS:
        raise ValueError(f"--item {item!r} is a key every row already uses; name a field of your own (e.g. country)")
    pairs, built, declared, item_values = checked_import(path, tokenizer, metric, given, item)
    for line in [*answer_warnings(tokenizer, pairs), *class_warnings(pairs)] if warn is not None else ():
        warn(line)
    meta = {
        "format": FORMAT,
        "name": name or out.name,
        "source": str(path),
        "model": model,
        "templates": sorted({p.base.template for p in pairs if p.base.template}),
        "classes": sorted(pairs[0].base.classes),
        "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "n_pairs": len(pairs),
        "positions": sorted(pairs[0].base.positions),
        "metric": metric,
        "tokenizer": tokenizer_digest(tokenizer),
        "n_tokens": sorted({len(p.base.input_ids) for p in pairs}),
        "plan": "plan.toml" if plan_text else None,
        "desiderata": declared,
    }
    if item is not None:
        meta["item"] = item
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / PAIRS_FILE).write_text("".join(canonical_json(record_dict(p)) + "\n" for p in pairs), encoding="utf-8")
        write_desiderata(tmp, built)
        if item_values is not None:
            (tmp / ITEMS_FILE).write_text("".join(v + "\n" for v in item_values), encoding="utf-8")
        if plan_text:
            (tmp / "plan.toml").write_text(plan_text, encoding="utf-8")
        (tmp / TASK_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def checked_import(
    path: Path, tokenizer: Any, metric: str, given: Sequence[Any], item: Optional[str]
) -> tuple[list[Pair], dict[str, list[Pair]], dict[str, dict], Optional[list[str]]]:
    """Every check of an import in one pass: each row's (all its problems), the ``--item`` field's, the metric's and
    each declared desideratum's; raises one `ImportErrors` listing every problem found, else gives the
    pairs (`with_rest`), the desiderata built and declared, and the rows' items."""
    from .declared import declare, extra_keys

    errors: list[str] = []
    item_values = gathered(errors, read_items, path, item) if item is not None else None
    pairs, numbers, row_errors = check_rows(path, tokenizer, extra_keys(given) | ({item} if item else set()))
    if not pairs:
        raise ImportErrors(f"{path} holds no rows")
    errors += row_errors
    if metric == "logit_diff":
        errors += check_logit_diff(path, pairs, numbers)
    built, declared = gathered(errors, declare, tokenizer, path, pairs, given) or ({}, {})
    if errors:
        errors = sorted(errors, key=lambda e: by_line(path, e))
        raise ImportErrors(bad_rows_message(path, errors), errors)
    return with_rest([p for p in pairs if p is not None]), built, declared, item_values


def by_line(path: Path, error: str) -> tuple[int, int]:
    """Where an import's problem sorts: a row of the pairs file by its line, then the rest in the order found."""
    m = re.match(r"(.*?):(\d+): ", error)
    return (0, int(m.group(2))) if m and m.group(1) == str(path) else (1, 0)


def gathered(errors: list[str], check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``; None where it raises `ImportErrors`, its problems appended to ``errors``."""
    try:
        return check(*args)
    except ImportErrors as e:
        errors.extend(e.lines)
        return None


def read_items(path: Path, item: str) -> list[str]:
    """Each row's value of the key ``item`` as canonical JSON (a string, number or boolean); refused naming the
    lines where a row lacks it or gives a list, an object or null."""
    from .declared import non_blank_lines

    values, bad = [], []
    for no, line in non_blank_lines(path):
        try:
            value = json.loads(line).get(item)
        except (ValueError, AttributeError):
            value = None  # read_pairs names the malformed line
        if value is None or isinstance(value, (list, dict)):
            bad.append(no)
        values.append(canonical_json(value))
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        raise ImportErrors(
            f"--item {item}: every row of {path} needs a key {item!r} holding a string or number (its item: rows "
            f"of one item are never split across a study's prompt sets); lines {shown} give none"
        )
    return values


def check_logit_diff(path: Path, pairs: Sequence[Optional[Pair]], numbers: Sequence[int]) -> list[str]:
    """``logit_diff`` (answer - counterfactual answer) needs a counterfactual answer on every row, and one that
    differs from the answer on some row (else it is always 0): the problems, naming the lines (``pairs``: each
    row's pair, None where the row is bad; ``numbers``: their lines)."""
    from .declared import non_blank_lines

    rows = [_json_or_none(line) for _, line in non_blank_lines(path)]
    missing = [no for no, r in zip(numbers, rows) if isinstance(r, dict) and r.get("counterfactual_answer") is None]
    if missing:
        return [
            f"metric logit_diff needs a counterfactual_answer in every row of {path}; lines "
            f"{', '.join(map(str, missing[:10]))}{' ...' if len(missing) > 10 else ''} give none"
        ]
    good = [p for p in pairs if p is not None]
    if good and all(answer_tokens(p.base) == alternative_tokens(p.base)[0] for p in good):
        return [
            f"metric logit_diff: counterfactual_answer equals answer on every row of {path} (lines {numbers[0]}-"
            f"{numbers[-1]}), so the logit difference is always 0; give each row the answer its counterfactual "
            "prompt calls for, or use --metric prob"
        ]
    return []


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None  # the row checks name the malformed line
