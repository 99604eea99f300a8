"""The fine-tune's DCM and the heads CMAP patched, for the committed paper-form results
(``results/entity-tracking-smollm2-paper-form``), whose report was written before the report showed them.

The study's stage records are not committed (``/results/**/stages/`` is ignored), so this recomputes the two
stages that read the fine-tune's pruned circuit, ``dcm:smollm2-et`` and ``cmap:smollm2-et``, from the committed
``circuits/smollm2-et.pruned.json`` under the committed prune key. It stops unless the circuit and prune keys
of the task file equal those of the committed ``run.json`` (the same code, spec, models and prompts), and
unless the recomputed keys and CMAP rows equal the committed ones. Then it writes ``tables/dcm_smollm2-et.*``
and ``tables/cmap_heads_smollm2-et.md`` with the report's own functions, adds them to ``report.md`` as a
section marked as added, and rewrites ``report.html``. About 45 min on 2 cores, ~17 GB.

    python scripts/paper_form_finetune_dcm.py [--stages DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mechdiff.circuits.circuit import Circuit
from mechdiff.report.html import write_html
from mechdiff.report.rows import dcm_rows
from mechdiff.runs.stages import StageRecord, key_hash
from mechdiff.studies.circuits.report.cmap import patched_heads
from mechdiff.studies.circuits.report.dcm import DCM_CAPTION
from mechdiff.studies.circuits.report.kit import study_table
from mechdiff.studies.circuits.study import CircuitsStudy

RESULTS = Path("results/entity-tracking-smollm2-paper-form")
TASK_FILE = "tasks/entity_tracking_paper_form.toml"
FINETUNE = "smollm2-et"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="runs/paper-form-finetune", help="run directory for the recomputed stages")
    args = ap.parse_args()
    committed = {k: v["key"] for k, v in json.loads((RESULTS / "run.json").read_text())["stages"].items()}
    study = CircuitsStudy.from_file(TASK_FILE, out=args.stages)
    for name in study.spec.model_names:  # the same inputs as the committed run, before anything computes
        circuit_key = key_hash(study._circuit_inputs(name))
        prune_key = key_hash(study._prune_inputs(name, circuit_key))
        if (circuit_key, prune_key) != (committed[f"circuit:{name}"], committed[f"prune:{name}"]):
            raise SystemExit(
                f"{name}: the task file's circuit/prune keys differ from the committed run.json; "
                "this code or spec did not make those results"
            )
    pruned = json.loads((RESULTS / "circuits" / f"{FINETUNE}.pruned.json").read_text())
    prune_rec = StageRecord(f"prune:{FINETUNE}", committed[f"prune:{FINETUNE}"], {"circuit": pruned}, 0.0, True)
    dcm = study.dcm(prune_rec, FINETUNE)
    cmap = study.cmap(FINETUNE, prune_rec, dcm)
    rows = [(r["scope"], r["kind"], r["accuracy"]["value"]) for r in cmap.result["rows"]]
    table = [
        (r["scope"], r["kind"], r["accuracy"])
        for r in json.loads((RESULTS / "tables" / f"cmap_{FINETUNE}.json").read_text())
    ]
    if (dcm.key, cmap.key) != (committed[f"dcm:{FINETUNE}"], committed[f"cmap:{FINETUNE}"]) or rows != table:
        raise SystemExit("the recomputed DCM/CMAP differ from the committed run; nothing written")
    study.dir = RESULTS  # the tables go beside the committed ones
    text = study_table(
        study,
        dcm_rows(dcm.result["dcm"]),
        f"dcm_{FINETUNE}",
        f"DCM on {FINETUNE}'s own pruned circuit (its selections are the heads CMAP as the paper "
        f"patches): {DCM_CAPTION}",
    )
    heads = patched_heads(study, Circuit.from_dict(cmap.result["circuit"]))
    (RESULTS / "tables" / f"cmap_heads_{FINETUNE}.md").write_text(heads)
    add_to_report(text + "\n" + heads)
    write_html(RESULTS)
    print(text, heads, sep="\n")


def add_to_report(body: str) -> None:
    """``report.md`` with the added section before "What was run" (replacing an earlier one)."""
    path = RESULTS / "report.md"
    report = path.read_text()
    if ADDED in report:
        start = report.index(ADDED)
        report = report[:start] + report[report.index(RUN, start) :]
    section = (
        f"{ADDED}\n\nWritten by `scripts/paper_form_finetune_dcm.py` from the stages `dcm:{FINETUNE}` and "
        f"`cmap:{FINETUNE}` recomputed under their committed keys (the recomputed CMAP rows equal the table "
        "above): the report of this run predates these tables.\n\n" + body + "\n"
    )
    path.write_text(report.replace(RUN, section + RUN, 1))


ADDED = f"## Added after the run: {FINETUNE}'s own DCM and the heads CMAP patched"
RUN = "## What was run\n"


if __name__ == "__main__":
    main()
