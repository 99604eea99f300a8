"""The circuits study's report text: each model's findings open with its own bullet, and a limitation names
only what the run did (a position scan, pruning, CMAP's random control)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mechdiff.studies.circuits.report.claims import circuit_findings
from mechdiff.studies.circuits.report.run import limitations
from mechdiff.studies.circuits.spec import RunSpec, default_spec


def _spec(**changes) -> RunSpec:
    spec = default_spec()
    spec.models.base, spec.models.finetunes = "base", ["tuned"]
    for section, values in changes.items():
        for key, value in values.items():
            setattr(getattr(spec, section), key, value)
    return spec


def _own(model: str, n_pairs: int) -> dict:
    return {
        "model": model,
        "circuit": model,
        "n_pairs": n_pairs,
        "n_prompts": 50,
        "faithfulness": 0.9,
        "faithfulness_low": 0.85,
        "faithfulness_high": 0.95,
        "accuracy": 0.8,
        "accuracy_low": 0.7,
        "accuracy_high": 0.9,
    }


def _scan(classes: list[str]) -> SimpleNamespace:
    step = {"classes": classes, "faithfulness": {"value": 0.5, "low": 0.4, "high": 0.6, "n": 10}}
    return SimpleNamespace(result={"scan": {"steps": [step], "n_prompts": 10}})


def test_each_model_opens_its_own_bullet_with_or_without_a_position_scan():
    study = SimpleNamespace(spec=_spec())
    rows = [_own("base", 10), _own("tuned", 20)]
    lines = circuit_findings(study, {}, rows).splitlines()
    assert lines[0].startswith("- **base**: its own circuit (10 ") and lines[1].startswith("- **tuned**: its own")
    lines = circuit_findings(study, {"base": _scan(["last"]), "tuned": None}, rows).splitlines()
    assert lines[0].startswith("- **base**: every head kept at `last`")
    assert lines[1].startswith("  Its own circuit (10 ") and lines[2].startswith("- **tuned**: its own circuit (20 ")


def _task(metric: str = "prob", answer_tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(metric=metric, answer_tokens=answer_tokens, options=())


def test_limitations_name_only_what_the_run_did():
    none = limitations(SimpleNamespace(spec=_spec(scoring={"prune": False}, cmap={"n_random": 0}), task=_task()), {})
    assert "position scan" not in none and "Pruning" not in none and "random control" not in none
    assert none.startswith("- Departures from Prakash et al.")
    greedy = _spec(scoring={"prune": True, "prune_rule": "greedy"}, cmap={"n_random": 3})
    every = limitations(SimpleNamespace(spec=greedy, task=_task()), {"base": _scan(["last"])})
    assert "position scan" in every and "bounded greedy search" in every and "random control" in every
    assert "Pruning uses the answer probability" in every
    ld = limitations(SimpleNamespace(spec=greedy, task=_task("logit_diff")), {})
    assert "Pruning uses the logit difference" in ld  # a logit_diff task prunes on its own metric
    greedy.scoring.prune_metric = "accuracy"
    acc = limitations(SimpleNamespace(spec=greedy, task=_task("logit_diff")), {})
    assert "Pruning uses the accuracy" in acc  # what the code pruned on, whatever the task's metric
    paper = limitations(
        SimpleNamespace(
            spec=_spec(discovery={"method": "path"}, scoring={"prune": True, "prune_rule": "paper"}), task=_task()
        ),
        {},
    )
    assert "path patching of head groups" in paper and "bounded greedy" not in paper and "pruning `paper`" in paper
    assert "teacher forcing" not in paper  # one-token answers: nothing to say
    several = limitations(SimpleNamespace(spec=greedy, task=_task("logit_diff", answer_tokens=3)), {})
    assert "Answers of up to 3 tokens are scored by teacher forcing" in several
    assert "cover the prompt's positions only" in several


def test_report_states_an_ordering_only_where_the_holm_adjusted_paired_test_rejects():
    """CMAP orderings are tests in one family: V against QK with 10 of 10 discordant prompts is shown; 1 against
    0 is not; a comparison whose outcomes were not kept says nothing."""
    from scipy import stats as sps

    from mechdiff.report.claims import cmap_family
    from mechdiff.studies.circuits.report.claims import _ordering

    clear = {"rows": [], "outcomes": {"circuit/v": [1] * 30 + [0] * 10, "circuit/qk": [1] * 20 + [0] * 20}}
    close = {"rows": [], "outcomes": {"circuit/v": [1] * 21 + [0] * 19, "circuit/qk": [1] * 20 + [0] * 20}}
    gain = cmap_family({"a": SimpleNamespace(result=clear), "b": SimpleNamespace(result=close)})
    assert "the first is larger" in _ordering(gain, "a", "circuit/v", "circuit/qk")
    assert "neither is shown to be larger" in _ordering(gain, "b", "circuit/v", "circuit/qk")
    assert gain[("a", "circuit/v", "circuit/qk")].p_adjusted == 2 * sps.binomtest(10, 10).pvalue  # Holm over two
    assert _ordering(gain, "c", "circuit/v", "circuit/qk") == ""


def test_dcm_encodes_only_where_both_paired_tests_survive_holm():
    """A group above its floor by 30 of 40 pairs but not above random heads (per-pair outcomes kept) is not shown
    to encode; one above both is."""
    from mechdiff.common.outcomes import bits
    from mechdiff.report.claims import encodes, encodes_family

    patched = [1] * 30 + [0] * 10
    floor = [0] * 40
    close_random = [bits([1] * 29 + [0] * 11)] * 3
    far_random = [bits([0] * 40)] * 3

    def row(group, random):
        est = {"value": 0.75, "low": 0.6, "high": 0.86, "n": 40}
        return {
            "group": group, "desideratum": "x", "selected": ["L1H0"], "test_accuracy": est,
            "floor": {"value": 0.0, "low": 0, "high": 0.09, "n": 40}, "random": {"value": 0.1, "n": 40},
            "test_outcomes": bits(patched), "floor_outcomes": bits(floor), "random_outcomes": random,
        }  # fmt: skip

    tests = encodes_family([row("near", close_random), row("far", far_random)])
    assert not encodes(tests, "near", "x") and encodes(tests, "far", "x")
    assert tests[("far", "x", "floor")].discordant == (30, 0)


def test_a_skipped_dcm_states_no_finding():
    """A task without a desideratum: the report says DCM was not run and why, never that it selected no head."""
    from mechdiff.studies.circuits.report.dcm import dcm_findings, dcm_section

    why = "the task declares no desideratum: capitals defines none"
    skipped = SimpleNamespace(result={"dcm": [], "semantic": [], "skipped": why})
    assert dcm_findings(skipped) == f"- DCM: not run ({why})."
    assert dcm_section(SimpleNamespace(spec=default_spec()), skipped) == f"DCM: not run ({why}).\n"
    ran = SimpleNamespace(result={"dcm": [], "semantic": []})
    assert "selected no head in any of 0" in dcm_findings(ran)  # a run that selected nothing is still reported


def test_the_circuit_against_random_draws_is_its_rank_among_them():
    """The rank is a direct count of draws at least as accurate on the same prompts, p = (1 + rank) / (1 + draws),
    adjusted by Holm over the circuits; a circuit matched by its best draw is not shown above them."""
    from mechdiff.report.claims import controls_family

    rows = [
        {"circuit": "a", "model": "a", "accuracy": 0.93, "n_prompts": 200, "random_draws": [0.04] * 99 + [0.93]},
        {"circuit": "b", "model": "b", "accuracy": 0.90, "n_prompts": 200, "random_draws": [0.5] * 99},
        {"circuit": "c", "model": "c", "accuracy": 0.90, "n_prompts": 200},
    ]  # fmt: skip
    tests = controls_family(rows)
    assert set(tests) == {("a", "a"), ("b", "b")}
    assert tests[("a", "a")].p == 2 / 101 and tests[("b", "b")].p == 1 / 100
    assert tests[("a", "a")].p_adjusted == tests[("b", "b")].p_adjusted == 2 / 100  # 2 x 1/100, then max(., 2/101)
    assert tests[("a", "a")].rejects and tests[("b", "b")].rejects
    few = controls_family([{**rows[0], "random_draws": [0.1] * 19 + [0.95]}])
    assert not few[("a", "a")].rejects  # 1 of 20 draws above: p = 2/21


def test_captions_name_the_metric_the_code_used(tmp_path):
    """On a logit_diff task the attribution caption names the logit difference it differentiates, pruning's caption
    the logit difference it decided on (never "prob metric"), and path patching the measure its scores are
    relative changes of; on a prob task, the answer's (log-)probability as before."""
    from mechdiff.studies.circuits.report.circuits import _method, pruning_section

    pruned = {
        "base": SimpleNamespace(
            result={
                "minimality": {"pairs": {"L0H1@last": {"searched": True}}, "circuit": 0.5, "full": 0.6},
                "circuit": {"model": "base", "task": "t", "groups": {"last": ["L0H1"]}, "positions": {"last": "last"}},
            }
        )
    }
    for metric, attributed, said in (
        ("logit_diff", "d LD / d z", "logit difference"),
        ("prob", "d log p(answer)", "answer probability"),
    ):
        for rule in ("greedy", "paper"):
            spec = _spec(scoring={"prune_rule": rule, "prune_metric": "prob"})
            study = SimpleNamespace(spec=spec, task=_task(metric), dir=tmp_path)
            caption = pruning_section(study, pruned).split("**")[1]
            assert f"the {said}" in caption and "prob metric" not in caption
        assert attributed in _method(study)
        spec.discovery.method = "path"
        assert f"the relative change of the {said}" in _method(study)
    spec.scoring.prune_metric = "accuracy"
    assert "on the accuracy over" in pruning_section(study, pruned)


