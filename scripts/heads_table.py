"""Write ``tables/heads.json`` for a curve-method study run before the study wrote it (its stage records are not
committed): recompute each model's attribution ranking and selection stability exactly as the circuit stage
does (same prompts, seeds and reference means; not the faithfulness curve), refuse unless the top ``n`` of the
ranking is the committed circuit pair for pair, then write the table the study writes.

    PYTHONPATH=. python scripts/heads_table.py results/entity-tracking-smollm2 [--store /tmp/acts.h5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--store", default="/tmp/heads_table_acts.h5", help="activation store for the reference means")
    args = ap.parse_args()
    run = Path(args.run_dir)
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.circuits.curve import pair_scores, prompt_attribution, ranking, selection_stability
    from mechdiff.circuits.positions import task_classes
    from mechdiff.circuits.pruning import pair_name
    from mechdiff.report.heads import head_rows, write_heads_table
    from mechdiff.runs.stages import label
    from mechdiff.studies.circuits.spec import SECTIONS, RunSpec
    from mechdiff.studies.circuits.study import CircuitsStudy as Study

    manifest = json.loads((run / "run.json").read_text())
    spec = RunSpec(
        **{k: SECTIONS[k](**v) for k, v in manifest["spec"].items() if k in SECTIONS}, source=manifest["source"]
    )
    if spec.discovery.method != "curve":
        raise SystemExit("only curve-method studies have attribution rankings to recompute")
    spec.output.store = args.store
    study = Study(spec, progress=False, out_dir=str(run))
    d = spec.discovery
    found, pruned = {}, {}
    for name in spec.model_names:
        committed = Circuit.from_dict(json.loads((run / "circuits" / f"{label(name)}.json").read_text()))
        n = committed.meta["n_pairs"]
        ranker = study.scorer(name, "ranking", d.n)
        classes = task_classes(ranker)
        per_prompt = prompt_attribution(ranker, classes)
        scores = pair_scores(per_prompt.mean(0), classes)
        ranked = ranking(scores)
        top = {pair_name(p) for p in ranked[:n]}
        want = {f"{h.name}@{committed.positions[g]}" for g, hs in committed.groups.items() for h in hs}
        if top != want:
            raise SystemExit(
                f"{name}: the recomputed top {n} differs from the committed circuit in "
                f"{len(top ^ want)} pairs; not writing a table that does not describe it"
            )
        stability = selection_stability(per_prompt, classes, n, d.stability_draws, study.seed("ranking"))
        found[name] = {
            "circuit": committed.to_dict(),
            "ranking": [[pair_name(p), scores[p]] for p in ranked[: 2 * n]],
            "stability": {
                "selected": {pair_name(p): stability[p] for p in ranked[:n]},
                "others": {pair_name(p): f for p, f in stability.items() if f > 0 and pair_name(p) not in top},
            },
        }
        pruned_file = run / "circuits" / f"{label(name)}.pruned.json"
        if pruned_file.exists():
            pruned[name] = {"circuit": json.loads(pruned_file.read_text())}
        print(f"{name}: top {n} of {len(ranked)} pairs reproduce the committed circuit", flush=True)
    paths = write_heads_table(head_rows(found, pruned), run / "tables")
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
