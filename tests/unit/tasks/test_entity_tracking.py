"""Entity-tracking dataset generator: prompts, positions, counterfactual pairs, export."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from mechdiff.tasks import (
    PAIR_KINDS,
    CounterfactualPair,
    EntityTrackingExample,
    batch_tensors,
    build_example,
    counterfactual_pairs,
    dataset_hash,
    generate,
    label_value_pairs,
    load_vocabulary,
    object_value_pairs,
    pair_batch_tensors,
    path_patching_pairs,
    positional_pairs,
    read_jsonl,
    to_hf_dataset,
    vocabulary_report,
    write_jsonl,
)
from mechdiff.tasks import entity_tracking as et


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def gpt2_style_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer trained in-process (no download), with a BOS
    token prepended so that special tokens shift every position by one. Its small vocabulary
    leaves part of the object list multi-token."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab = load_vocabulary()
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    corpus = [f"The {w} is in Box {L}, the {w} contains the. " for w in vocab[:100] for L in et.ALL_LETTERS]
    t.train_from_iterator(corpus, trainer)
    bos = t.token_to_id("<|endoftext|>")
    t.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def check_example(tok, e: EntityTrackingExample) -> None:
    """Every invariant a single example must satisfy."""
    n = e.n_boxes
    assert list(e.input_ids) == tok(e.prompt)["input_ids"]
    dec = lambda t: tok.decode([e.input_ids[t]]).strip()  # noqa: E731
    assert len(e.labels) == n and len(set(e.objects)) == n and len(set(e.labels)) == n
    assert all(len(L) == 1 and L.isupper() for L in e.labels)
    assert [dec(p) for p in e.positions["objects"]] == list(e.objects)
    assert [dec(p) for p in e.positions["labels"]] == list(e.labels)
    assert dec(e.positions["query_label"]) == e.query_label
    assert e.positions["last"] == len(e.input_ids) - 1
    assert dec(e.positions["last"]) == "the"
    # Each label sits right after a "Box" token, each object right after "The"/"the".
    for p in (*e.positions["labels"], e.positions["query_label"]):
        assert dec(p - 1) == "Box"
    for p in e.positions["objects"]:
        assert dec(p - 1).lower() == "the"
    assert e.answer == " " + e.objects[e.query_index]
    assert e.input_ids[e.positions["objects"][e.query_index]] == e.answer_id
    assert tok(e.answer, add_special_tokens=False)["input_ids"] == [e.answer_id]
    if e.query_label in e.labels:
        assert e.positions["query_label_context"] == e.positions["labels"][e.labels.index(e.query_label)]
    else:
        assert e.positions["query_label_context"] is None
    # Prompt format, exactly.
    segs = [f"the {o} is in Box {L}" for o, L in zip(e.objects, e.labels)]
    assert e.prompt == "T" + ", ".join(segs)[1:] + f". Box {e.query_label} contains the"


# ---------------------------------------------------------------- vocabulary


def test_vocabulary_file_and_report(tok):
    vocab = load_vocabulary()
    assert 140 <= len(vocab) <= 170
    assert all(w == w.strip().lower() and w.isalpha() for w in vocab)
    r = vocabulary_report(tok)
    assert r.n_total == len(vocab)
    assert set(r.kept) | set(r.dropped) == set(vocab)
    assert len(r.kept) >= 140
    assert r.labels_kept == et.ALL_LETTERS
    for w in r.kept:
        assert tok(" " + w, add_special_tokens=False)["input_ids"] == [r.token_ids[w]]
    for w in r.dropped:
        assert len(tok(" " + w, add_special_tokens=False)["input_ids"]) > 1
    assert f"dropped {len(r.dropped)}" in r.summary() or not r.dropped


def test_a_vocabulary_report_is_taken_once_per_tokenizer_and_again_after_its_vocabulary_grows(tok):
    """A second report of one tokenizer object calls it no more; a grown vocabulary reports afresh; another
    tokenizer object (or another set of letters) gets its own report, equal where its tokens are."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls, self.grown = inner, 0, 0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)

        def __len__(self):
            return len(self.inner) + self.grown

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = Counting(tok)
    first = vocabulary_report(counting)
    assert counting.calls >= len(load_vocabulary()) + 26
    calls = counting.calls
    assert vocabulary_report(counting) is first and counting.calls == calls
    assert vocabulary_report(counting, letters="AB").labels_kept == ("A", "B") and counting.calls > calls
    counting.grown, calls = 1, counting.calls
    assert vocabulary_report(counting) == first and counting.calls > calls
    assert vocabulary_report(Counting(tok)) == first and first.token_ids == vocabulary_report(tok).token_ids


