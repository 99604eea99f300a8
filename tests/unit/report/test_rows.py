"""One measurement, one table: the standalone commands (``mechdiff dcm``, ``mechdiff cmap``) write the DCM,
semantic-patching and CMAP tables the circuits study's report writes for the same records, with the study's
columns (the trajectory study reads ``accuracy_low`` and ``floor_high`` of the DCM table)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mechdiff.studies.circuits.dcm as dcm_study
from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import Head
from mechdiff.common.inference import Interval
from mechdiff.methods.cmap import CMAPResult, CMAPRow
from mechdiff.methods.dcm import DCMConfig, DCMResult
from mechdiff.methods.semantic import SemanticResult
from mechdiff.studies.circuits.cmap import write_outputs
from mechdiff.studies.circuits.report.cmap import cmap_section
from mechdiff.studies.circuits.report.dcm import dcm_section


def _est(v: float, n: int = 10) -> Interval:
    return Interval(v, max(v - 0.1, 0.0), min(v + 0.1, 1.0), n, n, "test")


class _Models:
    """The little of a ModelSet that ``dcm_run`` reads before semantic patching."""

    def __init__(self, *names: str):
        self.names = list(names)

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, fingerprint=f"fp-{name}")

    def __len__(self) -> int:
        return len(self.names)


def _dcm_results() -> list[DCMResult]:
    heads = [Head(1, 0), Head(2, 1), Head(2, 3)]
    return [
        DCMResult(
            "positional",
            "last",
            heads,
            [0.1, 0.9, 0.2],
            [heads[0], heads[2]],
            _est(0.8),
            _est(0.2),
            _est(0.85),
            _est(0.3),
            (6, 3, 3),
            2,
            [],
            "A",
            {},
        ),
        DCMResult(
            "object",
            "last",
            heads,
            [0.9, 0.9, 0.9],
            [],
            _est(0.2),
            _est(0.2),
            _est(0.7),
            None,
            (6, 3, 3),
            0,
            [],
            "A",
            {},
        ),
        DCMResult(
            "positional",
            "query_label",
            heads[:1],
            [0.2],
            heads[:1],
            _est(0.6),
            _est(0.1),
            _est(0.6),
            None,
            (6, 3, 3),
            1,
            [],
            "C",
            {},
        ),
    ]


def test_dcm_command_writes_the_study_dcm_and_semantic_tables(tmp_path, monkeypatch):
    results = _dcm_results()
    monkeypatch.setattr(dcm_study, "dcm_circuit", lambda *args, **kwargs: results)
    monkeypatch.setattr(  # the semantic records: the DCM stage's computation, which the command runs
        "mechdiff.methods.semantic.semantic_selections",
        lambda models, selections, *args, **kwargs: (
            lambda models: [
                [SemanticResult(m.name, _est(0.7 if m.name == "base" else 0.4), _est(0.2)) for m in models]
                for _ in selections
            ]
        )(list(models)),
    )
    circuit = Circuit(
        "tiny",
        "entity-tracking",
        {"A": [Head(1, 0), Head(2, 1), Head(2, 3)], "C": [Head(1, 0)]},
        {"A": "last", "C": "query_label"},
    )
    out = tmp_path / "command"
    printed: list[str] = []
    dcm_study.dcm_run(
        _Models("base", "tuned"),
        circuit,
        "c.json",
        {"positional": list(range(12)), "object": list(range(12))},
        DCMConfig(),
        None,
        "entity-tracking",
        3,
        out,
        echo=printed.append,
    )
    command_csv = (out / "dcm.csv").read_text()
    assert command_csv.splitlines()[0] == (
        "group,desideratum,position,n_heads,selected,accuracy,accuracy_low,accuracy_high,floor,floor_low,"
        "floor_high,random,random_low,random_high"
    )
    summary = json.loads((out / "dcm.json").read_text())
    record = SimpleNamespace(result={"dcm": summary["results"], "semantic": summary["semantic"]})
    study = SimpleNamespace(dir=tmp_path / "study")
    dcm_section(study, record)
    tables = study.dir / "tables"
    assert command_csv == (tables / "dcm.csv").read_text()
    assert (out / "semantic.csv").read_text() == (tables / "semantic_patching.csv").read_text()
    assert (out / "dcm.md").read_text().split("\n\n", 1)[1] == (tables / "dcm.md").read_text().split("\n\n", 1)[1]
    assert printed[0] == (tables / "dcm.md").read_text().split("\n\n", 1)[1].rstrip("\n")


def _cmap_result(gap: bool) -> CMAPResult:
    rows = [
        CMAPRow(scope, kind, _est(acc, 8), _est(acc - 0.1, 8), recovered)
        for scope, kind, acc, recovered in (
            ("A", "z", 0.7, 0.5),
            ("A", "qk", 0.5, 0.1),
            ("A", "v", 0.6, 0.3),
            ("circuit", "z", 0.9, 0.9),
        )
    ]
    random_rows = [CMAPRow("random:A", "z", _est(0.45, 8), _est(0.4, 8), 0.05)]
    outcomes = {
        "base": [0, 1, 0, 0, 1, 0, 0, 1],
        "A/z": [1, 1, 0, 1, 1, 0, 1, 1],
        "A/qk": [0, 1, 0, 1, 1, 0, 0, 1],
        "A/v": [1, 1, 0, 0, 1, 0, 1, 1],
        "circuit/z": [1, 1, 1, 1, 1, 0, 1, 1],
        "random:A/z": [0, 1, 0, 0, 1, 1, 0, 1],
    }
    return CMAPResult(
        "base",
        "ft",
        _est(0.4, 8),
        _est(0.95 if gap else 0.45, 8),
        rows,
        _est(0.3, 8),
        _est(0.9, 8),
        {"A": "last", "circuit": "per group"},
        random_rows=random_rows,
        outcomes={k: [float(x) for x in v] for k, v in outcomes.items()},
    )


def test_cmap_command_writes_the_study_cmap_tables(tmp_path):
    for gap in (True, False):
        result = _cmap_result(gap)
        out = tmp_path / f"command-{gap}"
        text = write_outputs(result, out)
        study = SimpleNamespace(dir=tmp_path / f"study-{gap}")
        cmap_section(study, {"ft": SimpleNamespace(result=result.to_dict())})
        tables = study.dir / "tables"
        header = (out / "cmap.csv").read_text().splitlines()[0]
        assert header == "scope,kind,accuracy,accuracy_low,accuracy_high" + (",recovered" if gap else "")
        for command, studied in (("cmap", "cmap_ft"), ("cmap_paired", "cmap_paired_ft")):
            for fmt in ("csv", "md", "tex"):
                assert (out / f"{command}.{fmt}").read_text() == (tables / f"{studied}.{fmt}").read_text(), fmt
        caption = (tables / "cmap_ft.md").read_text().split("\n\n", 1)[0].strip("*")
        assert caption in text and (tables / "cmap_ft.md").read_text().split("\n\n", 1)[1].rstrip("\n") in text


def _interval(value: float) -> dict:
    return {"value": value, "low": value - 0.1, "high": value + 0.1}


def test_captions_name_the_logit_difference_and_leave_prob_tasks_alone():
    from mechdiff.report.rows import curve_caption, curve_rows, metric_note, scan_rows

    def curve(m: str) -> dict:
        row = {"fraction": 0.1, "n_pairs": 3, "accuracy": _interval(0.5), "faithfulness": _interval(0.6)}
        return {"rows": [{**row, f"faithfulness_{m}": _interval(0.7)}], f"cpr_{m}": 0.4, f"cmd_{m}": 0.3}

    prob, ld = curve("prob"), curve("logit_diff")
    assert curve_caption("m", prob) == (
        "Faithfulness of nested circuits over (head, position class) pairs on m (ranked by mean-ablation "
        "attribution; CPR 0.4, CMD 0.3)"
    )
    assert metric_note(prob["rows"][0]) == ""
    caption = curve_caption("m", ld)
    assert (
        "CPR (logit difference) 0.4" in caption and "faithfulness_logit_diff: faithfulness (logit difference" in caption
    )
    assert curve_rows(ld)[0]["faithfulness_logit_diff"] == 0.7 and "faithfulness_prob" not in curve_rows(ld)[0]
    step = {
        "added": "last",
        "accuracy": _interval(0.5),
        "faithfulness": _interval(0.6),
        "faithfulness_logit_diff": _interval(0.8),
    }
    assert scan_rows({"steps": [step]})[0]["faithfulness_logit_diff"] == 0.8
