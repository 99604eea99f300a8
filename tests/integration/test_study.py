"""The whole study on tiny saved models: report written, reruns cached, one changed option recomputes
only what depends on it, a killed run resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import count_forwards

from mechdiff.studies.circuits.spec import default_spec
from mechdiff.studies.circuits.study import CircuitsStudy as Study


def tiny_spec(names, out):
    spec = default_spec()
    spec.models.base, spec.models.finetunes = names[0], names[1:]
    spec.task.n_boxes = 3
    spec.eval.n, spec.eval.batch_size = 12, 12
    spec.eval.floor = -1.0  # random tiny models answer nothing: every model counts as doing the task (mechanics)
    spec.discovery.n, spec.discovery.top_k, spec.discovery.screen_multiple = 6, {"A": 2, "B": 1, "C": 1, "D": 1}, 2
    spec.discovery.curve_n, spec.discovery.sizes, spec.discovery.stability_draws = 8, [0.1, 0.5, 1.0], 20
    spec.positions.n, spec.positions.max_steps = 6, 2
    spec.scoring.n, spec.scoring.random_draws, spec.scoring.completeness_draws = 8, 2, 1
    spec.scoring.reference_n, spec.scoring.prune_n = 12, 6
    spec.cmap.n_random = 1
    spec.dcm.n_train, spec.dcm.n_val, spec.dcm.n_test, spec.dcm.epochs = 6, 3, 3, 1
    spec.dcm.desiderata = ["positional"]
    spec.cmap.n, spec.cmap.parts = 8, ["z", "qk"]
    spec.output.dir, spec.output.store = str(out / "run"), str(out / "store.h5")
    return spec


def stage_numbers(d, path=""):
    """Every number of a stage record's result, by its path (a ranking [[pair, score], ...] by pair, whatever its
    rank)."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from stage_numbers(v, f"{path}.{k}")
    elif isinstance(d, list) and d and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) for x in d):
        yield from stage_numbers(dict(d), path)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from stage_numbers(v, f"{path}[{i}]")
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        yield path, float(d)


def bfloat16_outside(ours: Path, theirs: Path, tolerance, least: int = 10) -> tuple[int, list]:
    """(figures compared, those outside ``tolerance(path)`` = (absolute, relative) or None to skip) of every stage
    record in ``ours`` (bfloat16) against the same record in ``theirs`` (float32); both runs have every stage (at
    least ``least`` of them)."""
    import math

    names = sorted(p.name for p in theirs.glob("*.json"))
    assert names == sorted(p.name for p in ours.glob("*.json")) and len(names) >= least
    checked, outside = 0, []
    for name in names:
        f32 = dict(stage_numbers(json.loads((theirs / name).read_text())["result"]))
        b16 = dict(stage_numbers(json.loads((ours / name).read_text())["result"]))
        for path, value in f32.items():
            tol = tolerance(path)
            if tol is None or path not in b16 or math.isnan(value):
                continue
            if abs(b16[path] - value) > tol[0] + tol[1] * abs(value):
                outside.append((name, path, value, b16[path]))
            checked += 1
    return checked, outside


def tolerance(path: str) -> tuple[float, float] | None:
    """(absolute, relative) tolerance of one figure of a bfloat16 run against float32's; None for timings and
    digests."""
    if "second" in path or "timings" in path or "key" in path or "fingerprint" in path:
        return None
    if ".minimality." in path or "contribution" in path or ".relative" in path:
        return 2**-7, 0.0  # differences of near-equal probabilities over F(C): two bfloat16 epsilons
    if "cpr" in path or "cmd" in path or "normalised" in path:
        return 0.05, 0.0  # (m(C) - m(empty)) / (m(M) - m(empty)) and its areas: ratios of such differences
    if "ranking" in path or ".scores." in path:
        return 2e-5, 0.1  # attribution scores (gradients): within 10% or 2e-5 (near-zero ones)
    return 1e-6, 0.02  # every other figure (probabilities, ratios, intervals, counts): 2% of its value


