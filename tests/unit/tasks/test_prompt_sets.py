"""Prompt sets dealt from a task's rows: disjoint, of the sizes asked, every group in proportion."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechdiff.tasks.prompt_sets import PromptSetError, describe_sets, draw_sets


@st.composite
def strata_and_sizes(draw):
    group_sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    strata = [g for g, m in enumerate(group_sizes) for _ in range(m)]
    draw(st.randoms()).shuffle(strata)
    n_sets = draw(st.integers(1, 5))
    budget = draw(st.integers(n_sets, len(strata))) if len(strata) >= n_sets else len(strata)
    cuts = sorted(draw(st.lists(st.integers(0, budget), min_size=n_sets - 1, max_size=n_sets - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, budget])]
    return strata, {f"set{i}": n for i, n in enumerate(sizes)}, draw(st.integers(0, 10**6))


@settings(max_examples=500, deadline=None, derandomize=True)  # the same cases on every machine
@given(strata_and_sizes())
def test_sets_are_disjoint_of_their_sizes_and_stratified(case):
    """Each set has exactly its rows, no row is in two sets, and each group's count in a set is within
    two of its proportional share (set size x group size / rows), counted directly from the lists."""
    strata, sizes, seed = case
    sets = draw_sets(strata, sizes, seed)
    assert {k: len(v) for k, v in sets.items()} == sizes
    drawn = [r for rows in sets.values() for r in rows]
    assert len(drawn) == len(set(drawn)) and all(0 <= r < len(strata) for r in drawn)
    total, n = Counter(strata), len(strata)
    for rows in sets.values():
        got = Counter(strata[r] for r in rows)
        for g, m in total.items():
            assert abs(got[g] - len(rows) * m / n) <= 2, (g, got[g], len(rows) * m / n)
    assert describe_sets(sets, strata)["shared_rows"] == 0


def test_the_first_set_holds_every_group_and_a_seed_fixes_the_draw():
    """A first set (the reference) at least as long as the number of groups holds each group, even a group of one
    row among hundreds; the same seed deals the same rows, another seed other rows."""
    strata = ["big"] * 300 + ["small"] + ["mid"] * 20
    sizes = {"reference": 3, "eval": 100, "matrix": 100}
    for seed in range(20):
        sets = draw_sets(strata, sizes, seed)
        assert {strata[r] for r in sets["reference"]} == {"big", "small", "mid"}
    assert draw_sets(strata, sizes, 1) == draw_sets(strata, sizes, 1)
    assert draw_sets(strata, sizes, 1)["eval"] != draw_sets(strata, sizes, 2)["eval"]


def test_a_study_needing_more_rows_than_the_task_holds_is_refused_with_each_sets_need():
    with pytest.raises(PromptSetError, match=r"need 11 rows \(eval 6, matrix 5\), and the task holds 10"):
        draw_sets(["a"] * 10, {"eval": 6, "matrix": 5}, 0)


def test_describe_counts_rows_two_sets_share():
    """The report's disjointness comes from the lists: overlapping lists are counted, not assumed away."""
    strata = ["a", "b", "a", "b", "a"]
    d = describe_sets({"eval": [0, 1, 2], "matrix": [2, 3], "cmap": [0, 4]}, strata)
    assert d["shared_rows"] == 2 and d["sizes"] == {"eval": 3, "matrix": 2, "cmap": 2}
    assert d["groups"] == {"eval": 2, "matrix": 2, "cmap": 1} and d["n_groups"] == 2
