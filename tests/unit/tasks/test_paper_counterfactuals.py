"""The paper's path-patching counterfactuals and per-model seeds (mechdiff.tasks.entity_tracking.pairs) against an
independent re-implementation of its code (Nix07/finetuning 379765d, data/data_utils.py, load_pp_data), and the
default construction unchanged."""

from __future__ import annotations

import random
import re

import pytest

from mechdiff.tasks import dataset_hash, generate, path_patching_pairs
from mechdiff.tasks import entity_tracking as et


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def paper_sources(prompts: list[str], n_boxes: int, rng: random.Random) -> list[str]:
    """``load_pp_data``'s counterfactual prompts, written from its text: for line ``i + j`` (``j`` its index in its
    group of ``n_boxes`` lines), a random line among ``range(0, n - (j+1) % n_boxes, n_boxes)`` shifted by
    ``(j+1) % n_boxes``, its query letter (the word after the last ``". Box"``) replaced by ``chr(randint(65, 90))``."""
    n, out = len(prompts), []
    for i in range(0, n, n_boxes):
        for j in range(n_boxes):
            if i + j >= n:
                break
            index = rng.choice(list(range(0, n - ((j + 1) % n_boxes), n_boxes)))
            index += (j + 1) % n_boxes
            letter = chr(rng.randint(65, 90))
            context, query = prompts[index].rsplit(". ", 1)
            words = query.split(" ")
            out.append(f"{context}. {' '.join([words[0], letter, *words[2:]])}")
    return out


@pytest.mark.parametrize("n, n_boxes, seed", [(30, 7, 0), (300, 7, 20), (13, 4, 82)])
def test_paper_counterfactuals_are_the_papers_rule(tok, n, n_boxes, seed):
    """The same clean prompts as ``generate``, and every counterfactual the prompt the paper's code builds from them
    (its two draws per pair in its order, from the generator's stream); the source queries box (j+1) mod n_boxes."""
    assert "".join(et.vocabulary_report(tok).labels_kept) == "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # the paper's A-Z draw
    pairs = path_patching_pairs(tok, n, n_boxes=n_boxes, seed=seed, counterfactual="paper")
    clean = generate(tok, n, n_boxes=n_boxes, seed=seed)
    assert [p.base.prompt for p in pairs] == [e.prompt for e in clean]
    expected = paper_sources([e.prompt for e in clean], n_boxes, random.Random(f"{seed}:path_patching"))
    assert [p.source.prompt for p in pairs] == expected
    for i, p in enumerate(pairs):
        assert p.source.query_index == (i % n_boxes + 1) % n_boxes
        assert (p.target, p.target_id) == (p.base.answer, p.base.answer_id)  # the clean answer's probability
        assert p.source.input_ids == tuple(tok(p.source.prompt)["input_ids"])
        assert len(p.source.input_ids) == len(p.base.input_ids)


def test_paper_query_letters_are_uniform_and_may_be_context_labels(tok):
    """Over 700 pairs the drawn letter is sometimes the counterfactual's own query label, sometimes another of its
    context labels (query_label_context then points at it), mostly absent; all 26 letters occur, and sources come
    from many clean prompts. With 7 of 26 letters in a context, about 27% are context labels: 189 expected, and
    fewer than 120 or more than 260 has probability below 1e-7 (binomial tails)."""
    pairs = path_patching_pairs(tok, 700, n_boxes=7, seed=3, counterfactual="paper")
    own = sum(p.source.query_label == p.source.labels[p.source.query_index] for p in pairs)
    in_context = [p for p in pairs if p.source.query_label in p.source.labels]
    assert own > 0 and len(in_context) > own
    assert 120 <= len(in_context) <= 260
    for p in in_context:
        ctx = p.source.positions["query_label_context"]
        assert ctx == p.source.positions["labels"][p.source.labels.index(p.source.query_label)]
    assert all(p.source.positions["query_label_context"] is None for p in pairs if p not in in_context)
    assert {p.source.query_label for p in pairs} == set(et.ALL_LETTERS)
    assert len({p.source.objects for p in pairs}) > 50


@pytest.mark.parametrize("counterfactual", ["fresh", "paper"])
def test_a_models_seed_redraws_only_the_counterfactuals(tok, counterfactual):
    """With one clean seed, two model seeds give the same clean prompts (``generate``'s of the clean seed) and
    different counterfactuals; without it, the model's seed draws both (as before)."""
    runs = {s: path_patching_pairs(tok, 21, seed=s, clean_seed=0, counterfactual=counterfactual) for s in (20, 82)}
    clean = [e.prompt for e in generate(tok, 21, seed=0)]
    for pairs in runs.values():
        assert [p.base.prompt for p in pairs] == clean
    assert [p.source.prompt for p in runs[20]] != [p.source.prompt for p in runs[82]]
    whole = path_patching_pairs(tok, 21, seed=20, counterfactual=counterfactual)
    assert [p.base.prompt for p in whole] == [e.prompt for e in generate(tok, 21, seed=20)] != clean
    same = path_patching_pairs(tok, 21, seed=20, clean_seed=20, counterfactual=counterfactual)
    assert dataset_hash(same) == dataset_hash(whole)


def test_the_default_construction_is_unchanged(tok):
    """mechdiff's counterfactuals for a fixed seed: the digests of the pairs made before the paper's construction
    was added (a fresh context, another box, a query letter absent from it)."""
    assert dataset_hash(path_patching_pairs(tok, 30, n_boxes=7, seed=0)) == (
        "2c533ea2821e8f192540fe0a578eadf3634a1cc0d8d66f0726d5aced98c5c533"
    )
    assert dataset_hash(path_patching_pairs(tok, 9, n_boxes=3, seed=20, counterfactual="fresh")) == (
        "f5d694c37720c5c2e7fe6b3425577236d704b2c99438728cc1bfb3c67cbde7ab"
    )


def test_bad_counterfactual_options_are_refused(tok):
    with pytest.raises(ValueError, match=re.escape("choose one of fresh, paper")):
        path_patching_pairs(tok, 7, counterfactual="papers")
    with pytest.raises(ValueError, match="do not query every box: give at least n_boxes = 7"):
        path_patching_pairs(tok, 5, counterfactual="paper")
    assert path_patching_pairs(tok, 0, counterfactual="paper") == []


def test_the_circuit_command_hands_the_pairs_the_papers_options():
    """``mechdiff circuit --counterfactual paper --clean-seed 0`` gives the pairs both options; by default neither
    (every task's generator called as before); for a task whose pairs take no such choice, refused by its flag."""
    from mechdiff.cli import build_parser
    from mechdiff.commands.circuit import pair_options
    from mechdiff.tasks.base import get_task

    parse = build_parser().parse_args
    given = parse(["circuit", "--counterfactual", "paper", "--clean-seed", "0", "--seed", "20"])
    assert pair_options(given, et.TASK) == {"counterfactual": "paper", "clean_seed": 0}
    assert pair_options(parse(["circuit"]), et.TASK) == {}
    with pytest.raises(ValueError, match="--counterfactual: task ioi's pairs offer no such choice"):
        pair_options(parse(["circuit", "--task", "ioi", "--counterfactual", "paper"]), get_task("ioi"))