def _check_paired_differences(spec, run_dir, text):
    """Every model was scored on the same prompts; outcomes.json keeps each stage's per-prompt outcomes, and the
    paired table's differences are recomputed from it (mean of per-prompt differences)."""
    import numpy as np

    from mechdiff.common.outcomes import read_outcomes, read_record

    stages = read_outcomes(run_dir)
    base, ft = spec.models.base, spec.models.finetunes[0]
    (cb, pb), (cf, pf) = read_record(stages["accuracy"][base]), read_record(stages["accuracy"][ft])
    assert cb.size == cf.size == spec.eval.n
    accuracy = json.loads((run_dir / "stages" / f"accuracy__{base.rsplit('/', 1)[-1]}.json").read_text())["result"]
    assert np.isclose(cb.mean(), accuracy["accuracy"]["value"])
    rows = {r["measure"]: r for r in json.loads((run_dir / "tables" / "paired_differences.json").read_text())}
    assert np.isclose(rows["accuracy"]["difference"], cf.mean() - cb.mean())
    assert np.isclose(rows["answer probability"]["difference"], np.mean(pf - pb), rtol=1e-4, atol=1e-6)
    own = stages[f"matrix:{base}"][base]
    assert len(own["correct"]) == spec.scoring.n and f"circuit of {base}: accuracy" in rows  # (faithfulness: nan here)
    assert "## Differences between models (paired)" in text
    assert "on the same prompts (paired 95% intervals, Holm within the family)" in text


def test_study_end_to_end_and_caching(tiny_family, tiny_study, tmp_path):
    import shutil

    spec = tiny_spec(tiny_family, tmp_path)
    first = Study(spec, progress=False)
    plan = first.plan()  # what the run will do: every stage to compute, each with its key
    assert first.models._loaded == {} and not any(p.cached for p in plan) and all(p.key for p in plan)
    # the run of this spec from an empty directory: tiny_study's (the same spec, run once for every test that
    # reads a finished study; the output paths are in no stage key), copied here before anything changes
    shutil.copytree(tiny_study, tmp_path, dirs_exist_ok=True)
    run_dir = tmp_path / "run"
    records = [json.loads(p.read_text()) for p in (run_dir / "stages").glob("*.json")]
    assert {p.name: p.key for p in plan} == {r["name"]: r["key"] for r in records}  # the plan's stages, its keys
    text = (run_dir / "report.md").read_text()
    for section in (
        "## Findings",
        "## Accuracy",
        "## Circuits",
        "## Circuit x model",
        "## Overlap",
        "## What the heads encode (DCM)",
        "## Cross-model activation patching (CMAP)",
        "## What was run",
    ):
        assert section in text
    assert (run_dir / "figures" / "membership.png").is_file()
    assert (run_dir / "tables" / "accuracy.csv").is_file() and (run_dir / "tables" / "accuracy.tex").is_file()
    assert (run_dir / "circuits").is_dir()
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["versions"]["torch"] and all(not s["cached"] for s in manifest["stages"].values())
    ran = tiny_spec(tiny_family, tiny_study)  # the spec as it ran: this one but for its output paths
    assert manifest["kind"] == "circuits" and manifest["spec"] == json.loads(json.dumps(ran.to_dict()))
    assert "settings" not in manifest and set(manifest["model_digests"]) == set(tiny_family)
    assert set(manifest["loaded_models"]) == set(tiny_family) and manifest["source"] == ran.source
    _check_heads_table_and_page(spec, run_dir, text, tmp_path)
    _check_paired_differences(spec, run_dir, text)

    again = Study(spec, progress=False)
    replan = again.plan()  # every stage cached, under the keys the first run wrote, with their cost then
    assert all(p.cached and p.same_as_committed for p in replan)
    assert {p.name: p.committed_seconds for p in replan} == {n: s["seconds"] for n, s in manifest["stages"].items()}
    with count_forwards() as calls:
        again.run()
    assert calls == [] and all(r.cached for r in again.cache.records.values())
    assert again.models._loaded == {}  # nothing recomputed, so no weights loaded

    from mechdiff.common.inference import margins_of

    spec.inference.margins = margins_of({"accuracy": 0.001})  # report-only: no stage recomputes, the report moves
    report_only = Study(spec, progress=False)
    with count_forwards() as calls:
        text = report_only.run().read_text()
    assert calls == [] and all(r.cached for r in report_only.cache.records.values())
    assert "[inference] margins: accuracy +-0.001, probability +-0.05" in text

    spec.cmap.parts = ["z", "v"]  # one changed option: only the CMAP stages recompute
    changed = Study(spec, progress=False)
    changed.run()
    fresh = {n for n, r in changed.cache.records.items() if not r.cached}
    assert fresh == {f"cmap:{n}" for n in spec.models.finetunes}