def test_too_few_single_token_objects_raises(tok):
    vocab = ["apple", "xqzvbnmkwj", "qwzxplkjhgf", "zzqxvbnrtyw"]
    with pytest.raises(
        ValueError, match=r"only 1 of 4 objects are single tokens for this tokenizer.*more single-token nouns"
    ):
        generate(tok, 3, n_boxes=3, vocabulary=vocab)


def test_too_few_labels_raises(tok):
    with pytest.raises(ValueError, match="box labels"):
        generate(tok, 3, n_boxes=3, letters=["A", "B"])
    with pytest.raises(ValueError, match="A-Z"):
        generate(tok, 3, n_boxes=2, letters=["a", "B"])


def test_vocabulary_from_file(tok, tmp_path):
    p = tmp_path / "v.txt"
    p.write_text("# comment\nApple\n\nbook\nbook\ncoat\n")
    assert load_vocabulary(p) == ("apple", "book", "coat")
    ex = generate(tok, 3, n_boxes=3, vocabulary=p)
    assert all(set(e.objects) == {"apple", "book", "coat"} for e in ex)


@pytest.mark.parametrize("n_boxes", [0, 1, 11, 20, -3])
def test_n_boxes_out_of_range(tok, n_boxes):
    with pytest.raises(ValueError, match=r"2\.\.10"):
        generate(tok, 2, n_boxes=n_boxes)
    with pytest.raises(ValueError, match=r"2\.\.10"):
        positional_pairs(tok, 2, n_boxes=n_boxes)


# ---------------------------------------------------------------- examples


@pytest.mark.parametrize("n_boxes", [2, 3, 7, 10])
def test_examples_invariants(tok, n_boxes):
    ex = generate(tok, 4 * n_boxes, n_boxes=n_boxes, seed=3)
    for e in ex:
        check_example(tok, e)
        assert e.query_label == e.labels[e.query_index]
    # Every box queried, equally often, cycling.
    assert [e.query_index for e in ex] == [i % n_boxes for i in range(len(ex))]
    assert Counter(e.query_index for e in ex) == {k: 4 for k in range(n_boxes)}
    # One token length for all prompts with this n_boxes (also across seeds).
    other = generate(tok, 5, n_boxes=n_boxes, seed=99)
    assert len({len(e.input_ids) for e in ex + other}) == 1


def test_paper_example_format(tok):
    e = build_example(tok, ["apple", "computer", "bell"], ["F", "Q", "A"], query_index=1)
    assert e.prompt == "The apple is in Box F, the computer is in Box Q, the bell is in Box A. Box Q contains the"
    assert e.answer == " computer"
    check_example(tok, e)


def test_seed_reproducible(tok):
    a = generate(tok, 20, seed=7)
    b = generate(tok, 20, seed=7)
    c = generate(tok, 20, seed=8)
    assert a == b and dataset_hash(a) == dataset_hash(b)
    assert a != c and dataset_hash(a) != dataset_hash(c)
    assert [p.to_dict() for p in label_value_pairs(tok, 5, seed=1)] == [
        p.to_dict() for p in label_value_pairs(tok, 5, seed=1)
    ]


def test_substring_trap(tok):
    """Labels A/B/T next to objects starting with a/b/t, the word "Box" (contains "B") and
    "The" (contains "T"): a substring search finds the wrong character, the span-based
    lookup does not."""
    vocab = ["apple", "bag", "ant", "bell", "book", "table", "tea", "axe"]
    ex = generate(tok, 12, n_boxes=3, seed=0, vocabulary=vocab, letters=["A", "B", "T"])
    trapped = 0
    for e in ex:
        check_example(tok, e)
        assert set(e.labels) == {"A", "B", "T"}
        enc = tok(e.prompt, return_offsets_mapping=True)
        for L, pos in zip(e.labels, e.positions["labels"]):
            start, end = enc["offset_mapping"][pos]
            assert e.prompt[start:end].strip() == L
            # What the reference code did: the first occurrence of the letter in the prompt.
            naive = e.prompt.find(L)
            if not (start <= naive < end):
                trapped += 1
    assert trapped > 0  # the trap is really in these prompts (e.g. "B" inside "Box")


def test_build_example_rejects_multi_token_piece(gpt2_style_tokenizer):
    r = vocabulary_report(gpt2_style_tokenizer)
    assert r.dropped
    with pytest.raises(ValueError, match="single token"):
        build_example(gpt2_style_tokenizer, [r.kept[0], r.dropped[0]], ["A", "B"], 0)


