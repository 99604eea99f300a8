"""The trajectory study end to end on a tiny trajectory (three checkpoints trained in the test): every stage, the
report, tables and figures; a second run finds every stage cached and loads no model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import circuit_pairs

from mechdiff.methods.roles import THRESHOLD
from mechdiff.methods.trajectory import against_first
from mechdiff.runs.stages import label
from mechdiff.studies.base import load_study
from mechdiff.studies.spec import SpecError
from mechdiff.studies.trajectory.settings import load_settings, read_labels
from mechdiff.studies.trajectory.stages.roles import RolesStage
from mechdiff.studies.trajectory.study import TrajectoryStudy


def task_file(path, run, out, extra: str = "", sections: str = "") -> str:
    text = f"""
[study]
kind = "trajectory"

[task]
name = "entity-tracking"
n_boxes = 3
seed = 0

[models]
checkpoints = ["{run}@0", "{run}@2", "{run}@4"]

[eval]
n = 16
batch_size = 8

[discovery]
n = 12
runs_n = 16
sizes = [0.05, 0.2, 1.0]
curve_n = 12
stability_draws = 20

[scoring]
n = 12
reference_n = 16

[structure]
draws = 20

[dcm]
desiderata = ["positional"]
groups = ["last"]
n_train = 8
n_val = 4
n_test = 8
epochs = 1
batch_size = 4
{extra}
[cmap]
n = 12
parts = ["z"]
groups = ["last", "query_label"]
{sections}
[output]
dir = "{out}"
store = "{out}/activations.h5"
"""
    path.write_text(text)
    return str(path)


PART = (
    "import sys\nfrom mechdiff.studies.trajectory.study import TrajectoryStudy\n"
    "TrajectoryStudy.from_file(sys.argv[1], progress=False).run_checkpoints(sys.argv[2].split(','))\n"
)


@pytest.fixture(scope="module")
def float32_run(tiny_run, tmp_path_factory) -> Path:
    """The plain task file (``task_file`` with nothing added: no labels table, no ``[roles]``, no ``[runs]``) run
    once in float32 from an empty directory: the float32 side of the bfloat16 test, and the finished stages the roles
    tests start from (a copy of its directory: the accuracy, circuit, score, CMAP and structure stages read
    neither the labels table nor ``[roles]``, so their keys are those of the roles tests' runs, which then compute
    their own DCM, semantic and roles stages)."""
    _, run = tiny_run
    root = tmp_path_factory.mktemp("float32")
    path = task_file(root / "float32.toml", run, root / "float32")
    study = TrajectoryStudy.from_file(path, progress=False, models={"dtype": "float32"})
    assert study.st.models.dtype == "float32"
    study.run()
    return root / "float32"


def seeded(float32_run: Path, out: Path) -> Path:
    """``out``, a copy of ``float32_run``'s directory: a run directory whose earlier run (of the plain task file)
    finished its stages, their records and the circuit files they wrote."""
    return shutil.copytree(float32_run, out)


def positional_labels(tmp_path: Path, selected: str) -> Path:
    """A DCM labels table (``[dcm] labels``) giving the ``last`` group's ``selected`` heads the positional role (a
    tiny model's own DCM may select nothing)."""
    labels = tmp_path / "dcm.json"
    row = {"group": "last", "desideratum": "positional", "position": "last", "selected": selected}
    labels.write_text(json.dumps([row]))
    return labels


