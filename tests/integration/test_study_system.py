"""One study system: every kind (circuits, knowledge, HeadMap) is a task file run by `mechdiff run`, prints its
stage plan first, runs end to end on tiny models, and a second run finds every stage cached and runs no forward
pass. The committed studies' task files resolve to the stages, settings and seeds of their committed results."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import count_forwards, make_tiny

from mechdiff.runs.seeds import PROMPT_OFFSETS, prompt_seed
from mechdiff.studies.base import KINDS, format_plan, load_study, study_class, study_kind
from mechdiff.studies.headmap import settings as hm_settings
from mechdiff.studies.headmap.study import HeadMapStudy
from mechdiff.studies.knowledge import settings as kn_settings
from mechdiff.studies.knowledge.study import KnowledgeStudy
from mechdiff.studies.spec import SpecError

#: study.SEED_OFFSETS before the one study system (copied from it), and reproduce.py's ``seed + 7`` and ``+ 8``:
#: the seeds every committed result was drawn with.
OLD_OFFSETS = {
    "discovery": 0,
    "eval": 1,
    "matrix": 2,
    "reference": 3,
    "dcm": 4,
    "cmap": 5,
    "prune": 6,
    "positions": 7,
    "ranking": 8,
    "curve": 9,
}
OLD_REPRODUCTION = {"reproduction": 7, "reproduction-reference": 8}
#: The commands' ``--seed``, ``--seed + 1`` and ``--seed + 2`` (scored, reference, ranking prompts), with which
#: results/curve-smollm2 was drawn.
OLD_COMMANDS = {"command-scoring": 0, "command-reference": 1, "command-ranking": 2}


def test_prompt_seeds_are_those_of_the_committed_results():
    for seed in (0, 3, 1000):
        for name, offset in {**OLD_OFFSETS, **OLD_REPRODUCTION, **OLD_COMMANDS}.items():
            assert prompt_seed(seed, name) == seed + offset, name
    assert set(PROMPT_OFFSETS) == set(OLD_OFFSETS) | set(OLD_REPRODUCTION) | set(OLD_COMMANDS)
    with pytest.raises(KeyError, match="no prompt set 'evaluation'"):
        prompt_seed(0, "evaluation")


def test_kinds_and_the_committed_task_files(tmp_path):
    assert {k: study_class(k).kind for k in KINDS} == {k: k for k in KINDS}
    kinds = {p.name: study_kind(p) for p in Path("tasks").glob("*.toml")}
    assert kinds["headmap.toml"] == "headmap" and kinds["knowledge_acdc.toml"] == "knowledge"
    assert kinds["entity_tracking.toml"] == "circuits" and kinds["knowledge.toml"] == "knowledge"
    bad = tmp_path / "bad.toml"
    bad.write_text('[study]\n\nkind = "nonesuch"\n')
    with pytest.raises(SpecError, match=r"bad.toml:3: kind = 'nonesuch' in \[study\]; valid values: circuits"):
        study_kind(bad)
    bad.write_text('[study]\nkind = "knowledge"\n\n[knowledge]\nrelations = ["nonesuch"]\n[output]\ndir = "x"\n')
    with pytest.raises((ValueError, FileNotFoundError), match="nonesuch"):  # before any weights load
        load_study(bad)
    bad.write_text('[study]\nkind = "headmap"\n\n[headmap]\nk = 2\n')
    with pytest.raises(ValueError, match=r"give \[output\] dir"):
        load_study(bad)


def _states(plan) -> dict[str, str]:
    return {p.name: "cached" if p.cached else f"after {p.after}" if p.after else "compute" for p in plan}


# circuits: the plan, the run and the cached rerun without a forward pass are checked in
# test_study.py::test_study_end_to_end_and_caching (one tiny circuits study serves both).


# --------------------------------------------------------------------------------------
# knowledge
# --------------------------------------------------------------------------------------


def test_knowledge_study_plan_run_and_rerun(tmp_path, smollm2_tokenizer):
    model = make_tiny("llama", smollm2_tokenizer, seed=3, n_layers=2)
    settings = kn_settings.KnowledgeSettings(
        method="eap",
        k=30000,
        target=0.0,
        sizes=(0.3,),
        curve=False,
        n_random=1,
        max_facts=4,
        models=(model.name,),
        relations=("country_language", "antonym"),
    )
    loads = []

    def load(name):
        loads.append(name)
        return model

    study = KnowledgeStudy(settings, tmp_path / "k", load, progress=False)
    n = model.name
    per_relation = {
        "facts": "compute",
        f"discovery:{n}": "after facts",
        f"scoring:{n}": "after facts",
        f"analysis:{n}": "after facts",
    }
    want = {f"{r}/{s}": v for r in settings.relations for s, v in per_relation.items()}
    assert _states(study.plan()) == want
    report = study.run()
    assert report == tmp_path / "k"
    for r in settings.relations:  # each relation in its own directory, with its own stage records
        saved = json.loads((tmp_path / "k" / r / "study.json").read_text())
        assert saved["relation"] == r and set(saved["stages"]) == set(per_relation)
        assert (tmp_path / "k" / r / "report.md").is_file()
    manifest = json.loads((tmp_path / "k" / "run.json").read_text())
    assert manifest["kind"] == "knowledge" and set(manifest["stages"]) == set(want)
    again = KnowledgeStudy(settings, tmp_path / "k", load, progress=False)
    replan = again.plan()
    assert all(p.cached for p in replan) and {p.name: p.key for p in replan} == {
        n: s["key"] for n, s in manifest["stages"].items()
    }
    with count_forwards() as calls:
        again.run()
    assert calls == []
    assert all(r.cached for c in again.caches() for r in c.records.values())
    # one changed option: the plan says which stages recompute, before anything does
    changed = KnowledgeStudy(replace(settings, n_random=2), tmp_path / "k", load, progress=False)
    assert {name: state for name, state in _states(changed.plan()).items() if state != "cached"} == {
        **{f"{r}/scoring:{n}": "compute" for r in settings.relations},
        **{f"{r}/analysis:{n}": f"after scoring:{n}" for r in settings.relations},
    }  # its circuit is chosen anew


# --------------------------------------------------------------------------------------
# HeadMap
# --------------------------------------------------------------------------------------


def test_headmap_study_plan_run_and_rerun(tmp_path, smollm2_tokenizer):
    tiny = make_tiny("llama", smollm2_tokenizer, seed=1, n_layers=2)
    settings = hm_settings.HeadMapSettings(
        model="tiny-base",
        path_patching=(),
        n=4,
        pool=8,
        k=1,
        batch_size=16,
        steps=1,
        batch=4,
        eval_n=6,
        val_n=4,
        seeds=(0,),
        runs=("base", "located", "random"),
    )
    study = HeadMapStudy(settings, tmp_path / "hm", lambda name: tiny, progress=False)
    hlr = f"{settings.headmap_lr:g}"
    assert _states(study.plan()) == {
        "train-base": "compute",
        "locate-entity-tracking": "compute",
        f"train-located-seed0-hlr{hlr}": "after locate-entity-tracking",
        f"train-random-seed0-hlr{hlr}": "compute",
    }
    study.run()
    ran = {n: r.key for n, r in study.cache.records.items()}
    again = HeadMapStudy(settings, tmp_path / "hm", lambda name: tiny, progress=False)
    replan = again.plan()
    assert all(p.cached for p in replan) and {p.name: p.key for p in replan} == ran
    assert "0 of 4 stages to compute" in format_plan(replan)
    with count_forwards() as calls:
        again.run()
    assert calls == [] and all(r.cached for r in again.cache.records.values())


def test_committed_headmap_study_resolves_to_its_committed_stages(smollm2, tmp_path):
    """`mechdiff run tasks/headmap.toml` plans exactly the committed study: every stage of its run.json, under the
    same key, and every one cached (its records are committed), so the run recomputes nothing."""
    import shutil

    committed = json.loads(Path("results/headmap-smollm2/run.json").read_text())
    shutil.copytree("results/headmap-smollm2/stages", tmp_path / "stages")
    settings, directory = hm_settings.load_file("tasks/headmap.toml")
    assert directory == "results/headmap-smollm2"
    assert {k: v for k, v in json.loads(json.dumps(settings.__dict__)).items() if k != "notes"} == {
        k: v for k, v in committed["settings"].items() if k != "notes"
    }
    study = HeadMapStudy(settings, tmp_path, lambda name: smollm2, progress=False)
    plan = study.plan()
    assert {p.name: p.key for p in plan} == {n: s["key"] for n, s in committed["stages"].items()}
    assert all(p.cached for p in plan)


def test_committed_knowledge_study_resolves_to_its_committed_facts(smollm2, tmp_path):
    """`mechdiff run tasks/knowledge_acdc.toml` plans the three committed relations with their settings; the first
    stage of each (which facts the model gets right) has the committed key, so the same facts are read."""
    settings, directory = kn_settings.load_file("tasks/knowledge_acdc.toml")
    assert directory == "results/knowledge-smollm2/acdc"
    study = KnowledgeStudy(settings, tmp_path, lambda name: smollm2, progress=False)
    plan = {p.name: p for p in study.plan()}
    for relation in settings.relations:
        root = Path(directory) / relation
        saved = json.loads((root / "results.json").read_text())["settings"]
        mine = vars(study.relation_settings(relation))
        assert {k: mine[k] for k in saved if k in mine and k != "relations"} == {
            k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in mine and k != "relations"
        }
        committed = json.loads((root / "study.json").read_text())["stages"]
        assert plan[f"{relation}/facts"].key == committed["facts"]["key"]


def test_library_warnings_a_user_cannot_act_on_are_filtered_precisely():
    import warnings

    from mechdiff.cli import quiet_library_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_warnings()
        peft_alias = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
        warnings.warn_explicit(peft_alias, FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit(
            "another deprecation", FutureWarning, "modeling_utils.py", 2, module="transformers.modeling_utils"
        )
        warnings.warn_explicit(peft_alias, FutureWarning, "mine.py", 3, module="mechdiff.mine")
        warnings.warn_explicit(peft_alias, UserWarning, "modeling_utils.py", 4, module="transformers.modeling_utils")
    assert [(str(w.message), w.lineno) for w in seen] == [("another deprecation", 2), (peft_alias, 3), (peft_alias, 4)]


@pytest.fixture(scope="module")
def antonym_runs(tiny_family, tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str, str]]]:
    """`mechdiff run` of one knowledge task file (antonym, 4 facts, the base of `tiny_family`), progress on, its
    stdout and stderr each a file as in a study's log: ``--plan``, the run, a rerun, each in this process (cli.main,
    as the entry point calls it). Returns the task file and, for ``plan``, ``computed`` and ``cached``, the exit
    code, stdout and stderr (bytes decoded as written: a bar's "\\r" stays); ``plan`` also says whether the plan
    left a stage record or run.json behind. Read by the two tests below (one study run, not two, and no process)."""
    import contextlib

    from mechdiff.cli import main

    root = tmp_path_factory.mktemp("antonym")
    task = root / "k.toml"
    task.write_text(
        f'[study]\nkind = "knowledge"\n\n[output]\ndir = "{root / "out"}"\n\n[knowledge]\n'
        f'relation = "antonym"\nmodels = ["{tiny_family[0]}"]\nmax_facts = 4\nk = 30000\n'
    )
    runs = {}
    for state, options in (("plan", ["--plan"]), ("computed", []), ("cached", [])):
        out, err = root / f"{state}.out", root / f"{state}.err"
        with open(out, "w") as o, open(err, "w") as e, contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            code = main(["run", str(task), *options])
        runs[state] = (code, out.read_bytes().decode(), err.read_bytes().decode())
        if state == "plan":
            runs["plan left"] = ((root / "out" / "stages").exists(), (root / "out" / "run.json").exists())
    return task, runs


def test_mechdiff_run_prints_the_plan_and_plan_stops_there(tiny_family, antonym_runs):
    task, runs = antonym_runs
    out_dir = task.parent / "out"
    code, out, _ = runs["plan"]
    assert code == 0
    resources, _, stages = out.partition(f"\nknowledge study into {out_dir}:\n")
    assert stages and "host GiB" in resources  # every kind's plan: its resources first, then its stages
    assert "facts " in out and f"discovery:{tiny_family[0]}" in out and "4 of 4 stages to compute" in out
    assert runs["plan left"] == (False, False)  # no stage record, no run.json
    # Then the run (studies.base.plan_then_run): the plan, each stage's time, the report; a rerun: all cached.
    stages = ["facts", f"discovery:{tiny_family[0]}", f"scoring:{tiny_family[0]}", f"analysis:{tiny_family[0]}"]
    for state, cached in (("computed", False), ("cached", True)):
        code, out, _ = runs[state]
        assert code == 0
        assert out.startswith(f"knowledge study into {out_dir}:\n")
        assert f"{4 * (not cached)} of 4 stages to compute" in out and out.rstrip().endswith("report.md")
        lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
        assert [w[0] for w in lines] == stages
        assert all((w[1:] == ["cached"]) if cached else (w[2] == "s" and float(w[1]) >= 0) for w in lines)


def test_a_run_logged_to_a_file_has_no_bars_and_one_line_per_stage(tiny_family, antonym_runs):
    """``mechdiff run`` with stderr a file (a study's log, CI), progress on: no bar's carriage return or cursor
    escape in the log, one plain line per stage as it ends, computed and then, on a rerun, cached."""
    _, runs = antonym_runs
    stages = ["facts", f"discovery:{tiny_family[0]}", f"scoring:{tiny_family[0]}", f"analysis:{tiny_family[0]}"]
    for state in ("computed", "cached"):
        code, _, text = runs[state]
        assert code == 0, text
        assert "\r" not in text and "\x1b[" not in text, text
        lines = [line for line in text.splitlines() if line.startswith("stage ")]
        assert [line.split()[1].rstrip(":") for line in lines] == stages, text
        assert all(line.split()[2] == state for line in lines), text
