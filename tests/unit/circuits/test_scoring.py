"""Mean-ablation scoring on tiny models: constructed circuits with known answers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from tolerances import EPS32, approx32, assert_close32, tol32

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.measures import completeness, faithfulness, full_circuit, matrix_rows, random_circuit
from mechdiff.circuits.pruning import pair_name
from mechdiff.circuits.scoring import EVERY_POSITION, Scorer, ablation_patches, position_means
from mechdiff.common.components import Head, parse_heads
from mechdiff.patching.core import Patch, run
from mechdiff.patching.evaluate import EvalResult, evaluate
from mechdiff.tasks.entity_tracking import batch_tensors, generate, reference_records
from unit.circuits.conftest import N_BOXES


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
    plain = evaluate(
        scorer.model, records, 6, patches=lambda b, r: plain_mean_patches(scorer.model, scorer.means), progress=False
    )
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
    kept = run(model, ids, ablation_patches(model, means, batch, [(head, "last")]), capture=[("z", 2)]).captured[
        ("z", 2)
    ]
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
    kept = run(
        model,
        batch["input_ids"],
        ablation_patches(model, means, batch, [(head, "query_label_context")]),
        capture=[("z", 0)],
    ).captured[("z", 0)]
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
    circuit = Circuit(
        "tiny", "et", {"A": [Head(2, 0), Head(2, 1)], "C": [Head(0, 3)]}, {"A": "last", "C": "query_label"}
    )
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


def test_completeness_of_a_partial_circuit(tiny_llama, records, smollm2_tokenizer):
    scorer = Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 6, False)
    circuit = Circuit(
        "tiny", "et", {"A": [Head(2, 0), Head(1, 1)], "C": [Head(0, 3)]}, {"A": "last", "C": "query_label"}
    )
    comp = completeness(scorer, circuit, n_draws=3, metric="prob", seed=0)
    assert len(comp["random"]["draws"]) == 3 and comp["random"]["std"] >= 0
    g = comp["groups"]["A"]
    kept, ablated = (
        scorer.keep([(Head(0, 3), "query_label")]).prob,
        scorer.ablate([(Head(2, 0), "last"), (Head(1, 1), "last")]).prob,
    )
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
def tiny_dirs(tmp_path_factory, tiny_pair_dirs):
    """The two tiny checkpoints (`tiny_pair_dirs`) and two circuits' files."""
    root = tmp_path_factory.mktemp("tiny-circuits")
    first = Circuit(
        "tiny-0",
        "entity-tracking",
        {"A": [Head(2, 0), Head(1, 1)], "C": [Head(0, 3)]},
        {"A": "last", "C": "query_label"},
    ).save(root / "first.json")
    second = Circuit(
        "tiny-1",
        "entity-tracking",
        {"A": [Head(2, 0), Head(2, 3)], "C": [Head(0, 1)]},
        {"A": "last", "C": "query_label"},
    ).save(root / "second.json")
    return tiny_pair_dirs, str(first), str(second)


DATA = ["--n", "6", "--n-boxes", str(N_BOXES), "--batch-size", "6", "--no-progress"]


def test_score_and_prune_commands(tiny_dirs, tmp_path):
    from mechdiff.cli import main

    (model, _), first, _ = tiny_dirs
    out = tmp_path / "score"
    assert (
        main(
            [
                "score",
                "--model",
                model,
                "--circuit",
                first,
                "--n-random",
                "1",
                "--completeness-draws",
                "2",
                "--out",
                str(out),
                *DATA,
            ]
        )
        == 0
    )
    result = json.loads((out / "score.json").read_text())
    assert set(result["faithfulness"]) >= {"full", "circuit", "random"}
    assert set(result["completeness"]["groups"]) == {"A", "C"}
    for stem in ("faithfulness", "completeness"):
        assert all((out / f"{stem}.{ext}").is_file() for ext in ("md", "csv", "tex", "json"))
    assert "faithfulness [95% CI]" in (out / "faithfulness.md").read_text()
    pruned_path = tmp_path / "pruned.json"
    assert (
        main(
            [
                "prune",
                "--model",
                model,
                "--circuit",
                first,
                "--out",
                str(pruned_path),
                "--threshold",
                "0.5",
                "--metric",
                "prob",
                *DATA,
            ]
        )
        == 0
    )
    pruned = Circuit.load(pruned_path)
    assert pruned.meta["pruned"]["threshold"] == 0.5 and pruned.meta["pruned"]["source"] == first
    assert sum(pruned.sizes().values()) < 3  # no head of a random tiny model carries half its answer probability
    assert (tmp_path / "pruned.minimality.csv").is_file()


