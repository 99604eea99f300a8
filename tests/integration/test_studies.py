"""The knowledge and HeadMap studies on the one stage cache and the one task-file loader (tiny models):
a rerun recomputes nothing, a changed option recomputes only the stages that read it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny

from mechdiff.methods.knowledge.graph import EdgeCircuit
from mechdiff.studies.knowledge import analysis as k_analysis
from mechdiff.studies.knowledge import discovery as k_discovery
from mechdiff.studies.knowledge import facts as k_facts
from mechdiff.studies.knowledge import model_run as k_model_run
from mechdiff.studies.knowledge import scoring as k_scoring
from mechdiff.studies.knowledge.settings import KnowledgeSettings, load_settings
from mechdiff.studies.knowledge.study import KnowledgeStudy
from mechdiff.studies.spec import SpecError


def _forbid(monkeypatch, module, *names):
    """Make each of ``names`` in ``module`` fail if called: a cached stage must not compute."""
    for name in names:

        def fail(*a, _name=name, **k):
            raise AssertionError(f"{_name} ran in a cached rerun")

        monkeypatch.setattr(module, name, fail)


def _knowledge_setup(tmp_path, tokenizer):
    model = make_tiny("llama", tokenizer, seed=3, n_layers=2)
    # A random model ranks few answers in its top 10: a wide k keeps facts in the study.
    settings = KnowledgeSettings(
        method="eap",
        k=30000,
        target=0.0,
        sizes=(0.01, 0.3),
        curve_sizes=(0.1, 1.0),
        n_random=1,
        max_facts=8,
        relation="country_language",
    )
    return model, settings, tmp_path / "k"


def _knowledge_study(model, settings, out) -> "KnowledgeStudy":
    """The knowledge study of ``settings`` on the loaded ``model`` (a test's tiny one), by its class."""
    return KnowledgeStudy(replace(settings, models=(model.name,)), out, {model.name: model}.__getitem__, progress=False)


def _run_knowledge(model, settings, out) -> dict:
    """Run the study (:func:`_knowledge_study`); its outcome on its one relation."""
    study = _knowledge_study(model, settings, out)
    study.run()
    return study.outcome[settings.relation]


@pytest.fixture
def knowledge_run(tmp_path, smollm2_tokenizer):
    return _knowledge_setup(tmp_path, smollm2_tokenizer)


@pytest.fixture(scope="module")
def knowledge_first(tmp_path_factory, smollm2_tokenizer):
    """The knowledge study run once from an empty directory: (model, settings, its directory, its result). The
    tests that rerun it work on their own copy of the directory."""
    model, settings, out = _knowledge_setup(tmp_path_factory.mktemp("knowledge"), smollm2_tokenizer)
    return model, settings, out, _run_knowledge(model, settings, out)


def _page_holds_each_circuit_file(run: Path) -> None:
    """``mechdiff run`` wrote ``report.html``: under 2.5 MB (plotly.js gzipped, where it has a figure), titled as the
    report, a grid view per circuit file it names (and the differences of two)."""
    import re

    html = (run / "report.html").read_text()
    assert html.count('id="plotly-gz"') <= 1 and "* plotly.js v" not in html and len(html) < 2_500_000
    title = next(line[2:] for line in (run / "report.md").read_text().splitlines() if line.startswith("# "))
    assert f"<title>{title}</title>" in html
    grid = re.search(r"var GRID_DATA = (\{.*?\});</script>", html)
    for view in json.loads(grid.group(1))["views"] if grid else []:
        assert " - " in view["name"] or (run / f"{view['name']}.json").is_file(), view["name"]


def _cached(res: dict) -> dict[str, bool]:
    return {n: s["cached"] for n, s in res["study"]["stages"].items()}


def test_knowledge_rerun_recomputes_nothing(knowledge_first, tmp_path, monkeypatch):
    import shutil

    model, settings, shared, first = knowledge_first
    name = model.name
    _page_holds_each_circuit_file(shared)
    assert _cached(first) == {
        "facts": False,
        f"discovery:{name}": False,
        f"scoring:{name}": False,
        f"analysis:{name}": False,
    }
    out = shutil.copytree(shared, tmp_path / "k")
    before = json.loads((out / "results.json").read_text())
    with monkeypatch.context() as m:
        for module, names in (
            (k_facts, ("evaluate", "full_model_hits")),
            (k_model_run, ("evaluate", "mean_ablation")),
            (k_discovery, ("attribution_scores",)),
            (k_scoring, ("faithfulness_curve",)),
            (k_analysis, ("logit_lens", "attention_mass")),
        ):
            _forbid(m, module, *names)
        second = _run_knowledge(model, settings, out)
    assert all(_cached(second).values())
    after = json.loads((out / "results.json").read_text())
    for key in ("circuit_edges", "full", "circuit", "random", "sweep", "curve", "roles", "logit_lens"):
        assert after[key] == before[key], key
    # The circuit file rewritten from the records is the same circuit.
    assert len(EdgeCircuit.load(out / "circuit.json").edges) == before["circuit_edges"]


def test_knowledge_changed_option_recomputes_only_its_stages(knowledge_first, tmp_path):
    import shutil

    model, settings, shared, first = knowledge_first
    out = shutil.copytree(shared, tmp_path / "k")
    name = model.name
    # More random circuits: scoring only; the circuit (hence the analysis) and the edge scores are unchanged.
    more = _run_knowledge(model, replace(settings, n_random=2), out)
    assert _cached(more) == {
        "facts": True,
        f"discovery:{name}": True,
        f"scoring:{name}": False,
        f"analysis:{name}": True,
    }
    r0, r1 = first["results"][name], more["results"][name]
    hk = f"hit@{settings.k}"
    assert r1["random"][hk][0] == r0["random"][hk][0]  # draw 0 keeps its derived seed
    assert len(r1["random"][hk]) == 2 and r1["circuit_edges"] == r0["circuit_edges"]
    # Another discovery method: discovery and what reads it; the facts stay.
    other = _run_knowledge(model, replace(settings, n_random=2, method="eap-ig", ig_steps=2), out)
    c = _cached(other)
    assert c["facts"] and not c[f"discovery:{name}"] and not c[f"scoring:{name}"]


def test_knowledge_study_refuses_models_of_different_vocabularies_before_any_stage(tmp_path):
    from types import SimpleNamespace

    from mechdiff.models.modelset import IncompatibleModels

    vocabs = {"a": {"x": 0, "y": 1}, "b": {"x": 0, "y": 2}}
    models = {n: SimpleNamespace(name=n, tokenizer=SimpleNamespace(get_vocab=v.copy)) for n, v in vocabs.items()}
    study = KnowledgeStudy(KnowledgeSettings(models=("a", "b")), tmp_path / "k", models.__getitem__, progress=False)
    with pytest.raises(IncompatibleModels, match=r"vocabularies differ \(a: 2 tokens, b: 2 tokens, 2 differing"):
        study.stages()
    assert not (tmp_path / "k" / "stages").exists()


def test_knowledge_task_file_through_the_one_loader(tmp_path):
    good = tmp_path / "k.toml"
    good.write_text('[knowledge]\nrelation = "antonym"\nmodels = ["a", "b"]\nsizes = [0.1, 0.2]\nk = 5\n')
    s = load_settings(good)
    assert (s.relation, s.models, s.sizes, s.k) == ("antonym", ("a", "b"), (0.1, 0.2), 5)
    assert s.tau == KnowledgeSettings().tau  # the rest: the dataclass defaults
    bad = tmp_path / "bad.toml"
    bad.write_text('[knowledge]\nk = 5\n\nmethod = "eap-xx"\n')
    with pytest.raises(SpecError, match=r"bad.toml:4: method = 'eap-xx'.*valid values: eap, iterative"):
        load_settings(bad)
    bad.write_text("[knowledge]\nk = 5\ntemplatez = 1\n")
    with pytest.raises(SpecError, match=r"bad.toml:3: unknown key 'templatez' in \[knowledge\]"):
        load_settings(bad)
    bad.write_text('[knowledge]\nk = "ten"\n')
    with pytest.raises(SpecError, match=r"bad.toml:2: k = 'ten'"):
        load_settings(bad)
    bad.write_text('[task]\nname = "ioi"\n')
    with pytest.raises(SpecError, match=r"bad.toml:1: unknown section \[task\]; valid sections: knowledge"):
        load_settings(bad)


def test_the_committed_knowledge_task_file_loads():
    s = load_settings("tasks/knowledge.toml")
    assert s.models == ("smollm2-135m", "smollm2-et") and s.sizes[0] == 0.001 and isinstance(s.sizes, tuple)


# --------------------------------------------------------------------------------------
# HeadMap
# --------------------------------------------------------------------------------------

import mechdiff.studies.headmap.study as hm  # noqa: E402
from mechdiff.methods.headmap import choose_lr, correct, get_task, random_heads  # noqa: E402
from mechdiff.studies.headmap import locate as hm_locate  # noqa: E402
from mechdiff.studies.headmap import settings as hm_settings  # noqa: E402
from mechdiff.studies.headmap import training as hm_training  # noqa: E402
from mechdiff.studies.headmap.tables import validation_accuracy  # noqa: E402


def _headmap_setup(tmp_path, tokenizer):
    models = {
        "tiny-base": make_tiny("llama", tokenizer, seed=1, n_layers=2),
        "tiny-zoo": make_tiny("llama", tokenizer, seed=2, n_layers=2),
    }
    loaded = []

    def load(name):
        loaded.append(name)
        return models[name]

    settings = hm_settings.HeadMapSettings(
        model="tiny-base",
        lora_zoo="tiny-zoo",
        path_patching=(),
        n=4,
        pool=8,
        k=1,
        batch_size=16,
        steps=2,
        batch=4,
        eval_n=8,
        val_n=6,
        lora_small=1,
        lora_large=2,
        seeds=(0, 1),
        lrs=(1e-3, 1e-2),
        runs=("base", "located", "random", "outside", "lora-small", "transfer", "lora-zoo"),
    )
    return settings, tmp_path / "hm", load, loaded


@pytest.fixture
def headmap_setup(tmp_path, smollm2_tokenizer):
    return _headmap_setup(tmp_path, smollm2_tokenizer)


@pytest.fixture(scope="module")
def headmap_first(tmp_path_factory, smollm2_tokenizer):
    """The whole HeadMap study run once from an empty directory: (its study, report text, the models it loaded,
    settings, its directory). The tests that rerun it work on their own copy of the directory."""
    settings, out, load, loaded = _headmap_setup(tmp_path_factory.mktemp("headmap"), smollm2_tokenizer)
    study = hm.HeadMapStudy(settings, out, load, progress=False)
    text = study.run().read_text()
    return study, text, list(loaded), settings, out


def test_headmap_rerun_recomputes_nothing(headmap_first, headmap_setup, monkeypatch):
    import shutil

    study, text, loaded_first, settings, shared = headmap_first
    _, out, load, loaded = headmap_setup
    _page_holds_each_circuit_file(shared)
    first = study.cache.summary()
    lora_lr, hm_lr = study.chosen_lrs({})  # chosen by the run above
    sweep = {f"train-located-seed0-hlr{lr:g}" for lr in settings.lrs} | {
        f"train-lora-small-seed0-lr{lr:g}" for lr in settings.lrs
    }
    seeded = {f"train-{r}-seed{s}-hlr{hm_lr:g}" for r in ("located", "random", "outside", "transfer") for s in (0, 1)}
    seeded |= {f"train-lora-small-seed{s}-lr{lora_lr:g}" for s in (0, 1)}
    assert (
        set(first)
        == {"locate-entity-tracking", "locate-arithmetic-mc", "train-base", "train-lora-zoo"} | sweep | seeded
    )  # the sweep's seed-0 runs at the chosen rates are the seed-0 runs: trained once
    reused = {n for n, r in first.items() if r["cached"]}  # in the first run, from the sweep
    assert reused == {f"train-located-seed0-hlr{hm_lr:g}", f"train-lora-small-seed0-lr{lora_lr:g}"}
    assert loaded_first.count("tiny-zoo") == 1  # the zoo's model loaded once, for its stage
    shutil.copytree(shared, out)
    with monkeypatch.context() as m:
        _forbid(m, hm, "train")
        _forbid(m, hm_locate, "locate_task")
        _forbid(m, hm_training, "correct")
        again = hm.HeadMapStudy(settings, out, load, progress=False)
        again.run()
    assert all(r["cached"] for r in again.cache.summary().values())
    assert "tiny-zoo" not in loaded  # the zoo's model loads only when its stage computes
    # The report rebuilt from the records carries the same numbers (only the wall time may differ).
    strip = lambda t: [line for line in t.splitlines() if not line.startswith("Made by")]  # noqa: E731
    assert strip((out / "report.md").read_text()) == strip(text)
    methods = json.loads((out / "tables" / "methods.json").read_text())
    rows = methods["rows"] if isinstance(methods, dict) else methods
    base = next(r for r in rows if r["method"] == "base (no training)")
    want = float(
        np.mean(
            correct(
                study.model.model,
                get_task("entity-tracking").eval_batch(
                    study.model.tokenizer, settings.eval_n, settings.train_config().eval_seed
                ),
            )
        )
    )
    assert base["accuracy"] == pytest.approx(want)
    located = next(r for r in rows if r["method"] == "HeadMap (located)")
    per_seed = [
        np.mean(
            json.loads((out / "stages" / f"train-located-seed{s}-hlr{hm_lr:g}.json").read_text())["result"]["correct"][
                "entity-tracking"
            ]
        )
        for s in (0, 1)
    ]
    assert located["seeds"] == 2 and located["accuracy"] == pytest.approx(np.mean(per_seed))
    assert located["per_seed"] == " / ".join(f"{a:.3f}" for a in per_seed)
    assert "Do located heads beat random ones here?" in text
    assert (out / "tables" / "lr_sweep.json").exists() and (out / "tables" / "paired.json").exists()


def test_headmap_changed_option_recomputes_only_dependent_stages(headmap_first, headmap_setup):
    import shutil

    _, out, load, _ = headmap_setup  # models made afresh, as the shared run's were before it ran
    settings, shared = headmap_first[3], headmap_first[4]
    shutil.copytree(shared, out)  # every training run of ``settings`` cached
    # Another LoRA rank: only the LoRA runs (its sweep and seeds); a third seed: only that seed's runs, not
    # locating, the sweep or the evaluations.
    study = hm.HeadMapStudy(replace(settings, lora_small=2), out, load, progress=False)
    study.run(train_only=True)
    changed = {n for n, r in study.cache.summary().items() if not r["cached"]}
    assert changed and all(n.startswith("train-lora-small-") for n in changed)
    study = hm.HeadMapStudy(replace(settings, lora_small=2, seeds=(0, 1, 2)), out, load, progress=False)
    study.run(train_only=True)
    changed = {n for n, r in study.cache.summary().items() if not r["cached"]}
    assert {n.split("-seed")[0] for n in changed} == {
        "train-located",
        "train-random",
        "train-outside",
        "train-lora-small",
        "train-transfer",
    }
    assert all("-seed2-" in n for n in changed)


def test_random_head_sets_draw_seeds_by_name(headmap_setup):
    settings, out, load, _ = headmap_setup
    study = hm.HeadMapStudy(replace(settings, k=1), out, load, progress=False)
    shape = study.model.shape
    per_layer = {layer: 1 for layer in range(shape.n_layers)}
    from mechdiff.runs.seeds import derive

    located = study.locate("entity-tracking", settings.n).heads()
    for seed in (0, 1):  # every seed draws its own sets
        assert study.heads("random", seed) == random_heads(shape, per_layer, seed=derive(seed, "random-heads"))
        outside = study.heads("outside", seed)
        assert outside == random_heads(shape, per_layer, seed=derive(seed, "outside-heads"), exclude=located)
        assert all((layer, h) not in {(x.layer, x.head) for x in located} for layer, hs in outside.items() for h in hs)
    assert study.heads("random") == study.heads("random", 0)


def test_headmap_task_file_and_committed_records(tmp_path, smollm2_tokenizer):
    """tasks/headmap.toml is the committed study's settings: its locating, evaluation and learning-rate sweep
    records are reused as they are (the rates chosen from the committed validation outcomes)."""
    import shutil

    settings = hm_settings.load_settings("tasks/headmap.toml")
    assert (settings.n, settings.pool, settings.k, settings.batch_size, settings.steps, settings.eval_n) == (
        64,
        256,
        2,
        64,
        20,
        150,
    )
    assert settings.seeds == (0, 1, 2) and settings.lrs == (1e-3, 3e-3, 1e-2, 3e-2)
    shutil.copytree("results/headmap-smollm2/stages", tmp_path / "stages")
    tiny = make_tiny("llama", smollm2_tokenizer, n_layers=2)
    study = hm.HeadMapStudy(settings, tmp_path, lambda name: tiny, progress=False)
    fail = lambda: pytest.fail("recomputed a committed stage")  # noqa: E731
    study.cache.run = (lambda run: lambda name, inputs, compute: run(name, inputs, fail))(study.cache.run)
    circuit = study.locate("entity-tracking", settings.n)
    assert len(circuit.heads()) == 30 * settings.k and circuit.meta["n_samples"] == 64
    lora_lr, hm_lr = study.chosen_lrs({})
    sweep = study.sweep({})
    assert hm_lr == choose_lr(validation_accuracy(sweep["headmap"]))
    assert lora_lr == choose_lr(validation_accuracy(sweep["lora"]))
    for run_id in ("base", "located", "lora-zoo"):
        assert len(study.train_run(run_id, {})["correct"]["entity-tracking"]) == settings.eval_n
    bad = tmp_path / "bad.toml"
    bad.write_text('[headmap]\nn = 8\nruns = ["base", "lorra"]\n')
    with pytest.raises(SpecError, match=r"bad.toml:3: runs = .*valid values: base, located"):
        hm_settings.load_settings(bad)
    bad.write_text('[headmap]\n\ntransfer_task = "nonesuch"\n')
    with pytest.raises(SpecError, match=r"bad.toml:3: transfer_task = 'nonesuch'.*entity-tracking"):
        hm_settings.load_settings(bad)


def _parse(*argv):
    import argparse

    from mechdiff.commands import headmap as hm_cmd
    from mechdiff.commands import knowledge as k_cmd

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    hm_cmd.register(sub)
    k_cmd.register(sub)
    return p.parse_args(list(argv))


def test_commands_read_the_task_file_and_flags_override_it():
    from mechdiff.commands import headmap as hm_cmd
    from mechdiff.commands import knowledge as k_cmd

    args = _parse("headmap", "compare", "--task", "tasks/headmap.toml", "--k", "3", "--runs", "base,located")
    s = hm_cmd.settings_from(args, task_file=True)
    assert (s.k, s.runs, s.n, s.eval_n) == (3, ("base", "located"), 64, 150)  # flags over the file over defaults
    args = _parse("headmap", "compare", "--task", "tasks/headmap.toml", "--seeds", "0,5", "--lrs", "0.002,0.02")
    s = hm_cmd.settings_from(args, task_file=True)
    assert (s.seeds, s.lrs, s.val_n) == ((0, 5), (0.002, 0.02), 100)
    assert hm_cmd.settings_from(_parse("headmap", "locate", "--out", "x")) == hm_settings.HeadMapSettings()
    with pytest.raises(ValueError, match="unknown runs"):
        hm_cmd.settings_from(_parse("headmap", "compare", "--runs", "base,lorra"), task_file=True)
    args = _parse("knowledge", "--task", "tasks/knowledge.toml", "--models", "m1", "--sizes", "1,10", "--no-curve")
    s = k_cmd.settings_from(args)
    assert (s.models, s.sizes, s.curve, s.relation) == (("m1",), (0.01, 0.1), False, "country_language")
    assert k_cmd.settings_from(_parse("knowledge")) == KnowledgeSettings()


def test_studies_hold_their_directory_lock(knowledge_run, headmap_setup):
    from mechdiff.common.io import RunLockedError, run_lock

    model, settings, out = knowledge_run
    with run_lock(out):
        with pytest.raises(RunLockedError, match="another mechdiff run"):
            _knowledge_study(model, settings, out).run()
    hm_settings, hm_out, load, _ = headmap_setup
    study = hm.HeadMapStudy(hm_settings, hm_out, load, progress=False)
    with run_lock(hm_out):
        with pytest.raises(RunLockedError, match="another mechdiff run"):
            study.run()
    assert not (out / "stages").exists() and not (hm_out / "stages").exists()  # refused before computing


# --------------------------------------------------------------------------------------
# bfloat16 (the paper's float32 stays every default)
# --------------------------------------------------------------------------------------

BF16_U = 2**-9  # bfloat16's unit roundoff: a value of size 1 rounds by at most this
VOCAB = 49152  # the tiny models' vocabulary (the SmolLM2 tokenizer's)


def knowledge_tolerance(path: str) -> tuple[float, float] | None:
    """(absolute, relative) tolerance of one knowledge figure in bfloat16 against float32's; None: not compared."""
    from test_study import tolerance

    if "faithfulness" in path or ".cpr" in path or ".cmd" in path:
        return None  # ratios over m_full - m_empty = 0.004 on the random model: their logprobs are compared
    if "logprob" in path or ".m_full" in path or ".m_empty" in path or ".metric_" in path or ".scores[" in path:
        return BF16_U, 0.0
    if "rank" in path or ".lens." in path:
        return 0.02 * VOCAB, 0.0
    return tolerance(path)


def test_knowledge_study_runs_in_bfloat16_within_a_stated_tolerance_of_float32(knowledge_first, tmp_path):
    """Every knowledge stage (facts, EAP discovery, scoring: Hit@k and the faithfulness curve, analysis: the logit
    lens and head roles) on the tiny model in bfloat16 against the float32 run. Stated tolerances: mean answer
    log-probabilities (about -10.8) and EAP edge scores, computed in float32 from bfloat16 logits of size below 1,
    within one bfloat16 unit roundoff 2^-9 absolute (measured: at most 1.0e-3 for an interval's bound, 4.6e-4 for
    a score, across EAP, EAP-IG, iterative and ACDC); a rank among the 49152 near-uniform logits (logit lens,
    median rank) within 2% of the vocabulary (measured: 220); Hit@k, head attention and every other figure as in
    the circuits study's test (2% of its value). Faithfulness and its CPR/CMD are ratios over m_full - m_empty =
    0.004 here, where bfloat16's error says nothing: the log-probabilities they are made of are compared."""
    from test_study import bfloat16_outside

    model, settings, shared, _ = knowledge_first
    bf16, _, out = _knowledge_setup(tmp_path, model.tokenizer)  # the same model made afresh
    bf16.model.to(torch.bfloat16)
    _run_knowledge(bf16, settings, out)
    checked, outside = bfloat16_outside(out / "stages", shared / "stages", knowledge_tolerance, least=4)
    assert outside == [] and checked > 150, outside[:40]


LOCATED = ("train-located-", "train-outside-", "train-transfer-")  # runs whose heads locating chose


def headmap_tolerance(path: str) -> tuple[float, float] | None:
    """(absolute, relative) tolerance of one HeadMap figure in bfloat16 against float32's; None: not compared."""
    from test_study import tolerance

    if "loss" in path or ".scores." in path or ".curve[" in path:
        return 2 * BF16_U, 0.0
    return tolerance(path)


def test_headmap_study_runs_in_bfloat16_within_a_stated_tolerance_of_float32(headmap_first, headmap_setup):
    """Every HeadMap stage (locating on both tasks, every training run: HeadMap maps, LoRA, the zoo's LoRA) on the
    tiny models in bfloat16 against the float32 run. Stated tolerances: cross-entropy losses (about 10.8) and the
    locating scores (the loss with a head masked), computed in float32 from bfloat16 logits of size below 1, within
    two bfloat16 unit roundoffs 2^-8 absolute (one for the forward, one for two training steps; measured: at most
    4.3e-4 for a locating score, 4.2e-4 for a training loss); correctness and every other figure as in the circuits
    study's test. The random models' locating scores of two heads of a layer lie within 1e-4 of each other, closer
    than bfloat16 resolves: a run training on located heads is compared only where both dtypes located the same
    heads, and only such runs may differ in their heads. Every stage's key differs from float32's (the study keys
    its stages by model name: the weights' dtype is added to them), so neither run reads the other's records."""
    from test_study import bfloat16_outside

    settings, out, load, _ = headmap_setup
    shared = headmap_first[4]

    def load_bf16(name: str):
        m = load(name)
        m.model.to(torch.bfloat16)
        return m

    hm.HeadMapStudy(settings, out, load_bf16, progress=False).run()
    keys = {p.name: json.loads(p.read_text())["key"] for p in (shared / "stages").glob("*.json")}
    assert not [n for n, k in keys.items() if json.loads((out / "stages" / n).read_text())["key"] == k]  # dtype in key

    def compared(path_of_record: Path):
        return json.loads(path_of_record.read_text())["result"].get("heads")

    differ = [
        p.name for p in (shared / "stages").glob("train-*.json") if compared(p) != compared(out / "stages" / p.name)
    ]
    assert all(n.startswith(LOCATED) for n in differ), differ
    checked, outside = bfloat16_outside(
        out / "stages", shared / "stages", headmap_tolerance, least=len(list((shared / "stages").glob("*.json")))
    )
    outside = [o for o in outside if o[0] not in differ or ".losses[" not in o[1] and ".heads." not in o[1]]
    assert outside == [] and checked > 100, outside[:40]


@pytest.mark.parametrize("method", ["acdc", "iterative", "eap-ig"])
def test_knowledge_discovery_methods_run_in_bfloat16_within_a_stated_tolerance_of_float32(
    method, tmp_path, smollm2_tokenizer
):
    """ACDC (its metric on every fact: the random model's top-1 is no answer), iterative pruning and EAP-IG, each
    in bfloat16 against float32 on the tiny model, with the tolerances of
    :func:`test_knowledge_study_runs_in_bfloat16_within_a_stated_tolerance_of_float32` (ACDC's edge effects and
    metrics, differences of mean log-probabilities, within 2^-9)."""
    from test_study import bfloat16_outside

    outs = {}
    for dtype in ("float32", "bfloat16"):
        model, settings, out = _knowledge_setup(tmp_path / dtype, smollm2_tokenizer)
        model.model.to(getattr(torch, dtype))
        _run_knowledge(model, replace(settings, method=method, acdc_metric="nll"), out)
        outs[dtype] = out / "stages"
    checked, outside = bfloat16_outside(outs["bfloat16"], outs["float32"], knowledge_tolerance, least=4)
    assert outside == [] and checked > 150, outside[:40]