# A run killed between stages keeps every finished stage and resumes with the rest:
# test_faults.test_killed_at_every_stage_boundary_keeps_finished_stages (it kills before DCM, among others).


def test_study_on_another_task(tiny_family, tmp_path):
    """`[task] name = "ioi"`: the same pipeline on IOI's prompts, plan and desideratum; an unknown task name
    is refused at load with the line and the way to import one."""
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    spec = tiny_spec(tiny_family, tmp_path)
    spec.task.name = "ioi"
    spec.dcm.desiderata = ["io_name"]
    study = Study(spec, progress=False)
    assert study.task.name == "ioi" and "vocabulary" not in study.options()
    report = study.run().read_text()
    assert "## Circuits" in report and "## What the heads encode (DCM)" in report
    assert "faithfulness_logit_diff: faithfulness (logit difference" in report  # IOI's metric, named in captions
    assert "faithfulness_prob" not in report and "Pruning uses the logit difference" in report
    circuit = json.loads((tmp_path / "run" / "circuits" / f"{tiny_family[0].rsplit('/', 1)[-1]}.json").read_text())
    # IOI's classes: derived from its named positions (each, the tokens after each, those before, the last)
    from mechdiff.tasks.base import derived_class_names

    assert set(circuit["positions"].values()) <= set(derived_class_names(["IO", "S1", "S2", "last"]))
    bad = tmp_path / "bad.toml"
    bad.write_text('[models]\nbase = "smollm2-135m"\n\n[task]\nname = "no-such-task"\n')
    with pytest.raises(SpecError, match=r"bad.toml:5: task 'no-such-task' is neither.*dataset import"):
        load_spec(bad)