def _fails(*args, **kwargs):
    raise RuntimeError("stopped part-way")


def test_score_prints_faithfulness_before_completeness_runs(tiny_dirs, tmp_path, capsys, monkeypatch):
    """A run that fails in completeness has already shown (and written) its faithfulness table."""
    from mechdiff.cli import main
    from mechdiff.studies.circuits import scoring

    (model, _), first, _ = tiny_dirs
    monkeypatch.setattr(scoring, "completeness", _fails)
    with pytest.raises(RuntimeError, match="stopped part-way"):
        main(["score", "--model", model, "--circuit", first, "--n-random", "1", "--out", str(tmp_path / "s"), *DATA])
    out = capsys.readouterr().out
    assert "faithfulness [95% CI]" in out and "| circuit " in out and "completeness" not in out
    assert (tmp_path / "s" / "faithfulness.md").read_text().count("| random ") == 1


def test_positions_prints_the_scan_before_leave_one_out_runs(tiny_dirs, tmp_path, capsys, monkeypatch):
    from mechdiff.cli import main
    from mechdiff.studies.circuits import scoring

    (model, _), _, _ = tiny_dirs
    monkeypatch.setattr(scoring, "leave_one_out", _fails)
    with pytest.raises(RuntimeError, match="stopped part-way"):
        main(
            ["positions", "--model", model, "--max-steps", "1", "--leave-one-out", "--out", str(tmp_path / "p"), *DATA]
        )
    out = capsys.readouterr().out
    assert "| step " in out and "added" in out and "left out" not in out


