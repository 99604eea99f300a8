"""A circuits study's claims as families of tests, restated from its committed files alone (no model run).

``restate(run_dir)`` reads ``outcomes.json`` (per-prompt outcomes), ``run.json`` (each set's rows, for an imported
task) and the DCM table, and writes ``tables/families.{md,csv,json}``, ``tables/paired_differences.*`` and
``inference.md``: every claim a test in a named family with Holm's adjusted p, "same" only by an equivalence test,
and intervals over items (a task's clean prompts) where the sets of an imported task repeat prompts.

What committed files cannot carry is said, not guessed: DCM's unpatched floor was kept as a count, not per pair,
so "encodes" is tested by the exact McNemar test at the least favourable pairing the two counts allow (a bound:
the true paired p is at most the one given); random-circuit draws were kept as a pooled figure, so the circuit's
rank among draws needs a rerun.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.io import write_text
from ..common.outcomes import from_bits, read_first_and_rest, read_outcomes
from ..tasks.prompt_sets import set_items
from .paired import CAPTION, paired_family_rows, paired_rows
from .paired import FAMILY as DIFFERENCES
from .tables import write_table

ENCODES = "what the heads encode"
BREAKDOWN_CAPTION = (
    "Eval accuracy by template and by answer length: top-1 (greedy decoding gives the whole answer: each of its "
    "tokens the top-1, teacher forced) and two-way (the answer's summed log-probability above the counterfactual "
    "answer's); on answers of several tokens, where the eval stage kept them, top-1 split by first token against "
    "the rest: `first token` (the first answer token the top-1 after the prompt; chance: one over the slice's "
    "distinct first tokens) and `rest given the first` (every later token the top-1 given the answer's tokens "
    "before it; no chance level); each with its interval over items and the chance level it is read against"
)
FIRST, REST = "first token", "rest given the first"
FAMILIES_CAPTION = (
    "Every test of the study by family: estimate and 95% interval (sameness between the models: the 90% interval "
    "its two one-sided tests read, and its margin), p, Holm's adjusted p within the family, whether the claim is "
    "shown, the test, rows and items (docs/inference.md)"
)


def _manifest(run_dir: Path) -> dict:
    data = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    for key in ("spec", "prompt_sets"):
        if isinstance(data.get(key), str):
            data[key] = ast.literal_eval(data[key])
    return data


def task_rows(manifest: Mapping[str, Any], root: Path) -> list[dict]:
    """The rows of an imported task's ``pairs.jsonl`` a study's ``run.json`` names (none for a generated task,
    whose ``run.json`` lists no prompt-set rows)."""
    if not (manifest.get("prompt_sets") or {}).get("rows"):
        return []
    task_dir = root / manifest["spec"]["task"]["name"]
    lines = (task_dir / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def length_class(n_tokens: int) -> str:
    """An answer's length class: ``1``, ``2`` or ``3+`` tokens."""
    return str(n_tokens) if n_tokens < 3 else "3+"


