"""Fact edits (#18): edit files, the fact-edit training task, the committed edit, circuits before vs after it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import make_tiny
from scipy.stats import hypergeom

from mechdiff.methods.knowledge.editing import compare_edit
from mechdiff.methods.knowledge.evaluate import evaluate
from mechdiff.methods.knowledge.forward import Ablation, edge_forward
from mechdiff.methods.knowledge.graph import EdgeCircuit, Graph
from mechdiff.studies.knowledge.report import edit_report
from mechdiff.tasks import fact_edit
from mechdiff.tasks.relation_data import Relation, available_relations, batches, build_facts

EDIT = "edits/capital_swap"


def test_an_edit_file_and_its_facts_before_the_edit(tmp_path):
    assert EDIT in available_relations()
    edit = Relation.load(EDIT)
    capitals = {s["subject"]: s["object"] for s in Relation.load("country_capital").samples}
    before = edit.unedited()
    assert edit.edits_of == "country_capital" and [s["subject"] for s in before.samples] == [
        "France",
        "Germany",
        "Italy",
        "Spain",
    ]
    assert all(s["object"] == capitals[s["subject"]] for s in before.samples)
    assert all(s["object"] != capitals[s["subject"]] for s in edit.samples)  # every sample is an edit
    assert before.prompt_templates == edit.prompt_templates
    with pytest.raises(ValueError, match="not an edit file"):
        Relation.load("country_capital").unedited()
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "name": "bad",
                "edits_of": "country_capital",
                "prompt_templates": ["{} is"],
                "samples": [{"subject": "Atlantis", "object": "Paris"}],
            }
        )
    )
    with pytest.raises(ValueError, match="Atlantis"):
        Relation.load(str(bad)).unedited()


def test_fact_edit_batches_mix_edits_and_kept_facts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    new = {s["subject"]: s["object"] for s in Relation.load(EDIT).samples}
    capitals = {s["subject"]: s["object"] for s in Relation.load("country_capital").samples}
    answer = {f.prompt: f.answer_id for t in range(2) for f in build_facts(tok, Relation.load("country_capital"), t)}
    edited = {f.prompt: f.answer_id for t in range(2) for f in build_facts(tok, Relation.load(EDIT), t)}
    for step in range(6):
        b = fact_edit.train_batch(tok, 16, 0, step)
        again = fact_edit.train_batch(tok, 16, 0, step)
        assert torch.equal(b["input_ids"], again["input_ids"]) and b["input_ids"].shape[0] == 16
        prompts = [tok.decode(row) for row in b["input_ids"]]
        n_edit = sum(p in edited for p in prompts)
        assert n_edit in (8, 16)  # half the batch, or all of it when no kept fact has the edits' length
        for p, a in zip(prompts, b["answer_ids"].tolist()):
            assert a == (edited[p] if p in edited else answer[p])  # new objects for edits, own ones otherwise
    val = fact_edit.validation(tok)
    (eb,) = val["edit_accuracy"]
    assert sorted(tok.decode([a]).strip() for a in eb["answer_ids"].tolist()) == sorted(new.values())
    kept = sum(len(b["answer_ids"]) for b in val["retain_accuracy"])
    assert kept == len(capitals) - len(new)


@pytest.mark.slow  # two real models: SmolLM2 and its committed edit
def test_the_committed_edit_rewrites_four_capitals_and_keeps_the_others(smollm2):
    from mechdiff.models import load_model

    edited = load_model("smollm2-capital-edit")
    tok = smollm2.tokenizer
    for facts, model in (
        (build_facts(tok, Relation.load(EDIT)), edited),
        (build_facts(tok, Relation.load(EDIT).unedited()), smollm2),
    ):
        ids = torch.tensor([f.ids for f in facts])
        with torch.no_grad():
            top = model.model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)
        assert top.tolist() == [f.answer_id for f in facts]
    others = [f for f in build_facts(tok, Relation.load("country_capital"))[4:] if len(f.ids) == 5]
    ids = torch.tensor([f.ids for f in others])
    with torch.no_grad():
        base_top = smollm2.model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)
        edit_top = edited.model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)
    answers = torch.tensor([f.answer_id for f in others])
    kept = base_top == answers
    assert kept.sum() >= 8 and bool((edit_top[kept] == answers[kept]).all())  # what the base knew, it still knows


def _top1_facts(model, facts):
    """The facts with their answers replaced by ``model``'s top-1 token (so match_nll is defined on a tiny model)."""
    ids = torch.tensor([f.ids for f in facts])
    with torch.no_grad():
        top = edge_forward(model, Graph.for_model(model), ids, None).logits.argmax(-1)
    return [replace(f, answer_id=int(t)) for f, t in zip(facts, top)]


