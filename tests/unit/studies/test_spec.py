"""The paper's study as a task file: the spec's rules and its checks (mechdiff.studies.circuits.spec)."""

from __future__ import annotations

import math

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["entity_tracking_llama7b.toml", "entity_tracking_paper_form.toml"])
def test_task_file_resolves_to_the_paper_rules(name):
    from mechdiff.methods.dcm import PAPER_DCM
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.circuits.stages.dcm import dcm_config
    from mechdiff.tasks.plan import default_plan

    spec = load_spec(ROOT / "tasks" / name)
    steps = [s.name for s in default_plan().steps]
    d, s, c, m = spec.discovery, spec.scoring, spec.dcm, spec.cmap
    # discovery: path patching of A-D. LLaMA-7B as the paper's code runs it: every sender exact on 300 pairs, the
    # mean of per-prompt relative changes, 20/5/10/5 receivers per step (experiment_1/path_patching.py) and the
    # circuit cut at 58/10/25/5 (experiment_1/minimality.py); Goat and FLoAT at their own k, each model its seed.
    # The committed SmolLM2 paper form (one k for both, scaled by 270 / 1024 heads) is left as it was run.
    k = {"A": 58, "B": 10, "C": 25, "D": 5}
    if "llama7b" in name:
        assert (d.method, d.n, d.screen, d.score) == ("path", 300, False, "mean_of_ratios")
        assert d.top_k == {"A": 20, "B": 5, "C": 10, "D": 5} and d.circuit_k == k
        goat, flt = {"A": 50, "B": 20, "C": 30, "D": 5}, {"A": 101, "B": 30, "C": 50, "D": 40}
        assert d.models["goat-7b"] == {"top_k": goat, "circuit_k": flt, "seed": 82}
        assert d.models["float-7b"] == {"top_k": goat, "circuit_k": {**flt, "A": 102}, "seed": 85}
        assert d.models["llama-7b"] == {"seed": 20} and "vicuna-7b" not in d.models  # Vicuna: LLaMA's k
    else:
        k = {g: math.ceil(v * 270 / 1024) for g, v in k.items()}
        assert d.method == "path" and d.n == 100 and d.top_k == k and d.circuit_k == {} and d.models == {}
    assert list(d.top_k) == steps
    assert spec.sets.nested  # discovery, pruning and evaluation: first-N of one draw, as the paper's one file
    # pruning: the paper's pairwise rule on accuracy over 100 prompts
    assert (s.prune, s.prune_rule, s.prune_metric, s.prune_n, s.prune_threshold, s.prune_share) == (
        True,
        "paper",
        "accuracy",
        100,
        0.01,
        0.3,
    )
    # DCM: the paper's training on the pruned groups A-D, 2000 pairs split 50/25/25
    assert c.circuit == "pruned" and c.groups == steps
    assert (c.n_train, c.n_val, c.n_test) == (1000, 500, 500)
    config = dcm_config(spec)
    for key, value in PAPER_DCM.items():
        assert getattr(config, key) == (pytest.approx(value) if key == "split" else value), key
    # CMAP: each fine-tune's pruned circuit cut to its DCM selections, the paper's patch sites
    assert m.scope == "paper" and m.groups == steps and m.isolate
    assert m.selection == {"A": "object_value", "B": "positional", "C": "positional"}
    assert set(m.selection.values()) <= set(c.desiderata) and set(m.parts) >= {"z", "q", "k", "v"}
    if "llama7b" in name:  # only = true runs the reproduction table; only = false the stages above
        assert spec.reproduce.only and spec.reproduce.circuit
    else:  # the same study on the embedded family, every stage
        assert (spec.models.base, spec.models.finetunes) == ("smollm2-et-early", ["smollm2-et"])
        assert not spec.reproduce.circuit


def test_task_file_paper_stages_need_pruning(tmp_path):
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    text = (ROOT / "tasks" / "entity_tracking_llama7b.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[scoring]\n", "[scoring]\nprune = false\n"))
    with pytest.raises(SpecError, match="prune = true"):
        load_spec(bad)
    bad.write_text(
        text.replace('desiderata = ["positional", "object_value", "label_value"]', 'desiderata = ["label_value"]')
    )
    with pytest.raises(SpecError, match="selection names desiderata"):
        load_spec(bad)


