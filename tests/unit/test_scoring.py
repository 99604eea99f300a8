"""Mean-ablation scoring on tiny models: constructed circuits with known answers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.scoring import (EVERY_POSITION, Scorer, ablation_patches, completeness, faithfulness,
                                       full_circuit, matrix_rows, minimality, pair_name, position_means, prune,
                                       random_circuit)
from mechdiff.common.components import Head
from mechdiff.patching.evaluate import evaluate
from mechdiff.patching.core import Patch, run
from mechdiff.tasks.entity_tracking import batch_tensors, generate, reference_records
from tolerances import EPS32, approx32, assert_close32, tol32

N_BOXES = 3


@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)


@pytest.fixture
def scorer(tiny_model, records, smollm2_tokenizer) -> Scorer:
    reference = reference_records(smollm2_tokenizer, 6, N_BOXES, seed=1)
    return Scorer.build(tiny_model, records, reference, batch_size=6, progress=False)


def plain_mean_patches(model, means):
    return [Patch("z", layer, means[layer][None]) for layer in range(model.shape.n_layers)]


def test_reference_sets_differ_from_prompts(smollm2_tokenizer, records):
    for kind in ("path_patching", "fresh"):
        ref = reference_records(smollm2_tokenizer, 6, N_BOXES, seed=1, kind=kind)
        assert len(ref) == 6 and len(ref[0].input_ids) == len(records[0].input_ids)
        assert not {r.prompt for r in ref} & {r.prompt for r in records}
    with pytest.raises(ValueError, match="unknown reference kind"):
        reference_records(smollm2_tokenizer, 2, N_BOXES, 1, kind="zero")


def test_means_of_one_prompt_leave_it_unchanged(tiny_model, records):
    one = records[:1]
    means = position_means(tiny_model, one, progress=False)
    batch = batch_tensors(one)
    clean = run(tiny_model, batch["input_ids"]).logits
    ablated = run(tiny_model, batch["input_ids"], ablation_patches(tiny_model, means, batch, [], keep=True)).logits
    assert torch.equal(clean, ablated)
    other = position_means(tiny_model, records[1:2], progress=False)  # another prompt's means do change it
    assert not torch.equal(clean, run(tiny_model, batch["input_ids"], plain_mean_patches(tiny_model, other)).logits)


def test_full_circuit_is_faithful_and_complete(scorer):
    shape = scorer.model.shape
    everything = full_circuit(shape.n_layers, shape.n_heads)
    res = faithfulness(scorer, everything)
    assert np.array_equal(scorer.keep(everything.pairs()).prob, scorer.full().prob)
    assert res["circuit"]["faithfulness_prob"]["value"] == 1.0
    assert res["circuit"]["faithfulness_prob"]["low"] == res["circuit"]["faithfulness_prob"]["high"] == 1.0
    comp = completeness(scorer, everything, n_draws=1, metric="prob")
    assert comp["random"]["mean"] == 0.0 and comp["random"]["std"] == 0.0
    assert all(g["completeness"] == 0.0 for g in comp["groups"].values())
    assert set(comp["groups"]) == {f"L{layer}" for layer in range(shape.n_layers)}


def test_empty_circuit_scores_as_full_mean_ablation(scorer, records):
    empty = Circuit("tiny", "entity-tracking", {"A": []}, {"A": "last"})
    plain = evaluate(scorer.model, records, 6, patches=lambda b, r: plain_mean_patches(scorer.model, scorer.means),
                     progress=False)
    circ = scorer.keep(empty.pairs())
    assert np.array_equal(circ.prob, plain.prob) and np.array_equal(circ.correct, plain.correct)
    assert not np.array_equal(circ.prob, scorer.full().prob)
    res = faithfulness(scorer, empty)
    assert res["circuit"]["answer_prob"]["value"] == pytest.approx(float(plain.prob.mean()))


def test_kept_head_uses_its_value_in_the_ablated_run(tiny_llama, smollm2_tokenizer, records):
    model, batch = tiny_llama, batch_tensors(records[:4])
    means = position_means(model, reference_records(smollm2_tokenizer, 4, N_BOXES, 1), progress=False)
    head, d, last = Head(2, 1), model.shape.d_head, batch["positions"]["last"]
    cols = slice(head.head * d, (head.head + 1) * d)
    ids = batch["input_ids"]
    kept = run(model, ids, ablation_patches(model, means, batch, [(head, "last")]), capture=[("z", 2)]).captured[("z", 2)]
    upstream_ablated = run(model, ids, plain_mean_patches(model, means)[:2], capture=[("z", 2)]).captured[("z", 2)]
    clean = run(model, ids, capture=[("z", 2)]).captured[("z", 2)]
    rows = torch.arange(4)
    assert_close32(kept[rows, last, cols], upstream_ablated[rows, last, cols])
    assert not torch.allclose(kept[rows, last, cols], clean[rows, last, cols])
    expected = means[2].expand_as(kept).clone()
    expected[rows, last, cols] = kept[rows, last, cols]
    assert torch.equal(kept, expected)  # every other cell of the layer (this head elsewhere too) is the mean


def test_per_example_positions_and_ablate_mode(tiny_llama, smollm2_tokenizer, records):
    model, batch = tiny_llama, batch_tensors(records[:3])
    assert len(set(batch["positions"]["query_label_context"].tolist())) == 3  # differs per prompt
    means = position_means(model, reference_records(smollm2_tokenizer, 3, N_BOXES, 1), progress=False)
    head, d = Head(0, 2), model.shape.d_head
    cols, pos, rows = slice(2 * d, 3 * d), batch["positions"]["query_label_context"], torch.arange(3)
    clean = run(model, batch["input_ids"], capture=[("z", 0)]).captured[("z", 0)]
    kept = run(model, batch["input_ids"], ablation_patches(model, means, batch, [(head, "query_label_context")]),
               capture=[("z", 0)]).captured[("z", 0)]
    assert torch.equal(kept[rows, pos, cols], clean[rows, pos, cols])  # layer 0: nothing upstream ablated
    assert int((kept != means[0]).any(-1).sum()) == 3
    patches = ablation_patches(model, means, batch, [(head, "query_label_context")], keep=False)
    assert [p.layer for p in patches] == [0]  # only the layer holding K is patched
    ablated = run(model, batch["input_ids"], patches, capture=[("z", 0)]).captured[("z", 0)]
    expected = clean.clone()
    expected[rows, pos, cols] = means[0][pos, cols]
    assert torch.equal(ablated, expected)


def test_ablation_errors(tiny_llama, records):
    batch = batch_tensors(records[:2])
    with pytest.raises(ValueError, match="same n_boxes"):
        ablation_patches(tiny_llama, torch.zeros(3, 5, 32), batch, [])
    means = torch.zeros(3, batch["input_ids"].shape[1], 32)
    with pytest.raises(ValueError, match="unknown position"):
        ablation_patches(tiny_llama, means, batch, [(Head(0, 0), "nowhere")])
    with pytest.raises(ValueError, match="no reference records"):
        position_means(tiny_llama, [])


def test_random_circuits_keep_sizes_and_baseline_is_seeded(tiny_llama, records, smollm2_tokenizer):
    circuit = Circuit("tiny", "et", {"A": [Head(2, 0), Head(2, 1)], "C": [Head(0, 3)]}, {"A": "last", "C": "query_label"})
    rnd = random_circuit(circuit, 3, 4, random.Random(0))
    assert rnd.sizes() == circuit.sizes() and rnd.positions == circuit.positions
    assert rnd.groups == random_circuit(circuit, 3, 4, random.Random(0)).groups
    scorer = Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
    a = faithfulness(scorer, circuit, n_random=2, seed=3)
    assert json.dumps(a) == json.dumps(faithfulness(scorer, circuit, n_random=2, seed=3))  # NaN-safe
    assert a["random"]["n_draws"] == 2 and 0 <= a["random"]["accuracy"]["value"] <= 1
    row = matrix_rows("tiny", {"c": circuit}, scorer, n_random=2, seed=3)[0]
    assert row["faithfulness_prob"] == a["circuit"]["faithfulness_prob"]["value"]
    assert row["random_faithfulness_prob_low"] <= row["random_faithfulness_prob_high"]


def test_minimality_prunes_heads_that_cannot_matter(tiny_llama, records, smollm2_tokenizer):
    model = tiny_llama
    d = model.shape.d_head
    model.model.model.layers[1].self_attn.o_proj.weight[:, 3 * d:4 * d] = 0  # L1H3 writes nothing
    circuit = Circuit("tiny", "et", {"A": [Head(2, 0), Head(1, 0), Head(1, 3)], "C": [Head(2, 2)]},
                      {"A": "last", "C": "query_label"})  # L2H2 at a non-final position of the last layer
    scorer = Scorer.build(model, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
    res = minimality(scorer, circuit, max_steps=1, n_candidates=None, metric="prob")
    scores = res["pairs"]
    assert scores["L1H3@last"]["contribution"] == 0.0
    assert scores["L2H2@query_label"]["contribution"] == 0.0
    assert scores["L2H0@last"]["contribution"] > 0 and scores["L1H0@last"]["contribution"] > 0
    assert all(len(s["K"]) <= 1 for s in scores.values())
    pruned = prune(circuit, res, threshold=0.0)
    assert pruned.groups == {"A": [Head(2, 0), Head(1, 0)], "C": []}
    meta = pruned.meta["pruned"]
    assert meta["threshold"] == 0.0 and meta["metric"] == "prob" and meta["removed"] == ["L1H3@last", "L2H2@query_label"]
    assert Circuit.from_dict(json.loads(json.dumps(pruned.to_dict()))).meta["pruned"]["threshold"] == 0.0
    with pytest.raises(ValueError, match="no minimality score"):
        prune(Circuit("t", "et", {"B": [Head(0, 0)]}, {"B": "last"}), res)


def test_completeness_of_a_partial_circuit(tiny_llama, records, smollm2_tokenizer):
    scorer = Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
    circuit = Circuit("tiny", "et", {"A": [Head(2, 0), Head(1, 1)], "C": [Head(0, 3)]}, {"A": "last", "C": "query_label"})
    comp = completeness(scorer, circuit, n_draws=3, metric="prob", seed=0)
    assert len(comp["random"]["draws"]) == 3 and comp["random"]["std"] >= 0
    g = comp["groups"]["A"]
    kept, ablated = scorer.keep([(Head(0, 3), "query_label")]).prob, scorer.ablate(
        [(Head(2, 0), "last"), (Head(1, 1), "last")]).prob
    diff = kept.mean() - ablated.mean()
    # Answer probabilities of a random tiny model are ~2e-5 (uniform over the vocabulary), so the
    # difference is ~1e-7: compare at float32 resolution of the probabilities, not relatively.
    scale = float(max(np.abs(np.asarray(kept)).max(), np.abs(np.asarray(ablated)).max()))
    assert abs(float(diff)) > 10 * tol32(scale)  # not vacuous
    assert g["completeness"] == approx32(abs(float(diff)), scale=scale)
    assert pair_name((Head(2, 0), EVERY_POSITION)) == "L2H0@*"


# --------------------------------------------------------------------------------------
# The commands, end to end on two tiny checkpoints saved to disk
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2_tokenizer):
    from conftest import make_tiny

    root = tmp_path_factory.mktemp("tiny-models")
    dirs = []
    for seed in (0, 1):
        path = root / f"tiny-{seed}"
        make_tiny("llama", smollm2_tokenizer, seed=seed).model.save_pretrained(path)
        smollm2_tokenizer.save_pretrained(path)
        dirs.append(str(path))
    first = Circuit("tiny-0", "entity-tracking", {"A": [Head(2, 0), Head(1, 1)], "C": [Head(0, 3)]},
                    {"A": "last", "C": "query_label"}).save(root / "first.json")
    second = Circuit("tiny-1", "entity-tracking", {"A": [Head(2, 0), Head(2, 3)], "C": [Head(0, 1)]},
                     {"A": "last", "C": "query_label"}).save(root / "second.json")
    return dirs, str(first), str(second)


DATA = ["--n", "6", "--n-boxes", str(N_BOXES), "--batch-size", "6", "--no-progress"]


def test_score_and_prune_commands(tiny_dirs, tmp_path):
    from mechdiff.cli import main

    (model, _), first, _ = tiny_dirs
    out = tmp_path / "score"
    assert main(["score", "--model", model, "--circuit", first, "--n-random", "1", "--completeness-draws", "2",
                 "--out", str(out), *DATA]) == 0
    result = json.loads((out / "score.json").read_text())
    assert set(result["faithfulness"]) >= {"full", "circuit", "random"}
    assert set(result["completeness"]["groups"]) == {"A", "C"}
    for stem in ("faithfulness", "completeness"):
        assert all((out / f"{stem}.{ext}").is_file() for ext in ("md", "csv", "tex", "json"))
    assert "faithfulness [95% CI]" in (out / "faithfulness.md").read_text()
    pruned_path = tmp_path / "pruned.json"
    assert main(["prune", "--model", model, "--circuit", first, "--out", str(pruned_path), "--threshold", "0.5",
                 "--metric", "prob", *DATA]) == 0
    pruned = Circuit.load(pruned_path)
    assert pruned.meta["pruned"]["threshold"] == 0.5 and pruned.meta["pruned"]["source"] == first
    assert sum(pruned.sizes().values()) < 3  # no head of a random tiny model carries half its answer probability
    assert (tmp_path / "pruned.minimality.csv").is_file()


def _fails(*args, **kwargs):
    raise RuntimeError("stopped part-way")


def test_score_prints_faithfulness_before_completeness_runs(tiny_dirs, tmp_path, capsys, monkeypatch):
    """A run that fails in completeness has already shown (and written) its faithfulness table."""
    from mechdiff.cli import main
    from mechdiff.studies import scoring

    (model, _), first, _ = tiny_dirs
    monkeypatch.setattr(scoring, "completeness", _fails)
    with pytest.raises(RuntimeError, match="stopped part-way"):
        main(["score", "--model", model, "--circuit", first, "--n-random", "1", "--out", str(tmp_path / "s"), *DATA])
    out = capsys.readouterr().out
    assert "faithfulness [95% CI]" in out and "| circuit " in out and "completeness" not in out
    assert (tmp_path / "s" / "faithfulness.md").read_text().count("| random ") == 1


def test_positions_prints_the_scan_before_leave_one_out_runs(tiny_dirs, tmp_path, capsys, monkeypatch):
    from mechdiff.cli import main
    from mechdiff.studies import scoring

    (model, _), _, _ = tiny_dirs
    monkeypatch.setattr(scoring, "leave_one_out", _fails)
    with pytest.raises(RuntimeError, match="stopped part-way"):
        main(["positions", "--model", model, "--max-steps", "1", "--leave-one-out", "--out", str(tmp_path / "p"),
              *DATA])
    out = capsys.readouterr().out
    assert "| step " in out and "added" in out and "left out" not in out


def test_score_and_positions_hand_each_table_to_echo_as_the_command_prints_them(tiny_dirs, tmp_path, capsys):
    """``echo`` gets each table once made; the commands print exactly those sections, blank-line separated."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.cli import main
    from mechdiff.models.loading import load_model
    from mechdiff.studies.scoring import ScoringPrompts, scan_positions, score_circuit
    from mechdiff.tasks.base import get_task

    (model, _), first, _ = tiny_dirs
    lm = load_model(model)
    prompts = ScoringPrompts(get_task("entity-tracking"), 6, batch_size=6, progress=False,
                             options={"n_boxes": N_BOXES})
    sections: list[str] = []
    assert score_circuit(lm, Circuit.load(first), first, prompts, tmp_path / "s", 1, 2, "accuracy", True, {},
                         echo=sections.append) is None
    assert len(sections) == 2 and "faithfulness [95% CI]" in sections[0] and sections[1].startswith("\n| model ")
    capsys.readouterr()
    assert main(["score", "--model", model, "--circuit", first, "--n-random", "1", "--completeness-draws", "2",
                 "--out", str(tmp_path / "c"), *DATA]) == 0
    assert capsys.readouterr().out == "".join(s + "\n" for s in sections)
    sections.clear()
    assert scan_positions(lm, prompts, tmp_path / "p", "accuracy", None, 1, True, {}, echo=sections.append) is None
    assert len(sections) == 2 and "| step " in sections[0] and sections[1].startswith("\n| left out ")