def test_trajectory_study_end_to_end_then_all_cached(tiny_run, tmp_path):
    """Every stage, computed by two processes sharing the checkpoints (``run_checkpoints``, each waiting for the
    circuits the other computes), then a plain run that finds every stage cached, loads nothing and writes the
    report. DCM labels are read from a table (a tiny model's own DCM may select nothing); DCM trained on the final
    checkpoint's circuit is checked after."""
    _, run = tiny_run
    out = tmp_path / "out"
    labels = positional_labels(tmp_path, "L2H1 L1H0")
    other = tmp_path / "other-run"  # the between-run null's "other run": a copy of this one, read at step 4
    shutil.copytree(run, other)
    runs = f'[runs]\ndirs = ["{other}"]\nsteps = [4]\n'
    path = task_file(tmp_path / "t.toml", run, out, extra=f'labels = "{labels}"\n', sections=runs)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    names = [f"{run}@{s}" for s in (0, 2, 4)]
    part = subprocess.Popen([sys.executable, "-c", PART, path, ",".join(names[2:])], env=env, cwd=root)
    try:  # the other part in this process: two processes still, each waiting for the circuits of the other
        TrajectoryStudy.from_file(path, progress=False).run_checkpoints(names[:2])
    except BaseException:
        part.kill()  # it would wait for this part's circuits
        raise
    assert part.wait(timeout=1200) == 0
    study = load_study(path, progress=False)  # by the file's [study] kind
    assert isinstance(study, TrajectoryStudy)
    plan = study.plan()
    assert plan and all(p.cached for p in plan) and study._checkpoints is None
    report = study.run()
    assert study._checkpoints is None  # nothing loaded: the two processes computed every stage
    assert report.is_file() and (out / "README.md").is_file() and (out / "run.json").is_file()
    assert study.names == names
    figures = ("accuracy", "circuits_faithfulness", "cmap_gain", "semantic", "structure", "membership")
    for fig in (*figures, "formation", "overlap_matrix"):
        assert (out / "figures" / f"{fig}.png").stat().st_size > 0, fig
    # report.html, written by the run: the overlap matrix the structure record holds, a figure per measure
    html = (out / "report.html").read_text()
    assert 'id="overlap_matrix"' in html and 'id="measure-accuracy"' in html
    reached = [r for r in json.loads((out / "tables" / "formation.json").read_text()) if r["step_50%"] is not None]
    assert ('id="formation"' in html) == bool(reached)  # the tiny run may form nothing: then a note says so
    matrix = json.loads((out / "tables" / "structure_matrix.json").read_text())
    overlap = json.loads(study.cache.path("structure").read_text())["result"]["matrix"]["overlap"]
    assert [[r[str(s)] for s in study.steps] for r in matrix] == overlap
    manifest = json.loads((out / "run.json").read_text())
    stages = set(manifest["stages"])
    assert manifest["kind"] == "trajectory" and {p.name for p in plan} == stages
    assert {f"{k}:{n}" for k in ("accuracy", "circuit", "score", "semantic") for n in names} <= stages
    assert {f"cmap:{n}" for n in names[1:]} | {
        "structure",
        "dcm",
        f"accuracy:{other}@4",
        f"ranking:{other}@4",
    } <= stages
    assert all(v["cached"] for v in manifest["stages"].values())
    computed = [json.loads(p.read_text()) for p in (out / "stages").glob("*.json")]
    assert len(computed) == len(stages) and all(r["seconds"] > 0 and r["cpu_seconds"] > 0 for r in computed)
    cpu = sum(r["cpu_seconds"] for r in computed)  # the README's cost: each record's CPU seconds, summed
    readme = (out / "README.md").read_text()
    assert f"and {cpu:.0f} s of CPU time in all)" in readme
    start = min(r["finished"] - r["seconds"] for r in computed)  # the elapsed time, from the records' own times
    assert f"UTC: {(max(r['finished'] for r in computed) - start) / 60:.1f} min elapsed." in readme

    # the report's tables are the stage records: the accuracy and the formed-at rule recomputed from them
    acc = json.loads((out / "tables" / "accuracy.json").read_text())
    records = {n: json.loads(study.cache.path(f"accuracy:{n}").read_text())["result"] for n in names}
    assert [r["accuracy"] for r in acc] == [np.mean(records[n]["correct"]) for n in names]
    diffs = against_first([records[n]["correct"] for n in names])
    assert [r["minus_first"] for r in acc] == [None] + [d["value"] for d in diffs[1:]]
    # formation on the change scale, recomputed here from the accuracy records: the model's change from the first
    # checkpoint per step, the first step reaching half the final change where that change is shown (Holm), the
    # first checkpoint after 0 written left-censored
    formation = {r["component"]: r for r in json.loads((out / "tables" / "formation.json").read_text())}
    gains = [np.mean(records[n]["correct"]) - np.mean(records[names[0]]["correct"]) for n in names]
    model = formation["the model"]
    assert model["change"] == pytest.approx(gains[-1], abs=1e-12)
    assert model["formed"] == (model["p_holm"] <= 0.05) and model["p_holm"] >= model["p"]
    sign = 1 if gains[-1] >= 0 else -1
    want = next((s for s, g in zip(study.steps, gains) if sign * g >= 0.5 * sign * gains[-1]), None)
    if want == study.steps[1]:
        want = f"at or before step {want}"
    assert model["step_50%"] == (want if model["formed"] else None)
    rows = json.loads((out / "tables" / "formation_curves.json").read_text())
    mine = [r for r in rows if r["component"] == "the model"]
    assert [r["step"] for r in mine] == study.steps
    assert [r["level"] for r in mine] == pytest.approx(gains + np.mean(records[names[0]]["correct"]), abs=1e-12)
    if gains[-1]:
        assert [r["share_of_final_change"] for r in mine] == pytest.approx(np.divide(gains, gains[-1]), abs=1e-12)
    # every order the report states survives Holm in the family "formation order" (the tiny run may form nothing)
    order = [r for r in json.loads((out / "tables" / "formation_order.json").read_text()) if "level" in r]
    for r in order:
        assert r["family"] == "formation order" and (r["ordered"] == "not ordered") == (r["p_holm"] > 0.05)
    if sum(r["formed"] for r in formation.values()) < 2:
        assert not order and "Fewer than two components change" in report.read_text()
    # each checkpoint against the final one: the own circuits' Jaccard from the circuit files, the top-n overlaps
    # from the structure record
    final_rows = json.loads((out / "tables" / "structure_final.json").read_text())
    st = json.loads(study.cache.path("structure").read_text())["result"]
    files = {n: circuit_pairs(out / "circuits" / f"{label(n)}.json") for n in names}
    flat = {n: {(h, p) for h, ps in files[n].items() for p in ps} for n in names}
    assert [r["checkpoint"] for r in final_rows] == names[:-1]
    for r, n in zip(final_rows, names):
        assert r["own_circuit_jaccard"] == len(flat[n] & flat[names[-1]]) / len(flat[n] | flat[names[-1]])
        assert r["cross_overlap"] == st["matrix"]["overlap"][names.index(n)][-1]
    assert [st["matrix"]["overlap"][i][i] for i in range(3)] == [st["null"][n]["value"] for n in names]
    # the circuits scored in every checkpoint: the final circuit is the final checkpoint's own
    scored = {n: json.loads(study.cache.path(f"score:{n}").read_text())["result"]["outcomes"] for n in names}
    assert scored[names[-1]]["final"] == scored[names[-1]]["own"]
    assert scored[names[1]]["first trained"] == scored[names[1]]["own"]
    circ = json.loads((out / "tables" / "circuits.json").read_text())
    assert [r["n_pairs"] for r in circ] == [
        json.loads(study.cache.path(f"circuit:{n}").read_text())["result"]["n_pairs"] for n in names
    ]

    # the between-run null: the other run is this one's copy, so its ranking is step 4's attribution bit for bit,
    # and the two runs' overlap at step 4 is step 4's own null, split by split
    ranked = json.loads(study.cache.path(f"ranking:{other}@4").read_text())["result"]
    own = json.loads(study.cache.path(f"circuit:{names[-1]}").read_text())["result"]
    assert ranked["attribution"] == own["attribution"] and ranked["classes"] == own["classes"]
    (between,) = st["between_runs"]
    assert between["checkpoint"] == names[-1] and between["overlap"] == st["null"][names[-1]] == between["null"]
    assert st["consecutive"][-1]["beyond_runs"]["at"] == names[-1]
    assert [r["step"] for r in json.loads((out / "tables" / "structure_runs.json").read_text())] == [4]
    # step 4 (read by the between-run null) ranked on runs_n = 16 prompts, the rest on 12: the main structure on the
    # 12 all share, the steps read again on their own 16
    assert st["prompts"] == 12 and st["dense"]["prompts"] == 16 and list(st["dense"]["null"]) == [names[-1]]
    assert (
        np.asarray(json.loads(study.cache.path(f"circuit:{names[-1]}").read_text())["result"]["attribution"]["shape"])[
            0
        ]
        == 16
    )
    # the attributions behind the structure tables, committed: float16 (gzip), and the structure recomputed from them
    # alone is the stage's record, the steps read on their own prompts included
    from mechdiff.methods.structure import ATTRIBUTIONS, committed_structure, read_attributions

    store = read_attributions(out / ATTRIBUTIONS)
    assert set(store.attribution) == {*names, f"{other}@4"} and store.meta["steps"][names[-1]] == 4
    assert [store.attribution[n].shape[0] for n in names] == [12, 12, 12]
    assert set(store.dense) == {names[-1], f"{other}@4"} and store.dense[names[-1]].shape[0] == 16
    assert committed_structure(out) == st
    # outcomes.json: every stage's per-prompt outcomes, the other run's accuracy among them
    kept = json.loads((out / "outcomes.json").read_text())["stages"]
    assert kept["accuracy"][f"{other}@4"] == kept["accuracy"][names[-1]] == records[names[-1]]["outcomes"]
    assert {f"scores:{n}" for n in names} | {f"cmap:{n}" for n in names[1:]} <= set(kept)
    assert kept[f"scores:{names[1]}"]["own"]["correct"] == "".join(map(str, scored[names[1]]["own"]))

    sem = json.loads((out / "tables" / "semantic.json").read_text())
    assert [r["step"] for r in sem] == list(study.steps)
    for r, n in zip(sem, names):
        outcomes = json.loads(study.cache.path(f"semantic:{n}").read_text())["result"]["rows"][0]["outcomes"]
        assert r["accuracy"] == np.mean(outcomes) and len(outcomes) == 8

    again = TrajectoryStudy.from_file(path, progress=False)
    # labels read were trained on the DCM prompt set, whose shorter draws repeat its first pairs: the test pairs of
    # semantic patching are a draw of their own, none of them among that set's
    dcm_set = again.desiderata(again.st.dcm.n_test)
    for d, pairs in again.tests().items():
        assert len(pairs) == again.st.dcm.n_test and not {repr(p) for p in pairs} & {repr(p) for p in dcm_set[d]}
    with pytest.raises(ValueError, match="not checkpoints of this study"):
        again.run_checkpoints(["nope@1"])

    # DCM trained on the final checkpoint's own circuit, its groups in [dcm] groups (the tiny model's masks)
    again.st.dcm.labels = ""
    final = again.circuit(names[-1])
    trained = again.dcm(final).result
    assert trained["source"] == f"DCM on the circuit of {names[-1]}"
    own = final.result["circuit"]
    assert [(r["group"], r["desideratum"]) for r in trained["dcm"]] == (
        [("last", "positional")] if own["groups"].get("last") else []
    )
    for r in trained["dcm"]:
        assert set(r["selected"]) <= set(r["heads"]) == set(own["groups"]["last"]) and r["n_test"] == 8