@pytest.mark.parametrize(
    "method, size, message",
    [
        ("path", "0", r"pairs_per_part = 0: give a number of pairs of at least 1"),
        ("curve", "50", r"pairs_per_part holds path patching's pairs in parts; method = 'curve' reads no pairs"),
    ],
)
def test_pairs_per_part_is_refused_with_its_line_where_it_cannot_hold(tmp_path, method, size, message):
    """A part of no pairs, of a fraction of one, or of a study that discovers no circuit by path patching."""
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    text = (ROOT / "tasks" / "entity_tracking_llama7b.toml").read_text()
    assert text.count('method = "path"') == 1
    good = tmp_path / "good.toml"
    good.write_text(text.replace('method = "path"', 'method = "path"\npairs_per_part = 50'))
    assert load_spec(good).discovery.pairs_per_part == 50
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('method = "path"', f'method = "{method}"\npairs_per_part = {size}'))
    line = next(i for i, x in enumerate(bad.read_text().splitlines(), 1) if x.startswith("pairs_per_part"))
    with pytest.raises(SpecError, match=rf"bad.toml:{line}: \[discovery\] {message}"):
        load_spec(bad)


def test_a_file_asking_for_dcm_needs_the_tasks_own_desiderata(smollm2_tokenizer, tmp_path):
    """[dcm] on a task that declares no desideratum is refused when the file loads, naming the line and the way
    out; so are desiderata the task does not declare. Without [dcm] the same task loads (DCM is then reported as
    not run)."""
    from conftest import capitals_rows, write_rows

    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.jsonl import import_pairs

    rows = capitals_rows(8)
    for row in rows:
        del row["counterfactual_answer"]
    task = import_pairs(write_rows(tmp_path / "c.jsonl", rows), smollm2_tokenizer, tmp_path / "capitals")
    head = f'[models]\nbase = "smollm2-135m"\nfinetunes = ["smollm2-et"]\n\n[task]\nname = "{task}"\n'
    plain = tmp_path / "plain.toml"
    plain.write_text(head)
    assert load_spec(plain).task.name == str(task)
    asks = tmp_path / "asks.toml"
    asks.write_text(head + "\n[dcm]\ngroups = []\n")
    with pytest.raises(SpecError, match=r"asks.toml:8: \[dcm\] asks for DCM, but task .* declares no desideratum"):
        load_spec(asks)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(head.replace(f'"{task}"', '"ioi"') + '\n[dcm]\ndesiderata = ["positional"]\n')
    with pytest.raises(SpecError, match=r"wrong.toml:9: \[dcm\] desiderata \['positional'\] are not task ioi's"):
        load_spec(wrong)


def test_defaults_come_from_the_task_never_from_entity_tracking(smollm2_tokenizer, tmp_path):
    """A task file that names no groups, desiderata or top_k gets the task's own: DCM trains every desideratum the
    task declares, the groups are every group at a position of the task's prompts (empty), and path patching keeps each
    step's plan k; groups the task does not have are refused with their line. The embedded default study keeps
    entity tracking's, and a study that leaves top_k unset is keyed as the committed ones were."""
    from conftest import capitals_rows, write_rows

    from mechdiff.studies.circuits.spec import default_spec, load_spec, section_inputs
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.jsonl import import_pairs
    from mechdiff.tasks.plan import load_plan

    task = import_pairs(write_rows(tmp_path / "c.jsonl", capitals_rows(8)), smollm2_tokenizer, tmp_path / "capitals")
    head = f'[models]\nbase = "smollm2-135m"\nfinetunes = ["smollm2-et"]\n\n[task]\nname = "{task}"\n'
    plain = tmp_path / "plain.toml"
    plain.write_text(head)
    spec = load_spec(plain)
    assert spec.dcm.desiderata == [] and spec.dcm.groups == [] and spec.cmap.groups == []
    assert spec.discovery.top_k == {}
    for bad, line in (('[dcm]\ngroups = ["query_label"]\n', 9), ('[cmap]\ngroups = ["last", "A"]\n', 9)):
        path = tmp_path / "bad.toml"
        path.write_text(head + "\n" + bad)
        with pytest.raises(SpecError, match=rf"bad.toml:{line}: .* names \['(query_label|A)'\], which task"):
            load_spec(path)
    ok = tmp_path / "ok.toml"
    ok.write_text(head + '\n[dcm]\ngroups = ["last", "after_capital", "country"]\n')
    assert load_spec(ok).dcm.groups == ["last", "after_capital", "country"]
    # IOI by path patching with no top_k: each step's plan k, not entity tracking's A-D
    ioi = tmp_path / "ioi.toml"
    ioi.write_text(head.replace(f'"{task}"', '"ioi"') + '\n[discovery]\nmethod = "path"\n')
    study = CircuitsStudy.__new__(CircuitsStudy)
    study.spec = load_spec(ioi)
    plan = load_plan(get_task("ioi").plan)
    assert study.path_settings("smollm2-135m", plan).k == {}
    assert {s.name: s.k for s in plan.with_k(study.path_settings("smollm2-135m", plan).k).steps} == {
        s.name: s.k for s in plan.steps
    }
    default = default_spec()
    assert default.dcm.desiderata == ["positional", "object_value", "label_value"]
    assert default.dcm.groups == default.cmap.groups == ["last", "query_label"]
    assert section_inputs("discovery", default.discovery)["top_k"] == {"A": 8, "B": 3, "C": 5, "D": 3}


