"""DCM of a circuit's groups and semantic patching, as ``mechdiff dcm`` runs it:
`mechdiff.methods.dcm.dcm_circuit` on the desiderata given, the selected heads patched into every model of a set,
and the tables, bar charts and JSON it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ...circuits.circuit import Circuit
from ...common.inference import Interval
from ...common.io import write_json
from ...methods.dcm import DCMConfig, DCMResult, dcm_circuit
from ...models.modelset import ModelSet
from ...report.bars import grouped_bars
from ...report.rows import dcm_rows, semantic_rows
from ...report.tables import to_markdown, write_table
from ...tasks.base import PairRecord
from .stages.dcm import semantic_records


def dcm_run(
    models: ModelSet,
    circuit: Circuit,
    circuit_path: str,
    desiderata: Mapping[str, Sequence[PairRecord]],
    config: DCMConfig,
    groups: Optional[Sequence[str]],
    task: str,
    n_boxes: int,
    out: Path,
    echo: Callable[[str], None] = print,
    cache: str = "file",
) -> None:
    """DCM on the first model of ``models`` for each group (``groups``; default all) of ``circuit`` and each
    desideratum (``out/dcm.*``, ``out/dcm.png``); with more than one model, semantic patching of each selection
    into every model (``out/semantic.*``); ``out/dcm.json``. Each table goes to ``echo`` (in markdown) as soon as
    it is ready: the DCM table before semantic patching loads the other models, then the semantic table. ``cache``:
    the pair caches' mode (`CACHE_MODES`)."""
    model = models[models.names[0]]
    results = dcm_circuit(model, circuit, dict(desiderata), config, groups, mode=cache)
    records = [r.to_dict() for r in results]
    rows = dcm_rows(records)
    caption = (
        f"DCM on {model.name} ({config.parameterisation} masks, lambda={config.lam}): heads whose z at the "
        "group's position, patched from the source, makes the desideratum's target win; test accuracy vs the "
        "no-intervention floor and random head sets of the selected size (the whole group: dcm.png, dcm.json)."
    )
    write_table(rows, out / "dcm", caption=caption)
    echo(to_markdown(rows))
    grouped_bars(
        out / "dcm.png",
        [f"{r.group}/{r.desideratum}" for r in results],
        {
            "selected heads": [r.test_accuracy for r in results],
            "floor (m=1)": [r.floor for r in results],
            "whole group": [r.full_group for r in results],
            "random": [r.random for r in results],
        },
        title=f"DCM on {model.name}",
        ylabel="target accuracy (test)",
    )
    summary = {
        "model": model.name,
        "task": task,
        "fingerprint": model.fingerprint,
        "circuit": circuit_path,
        "n_boxes": n_boxes,
        "results": records,
    }
    if len(models) > 1:
        summary["semantic"], semantic_text = _semantic(models, results, desiderata, config, out, cache)
        echo(semantic_text)
    write_json(out / "dcm.json", summary)


def _semantic(
    models: ModelSet,
    results: list[DCMResult],
    desiderata: Mapping[str, Sequence[PairRecord]],
    config: DCMConfig,
    out: Path,
    cache: str = "file",
) -> tuple[list[dict], str]:
    """Patch each selection into every model of the set, on that desideratum's test pairs (pair caches in
    ``cache`` mode; the study's DCM stage computes the same, `semantic_records`)."""
    records = semantic_records(models, results, desiderata, config, cache)
    rows = semantic_rows(records)
    if not rows:
        return records, "semantic patching skipped: no DCM mask selected any head"
    write_table(
        rows,
        out / "semantic",
        caption="Semantic patching: the DCM-selected heads patched source -> base "
        "within each model; target accuracy per model (with the unpatched floor and random heads of the selection's "
        "layers at its position; minus_floor: exact McNemar test on the same pairs; minus_random: sign-flip test "
        "against the per-pair share of random draws).",
    )
    cats = list(dict.fromkeys(f"{r['group']}/{r['desideratum']}" for r in rows))
    series = {}
    for name in models.names:
        by_cat = {f"{x['group']}/{x['desideratum']}": x for x in records if x["model"] == name}
        series[name] = [Interval.from_dict(by_cat[c]["accuracy"]) if c in by_cat else None for c in cats]
    grouped_bars(
        out / "semantic.png",
        cats,
        series,
        title="Semantic patching of DCM heads across models",
        ylabel="target accuracy",
    )
    return records, "\n" + to_markdown(rows)