def breakdown_rows(
    stages: Mapping[str, Mapping[str, dict]],
    rows: list[dict],
    set_rows: list[int],
    models: list[str],
    items: Sequence[Hashable],
) -> list[dict]:
    """Each model's eval accuracy (top-1) and two-way accuracy (the answer's summed log-probability above the
    counterfactual answer's, where the logit difference was kept) by template and by answer length, each with its
    interval over the set's items (``items``, aligned with ``set_rows``) and the chance level it is read against
    (top-1: one over the distinct answers the slice holds; two-way: 0.5); ``near chance`` where the interval reaches
    chance. On each slice of answers of several
    tokens, where the record keeps them (`read_first_and_rest`), top-1 split by
    first token against the rest (`FIRST`: the first answer token the top-1, chance one over the slice's
    distinct first tokens; `REST`: every later token the top-1 given those before it, teacher forced, no
    chance level): which token a whole-answer failure is at."""
    base = [rows[r]["base"] for r in set_rows]
    items = np.asarray(items)
    slices = {
        f"template {t}": np.array([b.get("template") == t for b in base])
        for t in sorted({b.get("template") for b in base})
    }
    lengths = np.array([length_class(len(b.get("answer_tokens") or [b["answer_id"]])) for b in base])
    slices.update({f"answer of {c} token{'s' if c != '1' else ''}": lengths == c for c in sorted(set(lengths))})
    several = {f"answer of {c} tokens" for c in set(lengths) if c != "1"}
    out = []
    for model in models:
        rec = stages.get("accuracy", {}).get(model)
        if rec is None:
            continue
        correct = from_bits(rec["correct"])
        two_way = (np.asarray(rec["logit_diff"], dtype=float) > 0).astype(float) if "logit_diff" in rec else None
        first, rest = read_first_and_rest(rec)
        for name, mask in slices.items():
            answers = {b["answer"] for b, m in zip(base, mask) if m}
            measures = [("top-1", correct, 1 / len(answers)), ("two-way", two_way, 0.5)]
            if name in several:
                firsts = {(b.get("answer_tokens") or [b["answer_id"]])[0] for b, m in zip(base, mask) if m}
                measures += [(FIRST, first, 1 / len(firsts)), (REST, rest, None)]
            for measure, values, chance in measures:
                if values is None or not mask.any():
                    continue
                iv = inf.proportion(values[mask], items[mask])
                near = None if chance is None else bool(iv.low <= chance)
                out.append(
                    {"model": model, "slice": name, "measure": measure, "accuracy": iv.value, "low": iv.low,
                     "high": iv.high, "chance": chance, "near_chance": near, "rows": iv.n_rows, "items": iv.n_items}
                )  # fmt: skip
    return out


def items_by_set(manifest: Mapping[str, Any], rows: list[dict]) -> tuple[dict[str, list], dict[str, list[int]]]:
    """Each prompt set's items (`set_items`: the recorded item ids, or in an older
    ``run.json`` its rows' clean prompts) and rows, from ``run.json``'s row lists and the task's rows
    (`task_rows`). A generated task lists no rows: its sets' recorded item ids, with no row lists; empty where
    the record holds neither (a generated task's ``run.json`` from before items: one prompt an item)."""
    record = manifest.get("prompt_sets") or {}
    sets = record.get("rows")
    if not sets or not rows:
        ids = record.get("item_ids") or {}
        return {name: list(its) for name, its in ids.items()}, {}
    return {name: set_items(record, name, rows).tolist() for name in sets}, sets


def items_sentence(items: Mapping[str, list[str]], rows: Mapping[str, list[int]]) -> str:
    """Rows and items per set, and the items two sets share (which the rows' disjointness hides)."""
    if not items:
        return "Generated task: every prompt is its own item (drawn afresh per set)."
    parts = [f"{name} {len(rows.get(name, its))} rows in {len(set(its))} items" for name, its in items.items()]
    shared = []
    names = list(items)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            k = len(set(items[a]) & set(items[b]))
            if k:
                shared.append(f"{a}/{b} {k}")
    text = "Prompt sets by item (a row's clean prompt): " + "; ".join(parts) + "."
    if shared:
        text += " Items shared between sets (disjoint by row, not by item): " + ", ".join(shared) + "."
    return text


def worst_pairing(k: int, f: int, n: int, claim: str) -> inf.Test:
    """Patched against floor on the same ``n`` pairs known only by their counts (``k`` and ``f`` successes): the
    exact McNemar test at the pairing with the most discordant pairs the counts allow (its p bounds the paired p)."""
    c = min(f, n - k)
    b = c + k - f
    if b < 0:
        b, c = 0, f - k  # the patched heads below the floor
    patched = np.r_[np.ones(b), np.zeros(c), np.zeros(n - b - c)]
    floor = np.r_[np.zeros(b), np.ones(c), np.zeros(n - b - c)]
    extra = k - b  # pairs both get right
    patched[b + c : b + c + extra], floor[b + c : b + c + extra] = 1, 1
    test = inf.paired(patched, floor, claim=claim)
    return inf.Test(claim, test.interval, test.p, "exact McNemar at the least favourable pairing (a bound)")