def test_the_papers_counterfactuals_and_seeds_are_selected_by_the_paper_files_and_keyed_only_when_set(
    smollm2_tokenizer, tmp_path
):
    """The paper's task file selects the paper's counterfactuals and per-model seeds that redraw only them (and no
    position scan); the study hands them to the task's pairs, so every model sees the study's clean prompts. Unset,
    neither enters a stage key (the committed studies' keys do not move); set where they cannot act, each is refused
    with its line."""
    from mechdiff.studies.circuits.report.circuits import _counterfactuals
    from mechdiff.studies.circuits.spec import default_spec, load_spec, section_inputs
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.plan import default_plan

    spec = load_spec(ROOT / "tasks" / "entity_tracking_llama7b.toml")
    d = spec.discovery
    assert (d.counterfactual, d.model_seed_redraws, spec.positions.n) == ("paper", "counterfactuals", 0)
    assert load_spec(ROOT / "tasks" / "entity_tracking_paper_form.toml").discovery.counterfactual == "paper"
    keyed = section_inputs("discovery", default_spec().discovery)
    assert "counterfactual" not in keyed and "model_seed_redraws" not in keyed
    assert _counterfactuals(default_spec().discovery) == ""
    assert "(j+1) mod n_boxes" in _counterfactuals(d) and "same clean prompts" in _counterfactuals(d)
    assert section_inputs("discovery", d)["counterfactual"] == "paper"

    study = CircuitsStudy.__new__(CircuitsStudy)
    study.spec, study.tokenizer = spec, smollm2_tokenizer
    study.spec.discovery.n = 14
    assert study.pair_options() == {"counterfactual": "paper", "clean_seed": study.seed("discovery")}
    options = study.options(prompts="discovery")
    clean = [e.prompt for e in study.task.records(smollm2_tokenizer, 14, study.seed("discovery"), **options)]
    pairs = {}
    for name in ("llama-7b", "goat-7b"):  # seeds 20 and 82
        seed = study.path_settings(name, default_plan()).seed
        pairs[name] = study.task.discovery_pairs(smollm2_tokenizer, 14, seed, **options, **study.pair_options())
        assert [p.base.prompt for p in pairs[name]] == clean
    assert [p.source.prompt for p in pairs["llama-7b"]] != [p.source.prompt for p in pairs["goat-7b"]]
    study.spec = default_spec()
    assert study.pair_options() == {}

    text = (ROOT / "tasks" / "entity_tracking_llama7b.toml").read_text()
    bad = tmp_path / "bad.toml"
    for old, new, message in (
        ('method = "path"', 'method = "curve"', r"counterfactual = 'paper' builds path patching's pairs"),
        ('name = "entity-tracking"', 'name = "ioi"', r"task ioi's pairs offer no such choice"),
        ('counterfactual = "paper"', 'counterfactual = "papers"', r"valid values: fresh, paper"),
    ):
        bad.write_text(text.replace(old, new))
        line = next(i for i, x in enumerate(bad.read_text().splitlines(), 1) if x.startswith("counterfactual"))
        with pytest.raises(SpecError, match=rf"bad.toml:{line}: .*{message}"):
            load_spec(bad)