def test_score_and_positions_hand_each_table_to_echo_as_the_command_prints_them(tiny_dirs, tmp_path, capsys):
    """``echo`` gets each table once made; the commands print exactly those sections, blank-line separated."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.cli import main
    from mechdiff.models.loading import load_model
    from mechdiff.studies.circuits.scoring import ScoringPrompts, scan_positions, score_circuit
    from mechdiff.tasks.base import get_task

    (model, _), first, _ = tiny_dirs
    lm = load_model(model)
    prompts = ScoringPrompts(get_task("entity-tracking"), 6, batch_size=6, progress=False, options={"n_boxes": N_BOXES})
    sections: list[str] = []
    assert (
        score_circuit(
            lm, Circuit.load(first), first, prompts, tmp_path / "s", 1, 2, "accuracy", True, {}, echo=sections.append
        )
        is None
    )
    assert len(sections) == 2 and "faithfulness [95% CI]" in sections[0] and sections[1].startswith("\n| model ")
    capsys.readouterr()
    assert (
        main(
            [
                "score",
                "--model",
                model,
                "--circuit",
                first,
                "--n-random",
                "1",
                "--completeness-draws",
                "2",
                "--out",
                str(tmp_path / "c"),
                *DATA,
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "".join(s + "\n" for s in sections)
    sections.clear()
    assert scan_positions(lm, prompts, tmp_path / "p", "accuracy", None, 1, True, {}, echo=sections.append) is None
    assert len(sections) == 2 and "| step " in sections[0] and sections[1].startswith("\n| left out ")


def test_scoring_prompts_refuse_an_unknown_reference_naming_the_choices():
    from mechdiff.studies.circuits.scoring import REFERENCES, ScoringPrompts
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
    assert (
        main(["compare", "--models", ",".join(dirs), "--circuits", f"{first},{second}", "--out", str(out), *DATA]) == 0
    )
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
    from mechdiff.studies.circuits.report.circuits import positions_section
    from mechdiff.studies.circuits.report.matrix import matrix_section
    from mechdiff.studies.circuits.spec import default_spec

    dirs, first, second = tiny_dirs
    out = tmp_path / "command"
    assert (
        main(
            [
                "compare",
                "--models",
                dirs[0],
                "--circuits",
                f"{first},{second}",
                "--n-random",
                "1",
                "--out",
                str(out / "compare"),
                *DATA,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "score",
                "--model",
                dirs[0],
                "--circuit",
                first,
                "--n-random",
                "1",
                "--completeness-draws",
                "2",
                "--out",
                str(out / "score"),
                *DATA,
            ]
        )
        == 0
    )
    assert main(["positions", "--model", dirs[0], "--max-steps", "2", "--out", str(out / "positions"), *DATA]) == 0
    assert (
        main(["curve", "--model", dirs[0], "--sizes", "0.1,1.0", "--rank-n", "6", "--out", str(out / "curve"), *DATA])
        == 0
    )
    compared = json.loads((out / "compare" / "compare.json").read_text())
    scored = json.loads((out / "score" / "score.json").read_text())
    scan = json.loads((out / "positions" / "positions.json").read_text())
    study = SimpleNamespace(dir=tmp_path / "study", spec=default_spec(), task=SimpleNamespace(answer_tokens=1))
    name = scored["model"]
    matrix_section(
        study, {name: SimpleNamespace(result={"rows": compared["matrix"], "completeness": scored["completeness"]})}
    )
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
        "faithfulness_prob,faithfulness_prob_low,faithfulness_prob_high"
    )


@pytest.mark.parametrize(
    "removed",
    [
        [(Head(1, 0), "last")],  # a late position: a suffix run from the last token
        [(Head(2, 2), "query_label"), (Head(1, 3), "last")],  # from layer 1, from the query label on
        [(Head(0, 3), "query_label")],  # from layer 0: no resumed blocks
    ],
)
def test_keep_without_equals_the_full_ablated_run(scorer, removed):
    """F(C minus some pairs), resumed from F(C)'s run at the removed pairs' first layer and position, equals
    the full mean-ablated run of the smaller circuit."""
    circuit = [
        (Head(2, 0), "last"),
        (Head(1, 0), "last"),
        (Head(1, 3), "last"),
        (Head(2, 2), "query_label"),
        (Head(0, 3), "query_label"),
        (Head(1, 1), "query_label"),
    ]
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


def test_removing_pairs_of_a_class_absent_from_the_batch_changes_nothing(tiny_llama, smollm2_tokenizer):
    """A removed pair whose position class holds no position in these prompts: the resumed run reads the
    last position only, and its logits are F(C)'s."""
    records = generate(smollm2_tokenizer, 4, n_boxes=3, seed=0)
    reference = reference_records(smollm2_tokenizer, 4, 3, seed=1)
    scorer = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False)
    batch = batch_tensors(records)
    batch["position_classes"] = {"nowhere": torch.zeros(batch["input_ids"].shape, dtype=torch.bool)}
    base = frozenset({(Head(1, 0), "last"), (Head(2, 1), "nowhere"), (Head(0, 2), "query_label")})
    removed = frozenset({(Head(2, 1), "nowhere")})
    got = scorer._resumed(base, base - removed, removed, 2, batch, [0, 1, 2, 3])
    with torch.no_grad():
        want = run(tiny_llama, batch["input_ids"], ablation_patches(tiny_llama, scorer.means, batch, base)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    key = frozenset({(Head(1, 0), "last")})
    cached, runs = scorer.keep(key), len(scorer.runs)
    assert scorer.keep_without(key | removed, removed) is cached  # served by the cache: nothing run again
    assert len(scorer.runs) == runs


def test_a_scorer_built_with_a_store_writes_and_then_reads_its_means(
    tiny_llama, smollm2_tokenizer, tmp_path, monkeypatch
):
    """``store``: the means are written to the HDF5 store on the first build and read from it on the next
    (no forward pass), equal to the means computed in memory."""
    import mechdiff.circuits.scoring as scoring
    import mechdiff.patching.store

    records = generate(smollm2_tokenizer, 2, n_boxes=3, seed=0)
    reference = reference_records(smollm2_tokenizer, 4, 3, seed=1)
    store = tmp_path / "activations.h5"
    first = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False, store=store)
    assert store.is_file()
    memory = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False)
    # exact: the same activations summed by the same code in this process (the store only holds a copy)
    torch.testing.assert_close(first.means, memory.means, rtol=0, atol=0)

    def recomputed(*args, **kwargs):
        raise AssertionError("the means were computed again")

    monkeypatch.setattr(scoring, "site_means", recomputed)
    monkeypatch.setattr(mechdiff.patching.store, "capture_sites", recomputed)
    again = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False, store=store)
    assert (again.batch_size, again.progress) == (4, False)
    torch.testing.assert_close(again.means, memory.means, rtol=0, atol=0)  # exact: read back, not recomputed