def test_scoring_prompts_refuse_an_unknown_reference_naming_the_choices():
    from mechdiff.studies.scoring import REFERENCES, ScoringPrompts
    from mechdiff.tasks.base import get_task

    task = get_task("entity-tracking")
    for reference in REFERENCES:
        assert ScoringPrompts(task, 4, reference=reference).reference == reference
    with pytest.raises(ValueError, match="unknown reference 'zero': choose one of path_patching, fresh"):
        ScoringPrompts(task, 4, reference="zero")


def test_compare_command(tiny_dirs, tmp_path):
    from mechdiff.cli import main

    dirs, first, second = tiny_dirs
    out = tmp_path / "compare"
    assert main(["compare", "--models", ",".join(dirs), "--circuits", f"{first},{second}", "--out", str(out),
                 *DATA]) == 0
    result = json.loads((out / "compare.json").read_text())
    assert {(r["circuit"], r["model"]) for r in result["matrix"]} == {(c, m) for c in ("first", "second") for m in dirs}
    assert all(r["accuracy_low"] <= r["accuracy"] <= r["accuracy_high"] for r in result["matrix"])
    a = next(r for r in result["overlap"] if r["group"] == "A")
    assert (a["intersection"], a["frac_first"], a["jaccard"]) == (1, 0.5, 1 / 3)
    assert (out / "membership.png").is_file() and (out / "overlap.tex").is_file()
    assert main(["compare", "--models", dirs[0], "--circuits", f"{first},{first}", "--out", str(out), *DATA]) == 2