def test_report_gives_accuracy_and_faithfulness_by_answer_length(tmp_path):
    """A task of answers of several lengths: the report's accuracy table per answer length (with the task's metric)
    and the circuit x model table per length (model's and circuit's accuracy, faithfulness), each counted from the
    stages' per-prompt outcomes; none for one-token answers."""
    import csv

    import numpy as np

    from mechdiff.common.outcomes import bits, outcome_record
    from mechdiff.studies.circuits.report.accuracy import _by_answer_length
    from mechdiff.studies.circuits.report.matrix import _matrix_by_answer_length
    from mechdiff.tasks.base import Example

    lengths = [1, 2, 3, 1, 2, 4, 1, 1]
    records = [
        Example("p", (1, 2), "a", 50 + n, answer_tokens=tuple(range(50 + n, 50 + 2 * n)) if n > 1 else ())
        for n in lengths
    ]
    full = np.array([1, 1, 1, 1, 0, 1, 1, 0])
    circ = np.array([1, 0, 1, 0, 0, 0, 1, 0])
    diff = np.linspace(-1, 2, 8)
    spec = _spec()
    study = SimpleNamespace(
        spec=spec,
        task=_task("logit_diff", answer_tokens=4),
        dir=tmp_path,
        eval_records=lambda: records,
        prompt_records=lambda prompts, n: records,
        set_items=lambda prompts: np.array([0, 0, 1, 2, 2, 3, 4, 4]),  # rows of one clean prompt share an item
    )
    accuracy = {"base": SimpleNamespace(result={"outcomes": {**outcome_record(full, diff * 0), "logit_diff": diff}})}
    kept = {"base": {"full": outcome_record(full), "circuit": outcome_record(circ)}}
    matrix = {"base": SimpleNamespace(result={"outcomes": kept})}
    assert "accuracy_by_answer_length" in _by_answer_length(study, accuracy)
    assert "circuit_x_model_by_answer_length" in _matrix_by_answer_length(study, matrix)
    read = lambda stem: list(csv.DictReader(open(tmp_path / "tables" / f"{stem}.csv")))  # noqa: E731
    bins = {"1": [0, 3, 6, 7], "2": [1, 4], "3+": [2, 5]}
    for row in read("accuracy_by_answer_length"):
        at = bins[row["answer_tokens"]]
        assert int(row["n"]) == len(at) and float(row["accuracy"]) == pytest.approx(full[at].mean())
        assert float(row["logit_diff"]) == pytest.approx(diff[at].mean())
    rows = read("circuit_x_model_by_answer_length")
    assert [r["answer_tokens"] for r in rows] == ["1", "2", "3+"]
    # intervals over items: the 1-token rows 0, 3, 6, 7 are items 0, 2, 4 (rows 6 and 7 one item)
    assert [int(r["items"]) for r in rows] == [3, 2, 2] == [int(r["items"]) for r in read("accuracy_by_answer_length")]
    for row in rows:
        at = bins[row["answer_tokens"]]
        assert float(row["model_accuracy"]) == pytest.approx(full[at].mean())
        assert float(row["accuracy"]) == pytest.approx(circ[at].mean())
        assert float(row["faithfulness"]) == pytest.approx(circ[at].mean() / full[at].mean())
    # by first token against the rest (#49 item 12), where the records keep the split: full = first & rest
    first, rest = np.array([1, 1, 1, 1, 0, 1, 1, 0]), np.array([1, 1, 1, 1, 1, 1, 1, 1])
    c_first, c_rest = np.array([1, 1, 1, 0, 0, 1, 1, 0]), np.array([1, 0, 1, 1, 1, 0, 1, 1])
    split = {"first": bits(first), "rest": bits(rest)}
    accuracy["base"].result["outcomes"].update(split)
    kept["base"]["full"].update(split)
    kept["base"]["circuit"].update(first=bits(c_first), rest=bits(c_rest))
    _by_answer_length(study, accuracy), _matrix_by_answer_length(study, matrix)
    for row in read("accuracy_by_answer_length"):
        at = bins[row["answer_tokens"]]
        assert float(row["first_token"]) == pytest.approx(first[at].mean())
        assert row["rest"] == "" if row["answer_tokens"] == "1" else float(row["rest"]) == pytest.approx(1.0)
    for row in read("circuit_x_model_by_answer_length"):
        at = bins[row["answer_tokens"]]
        assert float(row["faithfulness_first_token"]) == pytest.approx(c_first[at].mean() / first[at].mean())
        if row["answer_tokens"] != "1":
            assert float(row["accuracy_rest"]) == pytest.approx(c_rest[at].mean())
    study.task = _task("logit_diff", answer_tokens=1)
    assert _by_answer_length(study, accuracy) == "" == _matrix_by_answer_length(study, matrix)