def test_position_mask_refuses_unknown_and_missing_positions_by_kind():
    import pytest

    from mechdiff.circuits.scoring import position_mask

    ids = torch.zeros(2, 5, dtype=torch.long)
    batch = {
        "input_ids": ids,
        "positions": {
            "last": torch.tensor([4, 4]),
            "gone": torch.tensor([3, -1]),
            "objects": torch.tensor([[0, 2], [1, -1]]),
        },
        "position_classes": {"context": torch.ones(2, 5, dtype=torch.bool)},
    }
    assert position_mask(batch, "context") is batch["position_classes"]["context"]
    assert position_mask(batch, "last").nonzero().tolist() == [[0, 4], [1, 4]]
    for name, message in (
        ("gone", "position 'gone' is missing in some prompts; score on prompts that contain it"),
        ("objects", "position class 'objects' is missing in some prompts; score on prompts that contain it"),
        ("box", "unknown position 'box'; valid: ['gone', 'last', 'objects'], the classes ['context'] or '*'"),
    ):
        with pytest.raises(ValueError) as err:
            position_mask(batch, name)
        assert str(err.value) == message
    batch["positions"]["objects"] = torch.tensor([[0, 2], [1, 3]])
    assert position_mask(batch, "objects").nonzero().tolist() == [[0, 0], [0, 2], [1, 1], [1, 3]]


def test_means_of_no_records_are_refused(tiny_llama):
    import pytest

    from mechdiff.circuits.scoring import position_means

    with pytest.raises(ValueError) as err:
        position_means(tiny_llama, [])
    assert str(err.value) == "no reference records to average; give at least one"


# ----------------------------------------------------------------------------------- scoring helpers
def _result(correct: list[bool], prob: list[float]) -> EvalResult:
    return EvalResult(correct=np.array(correct), prob=np.array(prob))


def test_per_prompt_metrics():
    from mechdiff.circuits.scoring import per_prompt

    r = _result([True, False, True], [0.9, 0.2, 0.6])
    assert per_prompt(r, "accuracy").tolist() == [1.0, 0.0, 1.0]
    assert per_prompt(r, "prob").tolist() == pytest.approx([0.9, 0.2, 0.6])


def test_random_circuit_keeps_group_sizes_and_positions():
    from mechdiff.circuits.measures import random_circuit

    c = Circuit(
        "m",
        "t",
        {"A": parse_heads(["L1H0", "L1H1", "L2H3"]), "B": parse_heads(["L0H2"])},
        {"A": "last", "B": "query_label"},
    )
    draws = [random_circuit(c, 3, 4, random.Random(s)) for s in range(20)]
    c.names = {"A": "fetchers", "B": "movers"}
    draws = [random_circuit(c, 3, 4, random.Random(s)) for s in range(20)]
    for r in draws:
        assert r.sizes() == c.sizes() and r.positions == c.positions
        assert (r.model, r.task, r.names, r.meta) == ("m", "t", c.names, {"random_baseline_of": "m"})
        assert r.names is not c.names and r.positions is not c.positions
        assert len(set(r.groups["A"])) == 3
        assert all(0 <= h.layer < 3 and 0 <= h.head < 4 for h in r.heads())
    assert len({tuple(r.groups["A"]) for r in draws}) > 10  # drawn, not fixed


def test_full_circuit_has_every_head_at_every_position():
    from mechdiff.circuits.measures import full_circuit
    from mechdiff.circuits.scoring import EVERY_POSITION

    c = full_circuit(3, 4, model="m")
    assert sorted(c.heads()) == [Head(l, h) for l in range(3) for h in range(4)]
    assert c.groups["L1"] == [Head(1, h) for h in range(4)]
    assert set(c.positions.values()) == {EVERY_POSITION} and c.model == "m"
    assert c.task == "" and full_circuit(1, 2, task="ioi").task == "ioi"  # the engine names no task by default
    assert c.names == {"L0": "", "L1": "", "L2": ""}


# ----------------------------------------------------------------------------------- scoring on a fake scorer
class FakeScorer:
    """A scorer whose metric is a known function of which (head, position) pairs stay unablated:
    prompt i is correct when ``rule(kept)`` holds and ``i`` is not in ``always_wrong``; its answer
    probability is ``base[i] + 0.1 * (number of kept pairs among the circuit's)``."""

    metric = "prob"  # the task's continuous metric

    def __init__(self, every: list, rule, n: int = 12, progress: bool = False):
        self.model = type("M", (), {"shape": type("S", (), {"n_layers": 3, "n_heads": 4})()})()
        self.records = list(range(n))
        self.progress, self.every, self.rule = progress, frozenset(every), rule
        self.base = np.linspace(0.05, 0.5, n)
        self.calls: list[tuple[str, frozenset]] = []

    def _result(self, kept: frozenset) -> EvalResult:
        ok = self.rule(kept)
        correct = np.array([ok and i % 5 != 0 for i in self.records])
        return EvalResult(correct, self.base + 0.1 * len(kept & self.every))

    def full(self) -> EvalResult:
        self.calls.append(("full", frozenset()))
        return self._result(self.every)

    def keep(self, pairs) -> EvalResult:
        pairs = frozenset(pairs)
        self.calls.append(("keep", pairs))
        return self._result(pairs)

    def keep_without(self, pairs, removed) -> EvalResult:
        return self.keep(frozenset(pairs) - frozenset(removed))

    def ablate(self, pairs) -> EvalResult:
        pairs = frozenset(pairs)
        self.calls.append(("ablate", pairs))
        return self._result(self.every - pairs)