def test_gpt2_style_tokenizer_with_bos(gpt2_style_tokenizer):
    t = gpt2_style_tokenizer
    r = vocabulary_report(t)
    assert 0 < len(r.dropped) < r.n_total
    ex = generate(t, 10, n_boxes=5, seed=0)
    for e in ex:
        check_example(t, e)
        assert e.input_ids[0] == t.bos_token_id
        assert set(e.objects) <= set(r.kept)
    for kind in PAIR_KINDS:
        for p in counterfactual_pairs(kind, t, 5, n_boxes=4, seed=0):
            check_example(t, p.base)
            check_example(t, p.source)


def test_same_length_check_raises(tok):
    a = build_example(tok, ["apple", "book"], ["A", "B"], 0)
    b = build_example(tok, ["apple", "book", "coat"], ["A", "B", "C"], 0)
    with pytest.raises(ValueError, match="different lengths"):
        et.check_same_length([a, b], 2)


def test_single_token_fallback_for_prefix_space_tokenizers():
    """SentencePiece tokenizers (LLaMA) encode " apple" as ["▁", "▁apple"]; the in-context
    token is still found."""

    class Fake:
        table = {" apple": [5, 9], "the": [7], "the apple": [7, 9], " kiwi": [5, 11, 12], "the kiwi": [7, 11, 12]}

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": self.table[text]}

    assert et.single_token_id(Fake(), "apple") == 9
    assert et.single_token_id(Fake(), "kiwi") is None


def test_slow_tokenizer_rejected():
    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        vocabulary_report(Slow())


# ---------------------------------------------------------------- counterfactual pairs


@pytest.mark.parametrize("n_boxes", [2, 3, 7])
def test_pairs_common(tok, n_boxes):
    bases = generate(tok, 6, n_boxes=n_boxes, seed=4)
    for kind in PAIR_KINDS:
        pairs = counterfactual_pairs(kind, tok, 6, n_boxes=n_boxes, seed=4)
        assert len(pairs) == 6
        assert [p.base for p in pairs] == bases  # same bases for every kind
        for p in pairs:
            assert isinstance(p, CounterfactualPair) and p.kind == kind
            check_example(tok, p.base)
            check_example(tok, p.source)
            assert p.base.n_boxes == p.source.n_boxes == n_boxes
            assert len(p.base.input_ids) == len(p.source.input_ids)
            assert not set(p.source.objects) & set(p.base.objects)
            assert tok(p.target, add_special_tokens=False)["input_ids"] == [p.target_id]


def test_path_patching_pairs(tok):
    for p in path_patching_pairs(tok, 30, n_boxes=7, seed=0):
        s, b = p.source, p.base
        assert s.query_label not in s.labels
        assert s.query_label != b.query_label
        assert s.positions["query_label_context"] is None
        assert s.query_index != b.query_index
        assert p.target == b.answer and p.target_id == b.answer_id


def test_path_patching_needs_an_absent_letter(tok):
    with pytest.raises(ValueError, match="box labels"):
        path_patching_pairs(tok, 2, n_boxes=3, letters=["A", "B", "C", "D"])


def test_positional_pairs(tok):
    for p in positional_pairs(tok, 30, n_boxes=7, seed=0):
        b, s = p.base, p.source
        assert s.query_index != b.query_index
        assert p.target == " " + b.objects[s.query_index]
        assert p.target != b.answer
        assert s.query_label not in b.labels
        assert s.answer.strip() not in b.objects


def test_object_value_pairs(tok):
    for p in object_value_pairs(tok, 30, n_boxes=7, seed=0):
        b, s = p.base, p.source
        assert p.target == s.answer and p.target_id == s.answer_id
        assert s.answer.strip() not in b.objects
        assert p.target_id not in b.input_ids


@pytest.mark.parametrize("n_boxes", [2, 3, 7])
def test_label_value_pairs(tok, n_boxes):
    for p in label_value_pairs(tok, 20, n_boxes=n_boxes, seed=0):
        b, s = p.base, p.source
        assert s.query_label in b.labels
        k = b.labels.index(s.query_label)
        assert k != b.query_index and k != s.query_index
        assert p.target == " " + b.objects[k]
        assert p.target != b.answer
        assert p.target.strip() != b.objects[s.query_index]  # not the positional reading
        assert s.answer.strip() not in b.objects  # not the object reading


def test_unknown_kind(tok):
    with pytest.raises(ValueError, match="unknown counterfactual kind"):
        counterfactual_pairs("nope", tok, 2)