def test_circuit_x_model_by_answer_length_splits_first_token_from_the_rest():
    """#49 item 12: the model's and the circuit's first-token and rest accuracy on a length slice, and their
    ratios (faithfulness of each part), are the direct means of the kept outcomes; a one-token slice has no rest;
    records without the split add no column."""
    import numpy as np

    from mechdiff.studies.circuits.report.matrix import _first_and_rest_columns

    rng = np.random.default_rng(4)
    full_first, full_rest, circ_first, circ_rest = (rng.random(60) < p for p in (0.9, 0.8, 0.6, 0.7))
    split = {"full": (full_first * 1.0, full_rest * 1.0), "circuit": (circ_first * 1.0, circ_rest * 1.0)}
    at = np.arange(60) % 3 == 0
    items = np.arange(60) // 2  # two rows an item
    cols = _first_and_rest_columns(split, at, items, one_token=False)
    assert cols["model_accuracy_first_token"] == full_first[at].mean()
    assert cols["accuracy_rest"] == circ_rest[at].mean()
    assert np.isclose(cols["faithfulness_first_token"], circ_first[at].mean() / full_first[at].mean())
    assert np.isclose(cols["faithfulness_rest"], circ_rest[at].mean() / full_rest[at].mean())
    assert cols["accuracy_rest_low"] <= cols["accuracy_rest"] <= cols["accuracy_rest_high"]
    assert not [k for k in _first_and_rest_columns(split, at, items, one_token=True) if "rest" in k]
    assert _first_and_rest_columns({"full": (None, None), "circuit": (None, None)}, at, items, False) == {}