def _or_circuit():
    """Group A = {a, b}: the task works while either is kept (redundant heads), group B = {c}: not needed."""
    a, b, c = (Head(2, 0), "last"), (Head(2, 1), "last"), (Head(0, 3), "query_label")
    circuit = Circuit("m", "t", {"A": [a[0], b[0]], "B": [c[0]]}, {"A": "last", "B": "query_label"})
    scorer = FakeScorer([a, b, c], lambda kept: a in kept or b in kept)
    return circuit, scorer, (a, b, c)


def test_faithfulness_against_direct_means():
    from mechdiff.circuits.measures import faithfulness, random_circuit

    circuit, scorer, (a, b, c) = _or_circuit()
    only_c = Circuit("m", "t", {"B": [c[0]]}, {"B": "query_label"})
    full_acc = np.array([i % 5 != 0 for i in range(12)], dtype=float)
    res = faithfulness(scorer, only_c, n_random=3, seed=7)
    assert res["n_prompts"] == 12
    assert res["full"]["accuracy"]["value"] == pytest.approx(full_acc.mean())
    assert res["full"]["faithfulness"]["value"] == pytest.approx(1.0)
    assert res["circuit"]["accuracy"]["value"] == 0.0 and res["circuit"]["faithfulness"]["value"] == 0.0
    prob_c, prob_full = scorer.base + 0.1, scorer.base + 0.3
    assert res["circuit"]["answer_prob"]["value"] == pytest.approx(prob_c.mean())
    assert res["circuit"]["faithfulness_prob"]["value"] == pytest.approx(prob_c.mean() / prob_full.mean())
    rng = random.Random(7)
    draws = [scorer._result(frozenset(random_circuit(only_c, 3, 4, rng).pairs())) for _ in range(3)]
    acc = np.mean([d.correct for d in draws], 0)
    assert res["random"]["accuracy"]["value"] == pytest.approx(acc.mean())
    assert res["random"]["answer_prob"]["value"] == pytest.approx(np.mean([d.prob for d in draws]))
    assert (res["random"]["n_draws"], res["random"]["seed"]) == (3, 7)
    assert "random" not in faithfulness(scorer, only_c)
    bad = Circuit("m", "t", {"A": [Head(5, 0)]}, {"A": "last"})
    with pytest.raises(ValueError, match="do not exist"):
        faithfulness(scorer, bad)


def test_normalised_faithfulness_subtracts_the_empty_circuit():
    """(m(C) - m(empty)) / (m(M) - m(empty)) from the fake scorer's direct per-prompt values, beside the paper's
    m(C) / m(M); a circuit that does no more than the empty one scores 0 whatever the paper's ratio says."""
    from mechdiff.circuits.measures import faithfulness

    circuit, scorer, (a, b, c) = _or_circuit()
    res = faithfulness(scorer, circuit)
    full, circ, empty = scorer.full(), scorer.keep(circuit.pairs()), scorer.keep(())
    for metric, key in (("correct", "faithfulness_normalised"), ("prob", "faithfulness_normalised_prob")):
        f, ci, e = (getattr(r, metric).astype(float) for r in (full, circ, empty))
        assert res["circuit"][key]["value"] == pytest.approx((ci - e).mean() / (f - e).mean())
    only_c = Circuit("m", "t", {"B": [c[0]]}, {"B": "query_label"})
    none = faithfulness(scorer, only_c)["circuit"]
    assert none["faithfulness_normalised"]["value"] == pytest.approx(0.0)
    assert res["outcomes"]["empty"]["correct"] == "0" * 12


