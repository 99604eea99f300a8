"""`md.compare` is ``mechdiff compare`` from Python: on the same inputs it writes the command's tables byte for
byte, and its estimates are those tables' cells, the full model's accuracy checked against a plain forward pass and
its exact binomial interval."""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import beta

import mechdiff as md
from mechdiff.circuits.circuit import CircuitFileError
from mechdiff.common.components import Head
from mechdiff.runs.seeds import prompt_seed
from mechdiff.tasks.entity_tracking import batch_tensors

N, N_BOXES = 6, 3
FLAGS = ["--n", str(N), "--n-boxes", str(N_BOXES), "--batch-size", str(N), "--no-progress"]
KEYWORDS = {"batch_size": N, "options": {"n_boxes": N_BOXES}, "progress": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_pair_dirs):
    """The two tiny checkpoints (`tiny_pair_dirs`), and two entity-tracking circuits' files."""
    root, dirs = tmp_path_factory.mktemp("compare"), tiny_pair_dirs
    groups = {"A": [Head(2, 0), Head(1, 1)], "C": [Head(0, 3)]}
    first = md.Circuit("tiny-0", "entity-tracking", groups, {"A": "last", "C": "query_label"})
    second = md.Circuit("tiny-1", "entity-tracking", {"A": [Head(2, 0), Head(2, 3)]}, {"A": "last"})
    return dirs, first.save(root / "first.json"), second.save(root / "second.json"), root


@pytest.fixture(scope="module")
def compared(tiny, tmp_path_factory):
    """The command and md.compare on the same models, circuits and prompts, one random circuit a cell."""
    from mechdiff.cli import main

    dirs, first, second, _ = tiny
    out = tmp_path_factory.mktemp("compared")
    args = ["compare", "--models", ",".join(dirs), "--circuits", f"{first},{second}", "--n-random", "1"]
    assert main([*args, "--out", str(out / "cli"), *FLAGS]) == 0
    result = md.compare(dirs, [first, second], "entity-tracking", N, out=out / "api", n_random=1, **KEYWORDS)
    return out, result


def test_compare_writes_the_commands_tables_for_the_same_inputs(compared):
    out, result = compared
    for stem in ("matrix", "overlap"):
        for ext in ("md", "csv", "tex", "json"):
            assert (out / "api" / f"{stem}.{ext}").read_bytes() == (out / "cli" / f"{stem}.{ext}").read_bytes()
    cli, api = (json.loads((out / d / "compare.json").read_text()) for d in ("cli", "api"))
    for key in ("matrix", "overlap", "fingerprints"):
        assert api[key] == cli[key]
    assert (out / "api" / "membership.png").is_file()
    assert api["settings"]["via"] == "md.compare" and api["settings"]["options"] == {"n_boxes": N_BOXES}
    assert result.rows == cli["matrix"] and result.overlap == cli["overlap"]
    assert md.Comparison.load(out / "cli").rows == result.rows  # the command's directory reads back the same


def test_the_frame_and_estimates_are_the_written_tables_cells(compared, tiny):
    dirs, *_ = tiny
    _, result = compared
    frame = result.to_frame()
    table = json.loads((result.out / "matrix.json").read_text())
    assert list(frame.columns) == list(table[0]) and len(frame) == 4
    assert result.circuits == ["first", "second"] and result.models == dirs
    every = result.to_frame(every=True)
    assert list(every["faithfulness_prob"]) == [r["faithfulness_prob"] for r in result.rows]
    assert "random_draws" not in every.columns  # a list a cell: in rows, not in the frame
    for row in json.loads((result.out / "compare.json").read_text())["matrix"]:  # every figure, not only those shown
        for figure in ("faithfulness_prob", "answer_prob", "accuracy", "random_accuracy"):
            e = result.estimate(row["model"], row["circuit"], figure)
            assert (e.value, e.low, e.high) == (row[figure], row[f"{figure}_low"], row[f"{figure}_high"])
            assert e.rows == e.items == N
        assert 0 < row["answer_prob_low"] < row["answer_prob"] < row["answer_prob_high"]  # not a degenerate cell
    assert set(result.overlap_frame()["group"]) == {"A", "all"}  # the groups both circuits have, and all
    assert "| first" in str(result) and "jaccard" in str(result)
    with pytest.raises(ValueError, match="give circuit=, one of first, second"):
        result.estimate(dirs[0])
    with pytest.raises(KeyError, match="no figure 'faith'"):
        result.estimate(dirs[0], "first", "faith")