def encodes_family(semantic: list[Mapping[str, Any]], n_pairs: Mapping[str, int]) -> inf.Family:
    """DCM's "the heads of a group encode a desideratum in a model": the patched target rate above the unpatched
    floor on the same test pairs, one test per (group, desideratum, model)."""
    fam = inf.Family(ENCODES)
    for r in semantic:
        label = f"{r['group']}/{r['desideratum']} in {r['model']}"
        n = n_pairs.get(label)
        if n is None:
            continue
        k, f = round(r["accuracy"] * n), round(r["floor"] * n)
        fam.add(worst_pairing(k, f, n, f"{label}: patched against the unpatched floor"))
    return fam


def margins_used(manifest: Mapping[str, Any], margins: Optional[Mapping[str, float]] = None) -> tuple[dict, str]:
    """The equivalence margins a restatement tests sameness against, and where they come from: ``margins`` (a task
    file's ``[inference] margins``) where given, else those ``run.json`` records (runs since the setting), else the
    defaults (`mechdiff.common.inference.MARGINS`)."""
    if margins is not None:
        return inf.margins_of(margins), "the task file's [inference] margins"
    recorded = ((manifest.get("spec") or {}).get("inference") or {}).get("margins")
    if recorded is not None:
        return inf.margins_of(recorded), "the [inference] margins run.json records"
    return inf.margins_of(), "the default margins"


def margins_sentence(margins: Mapping[str, float], source: str) -> str:
    """The margins in words, with where they come from."""
    listed = ", ".join(f"{m} +-{v:g}" for m, v in margins.items())
    return f'"Same" is tested against {source}: {listed}.'


def restate(run_dir: str | Path, root: str | Path = ".", margins: Optional[Mapping[str, float]] = None) -> Path:
    """Write a circuits study's families of tests from its committed files; returns ``inference.md``. ``margins``:
    the equivalence margins (a task file's ``[inference] margins``; None: `margins_used`)."""
    run_dir, root = Path(run_dir), Path(root)
    manifest = _manifest(run_dir)
    margins, source = margins_used(manifest, margins)
    stages = read_outcomes(run_dir)
    models = manifest["spec"]["models"]
    base, finetunes = models["base"], list(models["finetunes"])
    rows = task_rows(manifest, root)
    items, rows_of = items_by_set(manifest, rows)
    by_stage = {"accuracy": items.get("eval"), "matrix": items.get("matrix")} if items else None
    paired = paired_rows(stages, base, finetunes, by_stage, margins)
    write_table(paired, run_dir / "tables" / "paired_differences", caption=CAPTION)
    semantic = _semantic_table(run_dir)
    n_pairs = {label: len(rec["correct"]) for label, rec in stages.get("semantic", {}).items()}
    encodes = encodes_family(semantic, n_pairs)
    family_rows = paired_family_rows(paired) + encodes.rows()
    write_table(family_rows, run_dir / "tables" / "families", caption=FAMILIES_CAPTION)
    breakdown = []
    if rows_of.get("eval"):
        breakdown = breakdown_rows(stages, rows, rows_of["eval"], [base, *finetunes], items["eval"])
        write_table(breakdown, run_dir / "tables" / "breakdown", caption=BREAKDOWN_CAPTION)
    path = run_dir / "inference.md"
    intro = f"{items_sentence(items, rows_of)}\n\n{margins_sentence(margins, source)}"
    write_text(path, _page(run_dir, intro, paired, encodes, breakdown))
    _mark_report(run_dir / "report.md")
    return path


RESTATED = (
    "> **Restated.** The findings of this report predate the inference rules of docs/inference.md (intervals over "
    'items, exact paired tests, Holm within families, equivalence for "same"). `inference.md` beside it states '
    "them as families of tests, and `tables/paired_differences.*` and `tables/families.*` are the restated tables; "
    "where a sentence below disagrees with them, they hold."
)