def test_completeness_against_direct_differences():
    from mechdiff.circuits.measures import completeness

    circuit, scorer, (a, b, c) = _or_circuit()
    pairs = circuit.pairs()
    res = completeness(scorer, circuit, n_draws=4, p=0.5, seed=11, metric="prob")
    rng = random.Random(11)
    expected = []
    for _ in range(4):
        k = [pr for pr in pairs if rng.random() < 0.5]
        kept = frozenset(pr for pr in pairs if pr not in k)
        expected.append(
            abs(float((scorer._result(kept).prob - scorer._result(scorer.every - frozenset(k)).prob).mean()))
        )
    assert res["random"]["draws"] == pytest.approx(expected)
    assert res["random"]["mean"] == pytest.approx(np.mean(expected))
    assert res["random"]["std"] == pytest.approx(np.std(expected))
    assert (res["metric"], res["p"], res["seed"], res["n_prompts"]) == ("prob", 0.5, 11, 12)
    # group A removed: the circuit keeps c only, the model keeps c too (the rest of it is "every" here)
    diff_a = scorer._result(frozenset([c])).prob - scorer._result(frozenset([c])).prob
    assert res["groups"]["A"]["completeness"] == pytest.approx(abs(diff_a.mean())) and res["groups"]["A"]["size"] == 2
    acc = completeness(scorer, circuit, n_draws=0, metric="accuracy")
    assert "random" not in acc and set(acc["groups"]) == {"A", "B"}
    assert acc["groups"]["B"]["completeness"] == 0.0 and acc["groups"]["B"]["size"] == 1
    always = completeness(scorer, circuit, n_draws=2, p=1.0, seed=0, metric="prob")
    assert always["random"]["draws"] == [0.0, 0.0]  # K = C: nothing kept in either run


def test_matrix_rows_columns_from_faithfulness():
    from mechdiff.circuits.measures import faithfulness, matrix_rows

    circuit, scorer, _ = _or_circuit()
    rows = matrix_rows("model-x", {"or": circuit}, scorer, n_random=2, seed=1)
    res = faithfulness(scorer, circuit, n_random=2, seed=1)
    (row,) = rows
    assert row["circuit"] == "or" and row["model"] == "model-x" and row["n_heads"] == 3 and row["n_prompts"] == 12
    assert row["n_pairs"] == len(circuit.pairs())
    for col, (part, metric) in {
        "full_accuracy": ("full", "accuracy"),
        "accuracy": ("circuit", "accuracy"),
        "faithfulness": ("circuit", "faithfulness"),
        "answer_prob": ("circuit", "answer_prob"),
        "faithfulness_prob": ("circuit", "faithfulness_prob"),
        "random_accuracy": ("random", "accuracy"),
        "random_faithfulness": ("random", "faithfulness"),
        "random_faithfulness_prob": ("random", "faithfulness_prob"),
    }.items():
        d = res[part][metric]
        assert (row[col], row[f"{col}_low"], row[f"{col}_high"]) == (d["value"], d["low"], d["high"])
    assert "random_accuracy" not in matrix_rows("m", {"or": circuit}, scorer)[0]
    only = matrix_rows("m", {"or": circuit, "same": circuit}, scorer, n_random=2, seed=1, random_for=["same"])
    assert "random_accuracy" not in only[0] and only[1]["random_accuracy"] == row["random_accuracy"]


def test_interval_round_trip_and_pair_name():
    from mechdiff.circuits.pruning import pair_name
    from mechdiff.common.inference import Interval

    e = Interval(0.4, 0.1, 0.7, 30, 12, "cluster bootstrap over items")
    assert Interval.from_dict(e.to_dict(detail=True)) == e
    assert e.to_dict() == {"value": 0.4, "low": 0.1, "high": 0.7, "n": 30}  # a stage record's four keys
    assert Interval.from_dict(e.to_dict()) == Interval(0.4, 0.1, 0.7, 30, 30, "")  # each row its own item
    assert pair_name((Head(14, 7), "query_label")) == "L14H7@query_label"


def test_head_mask_marks_each_pairs_position():
    from mechdiff.circuits.scoring import EVERY_POSITION, _head_mask, _pairs_by_layer

    batch = {
        "input_ids": torch.zeros(3, 6, dtype=torch.long),
        "positions": {
            "last": torch.tensor([5, 4, 5]),
            "query_label": torch.tensor([2, 1, 3]),
            "gone": torch.tensor([1, -1, 2]),
        },
    }
    layers = _pairs_by_layer([(Head(1, 2), "last"), (Head(0, 1), "query_label"), (Head(1, 0), EVERY_POSITION)])
    assert {k: [(h.name, p) for h, p in v] for k, v in layers.items()} == {
        1: [("L1H2", "last"), ("L1H0", EVERY_POSITION)],
        0: [("L0H1", "query_label")],
    }
    mask = _head_mask(layers[1], batch, 6, 4, fill=0.0)
    expected = torch.ones(3, 6, 4)
    expected[[0, 1, 2], [5, 4, 5], 2] = 0.0
    expected[:, :, 0] = 0.0
    assert torch.equal(mask, expected)
    keep = _head_mask(layers[0], batch, 6, 4, fill=1.0)
    expected = torch.zeros(3, 6, 4)
    expected[[0, 1, 2], [2, 1, 3], 1] = 1.0
    assert torch.equal(keep, expected)
    first = {"input_ids": batch["input_ids"], "positions": {"bos": torch.tensor([0, 0, 0])}}
    assert torch.equal(_head_mask([(Head(0, 2), "bos")], first, 6, 4, 1.0)[:, 0, 2], torch.ones(3))  # 0 is valid
    with pytest.raises(ValueError, match="unknown position 'nowhere'"):
        _head_mask([(Head(0, 0), "nowhere")], batch, 6, 4, 0.0)
    with pytest.raises(ValueError, match="missing in some prompts"):
        _head_mask([(Head(0, 0), "gone")], batch, 6, 4, 0.0)