def test_task_file_errors_name_the_line_before_loading(tiny_run, tmp_path):
    _, run = tiny_run
    out = tmp_path / "out"
    bad = task_file(tmp_path / "bad.toml", run, out, extra='labels = "no/such/dcm.json"\n')
    with pytest.raises(SpecError, match=r"bad.toml:\d+: no DCM table no/such/dcm.json"):
        load_settings(bad)
    one = tmp_path / "one.toml"
    one.write_text(
        f'[study]\nkind = "trajectory"\n[task]\nname = "entity-tracking"\n[models]\ncheckpoints = ["{run}@2"]\n'
    )
    with pytest.raises(SpecError, match=r"one.toml:6: a trajectory needs at least two distinct checkpoints"):
        load_settings(one)


def test_dcm_labels_read_from_a_circuits_study_table(tmp_path):
    table = tmp_path / "dcm.json"
    table.write_text(
        json.dumps(
            [
                {"group": "last", "desideratum": "positional", "position": "last", "selected": "L19H1 L19H4"},
                {"group": "query_label", "desideratum": "label_value", "position": "query_label", "selected": "-"},
                {
                    "group": "last",
                    "desideratum": "label_value",
                    "position": "last",
                    "selected": "L29H1",
                    "accuracy_low": 0.046,
                    "floor_high": 0.12,
                },
                {
                    "group": "last",
                    "desideratum": "object_value",
                    "position": "last",
                    "selected": "L22H6",
                    "accuracy_low": 0.54,
                    "floor_high": 0.018,
                },
            ]
        )
    )
    assert read_labels(table) == [
        {"group": "last", "desideratum": "positional", "position": "last", "selected": ["L19H1", "L19H4"]},
        {"group": "query_label", "desideratum": "label_value", "position": "query_label", "selected": []},
        {"group": "last", "desideratum": "label_value", "position": "last", "selected": [], "dropped": ["L29H1"]},
        {"group": "last", "desideratum": "object_value", "position": "last", "selected": ["L22H6"]},
    ]


