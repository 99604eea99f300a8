"""Differences between models on the same prompts: paired intervals, recomputed independently."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mechdiff.common.inference import proportion
from mechdiff.common.outcomes import outcome_record
from mechdiff.common.stats import paired_difference, paired_ratio_difference
from mechdiff.report.paired import difference_sentence, outcome_stages, paired_rows


def _rec(result: dict) -> SimpleNamespace:
    return SimpleNamespace(result=result)


def test_a_paired_interval_resolves_what_two_separate_intervals_do_not():
    """The fine-tune gets 10 more of 200 prompts right and none wrong that the base got right: the two exact
    binomial intervals overlap, the paired interval lies above 0 (what pairing is for)."""
    base = np.zeros(200)
    base[:100] = 1
    ft = base.copy()
    ft[100:110] = 1
    a, b = proportion(ft), proportion(base)
    assert a.low < b.high  # separate intervals: no difference read
    d = paired_difference(ft, base)
    assert d.value == 0.05 and d.low > 0


def test_paired_ratio_difference_is_the_difference_of_ratios_resampled_together():
    rng = np.random.default_rng(1)
    full = (rng.random(300) < 0.8).astype(float)
    circ_b = full * (rng.random(300) < 0.7)
    circ_f = full * (rng.random(300) < 0.9)
    est = paired_ratio_difference(circ_f, full, circ_b, full, n_resamples=2000, seed=3)
    assert np.isclose(est.value, circ_f.mean() / full.mean() - circ_b.mean() / full.mean())
    # the same draws by hand (the independent computation)
    idx = np.random.default_rng(3).integers(0, 300, size=(2000, 300))
    by_hand = circ_f[idx].mean(1) / full[idx].mean(1) - circ_b[idx].mean(1) / full[idx].mean(1)
    assert np.allclose([est.low, est.high], np.quantile(by_hand, [0.025, 0.975]))
    same = paired_ratio_difference(circ_b, full, circ_b, full)
    assert same.value == same.low == same.high == 0.0


def test_rows_from_stage_records_pair_the_same_prompts():
    """Accuracy, a circuit's accuracy and faithfulness in both models, and DCM heads patched in each: each row's
    difference equals the mean of per-prompt differences (or the difference of ratios) of what was recorded."""
    rng = np.random.default_rng(2)
    n = 120
    cb, cf = rng.random(n) < 0.5, rng.random(n) < 0.7
    pb, pf = rng.random(n), rng.random(n)
    lb, lf = rng.normal(5, 1, n), rng.normal(3, 1, n)
    accuracy = {
        "base": _rec({"outcomes": {**outcome_record(cb, pb), "logit_diff": list(lb)}}),
        "ft": _rec({"outcomes": {**outcome_record(cf, pf), "logit_diff": list(lf)}}),
    }
    full_b, full_f, circ_b, circ_f = (rng.random(n) < p for p in (0.8, 0.9, 0.6, 0.5))
    matrix = {
        "base": _rec({"outcomes": {"base": {"full": outcome_record(full_b), "circuit": outcome_record(circ_b)}}}),
        "ft": _rec({"outcomes": {"base": {"full": outcome_record(full_f), "circuit": outcome_record(circ_f)}}}),
    }
    sem_b, sem_f = rng.random(40) < 0.3, rng.random(40) < 0.6
    dcm = _rec(
        {
            "semantic": [
                {"group": "last", "desideratum": "object", "model": m, "outcomes": outcome_record(o)}
                for m, o in (("base", sem_b), ("ft", sem_f))
            ]
        }
    )
    rows = {r["measure"]: r for r in paired_rows(outcome_stages(accuracy, matrix, dcm), "base", ["ft"])}
    assert np.isclose(rows["accuracy"]["difference"], cf.mean() - cb.mean())
    assert np.isclose(rows["answer probability"]["difference"], np.mean(pf - pb), atol=1e-5)
    assert (
        np.isclose(rows["logit difference"]["difference"], np.mean(lf - lb))
        and rows["logit difference"]["n_prompts"] == n
    )
    assert np.isclose(rows["circuit of base: accuracy"]["difference"], circ_f.mean() - circ_b.mean())
    faith = circ_f.mean() / full_f.mean() - circ_b.mean() / full_b.mean()
    assert np.isclose(rows["circuit of base: faithfulness"]["difference"], faith)
    sem = rows["DCM heads of last/object patched: target accuracy"]
    assert np.isclose(sem["difference"], sem_f.mean() - sem_b.mean()) and sem["n_prompts"] == 40
    assert all(r["comparison"] == "ft - base" for r in rows.values())


def test_a_sentence_states_a_difference_only_where_its_adjusted_test_rejects():
    row = {"measure": "accuracy", "difference": 0.05, "difference_low": 0.02, "difference_high": 0.08}
    row.update(n_prompts=9, n_items=9, p=0.01, p_holm=0.03, shown=True)
    assert "higher in the fine-tune (Holm p = 0.03" in difference_sentence(row)
    row.update(p_holm=0.2, shown=False, same_within_margin=False, margin=0.05, p_tost=0.4)
    assert "not shown after Holm's adjustment in its family (p = 0.01, Holm p = 0.2" in difference_sentence(row)
    row.update(difference_low=-0.01, p=0.3, p_holm=0.6)
    assert "not shown to differ nor the same within +-0.05; the interval allows up to 0.080" in difference_sentence(row)
    row.update(same_within_margin=True, p_tost=0.01)
    assert "the same within +-0.05 (equivalence Holm p = 0.01" in difference_sentence(row)
    row.update(difference=-0.05, difference_low=-0.08, difference_high=-0.02, shown=True, p_holm=0.001)
    assert "lower in the fine-tune" in difference_sentence(row)


def test_rows_carry_the_exact_test_and_holm_within_the_family():
    """0/1 outcomes one prompt an item: each row's p is the exact binomial test on its discordant prompts, its
    Holm p the step-down over the family's tests, computed by hand; a 0-vs-4 difference is not shown (and is
    the same within 0.05 by its exact equivalence test)."""
    from scipy import stats as sps

    n = 200
    cb = np.zeros(n)
    cb[:100] = 1
    cf = cb.copy()
    cf[100:130] = 1  # 30 vs 0 discordant
    sem_b, sem_f = np.zeros(n), np.zeros(n)
    sem_b[:4] = 1  # 0 vs 4 discordant
    accuracy = {"base": _rec({"outcomes": outcome_record(cb)}), "ft": _rec({"outcomes": outcome_record(cf)})}
    dcm = _rec(
        {
            "semantic": [
                {"group": "last", "desideratum": "o", "model": m, "outcomes": outcome_record(o)}
                for m, o in (("base", sem_b), ("ft", sem_f))
            ]
        }
    )
    rows = {r["measure"]: r for r in paired_rows(outcome_stages(accuracy, {}, dcm), "base", ["ft"])}
    acc, sem = rows["accuracy"], rows["DCM heads of last/o patched: target accuracy"]
    p_acc, p_sem = sps.binomtest(30, 30).pvalue, sps.binomtest(0, 4).pvalue
    assert acc["p"] == p_acc and sem["p"] == p_sem == 0.125 and sem["discordant"] == "0 vs 4"
    assert acc["p_holm"] == 2 * p_acc and sem["p_holm"] == p_sem  # two tests: 2 p_(1), then max(., p_(2))
    assert acc["shown"] and not sem["shown"] and sem["difference_low"] < 0 <= sem["difference_high"]
    assert sem["same_within_margin"] and "the same within +-0.05" in difference_sentence(sem)  # 90% exact interval


def test_records_without_outcomes_give_no_rows():
    """Stage records made before outcomes were kept: no comparison is invented."""
    accuracy = {"base": _rec({"accuracy": {}}), "ft": _rec({"accuracy": {}})}
    assert outcome_stages(accuracy, {}, None) == {} and paired_rows({}, "base", ["ft"]) == []


def test_the_encodes_bound_is_the_largest_p_over_every_pairing_the_counts_allow():
    """DCM's floor kept as a count: the bound is the exact McNemar p maximised over every joint table with those
    margins, by brute force."""
    from scipy import stats as sps

    from mechdiff.report.families import worst_pairing

    for k, f, n in ((12, 3, 20), (5, 5, 20), (2, 9, 20), (20, 0, 20)):
        brute = 0.0
        for c in range(0, min(f, n - k) + 1):  # floor right, patched wrong
            b = c + k - f  # patched right, floor wrong
            if b < 0 or b + c > n:
                continue
            brute = max(brute, 1.0 if b + c == 0 else sps.binomtest(b, b + c).pvalue)
        test = worst_pairing(k, f, n, "x")
        assert test.p == pytest.approx(brute) and test.interval.value == pytest.approx((k - f) / n)


def test_a_circuit_is_also_compared_on_the_prompts_both_models_answer():
    """Faithfulness divides by each model's own accuracy; the circuit's accuracy on the prompts both full models
    answer compares like with like (issue #49, item 7)."""
    rng = np.random.default_rng(5)
    n = 150
    full_b, full_f, circ_b, circ_f = (rng.random(n) < p for p in (0.9, 0.7, 0.6, 0.5))
    matrix = {
        "base": _rec({"outcomes": {"base": {"full": outcome_record(full_b), "circuit": outcome_record(circ_b)}}}),
        "ft": _rec({"outcomes": {"base": {"full": outcome_record(full_f), "circuit": outcome_record(circ_f)}}}),
    }
    rows = {r["measure"]: r for r in paired_rows(outcome_stages({}, matrix, None), "base", ["ft"])}
    both = full_b & full_f
    row = rows["circuit of base: accuracy on the prompts both models answer"]
    assert np.isclose(row["difference"], circ_f[both].mean() - circ_b[both].mean()) and row["n_prompts"] == both.sum()


def test_breakdown_by_template_and_answer_length_against_direct_means():
    from mechdiff.report.families import breakdown_rows
    from mechdiff.tasks.prompt_sets import set_items

    rows = []
    for i in range(40):
        tokens = [1] * (1 + i % 4)
        rows.append({"base": {"prompt": f"p{i // 2}", "template": "ab"[i % 2], "answer": f" a{i % 5}",
                              "answer_id": 1, "answer_tokens": tokens}})  # fmt: skip
    correct = np.array([i % 3 != 0 for i in range(40)], dtype=float)
    ld = np.where(np.arange(40) < 20, 1.0, -1.0)
    stages = {"accuracy": {"m": {**outcome_record(correct), "logit_diff": list(ld)}}}
    items = set_items({"rows": {"eval": list(range(40))}}, "eval", rows)  # no item ids kept: the clean prompts
    out = breakdown_rows(stages, rows, list(range(40)), ["m"], items)
    by = {(r["slice"], r["measure"]): r for r in out}
    a = np.array([i % 2 == 0 for i in range(40)])
    assert by[("template a", "top-1")]["accuracy"] == correct[a].mean()
    assert by[("template a", "top-1")]["chance"] == 1 / 5  # every even i: a0 a2 a4 a1 a3
    three = np.array([1 + i % 4 >= 3 for i in range(40)])
    assert by[("answer of 3+ tokens", "two-way")]["accuracy"] == (ld[three] > 0).mean()
    assert by[("answer of 3+ tokens", "two-way")]["chance"] == 0.5
    assert by[("template b", "two-way")]["near_chance"] == (by[("template b", "two-way")]["low"] <= 0.5)
    assert by[("template a", "top-1")]["items"] == 20  # one item per pair of rows, half of them in a template


def test_breakdown_splits_answers_of_several_tokens_by_first_token_against_the_rest():
    """#49 item 12: on each slice of answers of several tokens, the first token's and the rest's accuracy, each
    the direct mean of the kept 0/1 outcomes with its interval over items, the first token read against one over
    the slice's distinct first tokens, the rest against none; a one-token slice gets no split, and records made
    before the split was kept get none either (and the page says why)."""
    from mechdiff.common.outcomes import bits
    from mechdiff.report.families import FIRST, REST, _breakdown_lines, breakdown_rows

    rows = []
    for i in range(30):
        tokens = [10 + i % 3] + [1] * (i % 3)  # 1, 2 and 3 tokens; first tokens 10, 11, 12
        rows.append({"base": {"prompt": f"p{i // 3}", "template": "a", "answer": f" a{i % 3}",
                              "answer_id": tokens[0], "answer_tokens": tokens}})  # fmt: skip
    first = np.array([i % 4 != 0 for i in range(30)])
    rest = np.array([i % 3 == 0 or i % 5 != 0 for i in range(30)])
    correct = first & rest
    stages = {"accuracy": {"m": {**outcome_record(correct), "first": bits(first), "rest": bits(rest)}}}
    items = [r["base"]["prompt"] for r in rows]
    by = {(r["slice"], r["measure"]): r for r in breakdown_rows(stages, rows, list(range(30)), ["m"], items)}
    for length, slice_name in ((2, "answer of 2 tokens"), (3, "answer of 3+ tokens")):
        at = np.array([1 + i % 3 == length for i in range(30)])
        assert by[(slice_name, FIRST)]["accuracy"] == pytest.approx(first[at].mean())
        assert by[(slice_name, REST)]["accuracy"] == pytest.approx(rest[at].mean())
        assert by[(slice_name, "top-1")]["accuracy"] == pytest.approx(correct[at].mean())
        assert by[(slice_name, FIRST)]["chance"] == 1.0 and by[(slice_name, REST)]["chance"] is None
        assert by[(slice_name, FIRST)]["items"] == 10  # every item holds one row of each length
        assert by[(slice_name, FIRST)]["low"] <= first[at].mean() <= by[(slice_name, FIRST)]["high"]
    assert ("answer of 1 token", FIRST) not in by and ("template a", REST) not in by
    assert "By first token against the rest (answers of several tokens): m answer of 2 tokens first token" in "\n".join(
        _breakdown_lines(list(by.values()))
    )
    older = breakdown_rows({"accuracy": {"m": outcome_record(correct)}}, rows, list(range(30)), ["m"], items)
    assert not [r for r in older if r["measure"] in (FIRST, REST)]
    assert "By first token against the rest: not in these outcomes" in "\n".join(_breakdown_lines(older))
