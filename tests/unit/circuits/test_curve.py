"""The (head, position class) attribution ranking against an independent torch-hook gradient, and the
faithfulness curve's end points."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mechdiff.circuits.curve import ablation_attribution, all_pairs, faithfulness_curve, ranking
from mechdiff.circuits.scoring import Scorer, per_prompt
from mechdiff.common.components import Head
from mechdiff.patching.evaluate import EvalResult
from mechdiff.tasks.entity_tracking import batch_tensors, generate, reference_records
from mechdiff.tasks.entity_tracking.positions import CLASSES

N_BOXES = 3


@pytest.fixture
def scorer(tiny_llama, smollm2_tokenizer) -> Scorer:
    records = generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)
    return Scorer.build(tiny_llama, records, reference_records(smollm2_tokenizer, 6, N_BOXES, 1), 3, False)


def hook_attribution(scorer: Scorer, classes) -> dict:
    """The same quantity with plain torch hooks on each o_proj input (no nnsight)."""
    model, shape = scorer.model, scorer.model.shape
    batch = batch_tensors(scorer.records)
    inputs = {}

    def keep(layer):
        def hook(module, args):
            args[0].retain_grad()
            inputs[layer] = args[0]

        return hook

    handles = [
        model.model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(keep(l)) for l in range(shape.n_layers)
    ]
    handles.append(
        model.model.model.embed_tokens.register_forward_hook(
            lambda module, args, output: output.detach().requires_grad_()
        )
    )
    try:
        logits = model.model(batch["input_ids"]).logits[:, -1].float()
        logits.log_softmax(-1).gather(1, batch["answer_ids"][:, None]).sum().backward()
    finally:
        for h in handles:
            h.remove()
    out = {}
    d = shape.d_head
    for l in range(shape.n_layers):
        z, g = inputs[l].detach(), inputs[l].grad
        delta = scorer.means[l][None] - z
        for c in classes:
            m = batch["position_classes"][c].float()[..., None]
            for h in range(shape.n_heads):
                cols = slice(h * d, (h + 1) * d)
                out[(l, h, c)] = float((delta[..., cols] * g[..., cols] * m).sum() / len(scorer.records))
    return out


def test_attribution_equals_an_independent_hook_gradient(scorer):
    got = ablation_attribution(scorer, CLASSES)
    want = hook_attribution(scorer, CLASSES)
    assert len(got) == len(CLASSES) * scorer.model.shape.n_layers * scorer.model.shape.n_heads
    for (head, c), v in got.items():
        assert v == pytest.approx(want[(head.layer, head.head, c)], rel=1e-4, abs=1e-6)
    assert max(abs(v) for v in got.values()) > 0


def test_curve_ends_at_the_full_model_and_picks_the_smallest_size(scorer):
    shape = scorer.model.shape
    scores = ablation_attribution(scorer, CLASSES)
    ranked = ranking(scores)
    assert len(ranked) == len(all_pairs(shape.n_layers, shape.n_heads, CLASSES))
    assert [abs(scores[p]) for p in ranked] == sorted((abs(v) for v in scores.values()), reverse=True)
    curve = faithfulness_curve(scorer, ranked, sizes=(0.05, 0.5, 1.0), target=0.5)
    last = curve["rows"][-1]
    assert last["n_pairs"] == len(ranked)
    assert last["faithfulness_prob"]["value"] == pytest.approx(1.0)  # every pair kept: the model itself
    assert curve["full_prob"] == pytest.approx(float(per_prompt(scorer.full(), "prob").mean()))
    if last["normalised_prob"] is not None:
        assert last["normalised_prob"] == pytest.approx(1.0)
    reached = [r for r in curve["rows"] if r["faithfulness"]["low"] >= 0.5]
    assert curve["chosen"] == (reached[0] if reached else None) and curve["select"] == "low"
    x = np.array([0.0, 0.05, 0.5, 1.0])
    y = np.array([0.0] + [r["normalised_prob"] for r in curve["rows"]])
    assert curve["cpr_prob"] == pytest.approx(float(np.trapezoid(y, x)))
    with pytest.raises(ValueError, match="no pairs"):
        faithfulness_curve(scorer, [])


class _KeepsPrompts:
    """A scorer whose circuit of n of ``total`` pairs answers the first ``2 n / total`` of 200 prompts."""

    def __init__(self, total: int) -> None:
        self.total, self.records, self.progress, self.metric = total, [None] * 200, False, "prob"

    def full(self) -> EvalResult:
        return EvalResult(np.ones(200, bool), np.ones(200))

    def keep(self, pairs) -> EvalResult:
        right = min(200, round(400 * len(pairs) / self.total))
        correct = np.arange(200) < right
        return EvalResult(correct, correct.astype(float))


def test_curve_picks_on_the_lower_bound_or_the_value():
    ranked = [(Head(0, h), "last") for h in range(100)]
    sizes = (0.3, 0.4, 0.45, 1.0)  # faithfulness 0.6, 0.8, 0.9, 1.0 on 200 prompts
    low = faithfulness_curve(_KeepsPrompts(100), ranked, sizes, target=0.8)
    value = faithfulness_curve(_KeepsPrompts(100), ranked, sizes, target=0.8, select="value")
    assert [r["faithfulness"]["value"] for r in low["rows"]] == pytest.approx([0.6, 0.8, 0.9, 1.0])
    assert low["rows"][1]["faithfulness"]["low"] < 0.8 <= low["rows"][2]["faithfulness"]["low"]
    assert low["chosen"]["fraction"] == 0.45 and low["select"] == "low"  # 0.8 is not carried by its interval
    assert value["chosen"]["fraction"] == 0.4 and value["select"] == "value"
    assert faithfulness_curve(_KeepsPrompts(100), ranked, sizes, target=1.01)["chosen"] is None
    with pytest.raises(ValueError, match="select must be one of"):
        faithfulness_curve(_KeepsPrompts(100), ranked, sizes, select="high")


def test_cli_curve_and_positions_write_tables_and_figures(tmp_path, tiny_llama, smollm2_tokenizer):
    import json

    from mechdiff.cli import main as cli_main

    tiny_llama.model.save_pretrained(tmp_path / "m")
    smollm2_tokenizer.save_pretrained(tmp_path / "m")
    common = ["--model", str(tmp_path / "m"), "--n", "6", "--n-boxes", "3", "--batch-size", "3", "--no-progress"]
    assert cli_main(["curve", *common, "--sizes", "0.1,1.0", "--out", str(tmp_path / "c")]) == 0
    data = json.loads((tmp_path / "c" / "curve.json").read_text())
    assert data["curve"]["rows"][-1]["n_pairs"] == len(data["ranking"]) == 13 * 3 * 4
    assert (tmp_path / "c" / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["positions", *common, "--max-steps", "2", "--leave-one-out", "--out", str(tmp_path / "p")]) == 0
    scan = json.loads((tmp_path / "p" / "positions.json").read_text())
    assert len(scan["scan"]["steps"]) == 2 and len(scan["leave_one_out"]["classes"]) == 13
    assert (tmp_path / "p" / "position_scan.png").is_file() and (tmp_path / "p" / "leave_one_out.md").is_file()
    assert cli_main(["curve", *common, "--sizes", "0,2", "--out", str(tmp_path / "bad")]) == 2


def test_cli_curve_draws_its_prompt_sets_by_name(tmp_path, tiny_llama, smollm2_tokenizer, monkeypatch):
    """Scored, reference and ranking prompts: the sets command-scoring, -reference, -ranking of --seed (the seeds
    results/curve-smollm2 was drawn with: --seed, + 1, + 2); --reference-seed overrides the reference's."""
    from mechdiff.cli import main as cli_main
    from mechdiff.tasks.base import Task

    drawn = []
    for method in ("records", "reference_records"):

        def spy(self, tokenizer, n, seed=0, _method=getattr(Task, method), _name=method, **options):
            drawn.append((_name, n, seed))
            return _method(self, tokenizer, n, seed, **options)

        monkeypatch.setattr(Task, method, spy)
    tiny_llama.model.save_pretrained(tmp_path / "m")
    smollm2_tokenizer.save_pretrained(tmp_path / "m")
    common = [
        "--model",
        str(tmp_path / "m"),
        "--n",
        "6",
        "--rank-n",
        "4",
        "--n-boxes",
        "3",
        "--batch-size",
        "3",
        "--no-progress",
        "--sizes",
        "0.5,1.0",
        "--seed",
        "5",
    ]
    assert cli_main(["curve", *common, "--out", str(tmp_path / "c")]) == 0
    assert sorted(drawn) == [("records", 4, 7), ("records", 6, 5), ("reference_records", 6, 6)]
    drawn.clear()
    assert cli_main(["curve", *common, "--reference-seed", "40", "--out", str(tmp_path / "d")]) == 0
    assert sorted(drawn) == [("records", 4, 7), ("records", 6, 5), ("reference_records", 6, 40)]