def test_per_prompt_rejects_unknown_metric():
    from mechdiff.circuits.scoring import per_prompt

    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        per_prompt(_result([True], [0.5]), "f1")


def test_group_pairs():
    from mechdiff.circuits.measures import group_pairs

    circuit, _, (a, b, c) = _or_circuit()
    assert group_pairs(circuit, "A") == [a, b] and group_pairs(circuit, "B") == [c]


def _completeness_scorer():
    """Circuit {a, b, c} inside a model that also has d: d and a together add 0.2 to the probability."""
    a, b, c, d = (Head(1, 0), "last"), (Head(1, 1), "last"), (Head(2, 2), "last"), (Head(0, 0), "last")
    circuit = Circuit("m", "t", {"A": [a[0], b[0]], "B": [c[0]]}, {"A": "last", "B": "last"})
    scorer = FakeScorer([a, b, c, d], lambda kept: d in kept or (a in kept and b in kept))
    plain = scorer._result

    def result(kept: frozenset) -> EvalResult:
        r = plain(kept)
        return EvalResult(r.correct, r.prob + 0.2 * (a in kept and d in kept))

    scorer._result = result
    return circuit, scorer, (a, b, c, d)


def test_completeness_draws_k_with_its_seed():
    from mechdiff.circuits.measures import completeness
    from mechdiff.common.stats import bootstrap

    circuit, scorer, (a, b, c, d) = _completeness_scorer()
    pairs = circuit.pairs()
    res = completeness(scorer, circuit, n_draws=8, p=0.5, seed=4, metric="prob")
    rng, expected = random.Random(4), []
    for _ in range(8):
        k = frozenset(pr for pr in pairs if rng.random() < 0.5)
        with_c = scorer._result(frozenset(pairs) - k).prob
        with_m = scorer._result(frozenset([a, b, c, d]) - k).prob
        expected.append(abs(float((with_c - with_m).mean())))
    assert len(set(expected)) > 1  # the draws differ, so the seed shows
    assert res["random"]["draws"] == pytest.approx(expected)
    assert res["random"]["ci"] == bootstrap(res["random"]["draws"]).to_dict()
    assert completeness(scorer, circuit, n_draws=8, p=0.5, seed=4, metric="prob")["random"] == res["random"]
    default = completeness(scorer, circuit)
    assert (default["metric"], default["p"], default["seed"], len(default["random"]["draws"])) == (
        "accuracy",
        0.5,
        0,
        5,
    )
    # group A removed: C keeps c only (wrong), M keeps c and d (right on 4 prompts of 5)
    acc_m = np.array([i % 5 != 0 for i in range(12)], dtype=float)
    assert default["groups"]["A"]["completeness"] == pytest.approx(acc_m.mean())
    assert default["groups"]["A"]["difference"]["value"] == pytest.approx(-acc_m.mean())


def test_full_circuit_default_model_name():
    from mechdiff.circuits.measures import full_circuit

    assert full_circuit(1, 2).model == ""