def test_commands_write_the_study_tables_for_the_same_records(tiny_dirs, tmp_path):
    """One measurement, one table: compare's matrix, score's completeness and positions' scan are the circuits
    study's circuit_x_model, completeness and position_scan tables of the same records (the scan's with the model
    column the study adds); curve's table has the study's columns."""
    from types import SimpleNamespace

    from mechdiff.cli import main
    from mechdiff.report.study_report import matrix_section, positions_section
    from mechdiff.studies.spec import default_spec

    dirs, first, second = tiny_dirs
    out = tmp_path / "command"
    assert main(["compare", "--models", dirs[0], "--circuits", f"{first},{second}", "--n-random", "1",
                 "--out", str(out / "compare"), *DATA]) == 0
    assert main(["score", "--model", dirs[0], "--circuit", first, "--n-random", "1", "--completeness-draws", "2",
                 "--out", str(out / "score"), *DATA]) == 0
    assert main(["positions", "--model", dirs[0], "--max-steps", "2", "--out", str(out / "positions"), *DATA]) == 0
    assert main(["curve", "--model", dirs[0], "--sizes", "0.1,1.0", "--rank-n", "6", "--out", str(out / "curve"),
                 *DATA]) == 0
    compared = json.loads((out / "compare" / "compare.json").read_text())
    scored = json.loads((out / "score" / "score.json").read_text())
    scan = json.loads((out / "positions" / "positions.json").read_text())
    study = SimpleNamespace(dir=tmp_path / "study", spec=default_spec())
    name = scored["model"]
    matrix_section(study, {name: SimpleNamespace(result={"rows": compared["matrix"],
                                                         "completeness": scored["completeness"]})})
    positions_section(study, {name: SimpleNamespace(result={"scan": scan["scan"], "figure": "scan.png"})})
    tables = study.dir / "tables"
    assert (out / "compare" / "matrix.csv").read_text() == (tables / "circuit_x_model.csv").read_text()
    assert "random_draws_min_max" in (tables / "circuit_x_model.csv").read_text()
    assert (out / "score" / "completeness.csv").read_text() == (tables / "completeness.csv").read_text()
    studied = (tables / "position_scan.csv").read_text().splitlines()  # the first column the model's (no comma)
    assert studied[0].startswith("model,") and all(line.startswith(f"{name},") for line in studied[1:])
    assert (out / "positions" / "position_scan.csv").read_text().splitlines() == [x.split(",", 1)[1] for x in studied]
    assert (out / "curve" / "curve.csv").read_text().splitlines()[0] == (
        "fraction,n_pairs,accuracy,accuracy_low,accuracy_high,faithfulness,faithfulness_low,faithfulness_high,"
        "faithfulness_prob,faithfulness_prob_low,faithfulness_prob_high")