def test_prompt_attribution_rows_are_each_prompts_own(scorer):
    """Row i of the per-prompt attribution is the attribution of a scorer holding prompt i alone (the same
    means), and the rows average to the ranking's scores."""
    from mechdiff.circuits.curve import pair_scores, prompt_attribution

    per = prompt_attribution(scorer, CLASSES)
    shape = scorer.model.shape
    assert per.shape == (len(scorer.records), len(CLASSES), shape.n_layers, shape.n_heads)
    alone = Scorer(scorer.model, scorer.records[2:3], scorer.means, 1, False)
    want = hook_attribution(alone, CLASSES)
    for (head, c), v in pair_scores(per[2], CLASSES).items():
        assert v == pytest.approx(want[(head.layer, head.head, c)], rel=1e-4, abs=1e-6)
    mean = ablation_attribution(scorer, CLASSES)
    # float64 means of the same rows (ablation_attribution averages prompt_attribution): exact but for float64
    assert all(v == pytest.approx(mean[p], abs=1e-9) for p, v in pair_scores(per.mean(0), CLASSES).items())


def test_selection_stability_counts_top_n_over_resamples():
    from mechdiff.circuits.curve import selection_stability
    from mechdiff.common.components import Head

    gen = torch.Generator().manual_seed(0)
    scores = 0.01 * torch.randn(40, 2, 3, 2, generator=gen, dtype=torch.float64)  # "prompt class layer head"
    scores[:, 0, 1, 1] += 5.0  # always first
    scores[:, 1, 2, 0] = 0.0  # never above the noise
    freq = selection_stability(scores, ["a", "b"], n_selected=3, draws=50, seed=4)
    assert len(freq) == 12 and sum(freq.values()) == pytest.approx(3.0)  # each draw selects exactly 3
    assert freq[(Head(1, 1), "a")] == 1.0 and freq[(Head(2, 0), "b")] == 0.0
    assert selection_stability(scores, ["a", "b"], 3, 50, seed=4) == freq  # seeded
    with pytest.raises(ValueError, match="n_selected"):
        selection_stability(scores, ["a", "b"], 0)


def test_ranked_circuit_keeps_exactly_the_top_pairs(scorer):
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.circuits.curve import ranked_circuit

    ranked = ranking(ablation_attribution(scorer, CLASSES))
    circuit = ranked_circuit(ranked, 17, "m", "entity-tracking", meta={"fraction": 0.1})
    assert set(circuit.pairs()) == set(ranked[:17]) and len(circuit.pairs()) == 17
    assert all(circuit.positions[g] == g for g in circuit.groups) and circuit.meta == {"fraction": 0.1}
    again = Circuit.from_dict(circuit.to_dict())
    assert set(again.pairs()) == set(ranked[:17])
    kept = scorer.keep(circuit.pairs())
    assert np.array_equal(kept.prob, scorer.keep(ranked[:17]).prob)
