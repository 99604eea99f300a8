"""--plan's detectable differences: each set's rows and items beside the difference a test on its items detects."""

from __future__ import annotations

import numpy as np
from scipy import stats as sps

from mechdiff.common.inference import detectable_difference
from mechdiff.studies.base import detectable_text


def test_each_set_gets_the_normal_approximation_of_its_detectable_difference():
    text = detectable_text({"eval": 300, "prune": 16, "none": 0})
    z = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    assert "computed on each set's items" in text.splitlines()[0]
    assert (
        f"eval         300 rows   300 items: paired {z * np.sqrt(0.2 / 300):.3f}, "
        f"one proportion {z * 0.5 / np.sqrt(300):.3f}" in text
    )  # a set the items do not name: one row an item
    assert "prune" in text and "none" not in text  # a set of no rows is left out


def test_a_set_of_few_items_is_marked_beyond_what_a_difference_can_be():
    """Two items: the normal approximation asks for a paired difference above the discordance and a proportion
    more than 0.5 from 0.5, which no difference can be; the line says so."""
    text = detectable_text({"prune": 16}, {"prune": 2})
    assert f"paired {detectable_difference(2):.3f}*" in text and "one proportion" in text
    assert "* beyond what a difference can be" in text
    assert "*" not in detectable_text({"eval": 300})


def _study(task_dir: str, tokenizer):
    """A circuits study of the imported task ``task_dir`` with 24 accuracy rows and one row in each other set (no
    models: the sets are drawn before any weights load)."""
    from mechdiff.studies.circuits.spec import study_spec
    from mechdiff.studies.circuits.study import CircuitsStudy

    spec = study_spec(None, task_dir)
    spec.eval.n, spec.positions.n, spec.scoring.prune, spec.models.finetunes = 24, 0, False, []
    spec.scoring.reference_n = spec.discovery.n = spec.discovery.curve_n = spec.scoring.n = 1
    spec.dcm.n_train = spec.dcm.n_val = spec.dcm.n_test = 1
    study = CircuitsStudy.__new__(CircuitsStudy)
    study.spec, study.tokenizer = spec, tokenizer
    return study


def test_plan_computes_each_sets_detectable_difference_on_its_items(smollm2_tokenizer, tmp_path):
    """The same 48 rows imported twice: each clean prompt its own item, and the four templates of a country one
    item. The accuracy set takes 24 rows either way, but in 6 items where a country is the item; the plan prints
    rows and items and the detectable difference of as many items (larger than the 24 distinct items'), each
    checked against ``detectable_difference`` of the items counted from the drawn rows themselves."""
    from conftest import capitals_rows, write_rows

    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.jsonl import import_pairs

    rows = capitals_rows(48)
    distinct = import_pairs(write_rows(tmp_path / "d.jsonl", rows), smollm2_tokenizer, tmp_path / "distinct")
    for r in rows:
        r["country"] = r["answer"]  # one capital a country: its four templates' prompts form one item
    path = write_rows(tmp_path / "c.jsonl", rows)
    repeated = import_pairs(path, smollm2_tokenizer, tmp_path / "repeated", item="country")
    lines = {}
    for name, task_dir in (("distinct", distinct), ("repeated", repeated)):
        study = _study(str(task_dir), smollm2_tokenizer)
        eval_rows = study.prompt_sets["eval"]
        task_items = get_task(str(task_dir)).items
        k = len({task_items[r] for r in eval_rows})
        assert len(eval_rows) == 24 and study.prompt_set_items()["eval"] == k
        text = detectable_text(study.prompt_set_sizes(), study.prompt_set_items())
        lines[name] = next(line for line in text.splitlines() if line.strip().startswith("eval"))
        assert f"24 rows {k:5d} items: paired {detectable_difference(k):.3f}" in lines[name], lines[name]
        assert f"one proportion {detectable_difference(k, 'proportion'):.3f}" in lines[name]
    assert "24 rows    24 items" in lines["distinct"] and "24 rows     6 items" in lines["repeated"]
    assert detectable_difference(6) > detectable_difference(24)