def test_whole_study_on_an_imported_task_of_several_templates_and_lengths(tiny_family, tmp_path, smollm2_tokenizer):
    """A JSONL task written outside the project (four templates; 5, 8 and 14 tokens) imported, then `mechdiff run`
    with `[task] name = DIR`: accuracy, position scan over its derived classes, curve circuit, pruning, matrix,
    CMAP and DCM (the task's own counterfactual as desideratum) and the report. A reference set missing a group
    is refused, naming it, before any weights load; so is a study whose prompt sets need more rows than the task
    holds. Every prompt set is drawn from rows of its own, each (template, length) group in each set: run.json
    lists each set's rows and the sets each stage read."""
    from conftest import capitals_rows, write_rows

    from mechdiff.cli import main

    rows = capitals_rows(80)
    for r in rows:  # two desiderata of its own: a column of the rows, and a file of its own
        r["swapped"] = r["counterfactual_answer"]
    rows = write_rows(tmp_path / "capitals.jsonl", rows)
    write_rows(tmp_path / "rome.jsonl", [{"target": " Rome"}] * 80)
    declared = ["--desideratum", "swapped=swapped", "--desideratum", f"rome={tmp_path / 'rome.jsonl'}"]
    args = ["dataset", "import", str(rows), "--model", tiny_family[0], "--out", str(tmp_path / "capitals")]
    assert main([*args, *declared]) == 0
    assert (
        main(
            [
                "eval",
                "--task",
                str(tmp_path / "capitals"),
                "--models",
                tiny_family[0],
                "--n",
                "24",
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert "accuracy" in (tmp_path / "eval.json").read_text()
    spec = tiny_spec(tiny_family, tmp_path)
    spec.task.name = str(tmp_path / "capitals")
    spec.dcm.desiderata = ["positional"]  # entity tracking's: not this task's, so the task's own are used
    spec.dcm.groups = spec.cmap.groups = []  # every group at a position of the prompts
    spec.scoring.reference_n = 3  # covers 3 of the 4 templates
    study = Study(spec, progress=False)
    with pytest.raises(ValueError, match="no reference prompts for the .* prompts of template '.*', .* tokens"):
        study.run()
    assert study.models.loaded == {}
    spec.scoring.reference_n = 12
    spec.eval.n = 15  # 81 rows in all
    with pytest.raises(ValueError, match=r"need 81 rows \(reference 12, eval 15, .*\), and the task holds 80"):
        Study(spec, progress=False)
    spec.eval.n = 12  # 80 rows, but rows 48-79 repeat the clean prompts of rows 0-31: 48 items
    with pytest.raises(
        ValueError,
        match=r"need about \d+ items \(reference: 12 rows in \d+ items; .*\), and the task "
        r"holds 48 items in 80 rows",
    ):
        Study(spec, progress=False)
    spec.eval.n, spec.scoring.prune_n = 8, 4  # 72 rows in 46 whole items
    study = Study(spec, progress=False)
    report = study.run().read_text()
    for section in (
        "## Accuracy",
        "## Circuits",
        "## Circuit x model",
        "## What the heads encode (DCM)",
        "## Cross-model activation patching (CMAP)",
        "never across templates",
        "no row is in two sets (counted from the row lists in `run.json`",
        "matrix 8 (4 groups)",
    ):
        assert section in report
    stages = tmp_path / "run" / "stages"
    base = tiny_family[0].rsplit("/", 1)[-1]
    positions = json.loads((stages / f"positions__{base}.json").read_text())["result"]["scan"]
    assert positions["classes"] == ["before", "capital", "after_capital", "country", "after_country", "last"]
    assert positions["n_prompts"] == spec.positions.n
    accuracy = json.loads((stages / f"accuracy__{base}.json").read_text())["result"]
    assert accuracy["accuracy"]["n"] == spec.eval.n
    dcm = json.loads((stages / "dcm.json").read_text())["result"]
    assert dcm["dcm"] and {r["desideratum"] for r in dcm["dcm"]} == {"swapped", "rome"}  # each declared one trained
    # groups at classes of several tokens (before, after_capital, ...) are trained at every token of the class;
    # one is left out only where a pair's two prompts hold different numbers of the class's tokens, and the report
    # says why
    circuit = json.loads((stages / f"circuit__{base}.json").read_text())["result"]["circuit"]
    multi = {
        g
        for g, heads in circuit["groups"].items()
        if heads and circuit["positions"][g] not in ("capital", "country", "last")
    }
    trained = {r["group"] for r in dcm["dcm"]}
    assert multi & trained and multi <= trained | set(dcm["left_out"]) and not trained & set(dcm["left_out"])
    assert all("tokens in the base prompt" in why for why in dcm["left_out"].values())
    assert not dcm["left_out"] or "Groups left out of DCM: " in report
    completeness = json.loads((stages / f"matrix__{base}.json").read_text())["result"]["completeness"]["groups"]
    assert multi <= set(completeness)  # completeness removes every token of a class
    # DCM's and CMAP's keys name the classes of several tokens they may patch (records made when such groups were
    # left out are not reused), and nothing where every group is a named token (the committed studies' keys)
    wide = set(positions["classes"]) - {"capital", "country", "last"}
    assert set(study.class_groups([])["class_groups"]) == wide
    assert study.class_groups(["capital", "last"]) == {}
    cmap = json.loads((stages / f"cmap__{tiny_family[1].rsplit('/', 1)[-1]}.json").read_text())["result"]
    assert cmap.get("skipped") or cmap["settings"]["n_prompts"] == spec.cmap.n
    sets = json.loads((tmp_path / "run" / "run.json").read_text())["prompt_sets"]
    rows = sets["rows"]
    drawn = [r for name in rows for r in rows[name]]
    assert len(drawn) == len(set(drawn)) == sum(study.prompt_set_sizes().values()) and sets["shared_rows"] == 0
    templates = [r["template"] for r in capitals_rows(80)]
    for name, indices in rows.items():  # every template in every set in proportion, within one item's 2 rows and 1
        counts = [sum(templates[i] == t for i in indices) for t in sorted(set(templates))]
        assert all(abs(c - len(indices) / 4) <= 3 for c in counts), (name, counts)
    # rows 48-79 repeat the clean prompts of rows 0-31 (12 countries x 4 templates): no clean prompt in two sets
    clean = [r["clean"] for r in capitals_rows(80)]
    held = {name: {clean[i] for i in indices} for name, indices in rows.items()}
    assert all(not held[a] & held[b] for a in held for b in held if a < b) and sets["shared_items"] == 0
    assert sets["items"] == {name: len(v) for name, v in held.items()} and sets["n_items"] == 48
    assert sets["stages"]["accuracy"] == ["eval"] and sets["stages"]["matrix"] == ["matrix", "reference"]


def test_stage_keys_know_an_imported_tasks_rows(tiny_family, tmp_path):
    """Every stage key of a study on an imported task carries the digest of its rows: the same rows imported
    again plan the same keys (cached stages stay cached); a changed row gives every stage another key. A task
    that generates its prompts carries no rows digest, so its keys (the committed studies') do not move."""
    from conftest import capitals_rows, write_rows

    from mechdiff.cli import main
    from mechdiff.studies.circuits.spec import output_dir
    from mechdiff.tasks.base import get_task

    def imported(rows: list[dict], matrix_n: int = 8) -> dict[str, str]:
        path = write_rows(tmp_path / "capitals.jsonl", rows)
        args = ["dataset", "import", str(path), "--model", tiny_family[0], "--out", str(tmp_path / "capitals")]
        assert main([*args, "--force"]) == 0
        spec = tiny_spec(tiny_family, tmp_path)
        spec.task.name = str(tmp_path / "capitals")
        spec.dcm.groups = spec.cmap.groups = []
        spec.scoring.n = matrix_n
        spec.eval.n, spec.scoring.prune_n = 8, 4  # within the rows' 48 items (clean prompts)
        return {p.name: p.key for p in Study(spec, progress=False).plan()}

    rows = capitals_rows(80)
    first = imported(rows)
    # another set's size deals other rows to the sets after it: those stages' keys move
    assert all(k != first[n] for n, k in imported(rows, matrix_n=9).items() if n.startswith(("accuracy", "dcm")))
    assert output_dir(str(tmp_path / "capitals")) == "results/capitals"  # an imported task's results: its name
    assert len(first) >= 5 and all(first.values())
    assert imported(rows) == first
    rows[0]["answer"], rows[0]["counterfactual_answer"] = rows[0]["counterfactual_answer"], rows[0]["answer"]
    changed = imported(rows)
    assert changed.keys() == first.keys() and all(changed[n] != first[n] for n in first)
    assert get_task("entity-tracking").rows_digest is None and get_task("ioi").rows_digest is None


def test_another_tasks_study_never_writes_into_a_committed_run_directory(tiny_family, tmp_path, capsys, monkeypatch):
    """`mechdiff run --task T` writes to results/T, not to the task file's directory; a task file without
    [output] writes to its task's own directory; a run into a directory whose run.json records another task is
    refused before any weights load (`--force` writes there anyway), and so is one of another kind of study."""
    from mechdiff.cli import main
    from mechdiff.models import loading
    from mechdiff.studies.base import RunDirError, check_run_dir, load_study

    assert load_study(None, task="ioi").dir == Path("results/ioi")
    assert load_study("tasks/ioi.toml").dir == Path("results/ioi-smollm2")  # the file's own [output]
    bare = tmp_path / "bare.toml"
    bare.write_text(f'[models]\nbase = "{tiny_family[0]}"\nfinetunes = ["{tiny_family[1]}"]\n\n[task]\nname = "ioi"\n')
    assert load_study(bare).dir == Path("results/ioi")

    run_dir = tmp_path / "committed"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"kind": "circuits", "spec": {"task": {"name": "entity-tracking"}}}))
    task_file = tmp_path / "ioi.toml"
    task_file.write_text(bare.read_text() + f'\n[output]\ndir = "{run_dir}"\n')

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(loading, "_load_weights", refuse)
    assert main(["run", str(task_file)]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir} holds a circuits study of task entity-tracking" in err and "--force" in err
    assert main(["run", str(task_file), "--model", tiny_family[0]]) == 2
    study = load_study(task_file)
    check_run_dir(study, force=True)  # asked to: no refusal
    (run_dir / "run.json").write_text(json.dumps({"kind": "circuits", "spec": {"task": {"name": "ioi"}}}))
    check_run_dir(study)  # its own task's directory: rerun freely
    (run_dir / "run.json").write_text(json.dumps({"kind": "headmap", "settings": {"model": "m"}}))
    with pytest.raises(RunDirError, match="holds a headmap study"):
        check_run_dir(study)
    assert main(["run", str(task_file), "--plan"]) == 0  # a plan writes nothing: never refused