def test_trajectory_study_runs_in_bfloat16_within_a_stated_tolerance_of_float32(tiny_run, float32_run, tmp_path):
    """Every per-checkpoint stage (accuracy, circuit with its curve, score, semantic, CMAP into each later
    checkpoint), the structure across checkpoints and DCM (trained here on the final checkpoint's circuit) with the
    checkpoints loaded in bfloat16 (``--dtype``; the task file's float32 the default) against float32. Stated
    tolerances: those of the circuits study's test (test_study.tolerance: 2% of a figure's value, 2^-7 for
    differences of near-equal probabilities, 0.05 for normalised faithfulness) and, for DCM's training losses
    (mean -logit(target), near 0 on a random tiny model), two bfloat16 epsilons 2^-7 absolute as in the paper-form
    test."""
    from test_study import bfloat16_outside, tolerance

    def dcm_tolerance(path: str) -> tuple[float, float] | None:
        return (2**-7, 0.0) if ".loss" in path else tolerance(path)

    _, run = tiny_run
    path = task_file(tmp_path / "bfloat16.toml", run, tmp_path / "bfloat16")
    study = TrajectoryStudy.from_file(path, progress=False, models={"dtype": "bfloat16"})
    assert study.st.models.dtype == "bfloat16"
    study.run()
    ours, theirs = tmp_path / "bfloat16" / "stages", float32_run / "stages"  # the same task file, run in float32
    assert {p.name for p in theirs.glob("*.json")} >= {"dcm.json", "structure.json", "cmap__run_4.json"}
    assert (
        json.loads((ours / "accuracy__run_4.json").read_text())["key"]
        != json.loads((theirs / "accuracy__run_4.json").read_text())["key"]
    )  # the dtype is in the stage's inputs
    checked, outside = bfloat16_outside(ours, theirs, dcm_tolerance)
    assert outside == [] and checked > 500, outside[:40]


