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


# --------------------------------------------------------------------------------------
# Items: sets disjoint by item, whole items until a set's rows; nested sets; generated tasks
# --------------------------------------------------------------------------------------


@st.composite
def items_and_sizes(draw):
    """Rows in items of 1 to 12 rows (as the capitals rows: one clean prompt, several counterfactuals), each item
    of one stratum, rows shuffled; sizes in rows adding up to at most the items (each set needs at most one item a
    row, so whole items always meet them)."""
    n_items = draw(st.integers(1, 30))
    item_rows = [draw(st.integers(1, 12)) for _ in range(n_items)]
    item_group = [draw(st.integers(0, 3)) for _ in range(n_items)]
    rows = [(i, item_group[i]) for i, m in enumerate(item_rows) for _ in range(m)]
    draw(st.randoms()).shuffle(rows)
    items, strata = [f"prompt {i}" for i, _ in rows], [g for _, g in rows]
    n_sets = draw(st.integers(1, min(4, n_items)))
    sizes = {f"set{k}": draw(st.integers(1, n_items // n_sets)) for k in range(n_sets)}
    return strata, items, sizes, draw(st.integers(0, 10**6))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(items_and_sizes())
def test_sets_of_rows_repeated_within_items_share_no_item(case):
    """Each set has exactly its rows, no item is in two sets, and a set holds every row of each of its items but
    at most one (the last, cut at the set's size; its other rows in no set), counted directly from the lists."""
    strata, items, sizes, seed = case
    sets = draw_sets(strata, sizes, seed, items)
    assert {k: len(v) for k, v in sets.items()} == sizes
    held = {name: {items[r] for r in rows} for name, rows in sets.items()}
    names = list(sets)
    assert all(not held[a] & held[b] for i, a in enumerate(names) for b in names[i + 1 :])
    drawn = {r for rows in sets.values() for r in rows}
    for name, rows in sets.items():
        cut = [item for item in held[name] if sum(x == item for x in items) != sum(items[r] == item for r in rows)]
        assert len(cut) <= 1, (name, cut)
        assert all(r not in drawn for r, x in enumerate(items) if x in cut and r not in rows)
    d = describe_sets(sets, strata, items)
    assert d["shared_items"] == 0 and d["items"] == {k: len(v) for k, v in held.items()}
    assert d["n_items"] == len(set(items))
    # stratified by whole items: each group's rows in a set within two items' rows (and 2) of its share
    total, n, widest = Counter(strata), len(strata), max(Counter(items).values())
    for rows in sets.values():
        got = Counter(strata[r] for r in rows)
        for g, m in total.items():
            assert abs(got[g] - len(rows) * m / n) <= 2 * widest + 2, (g, got[g], len(rows) * m / n, widest)


def test_rows_repeated_within_items_that_row_draws_would_split():
    """The capitals case: every clean prompt paired with several counterfactuals. Drawn by row (each row its own
    item, as before items), the sets share clean prompts; drawn by item they share none."""
    items = [f"prompt {i // 6}" for i in range(120)]  # 20 clean prompts, 6 rows each
    strata = [i // 6 % 2 for i in range(120)]
    sizes = {"reference": 24, "eval": 24, "matrix": 24}
    by_row = draw_sets(strata, sizes, 0)
    assert describe_sets(by_row, strata, items)["shared_items"] > 0
    by_item = draw_sets(strata, sizes, 0, items)
    assert describe_sets(by_item, strata, items)["shared_items"] == 0
    assert all(len({items[r] for r in rows}) == 4 for rows in by_item.values())  # 24 rows: 4 whole items


def test_a_study_needing_more_items_than_the_task_holds_is_refused_with_each_sets_need():
    """10 items of 3 rows: four sets of 7 rows need 3 items each (9 rows, cut to 7), 12 in all; the fourth gets the
    last item and needs 2 more (its 4 missing rows at 3 rows an item)."""
    items = [i // 3 for i in range(30)]
    with pytest.raises(
        PromptSetError,
        match=r"need about 12 items \(a: 7 rows in 3 items; b: 7 rows in 3 items; c: 7 rows in 3 items; "
        r"d: 7 rows in 3 items \(2 beyond the task's\); at the task's 3\.0 rows an item\), and the task holds 10 "
        r"items in 30 rows.*lower the sets' n",
    ):
        draw_sets(["g"] * 30, {"a": 7, "b": 7, "c": 7, "d": 7}, 0, items)


def test_nested_sets_are_prefixes_of_one_draw_and_share_no_item_with_the_others():
    items = [i // 2 for i in range(200)]
    strata = [i % 3 for i in range(200)]
    sizes = {"reference": 20, "eval": 40, "discovery": 30, "matrix": 40, "prune": 10, "cmap": 20}
    nested = ["eval", "discovery", "matrix", "prune"]
    sets = draw_sets(strata, sizes, 5, items, nested)
    assert {k: len(v) for k, v in sets.items()} == sizes
    assert sets["discovery"] == sets["eval"][:30] and sets["prune"] == sets["eval"][:10] == sets["matrix"][:10]
    assert sets["matrix"] == sets["eval"]
    inner = {items[r] for r in sets["eval"]}
    assert not inner & {items[r] for r in sets["reference"] + sets["cmap"]}
    d = describe_sets(sets, strata, items, nested=nested)
    assert d["shared_items"] == 0 and describe_sets(sets, strata, items)["shared_items"] > 0


def test_items_of_numbers_items_by_first_row():
    from mechdiff.tasks.prompt_sets import items_of, set_items

    class Rec:
        def __init__(self, ids):
            self.input_ids = ids

    records = [Rec((1, 2)), Rec((3,)), Rec((1, 2)), Rec((4,)), Rec((3,))]
    assert items_of(records).tolist() == [0, 1, 0, 2, 1]
    assert items_of(records, ["a", "b", "b", "a", "c"]).tolist() == [0, 1, 1, 0, 2]
    assert set_items({"item_ids": {"eval": [3, 3, 4]}}, "eval").tolist() == [3, 3, 4]
    with pytest.raises(KeyError, match="no item ids for prompt set 'cmap'"):
        set_items({"item_ids": {"eval": [0]}}, "cmap")


def test_set_items_reads_recorded_ids_first_then_an_older_record_s_clean_prompts():
    from mechdiff.tasks.prompt_sets import set_items

    rows = [{"base": {"prompt": p}} for p in ("x", "y", "x", "z")]
    old = {"rows": {"eval": [2, 0, 3]}}  # a run.json from before item ids: the listed rows' clean prompts
    assert set_items(old, "eval", rows).tolist() == ["x", "x", "z"]
    assert set_items({**old, "item_ids": {"eval": [5, 5, 6]}}, "eval", rows).tolist() == [5, 5, 6]
    with pytest.raises(KeyError, match="no item ids for prompt set 'eval'"):
        set_items(old, "eval")  # no task rows to read the prompts from


def _repeating_task(pool: int):
    """A generated task whose prompts are two tokens, each of ``pool`` values: prompts repeat across seeds."""
    import random

    from mechdiff.tasks.base import Example, Task

    def examples(tokenizer, n, seed=0):
        rng = random.Random(seed)
        return [Example("p", (rng.randrange(pool), rng.randrange(pool)), " a", 7) for _ in range(n)]

    return Task("repeats", "prompts that repeat", examples)


def test_a_generators_sets_share_no_item_and_keep_their_prompts_where_none_repeats():
    """Sets drawn past the items of earlier sets share none (raw draws of the same seeds do share some); where the
    pool is large enough that no prompt repeats, every set's prompts are the generator's own (keys unchanged)."""
    from mechdiff.tasks.prompt_sets import GeneratedSets, clean_key

    blocks = {"reference": (60, 3), "eval": (60, 1), "matrix": (40, 2)}
    task = _repeating_task(12)  # 144 prompts
    raw = {n: {clean_key(r) for r in task.examples(None, k, seed)} for n, (k, seed) in blocks.items()}
    assert raw["eval"] & raw["reference"] and raw["matrix"] & (raw["eval"] | raw["reference"])
    sets = GeneratedSets(task, blocks)
    drawn = sets.task()
    got = {n: drawn.records(None, k, seed, prompt_set=n) for n, (k, seed) in blocks.items()}
    keys = {n: {clean_key(r) for r in v} for n, v in got.items()}
    assert {n: len(v) for n, v in got.items()} == {n: k for n, (k, _) in blocks.items()}
    assert not keys["eval"] & keys["reference"] and not keys["matrix"] & (keys["eval"] | keys["reference"])
    assert sets.left_out(None)["eval"] == sum(clean_key(r) in raw["reference"] for r in task.examples(None, 60, 1))
    big = _repeating_task(10**6)
    wide = GeneratedSets(big, blocks)
    for n, (k, seed) in blocks.items():
        assert wide.task().records(None, k, seed, prompt_set=n) == big.examples(None, k, seed)
    assert wide.left_out(None) == {}


def test_ioi_sets_share_no_clean_prompt(smollm2_tokenizer):
    """IOI's generator repeats a few prompts across seeds (names, places and objects of small lists): the committed
    IOI study's set sizes drawn raw share clean prompts; drawn as the study draws them, none."""
    from mechdiff.runs.seeds import prompt_seed
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.prompt_sets import GeneratedSets, clean_key

    sizes = {"reference": 400, "eval": 400, "positions": 80, "ranking": 80, "curve": 100, "matrix": 200, "dcm": 132}
    blocks = {n: (k, prompt_seed(0, n)) for n, k in sizes.items()}
    ioi = get_task("ioi")
    raw = [{clean_key(r) for r in ioi.examples(smollm2_tokenizer, k, s)} for k, s in blocks.values()]
    assert sum(len(a & b) for i, a in enumerate(raw) for b in raw[i + 1 :]) > 0
    task = GeneratedSets(ioi, blocks).task()
    pairs = task.discovery_pairs(smollm2_tokenizer, 80, blocks["ranking"][1], prompt_set="ranking")
    drawn = {
        n: [clean_key(r) for r in task.records(smollm2_tokenizer, k, s, prompt_set=n)] for n, (k, s) in blocks.items()
    }
    assert [clean_key(p) for p in pairs] == drawn["ranking"]  # pairs draw the clean prompts examples draw
    sets = [set(v) for v in drawn.values()]
    assert sum(len(a & b) for i, a in enumerate(sets) for b in sets[i + 1 :]) == 0


def test_import_with_an_item_field_never_splits_an_item(smollm2_tokenizer, tmp_path, capsys):
    """`--item country`: every row of one country is one item (rows of four templates); the import prints rows
    and items; a row without the field is refused with its line; the drawn sets never split a country."""
    import json

    from conftest import capitals_rows, write_rows

    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.jsonl import ImportErrors, import_pairs

    rows = capitals_rows(48)  # 12 countries x 4 templates
    for r in rows:
        r["country"] = r["clean"].split("of ")[-1].split(" ")[0].rstrip("?")
    path = write_rows(tmp_path / "rows.jsonl", rows)
    out = import_pairs(path, smollm2_tokenizer, tmp_path / "task", item="country")
    meta = json.loads((out / "task.json").read_text())
    assert meta["item"] == "country"
    task = get_task(str(out))
    assert len(set(task.items)) == 12 and len(set(get_task(str(out)).sources)) == 48
    _, sets = task.draw_prompt_sets({"reference": 8, "eval": 12, "matrix": 12}, 0)
    countries = {n: {rows[r]["country"] for r in v} for n, v in sets.items()}
    assert not countries["reference"] & countries["eval"] and not countries["eval"] & countries["matrix"]
    bad = write_rows(tmp_path / "bad.jsonl", [*rows[:3], {k: v for k, v in rows[3].items() if k != "country"}])
    with pytest.raises(ImportErrors, match=r"--item country: .* lines 4 give none"):
        import_pairs(bad, smollm2_tokenizer, tmp_path / "bad", item="country")