def test_run_command_refuses_an_unknown_task_before_loading(capsys):
    from mechdiff.cli import main

    assert main(["run", "--task", "no-such-task"]) == 2
    assert "neither a registered task" in capsys.readouterr().err


def test_run_model_refuses_a_model_outside_the_study(tiny_family, tmp_path):
    """``mechdiff run TASK --model NAME`` runs one of the study's models; another name is refused before any work.
    (One process per model computing the serial run's records, the plain run after them finding every stage cached
    and loading no model: tests/integration/test_workers.py, whose workers are these processes.)"""
    with pytest.raises(ValueError, match="not a model of this study"):
        Study(tiny_spec(tiny_family, tmp_path), progress=False).run_model("other")


def test_a_process_waits_for_records_of_this_study_not_stale_ones(tiny_family, tmp_path, monkeypatch):
    """run_model waits for the other models' circuits and prunings: a record saved under other inputs (an
    earlier run's, with other settings) does not count, one under this study's inputs does."""
    import mechdiff.studies.circuits.study as study_module
    from mechdiff.common.io import write_json
    from mechdiff.runs.stages import key_hash

    class Waited(Exception):
        pass

    def sleep(_):
        raise Waited

    monkeypatch.setattr(study_module.time, "sleep", sleep)
    study = Study(tiny_spec(tiny_family, tmp_path), progress=False)
    other = tiny_family[1]

    def save(stage: str, inputs: dict) -> None:
        write_json(
            study.cache.path(f"{stage}:{other}"),
            {"name": stage, "key": key_hash(inputs), "inputs": inputs, "seconds": 0.0, "result": {}},
        )

    with pytest.raises(Waited):
        study._wait([other], "circuit", "me", poll=0)  # nothing saved yet
    circuit = study._circuit_inputs(other)
    save("circuit", circuit)
    study._wait([other], "circuit", "me", poll=0)
    save("prune", study._prune_inputs(other, "an earlier circuit's key"))
    with pytest.raises(Waited):
        study._wait([other], "prune", "me", poll=0)  # a stale pruning: the old code took it as ready
    save("prune", study._prune_inputs(other, key_hash(circuit)))
    study._wait([other], "prune", "me", poll=0)