def own_answers(name: str, pairs: list, every: int = 1) -> list:
    """``pairs`` with the target of every ``every``-th the base prompt's top-1 token in checkpoint ``name`` loaded
    by itself (a tiny model seldom gives a desideratum's target: with these, a head whose patch leaves the answer
    moves those pairs "to the target")."""
    from dataclasses import replace

    import torch

    from mechdiff.models.loading import load_model

    hf = load_model(name).model
    with torch.no_grad():
        top = [int(hf(torch.tensor([p.base.input_ids])).logits[0, -1].argmax()) for p in pairs]
    return [replace(p, target_id=t) if i % every == 0 else p for i, (p, t) in enumerate(zip(pairs, top))]


def test_roles_stage_writes_membership_tables_and_a_chart_per_role(tiny_run, float32_run, tmp_path):
    """A tiny trajectory run with ``[roles]``: a ``roles:<ckpt>`` stage per checkpoint (none without the section),
    every head any checkpoint's own circuit has in the ``last`` group scored on two desiderata (targets set to the
    last checkpoint's own answers, so that heads hold a role there); ``tables/roles.json`` is the membership
    recomputed here from the stage records' lower bounds (not the shares), the transitions table holds exactly the
    joins, leaves and takeovers of that membership, and report.html has a chart per role some head holds, a note
    for the others."""
    from mechdiff.common.outcomes import from_bits

    _, run = tiny_run
    out = seeded(float32_run, tmp_path / "out")  # its roles stages computed here, the rest found
    labels = positional_labels(tmp_path, "L2H1")
    plain = task_file(tmp_path / "plain.toml", run, out, extra=f'labels = "{labels}"\n')
    assert not [p for p in load_study(plain, progress=False).plan() if p.name.startswith("roles")]
    roles = '\n[roles]\nn = 6\nthreshold = 0.3\ngroups = ["last"]\ndesiderata = ["positional", "object"]\n'
    path = task_file(tmp_path / "t.toml", run, out, extra=f'labels = "{labels}"\n{roles}')
    study = load_study(path, progress=False)
    names = study.names
    assert [p.name for p in study.plan() if p.name.startswith("roles")] == [f"roles:{n}" for n in names]
    drawn = study.role_pairs()
    # the last checkpoint's own answers as the targets of every object pair and of half the positional ones: a
    # head leaving the answers has share 1 (lower bound 0.54 of 6) on object, 0.5 (lower bound 0.12) on positional
    study.role_pairs = lambda: {
        "positional": own_answers(names[-1], drawn["positional"], every=2),
        "object": own_answers(names[-1], drawn["object"]),
    }
    study.run()
    assert not any(study.cache.records[f"roles:{n}"].cached for n in names)  # computed by this run
    records = [json.loads(study.cache.path(f"roles:{n}").read_text())["result"] for n in names]
    own = [json.loads((out / "circuits" / f"{label(n)}.json").read_text()) for n in names]
    heads = sorted(
        {h for c in own for h in c["groups"].get("last", [])}, key=lambda h: [int(x) for x in h[1:].split("H")]
    )
    assert own[-1]["groups"].get("last") and records[0]["sites"] == [["last", "last", heads]]
    study.st.roles.heads = "final"  # the final circuit's heads only (the circuits are cached: nothing loads)
    ((_, _, final),) = RolesStage(study).sites({n: study.circuit(n) for n in names})
    assert [h.name for h in final] == sorted(
        own[-1]["groups"]["last"], key=lambda h: [int(x) for x in h[1:].split("H")]
    )
    study.st.roles.heads = "any"
    again = TrajectoryStudy.from_file(path, progress=False)  # a process given one checkpoint finds its roles stage
    again.run_checkpoints([names[1]])
    assert again._checkpoints is None and again.cache.records[f"roles:{names[1]}"].cached
    table = json.loads((out / "tables" / "roles.json").read_text())
    html = (out / "report.html").read_text()
    for d_i, d in enumerate(["positional", "object"]):
        ever = False
        for s_i, (step, rec) in enumerate(zip(study.steps, records)):
            rows = [r for r in rec["rows"] if r["desideratum"] == d]
            assert [r["head"] for r in rows] == heads
            for r in rows:
                k = from_bits(r["outcomes"]["correct"])
                assert len(k) == 6 and r["share"]["value"] == k.mean()
            holding = [r["head"] for r in rows if r["share"]["low"] > 0.3]
            ever |= bool(holding)
            row = table[d_i * len(names) + s_i]
            assert (row["desideratum"], row["step"], row["holding"]) == (d, step, " ".join(holding) or "-")
        assert (f'id="held-role-{d_i}"' in html) == ever and (f"No scored head holds last / {d}" in html) != ever
    assert 'id="held-role-1"' in html  # the last checkpoint's own answers: patching one head seldom moves them
    moves_file = out / "tables" / "role_transitions.json"
    moves = json.loads(moves_file.read_text()) if moves_file.exists() else []
    want = []  # joins, leaves and takeovers read off the membership table by set differences
    for d in ("positional", "object"):
        sets = [set(r["holding"].split()) - {"-"} for r in table if r["desideratum"] == d]
        for i in range(1, len(sets)):
            joined, left = sets[i] - sets[i - 1], sets[i - 1] - sets[i]
            want += [(d, study.steps[i], h, "takes over" if left else "joins") for h in joined]
            want += [(d, study.steps[i], h, "leaves") for h in left]
    assert sorted((m["desideratum"], m["step"], m["head"], m["event"]) for m in moves) == sorted(want)