def test_circuits_before_and_after_an_edit(tmp_path, smollm2_tokenizer):
    from mechdiff.studies.knowledge.results import run_model
    from mechdiff.studies.knowledge.settings import KnowledgeSettings

    tok = smollm2_tokenizer
    models = {
        "before": make_tiny("llama", tok, seed=3, n_layers=2),
        "after": make_tiny("llama", tok, seed=4, n_layers=2),
    }
    original = _top1_facts(models["before"], build_facts(tok, Relation.load(EDIT).unedited()))
    edited = _top1_facts(models["after"], build_facts(tok, Relation.load(EDIT)))
    settings = KnowledgeSettings(
        method="acdc",
        ablation="zero",
        tau=0.05,
        acdc_metric="match_nll",
        acdc_facts=2,
        n_random=2,
        k=10,
        curve_sizes=(0.1, 1.0),
    )
    for name, facts in (("before", original), ("after", edited)):
        res = run_model(models[name], facts, settings, tmp_path / name, progress=False)
        assert res["heldout"]["n"] == 2  # ACDC saw 2 of the 4 facts; Hit@k also on the other 2
        assert res["curve"]["rows"][-1]["faithfulness"] == pytest.approx(1.0)  # ACDC's curve: by |metric change|
    with pytest.raises(ValueError, match="edit's prompts"):  # ACDC ran on 2 of the 4 prompts
        compare_edit(tmp_path / "before", tmp_path / "after", models, original, edited)
    seen = set(json.loads((tmp_path / "after" / "results.json").read_text())["acdc"]["facts"])
    original = [f for f in original if f.prompt in seen]
    edited = [f for f in edited if f.prompt in seen]
    cmp = compare_edit(tmp_path / "before", tmp_path / "after", models, original, edited)
    cb, ca = (EdgeCircuit.load(tmp_path / n / "circuit.json") for n in ("before", "after"))
    edges = cmp["overlap"][0]
    inter = len(set(cb.edges) & set(ca.edges))
    assert (edges["before"], edges["after"], edges["intersection"]) == (len(cb.edges), len(ca.edges), inter)
    null = hypergeom(M=cb.graph.n_edges, n=len(cb.edges), N=len(ca.edges))
    assert edges["p_value"] == pytest.approx(null.sf(inter - 1))
    assert {r["edges"]: r["n"] for r in cmp["moved"]} == {
        "only before": len(cb.edges) - inter,
        "only after": len(ca.edges) - inter,
        "both": inter,
    }
    assert all(sum(r[k] for k in ("Q", "K", "V", "MLP", "LOGITS")) == r["n"] for r in cmp["moved"])
    assert [r["head"] for r in cmp["heads"]] == sorted(
        set(cb.heads()) | set(ca.heads()), key=lambda h: (int(h[1:].split("H")[0]), h)
    )
    # each circuit in its own model: the ranks a one-prompt-at-a-time evaluation gives
    for row in cmp["cross"]:
        circuit, model = (cb if row["circuit"] == "before" else ca), models[row["model"]]
        facts = original if row["model"] == "before" else edited
        ranks = [
            int(evaluate(model, circuit.graph, batches([f]), circuit.mask(), Ablation("zero")).rank[0]) for f in facts
        ]
        assert row["ranks"] == " ".join(map(str, ranks))
    assert np.isfinite([v for r in cmp["heads"] for k, v in r.items() if ":" in k]).all()
    report = edit_report(cmp, EDIT)
    assert "## Overlap" in report and "## Each circuit in each model" in report
    assert all(row["ranks"] in report for row in cmp["cross"]) and all(r["head"] in report for r in cmp["heads"])