def _check_heads_table_and_page(spec, run_dir, report_md, tmp_path):
    """tables/heads.json holds each circuit stage record's scores; report.html is written, and `mechdiff view`
    rebuilds it from the committed files alone (no stage records) with the report's own findings."""
    import shutil

    from mechdiff.cli import main
    from mechdiff.runs.stages import label

    heads = json.loads((run_dir / "tables" / "heads.json").read_text())
    for name in spec.model_names:
        rec = json.loads((run_dir / "stages" / f"circuit__{label(name)}.json").read_text())["result"]
        mine = {f"{r['head']}@{r['position']}": r for r in heads if r["model"] == name}
        members = {f"{h}@{rec['circuit']['positions'][g]}" for g, hs in rec["circuit"]["groups"].items() for h in hs}
        assert {p for p, r in mine.items() if r["in_circuit"]} == members
        for rank, (pair, score) in enumerate(rec["ranking"], 1):
            assert mine[pair]["attribution"] == score and mine[pair]["rank"] == rank
        for part in ("selected", "others"):
            for pair, freq in rec["stability"][part].items():
                assert mine[pair]["selection_frequency"] == freq
    page = (run_dir / "report.html").read_text()
    assert page.count('id="plotly-gz"') == 1 and "<script src=" not in page  # inlined once (gzipped), nothing fetched
    committed = tmp_path / "committed"
    shutil.copytree(run_dir, committed, ignore=shutil.ignore_patterns("stages", "report.html"))
    assert main(["view", str(committed)]) == 0
    again = (committed / "report.html").read_text()
    findings = report_md.split("## Findings", 1)[1].split("## Limitations", 1)[0]
    bullets = [line[2:].split("**")[-1].strip(" .") for line in findings.splitlines() if line.startswith("- ")]
    assert bullets and all(
        b.replace("`", "")[:40] in again.replace("<code>", "").replace("</code>", "") for b in bullets if b
    )
    assert "from <code>tables/heads.json</code>" in again and '"views"' in again
    # a run without the table (written before it existed) falls back on its stage records, with the same rows
    older = tmp_path / "older"
    shutil.copytree(run_dir, older, ignore=shutil.ignore_patterns("heads.*", "report.html"))
    assert main(["view", str(older)]) == 0
    fallback = (older / "report.html").read_text()
    assert "from <code>the circuit stage records (stages/)</code>" in fallback
    grid = lambda html: html.split("var GRID_DATA = ", 1)[1].split(";</script>", 1)[0]  # noqa: E731
    assert grid(fallback) == grid(again)