@pytest.mark.parametrize("removed", [
    [(Head(1, 0), "last")],  # a late position: a suffix run from the last token
    [(Head(2, 2), "query_label"), (Head(1, 3), "last")],  # from layer 1, from the query label on
    [(Head(0, 3), "query_label")],  # from layer 0: no resumed blocks
])
def test_keep_without_equals_the_full_ablated_run(scorer, removed):
    """F(C minus some pairs), resumed from F(C)'s run at the removed pairs' first layer and position, equals
    the full mean-ablated run of the smaller circuit."""
    circuit = [(Head(2, 0), "last"), (Head(1, 0), "last"), (Head(1, 3), "last"), (Head(2, 2), "query_label"),
               (Head(0, 3), "query_label"), (Head(1, 1), "query_label")]
    fresh = Scorer(scorer.model, scorer.records, scorer.means, scorer.batch_size, progress=False)
    full = fresh.keep(set(circuit) - set(removed))
    fast = scorer.keep_without(circuit, removed)
    assert (base := next(iter(scorer.runs))) and base[0] == frozenset(circuit)  # it resumed from F(C)'s run
    error = np.abs(fast.prob / full.prob - 1).max()
    change = np.abs(fresh.keep(circuit).prob / full.prob - 1).max()  # what removing the pairs does
    # not vacuous: the change is 10x the error and 10 float32 ulps (the error is 0 or 1 ulp, by kernel path)
    assert error < 1e-5 and change > 10 * max(error, EPS32)
    np.testing.assert_array_equal(fast.correct, full.correct)
    assert scorer.keep(set(circuit) - set(removed)) is fast  # one cache for both calls