def _mark_report(path: Path) -> None:
    """Put the restatement note under a report's title once (a report written by today's code needs none)."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if RESTATED in text:
        return
    title, _, rest = text.partition("\n")
    write_text(path, f"{title}\n\n{RESTATED}\n{rest}")


def _semantic_table(run_dir: Path) -> list[dict]:
    path = run_dir / "tables" / "semantic_patching.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []


def _page(
    run_dir: Path, items_line: str, paired: list[dict], encodes: inf.Family, breakdown: Optional[list[dict]] = None
) -> str:
    from .paired import difference_sentence, faithfulness_parts

    lines = [
        f"# {run_dir.name}: the findings as families of tests",
        "",
        "Restated from the committed per-prompt outcomes (`outcomes.json`), `run.json` and the DCM table by "
        "`mechdiff restate`, with no model run, under the rules of docs/inference.md. Every claim is one test in a "
        "named family; Holm's step-down adjusts within the family; a claim whose adjusted p exceeds 0.05 is not "
        'shown; "same" is written only where an equivalence test against the stated margin passes.',
        "",
        items_line,
        "",
        f"## Family: {DIFFERENCES} ({len(paired)} tests)",
        "",
    ]
    parts = faithfulness_parts(paired)
    for r in paired:
        extra = f"; {parts[r['measure']]}" if r["measure"] in parts else ""
        lines.append(f"- {r['comparison']}: {difference_sentence(r)}{extra}")
    adjusted = encodes.adjusted()
    lines += ["", f"## Family: {ENCODES} ({len(adjusted)} tests)", ""]
    for t in adjusted:
        iv = t.interval
        verdict = "shown" if t.rejects else "not shown"
        lines.append(
            f"- {t.claim}: patched minus floor {iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}], {verdict} "
            f"(Holm p <= {t.p_adjusted:.2g}; {iv.n_rows} pairs)"
        )
    lines += _breakdown_lines(breakdown or [])
    lines += [
        "",
        'Bounds, not figures: DCM\'s floor was committed as a count, so each "encodes" p is the exact McNemar p at '
        "the pairing with the most discordant pairs the counts allow (the paired p is at most that). Random "
        "controls (random circuits in the matrix, random heads in DCM and CMAP) were committed as pooled figures, "
        "not per draw: the circuit's rank among draws is not restated here; it needs the stages rerun.",
        "",
        "Tables: `tables/families.csv` (every test with its family and adjusted p), `tables/paired_differences.csv`"
        + (", `tables/breakdown.csv`." if breakdown else "."),
        "",
    ]
    return "\n".join(lines)


def _breakdown_lines(breakdown: list[dict]) -> list[str]:
    if not breakdown:
        return []
    near = [r for r in breakdown if r["near_chance"]]
    worst = sorted((r for r in breakdown if r["measure"] == "top-1"), key=lambda r: r["accuracy"])[:3]

    def fmt(r: dict) -> str:
        return f"{r['model']} {r['slice']} {r['measure']} {r['accuracy']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"

    return [
        "",
        "## By template and answer length (`tables/breakdown.*`)",
        "",
        "Near chance (the interval over items reaches it): "
        + ("; ".join(f"{fmt(r)} against {r['chance']:.2f}" for r in near) if near else "none")
        + ". Lowest top-1 slices: "
        + "; ".join(f"{fmt(r)} ({r['rows']} rows, {r['items']} items)" for r in worst)
        + ".",
        *_first_and_rest_lines(breakdown, fmt),
    ]


def _first_and_rest_lines(breakdown: list[dict], fmt: Any) -> list[str]:
    """The answers of several tokens by first token against the rest, or why the outcomes cannot say."""
    split = [r for r in breakdown if r["measure"] in (FIRST, REST)]
    if split:
        return ["", "By first token against the rest (answers of several tokens): " + "; ".join(map(fmt, split)) + "."]
    if any(r["slice"].endswith(" tokens") for r in breakdown):
        return [
            "",
            "By first token against the rest: not in these outcomes (the eval stage keeps the split, `first` and "
            "`rest` in `outcomes.json`, in records made since #49 item 12; its key did not change, so a cached "
            "accuracy stage record must be removed to recompute it).",
        ]
    return []


def families_of(run_dir: str | Path) -> Optional[list[dict]]:
    """The families table of a restated study (None where it was never restated)."""
    path = Path(run_dir) / "tables" / "families.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
