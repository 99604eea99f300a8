"""The paper's study form (path patching, pairwise pruning, DCM on the pruned groups with the paper's training,
CMAP of each fine-tune's own pruned circuit cut to its DCM selections) end to end on tiny saved models."""

from __future__ import annotations

import json

from mechdiff.circuits.circuit import Circuit
from mechdiff.methods.cmap_patches import dcm_cut
from mechdiff.studies.circuits.spec import default_spec
from mechdiff.studies.circuits.study import CircuitsStudy as Study


def paper_spec(names, out):
    spec = default_spec()
    spec.models.base, spec.models.finetunes = names[0], names[1:]
    spec.task.n_boxes = 3
    spec.eval.n, spec.eval.batch_size = 12, 12
    spec.eval.floor = -1.0  # random tiny models answer nothing: every model counts as doing the task (mechanics)
    spec.positions.n = 0
    d, s, c, m = spec.discovery, spec.scoring, spec.dcm, spec.cmap
    d.method, d.n, d.top_k, d.screen_multiple = "path", 6, {"A": 3, "B": 2, "C": 2, "D": 1}, 2
    s.n, s.random_draws, s.completeness_draws, s.reference_n = 8, 1, 0, 12
    s.prune_rule, s.prune_metric, s.prune_n = "paper", "prob", 6
    s.prune_threshold = -1.0  # every score F(C\K)/F(C\(K+v)) - 1 is >= -1: keep every head (tiny random models)
    c.circuit, c.groups, c.desiderata = "pruned", ["A", "B"], ["positional", "object_value"]
    c.n_train, c.n_val, c.n_test = 8, 4, 4
    c.lam_scale, c.epochs, c.batch_size, c.schedule, c.eval_every, c.shuffle = (
        "absolute",
        2,
        4,
        "epoch_batches",
        4,
        False,
    )
    # tiny random models carry no desideratum: a negative sparsity weight rewards patching, so every mask falls
    # below 0.5 in the first step and DCM selects every head, which leaves CMAP heads to patch
    c.lam, c.lr = -1.0, 1.0
    m.scope, m.groups, m.selection, m.parts, m.n, m.n_random = (
        "paper",
        ["A", "B", "C"],
        {"A": "object_value", "B": "positional"},
        ["z", "k"],
        8,
        0,
    )
    spec.output.dir, spec.output.store = str(out / "run"), str(out / "store.h5")
    return spec


def test_paper_study_form_end_to_end(tiny_family, tmp_path):
    spec = paper_spec(tiny_family, tmp_path)
    study = Study(spec, progress=False)
    report = study.run().read_text()
    assert "the paper's rule, per group" in report
    base, ft = spec.models.base, spec.models.finetunes[0]
    records = study.cache.records
    assert {"dcm", f"dcm:{ft}", f"prune:{ft}", f"cmap:{ft}"} <= set(records)
    # pruning by the paper's rule, per pair its K, F(C\K) and F(C\(K+v))
    pruned = records[f"prune:{ft}"].result
    assert pruned["minimality"]["rule"] == "paper"
    assert all({"K", "before", "after", "score"} <= set(v) for v in pruned["minimality"]["pairs"].values())
    # DCM of the base on its pruned groups, and of the fine-tune on its own
    assert records["dcm"].result["model"] == base and records[f"dcm:{ft}"].result["model"] == ft
    assert {r["config"]["lam_scale"] for r in records[f"dcm:{ft}"].result["dcm"]} == {"absolute"}
    own = Circuit.from_dict(pruned["circuit"])
    assert {r["group"] for r in records[f"dcm:{ft}"].result["dcm"]} == {g for g in ("A", "B") if own.groups[g]}
    # CMAP: the fine-tune's pruned circuit cut to its DCM selections; q/k/v only for last-token groups
    cmap = records[f"cmap:{ft}"].result
    assert "skipped" not in cmap, cmap
    cut = dcm_cut(own, records[f"dcm:{ft}"].result["dcm"], spec.cmap.selection)
    patched = Circuit.from_dict(cmap["circuit"])
    assert all(patched.groups[g] == cut.groups[g] for g in patched.groups)
    assert cmap["settings"]["rule"] == "paper"
    # the report names the heads it patched, and shows the fine-tune's DCM that selected them
    assert f"DCM on {ft}'s own pruned circuit" in report
    for g, heads in patched.groups.items():
        why = f"DCM {spec.cmap.selection[g]}" if g in spec.cmap.selection else "the whole pruned group"
        assert any(
            line.startswith(f"- {g} (`{patched.positions[g]}`), {why}")
            and line.endswith(": " + (" ".join(h.name for h in heads) or "-"))
            for line in report.splitlines()
        )
    for row in cmap["rows"]:
        scope_positions = (
            {patched.positions[g] for g in patched.groups}
            if row["scope"] == "circuit"
            else {patched.positions[row["scope"]]}
        )
        assert row["kind"] == "z" or scope_positions == {"last"}
    json.dumps(cmap)


def test_the_paper_form_runs_in_bfloat16_within_a_stated_tolerance_of_float32(tiny_family, tmp_path):
    """The paper's form (path patching with the paper's score, every sender exact, D's sender at a random label;
    the paper's pruning, DCM and CMAP) in bfloat16 on CPU against float32 (the paper's, and its task file's
    default). Each step keeps every eligible sender, so that both dtypes select the same circuit whatever the order
    of a random tiny model's near-zero scores; every figure is then compared. Stated tolerances: path-patching
    scores, the mean over prompts of (p - p_clean) / p_clean, and DCM's training losses (mean -logit(target), near
    0 on a random tiny model), differences of near-equal numbers, within two bfloat16 epsilons (2^-7) absolute;
    every other figure as in the circuits study's test (test_study.tolerance: 2% of its value, minimality
    contributions 2^-7, normalised faithfulness 0.05)."""
    from test_study import bfloat16_outside, tolerance

    def path_tolerance(path: str) -> tuple[float, float] | None:
        if path.startswith(".exact.") or ".circuit.scores." in path and "minimality" not in path or ".loss" in path:
            return 2**-7, 0.0
        return tolerance(path)

    runs = {}
    for dtype in ("float32", "bfloat16"):
        spec = paper_spec(tiny_family, tmp_path / dtype)
        spec.models.dtype = dtype
        d = spec.discovery
        d.top_k, d.score, d.source_position = {"A": 8, "B": 8, "C": 8, "D": 8}, "mean_of_ratios", {"D": "labels"}
        study = Study(spec, progress=False)
        study.run()
        runs[dtype] = study.cache.records

    def heads(result: dict) -> dict:
        return {g: set(hs) for g, hs in Circuit.from_dict(result["circuit"]).groups.items()}

    for name, record in runs["float32"].items():  # the same circuits (in another order), pruned the same
        if name.startswith(("circuit", "prune")):
            assert heads(record.result) == heads(runs["bfloat16"][name].result)
    assert set(runs["float32"]) == set(runs["bfloat16"]) >= {"dcm", "cmap:" + spec.models.finetunes[0]}
    checked, outside = bfloat16_outside(
        tmp_path / "bfloat16" / "run" / "stages", tmp_path / "float32" / "run" / "stages", path_tolerance
    )
    assert outside == [] and checked > 1000, outside[:40]