def test_every_stage_runs_in_bfloat16_within_a_stated_tolerance_of_float32(tiny_family, tiny_study, tmp_path):
    """The whole study in bfloat16 on CPU (the paper's float32 stays the task files' default): every stage runs,
    and its figures stay within bfloat16's tolerance of the float32 run's (tiny_study). Stated tolerances: every
    figure within 2% of its value (accuracies, probabilities, ratios, intervals, circuit sizes); attribution scores
    within 10% (or 2e-5); minimality contributions relative to F(C), differences of near-equal answer probabilities,
    within two bfloat16 epsilons (2^-7) absolute; normalised faithfulness and its areas (CPR, CMD) within 0.05."""
    spec = tiny_spec(tiny_family, tmp_path)
    spec.models.dtype = "bfloat16"
    Study(spec, progress=False).run()
    checked, outside = bfloat16_outside(tmp_path / "run" / "stages", tiny_study / "run" / "stages", tolerance)
    assert outside == [] and checked > 500, outside[:40]


def test_a_model_without_the_behaviour_gets_no_circuit(tiny_family, tiny_study, tmp_path, monkeypatch):
    """A model whose accuracy's lower bound is not above the floor (here the fine-tune: the floor is the task's
    chance level, 1/3 with 3 boxes, and random tiny models answer nothing) gets its accuracy and nothing that
    explains a behaviour: no position scan, circuit, pruning, matrix row or CMAP into it; the report says why
    in words and shows no nan for it. The base (let through as if above the floor) runs every stage. The run
    directory holds the stage records of tiny_study (the floor is in no stage key): the base's stages that do not
    read the fine-tune's are found there, the fine-tune's circuit and pruning lie there unused."""
    import shutil

    from mechdiff.studies.circuits.study import CircuitsStudy

    shutil.copytree(tiny_study / "run" / "stages", tmp_path / "run" / "stages")
    spec = tiny_spec(tiny_family, tmp_path)
    spec.eval.floor = None
    base, ft = spec.models.base, spec.models.finetunes[0]
    study = Study(spec, progress=False)
    assert study.floor() == pytest.approx(1 / 3)
    real = CircuitsStudy.has_behaviour
    monkeypatch.setattr(
        CircuitsStudy, "has_behaviour", lambda self, rec: rec.name == f"accuracy:{base}" or real(self, rec)
    )
    text = study.run().read_text()
    done = set(study.cache.records)
    assert {f"accuracy:{base}", f"accuracy:{ft}", f"circuit:{base}", f"matrix:{base}", "dcm"} <= done
    assert not {n for n in done if n.endswith(ft) and not n.startswith("accuracy")}  # nothing else for the fine-tune
    assert f"- **{ft}**: it answers 0.000 [0.000, " in text and "not above the floor 0.333 (the task's chance" in text
    assert not [line for line in text.splitlines() if ft in line and "nan" in line]  # (the base answers nothing too)
    matrix = json.loads((tmp_path / "run" / "stages" / f"matrix__{base.rsplit('/', 1)[-1]}.json").read_text())
    assert {r["circuit"] for r in matrix["result"]["rows"]} == {base, f"{base} pruned"}