def test_roles_section_errors_name_the_line_and_no_section_means_no_stage(tiny_run, tmp_path):
    _, run = tiny_run
    out = tmp_path / "out"
    assert load_settings(task_file(tmp_path / "none.toml", run, out)).roles is None
    for body, error in (
        ("threshold = 1.5", r"bad.toml:\d+: \[roles\] threshold must lie in \[0, 1\)"),
        ('desiderata = ["colour"]', r"bad.toml:\d+: \[roles\] scores heads on the task's desiderata; .*, not colour"),
        ('heads = "some"', r"bad.toml:\d+: heads = 'some' in \[roles\]; valid values: any, final"),
        ("n = 0", r"bad.toml:\d+: \[roles\] n must be at least 1 pair"),
    ):
        bad = task_file(tmp_path / "bad.toml", run, out, extra=f"\n[roles]\n{body}\n")
        with pytest.raises(SpecError, match=error):
            load_settings(bad)
    good = load_settings(
        task_file(tmp_path / "good.toml", run, out, extra='\n[roles]\ndesiderata = ["object_value"]\n')
    )
    assert good.roles.desiderata == ["object_value"] and good.roles.threshold == THRESHOLD


def test_other_runs_are_checked_when_the_task_file_loads(tiny_run, tmp_path):
    """``[runs]``: steps the trajectory lacks, a run without the step, and dirs without steps are refused with the
    file's line, before any weights load."""
    _, run = tiny_run
    other = tmp_path / "other-run"
    shutil.copytree(run, other)
    for runs, match in (
        (f'dirs = ["{other}"]\nsteps = [3]', r"\[runs\] needs .* among the trajectory's \(0, 2, 4\); \[3\] are not"),
        (f'dirs = ["{other}"]', r"\[runs\] needs dirs .* and steps"),
        (f'dirs = ["{tmp_path / "nowhere"}"]\nsteps = [4]', "nowhere"),
    ):
        path = task_file(tmp_path / "t.toml", run, tmp_path / "out", sections=f"[runs]\n{runs}\n")
        with pytest.raises(SpecError, match=match):
            load_settings(path)
    shutil.rmtree(other / "step-0004")
    path = task_file(tmp_path / "t.toml", run, tmp_path / "out", sections=f'[runs]\ndirs = ["{other}"]\nsteps = [4]\n')
    with pytest.raises(SpecError, match="step 4 is not saved"):
        load_settings(path)


