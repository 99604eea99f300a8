"""The fact edit's accuracy on the prompts of the countries it rewrote and on the others, from the committed study's
per-prompt outcomes (``results/capitals-smollm2/outcomes.json``) and its eval rows and items (``run.json``,
``prompt_sets``), with 95% intervals over items (`mechdiff.common.inference.proportion`: exact Clopper-Pearson where
an item has one row, else the cluster bootstrap over items widened to the exact interval of as many items); written
to ``tables/edited_accuracy.md`` and ``.csv``.

``python examples/capitals/edited_accuracy.py``"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from mechdiff.common.inference import proportion
from mechdiff.tasks.prompt_sets import set_items

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results" / "capitals-smollm2"
EDITED = json.loads((ROOT / "mechdiff/data/knowledge/edits/capital_swap.json").read_text())["samples"]


def country(row: dict) -> str:
    """The clean prompt's country (its ``country`` span)."""
    start, end = row["positions"]["country"]
    return row["clean"][start:end]


def rows() -> list[dict]:
    """One row per (model, the edited countries or the others): correct rows, rows, items, accuracy and its interval
    over items."""
    run = json.loads((RUN / "run.json").read_text())
    source = [json.loads(line) for line in (ROOT / "examples/capitals/capitals.jsonl").open()]
    edited = {s["subject"] for s in EDITED}
    listed, items = run["prompt_sets"]["rows"]["eval"], set_items(run["prompt_sets"], "eval")
    out = []
    for model, outcome in json.loads((RUN / "outcomes.json").read_text())["stages"]["accuracy"].items():
        for name, keep in (("edited countries", True), ("other countries", False)):
            kept = [i for i, r in enumerate(listed) if (country(source[r]) in edited) == keep]
            hits = [float(outcome["correct"][i] == "1") for i in kept]
            ci = proportion(hits, [int(items[i]) for i in kept])
            out.append(
                {
                    "model": model,
                    "prompts": name,
                    "correct rows": int(sum(hits)),
                    "rows": ci.n_rows,
                    "items": ci.n_items,
                    "accuracy [95% CI over items]": str(ci),
                }
            )
    return out


def main() -> None:
    table = rows()
    with (RUN / "tables" / "edited_accuracy.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in table]
    (RUN / "tables" / "edited_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