def test_random_baseline_averages_draws_per_prompt():
    """The random baseline's figures are means over draws and prompts; every interval resamples draws and prompts
    both (the spread between draws counts)."""
    from mechdiff.circuits.measures import faithfulness, random_circuit
    from mechdiff.common.inference import control_ratio

    circuit, scorer, (a, b, c) = _or_circuit()
    res = faithfulness(scorer, circuit, n_random=3)  # seed 0 by default
    assert res["random"]["seed"] == 0 and res == faithfulness(scorer, circuit, n_random=3, seed=0)
    rng = random.Random(0)
    draws = [scorer._result(frozenset(random_circuit(circuit, 3, 4, rng).pairs())) for _ in range(3)]
    acc = np.mean([d.correct for d in draws], 0)  # one value per prompt
    prob = np.mean([d.prob for d in draws], 0)
    want = control_ratio([d.correct.astype(float) for d in draws], seed=0)
    assert (res["random"]["accuracy"]["low"], res["random"]["accuracy"]["high"]) == (want.low, want.high)
    assert res["random"]["accuracy"]["value"] == pytest.approx(acc.mean()) and res["random"]["accuracy"]["n"] == 12
    assert res["random"]["draws"] == [float(d.correct.mean()) for d in draws]
    assert (
        res["random"]["answer_prob"]["value"] == pytest.approx(prob.mean()) and res["random"]["answer_prob"]["n"] == 12
    )
    assert res["random"]["answer_prob"]["high"] == control_ratio([d.prob for d in draws], seed=0).high


def test_quiet_scoring_prints_nothing(capsys):
    """``progress=False`` means no progress bar on stderr from any scoring loop."""
    from mechdiff.circuits.measures import completeness, faithfulness
    from mechdiff.circuits.pruning import minimality
    from mechdiff.circuits.scoring import per_prompt

    circuit, scorer, _ = _or_circuit()
    faithfulness(scorer, circuit, n_random=2)
    completeness(scorer, circuit, n_draws=2)
    minimality(scorer, circuit)
    assert capsys.readouterr().err == ""
    assert per_prompt(_result([True, False], [0.7, 0.2])).tolist() == [1.0, 0.0]  # accuracy by default


def test_random_circuit_is_layer_matched():
    circuit = Circuit(
        "t", "et", {"A": [Head(5, 1), Head(5, 2), Head(9, 0)], "B": [Head(2, 3)]}, {"A": "last", "B": "query_label"}
    )
    rng = random.Random(0)
    draws = [random_circuit(circuit, 12, 8, rng) for _ in range(30)]
    for d in draws:
        assert [h.layer for h in d.groups["A"]] == [5, 5, 9] and [h.layer for h in d.groups["B"]] == [2]
        assert len(set(d.groups["A"])) == 3 and d.positions == circuit.positions
    assert len({tuple(d.groups["A"]) for d in draws}) > 5  # not the same heads every time
    anywhere = [random_circuit(circuit, 12, 8, rng, match="all") for _ in range(30)]
    assert any({h.layer for h in d.groups["A"]} - {5, 9} for d in anywhere)
    with pytest.raises(ValueError, match="match must be"):
        random_circuit(circuit, 12, 8, rng, match="group")


def test_random_baseline_lists_its_draws(llama_scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0), Head(1, 1)]}, {"A": "last"})
    res = faithfulness(llama_scorer, circuit, n_random=4, seed=0)
    rnd = res["random"]
    assert rnd["match"] == "layer" and len(rnd["draws"]) == 4
    assert rnd["accuracy"]["value"] == pytest.approx(np.mean(rnd["draws"]))


def test_completeness_is_not_defined_for_an_empty_group(llama_scorer):
    circuit = Circuit("t", "et", {"A": [Head(2, 0)], "D": []}, {"A": "last", "D": "query_label"})
    comp = completeness(llama_scorer, circuit, n_draws=1, metric="prob")
    assert comp["groups"]["D"]["completeness"] is None and comp["groups"]["D"]["size"] == 0
    assert comp["groups"]["A"]["completeness"] is not None


def test_prune_metric_prob_is_the_tasks_continuous_metric(tiny_dirs, tmp_path):
    """`mechdiff prune --metric prob` on a logit_diff task (IOI) prunes on the logit difference and its caption says
    so (not "prob"); on a prob task (entity tracking), on the answer's probability."""
    from mechdiff.cli import main

    (model, _), first, _ = tiny_dirs
    ioi = Circuit("tiny-0", "ioi", {"NM": [Head(2, 0)], "SI": [Head(1, 1)]}, {"NM": "last", "SI": "S2"})
    ioi = str(ioi.save(tmp_path / "ioi.json"))
    for task, circuit, said in (("ioi", ioi, "logit difference"), ("entity-tracking", first, "answer probability")):
        path = tmp_path / task / "pruned.json"
        args = ["prune", "--model", model, "--circuit", circuit, "--out", str(path), "--metric", "prob"]
        assert main([*args, "--task", task, *DATA]) == 0
        caption = (path.parent / "pruned.minimality.md").read_text()
        assert f"Minimality (greedy rule, {said}, threshold" in caption