# ---------------------------------------------------------------- export


def test_jsonl_round_trip(tok, tmp_path):
    ex = generate(tok, 7, n_boxes=4, seed=2)
    pairs = path_patching_pairs(tok, 3, n_boxes=4, seed=2) + label_value_pairs(tok, 3, n_boxes=4, seed=2)
    for records in (ex, pairs, ex + pairs):
        path = tmp_path / "r.jsonl"
        write_jsonl(records, path)
        back = read_jsonl(path)
        assert back == records
        assert all(type(a) is type(b) for a, b in zip(back, records))
        assert isinstance(
            back[0].objects if isinstance(back[0], EntityTrackingExample) else back[0].base.objects, tuple
        )
        assert dataset_hash(back) == dataset_hash(records)
        assert len(path.read_text().splitlines()) == len(records)
        json.loads(path.read_text().splitlines()[0])


def test_dataset_hash(tok):
    ex = generate(tok, 5, n_boxes=3)
    h = dataset_hash(ex)
    assert len(h) == 64 and int(h, 16) >= 0
    assert dataset_hash(ex[::-1]) != h
    assert dataset_hash(ex[:4]) != h


def test_hf_dataset(tok):
    ex = generate(tok, 9, n_boxes=3, seed=1)
    ds = to_hf_dataset(ex)
    assert ds.num_rows == 9
    expected = {
        "prompt",
        "answer",
        "answer_id",
        "objects",
        "labels",
        "query_index",
        "query_label",
        "input_ids",
        "pos_last",
        "pos_query_label",
        "pos_query_label_context",
        "pos_objects",
        "pos_labels",
    }
    assert set(ds.column_names) == expected
    assert ds[0]["prompt"] == ex[0].prompt and ds[0]["pos_objects"] == list(ex[0].positions["objects"])

    pairs = path_patching_pairs(tok, 4, n_boxes=3, seed=1)
    dp = to_hf_dataset(pairs)
    assert dp.num_rows == 4
    assert set(dp.column_names) == (
        {"base_" + c for c in expected} | {"source_" + c for c in expected} | {"target", "target_id", "kind"}
    )
    assert dp[0]["source_pos_query_label_context"] is None
    assert dp[0]["kind"] == "path_patching"
    with pytest.raises(TypeError):
        to_hf_dataset(ex[:1] + pairs[:1])


def test_batch_tensors(tok):
    import torch

    ex = generate(tok, 6, n_boxes=4, seed=0)
    bt = batch_tensors(ex)
    L = len(ex[0].input_ids)
    assert bt["input_ids"].shape == (6, L) and bt["input_ids"].dtype == torch.long
    assert bt["attention_mask"].shape == (6, L) and bool(bt["attention_mask"].all())
    assert bt["answer_ids"].tolist() == [e.answer_id for e in ex]
    assert bt["positions"]["last"].tolist() == [L - 1] * 6
    assert bt["positions"]["query_label_context"].tolist() == [e.positions["query_label_context"] for e in ex]
    assert bt["positions"]["objects"].shape == (6, 4)
    # The answer token sits at the queried object's position.
    rows = torch.arange(6)
    obj_pos = bt["positions"]["objects"][rows, torch.tensor([e.query_index for e in ex])]
    assert torch.equal(bt["input_ids"][rows, obj_pos], bt["answer_ids"])

    pb = pair_batch_tensors(path_patching_pairs(tok, 3, n_boxes=4))
    assert pb["source"]["positions"]["query_label_context"].tolist() == [-1, -1, -1]
    assert pb["target_ids"].shape == (3,)
    with pytest.raises(ValueError, match="different token lengths"):
        batch_tensors(ex + generate(tok, 1, n_boxes=5))


def test_position_classes_partition_every_prompt(smollm2_tokenizer):
    from mechdiff.tasks.entity_tracking.positions import CLASSES, position_classes

    records = generate(smollm2_tokenizer, 8, n_boxes=4, seed=2)
    masks = position_classes(records, len(records[0].input_ids))
    assert set(masks) == set(CLASSES)
    assert torch.equal(sum(m.int() for m in masks.values()), torch.ones(8, len(records[0].input_ids), dtype=torch.int))
    for row, r in enumerate(records):
        assert masks["query_object"][row].nonzero()[:, 0].tolist() == [r.positions["objects"][r.query_index]]
        assert masks["query_label_context"][row].nonzero()[:, 0].tolist() == [r.positions["query_label_context"]]
        assert masks["last"][row].nonzero()[:, 0].tolist() == [r.positions["last"]]