def test_full_model_figures_are_a_plain_forwards(compared, tiny, smollm2_tokenizer):
    """The full model on the scored prompts, recomputed without the scorer by a plain forward pass: its accuracy
    (the top logit at the last token against the answer; its interval Clopper-Pearson's, from scipy's beta
    quantiles), and its mean answer probability, which over each circuit's (the table's ``answer_prob``) is the
    table's ``faithfulness_prob`` (a ratio of means)."""
    dirs, *_ = tiny
    _, result = compared
    task = md.task("entity-tracking")
    records = task.records(smollm2_tokenizer, N, prompt_seed(0, "command-scoring"), n_boxes=N_BOXES)
    batch = batch_tensors(records)
    answers = batch["answer_ids"].reshape(N, -1)[:, 0]
    for name in dirs:
        with torch.no_grad():
            logits = md.load_model(name).model(input_ids=batch["input_ids"]).logits[:, -1].double()
        k = int((logits.argmax(-1) == answers).sum())
        full_prob = float(logits.softmax(-1)[torch.arange(N), answers].mean())
        e = result.estimate(name, "first", "full_accuracy")
        assert e.value == pytest.approx(k / N)
        low = beta.ppf(0.025, k, N - k + 1) if k else 0.0
        high = beta.ppf(0.975, k + 1, N - k) if k < N else 1.0
        assert (e.low, e.high) == (pytest.approx(low), pytest.approx(high))
        for circuit in result.circuits:
            prob = result.estimate(name, circuit, "answer_prob").value
            assert result.estimate(name, circuit, "faithfulness_prob").value == pytest.approx(
                prob / full_prob, rel=1e-4
            )


def test_circuit_objects_and_files_compare_alike(compared, tiny, tmp_path):
    """A dict of `Circuit`s (e.g. a study's, `Results.circuit`) scores as the same circuits' files."""
    dirs, first, second, _ = tiny
    _, result = compared
    circuits = {"first": md.Circuit.load(first), "second": md.Circuit.load(second)}
    again = md.compare(dirs, circuits, md.task("entity-tracking"), N, out=tmp_path, n_random=1, **KEYWORDS)
    assert again.rows == result.rows
    assert again.settings["circuits"] == {"first": "<memory>", "second": "<memory>"}


def test_bad_input_is_refused_before_any_weights_load(tiny, tmp_path, monkeypatch):
    from mechdiff.models import modelset

    dirs, first, _, root = tiny
    monkeypatch.setattr(modelset, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    outside = md.Circuit("x", "entity-tracking", {"A": [Head(5, 0)]}, {"A": "last"}).save(root / "outside.json")
    with pytest.raises(CircuitFileError, match="outside.json: .*layer"):
        md.compare(dirs, outside, "entity-tracking", out=tmp_path)
    with pytest.raises(ValueError, match=r"need one unique label per circuit; got \['first', 'first'\]"):
        md.compare(dirs, [first, first], "entity-tracking", out=tmp_path)
    ioi = md.Circuit("x", "ioi", {"A": [Head(0, 0)]}, {"A": "S2"})
    with pytest.raises(ValueError, match=r"circuit of x: positions \{'A': 'S2'\} are not the task's \(last, "):
        md.compare(dirs, ioi, "entity-tracking", out=tmp_path)
    with pytest.raises(ValueError, match="unknown task"):
        md.compare(dirs, first, "no-such-task", out=tmp_path)
    with pytest.raises(TypeError, match="md.pair"):
        md.compare(dirs[0], first, "entity-tracking", out=tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no compare.json"):
        md.Comparison.load(tmp_path)