def test_the_stage_table_gives_each_stages_planned_flops_and_share_of_throughput(tiny_family, tiny_study):
    """report.md's stage table: beside each stage's seconds, the planner's FLOPs for it and FLOPs / (seconds x the
    throughput run.json records), counted here again by the planner from the spec alone."""
    from mechdiff.models.devices import Device
    from mechdiff.report.tables import format_value
    from mechdiff.studies.circuits.stages.plan import resource_plan

    manifest = json.loads((tiny_study / "run" / "run.json").read_text())
    throughput = manifest["resources"]["throughput"]
    assert 1e8 < throughput < 1e13  # FLOP per CPU second of a real matrix multiply on a CPU
    here = Device("given", 1 << 40, {"float32": throughput}, False)
    planned = {p.cost.stage: p.cost.flops for p in resource_plan(tiny_spec(tiny_family, tiny_study), here)}
    lines = (tiny_study / "run" / "report.md").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| stage "))
    columns = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))) for line in lines[head + 2 :]]
    rows = rows[: next(i for i, line in enumerate(lines[head + 2 :]) if not line.startswith("|"))]
    assert {r["stage"] for r in rows} == set(manifest["stages"]) == set(planned)
    for r in rows:
        flops, seconds = planned[r["stage"]], manifest["stages"][r["stage"]]["seconds"]
        assert r["GFLOP (planned)"] == format_value(flops / 1e9, ".3f")
        assert r["share of mm throughput"] == format_value(flops / (seconds * throughput), ".3f")


def test_the_plans_lengths_are_taken_once_on_the_studys_own_tokenizer(tiny_family, tmp_path, monkeypatch):
    """run.json's plan record and DCM's cache mode read the task's lengths the study took once, on the tokenizer
    its model set read: no tokenizer is read for them, and the lengths are those a plan reads afresh."""
    from mechdiff.studies import planner

    spec = tiny_spec(tiny_family, tmp_path)
    study = Study(spec, progress=False)
    fresh = planner.task_lengths(spec)
    monkeypatch.setattr(planner, "planning_tokenizer", lambda model: pytest.fail(f"{model}'s tokenizer read again"))
    assert study.resources_record()["stage_flops"] and study.dcm_cache_mode()[0] in ("file", "memory", "recompute")
    assert study.lengths() is study.lengths() and study.lengths() == fresh