def test_roles_by_dcm_in_each_scored_checkpoint(tiny_run, float32_run, tmp_path):
    """``[roles] method = "dcm"`` at steps 0 and 4: a roles stage at those steps only, each DCM over seeds trained in
    that checkpoint over every head any checkpoint's own circuit has in ``last``, with the fixed sparsity weight,
    equal to :func:`dcm_seeds` run here on the checkpoint loaded on its own; ``tables/roles.json`` holds a head at a
    step exactly where it is in the selection and the step's row holds the role (both paired tests after Holm in the
    "roles" family, ``tables/role_tests.json``); the per-pair outcomes are in ``outcomes.json``; steps the
    trajectory lacks are refused."""
    from mechdiff.common.components import parse_heads
    from mechdiff.methods.roles import dcm_seeds
    from mechdiff.models.loading import load_model
    from mechdiff.studies.trajectory.settings import roles_dcm_config

    _, run = tiny_run
    out = seeded(float32_run, tmp_path / "out")  # its roles stages computed here, the rest found
    labels = positional_labels(tmp_path, "L2H1")
    roles = (
        '\n[roles]\nmethod = "dcm"\nsteps = [0, 4]\ngroups = ["last"]\ndesiderata = ["positional"]\n'
        "lam = 0.00001\nseeds = 2\nvotes = 1\nn_random = 3\n"  # the tiny model's logits are small
    )
    path = task_file(tmp_path / "t.toml", run, out, extra=f'labels = "{labels}"\n{roles}')
    study = load_study(path, progress=False)
    names = study.names
    assert [p.name for p in study.plan() if p.name.startswith("roles")] == [f"roles:{names[0]}", f"roles:{names[2]}"]
    study.st.dcm.epochs = 10  # 20 mask updates at lr 0.1 (1 epoch, 2 updates, cannot move a mask below 0.5)
    n = study.st.dcm.n_train + study.st.dcm.n_val + study.st.dcm.n_test
    study.run()
    assert not any(study.cache.records[f"roles:{n}"].cached for n in (names[0], names[2]))  # computed by this run
    own = [json.loads((out / "circuits" / f"{label(n)}.json").read_text()) for n in names]
    order = lambda h: [int(x) for x in h[1:].split("H")]  # noqa: E731
    heads = sorted({h for c in own for h in c["groups"].get("last", [])}, key=order)
    pairs = study.desiderata(n, names=["positional"])
    config = roles_dcm_config(study.dcm_config(), study.st.roles)
    assert config.lam == 1e-5 and config.lam_scale == "absolute" and config.random_pool == "layer"
    table = json.loads((out / "tables" / "roles.json").read_text())
    per_step = json.loads((out / "tables" / "role_dcm.json").read_text())
    outcomes = json.loads((out / "outcomes.json").read_text())["stages"]
    for step, name in ((0, names[0]), (4, names[2])):
        got = json.loads(study.cache.path(f"roles:{name}").read_text())["result"]
        assert got["sites"] == [["last", "last", heads]]
        (want,) = dcm_seeds(load_model(name), [("last", "last", parse_heads(heads))], pairs, config, 2, 1)
        (x,) = got["rows"]
        assert [s["selected"] for s in x["seeds"]] == [s["selected"] for s in want["seeds"]]
        for k in ("selected", "test_outcomes", "floor_outcomes", "random_outcomes"):
            assert x[k] == want[k], k
        assert outcomes[f"roles:{name}"]["last/positional/floor"]["correct"] == x["floor_outcomes"]
        (row,) = [r for r in table if r["step"] == step]
        (verdict,) = [r for r in per_step if r["step"] == step]
        assert row["holding"] == (" ".join(x["selected"]) if verdict["holds"] else "-")
        assert row["heads_scored"] == len(heads)
    assert any(r["selected"] != "-" for r in per_step)  # else the family below would be empty
    tests = json.loads((out / "tables" / "role_tests.json").read_text())
    assert {t["family"] for t in tests} == {"roles"}
    assert len(tests) == 2 * sum(r["selected"] != "-" for r in per_step)
    # the family recomputes from the committed files alone: outcomes.json's bits, role_dcm's steps
    from mechdiff.studies.trajectory.roles import roles_family

    recomputed = []
    for step, name in ((0, names[0]), (4, names[2])):
        rec = outcomes[f"roles:{name}"]
        draws = [v["correct"] for k, v in rec.items() if k.startswith("last/positional/random/")]
        sel = rec.get("last/positional/selection")
        recomputed.append(
            {
                "group": "last",
                "desideratum": "positional",
                "step": step,
                "label": f"last/positional at step {step}",
                "selected": ["-"] if sel else [],
                "test_outcomes": sel and sel["correct"],
                "floor_outcomes": rec["last/positional/floor"]["correct"],
                "random_outcomes": draws,
            }
        )
    again = [t.row() for t in roles_family(recomputed).values()]
    assert [(t["claim"], t["p"], t["p_holm"]) for t in again] == [(t["claim"], t["p"], t["p_holm"]) for t in tests]
    assert [r["step"] for r in per_step] == [0, 4]
    bad = task_file(tmp_path / "bad.toml", run, out, extra='\n[roles]\nmethod = "dcm"\nsteps = [3]\n')
    with pytest.raises(SpecError, match=r"\[roles\] steps must be steps of the trajectory \(0, 2, 4\), not \[3\]"):
        load_settings(bad)
    bad = task_file(tmp_path / "bad.toml", run, out, extra='\n[roles]\nmethod = "dcm"\nseeds = 2\nvotes = 3\n')
    with pytest.raises(SpecError, match=r"bad.toml:\d+: \[roles\] votes must be between 1 and seeds \(2\)"):
        load_settings(bad)
