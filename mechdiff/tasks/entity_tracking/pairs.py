"""Entity-tracking counterfactual pairs: path patching and the DCM desiderata."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable, Sequence

from .building import build_example, check_n, check_same_length, generate, sample_base
from .records import DEFAULT_N_BOXES, PAIR_KINDS, CounterfactualPair, EntityTrackingExample, Vocabulary
from .vocabulary import VocabularyReport, prepare_vocabulary

if TYPE_CHECKING:  # heavy imports only for type checkers
    from transformers import PreTrainedTokenizerBase


# --------------------------------------------------------------------------------------
# Counterfactual pairs
# --------------------------------------------------------------------------------------


def _pairs(
    kind: str,
    make_source: Callable[[random.Random, EntityTrackingExample, VocabularyReport], tuple[EntityTrackingExample, str]],
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int,
    seed: int,
    vocabulary: Vocabulary,
    letters: Sequence[str] | None,
    labels_needed: int,
    clean_seed: int | None = None,
) -> list[CounterfactualPair]:
    """Shared driver: the bases are exactly ``generate(tokenizer, n, n_boxes, clean_seed, ...)`` (``clean_seed``
    defaults to ``seed``); the sources come from a second generator seeded with ``f"{seed}:{kind}"``."""
    check_n(n)
    # The sources' objects are disjoint from their base's, so twice the objects are needed.
    report = prepare_vocabulary(tokenizer, n_boxes, vocabulary, letters, 2 * n_boxes, labels_needed)
    base_rng = random.Random(seed if clean_seed is None else clean_seed)
    src_rng = random.Random(f"{seed}:{kind}")
    out: list[CounterfactualPair] = []
    for i in range(n):
        base = sample_base(base_rng, report, n_boxes, i % n_boxes, tokenizer)
        source, target_obj = make_source(src_rng, base, report)
        out.append(CounterfactualPair(base, source, " " + target_obj, report.token_ids[target_obj], kind))
    check_same_length([e for p in out for e in (p.base, p.source)], n_boxes)
    return out


def _other_objects(rng: random.Random, base: EntityTrackingExample, report: VocabularyReport) -> list[str]:
    pool = [o for o in report.kept if o not in base.objects]
    return rng.sample(pool, base.n_boxes)


#: How path patching builds a clean prompt's counterfactual: ``"fresh"`` (mechdiff's, the default: a new context
#: whose objects are disjoint from the clean prompt's, another box queried at random, a query letter absent from the
#: context) or ``"paper"`` (the paper's code, `paper_path_patching_pairs`).
COUNTERFACTUALS = ("fresh", "paper")


def check_counterfactual(counterfactual: str) -> None:
    """Refuse a counterfactual construction that is not one of `COUNTERFACTUALS`."""
    if counterfactual not in COUNTERFACTUALS:
        raise ValueError(
            f"unknown counterfactual construction {counterfactual!r}; choose one of {', '.join(COUNTERFACTUALS)}"
        )


def path_patching_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
    counterfactual: str = COUNTERFACTUALS[0],
    clean_seed: int | None = None,
) -> list[CounterfactualPair]:
    """Pairs for path patching; ``target`` is the base answer (metric: the probability of the base answer).

    ``counterfactual="fresh"`` (mechdiff's): the source is a different context (objects disjoint from the
    base's, fresh random labels) whose query segment index differs from the base's and whose final query label
    is a letter ABSENT from the source context and different from the base's query label; so
    ``source.positions["query_label_context"]`` is ``None``. ``source.query_index`` is the segment that would
    have been queried and ``source.answer`` its object (meaningless for the model). ``"paper"``: the paper's
    construction (`paper_path_patching_pairs`).

    ``clean_seed`` draws the clean prompts (default: ``seed``), which are then exactly
    ``generate(tokenizer, n, n_boxes, clean_seed, ...)``; ``seed`` draws the counterfactuals. Giving every model
    the same ``clean_seed`` and its own ``seed`` redraws only its counterfactuals, as the paper's per-model seed
    does (its clean prompts are its data file's first lines)."""
    check_counterfactual(counterfactual)
    if counterfactual == "paper":
        return paper_path_patching_pairs(tokenizer, n, n_boxes, seed, vocabulary, letters, clean_seed)

    def make(
        rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport
    ) -> tuple[EntityTrackingExample, str]:
        objects = _other_objects(rng, base, rep)
        labels = rng.sample(rep.labels_kept, base.n_boxes)
        q = rng.choice([k for k in range(base.n_boxes) if k != base.query_index])
        absent = rng.choice([L for L in rep.labels_kept if L not in labels and L != base.query_label])
        source = build_example(tokenizer, objects, labels, q, query_label=absent, token_ids=rep.token_ids)
        return source, base.answer[1:]

    # n_boxes letters in the source, plus one absent from it that also differs from the base query label.
    return _pairs(
        "path_patching", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes + 2, clean_seed=clean_seed
    )


def paper_path_patching_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
    clean_seed: int | None = None,
) -> list[CounterfactualPair]:
    """Path-patching pairs built as the paper's code builds them (``data/data_utils.py``, ``load_pp_data``,
    lines 1344-1364 at Nix07/finetuning 379765d).

    The clean prompts are ``generate(tokenizer, n, n_boxes, clean_seed, ...)`` (``clean_seed`` defaults to
    ``seed``); prompt ``i`` queries box ``j = i % n_boxes``. Its counterfactual is the clean prompt at an index
    drawn uniformly among those below ``n`` that query box ``(j + 1) % n_boxes`` (the paper:
    ``random.choice(range(0, n - r, n_boxes)) + r``), with its query letter overwritten by a uniform draw from
    the labels (the paper: ``chr(random.randint(65, 90))``, any of A-Z), which may be the prompt's own query label
    or another label of its context. The two draws per pair, in the paper's order, come from
    ``random.Random(f"{seed}:path_patching")``; with the 26 letters A-Z they are the paper's draws for that
    state. Departure: the paper's data file gives seven lines to a context, so its counterfactual may share the
    clean prompt's context; here every clean prompt has a context of its own."""
    check_n(n)
    if 0 < n < n_boxes:
        raise ValueError(
            f"the paper's counterfactual of a prompt querying box j is a prompt querying box (j + 1) mod {n_boxes}; "
            f"n = {n} prompts do not query every box: give at least n_boxes = {n_boxes} prompts"
        )
    bases = generate(tokenizer, n, n_boxes, seed if clean_seed is None else clean_seed, vocabulary, letters)
    report = prepare_vocabulary(tokenizer, n_boxes, vocabulary, letters, n_boxes, n_boxes)
    rng = random.Random(f"{seed}:path_patching")
    out = []
    for i, base in enumerate(bases):
        r = (i % n_boxes + 1) % n_boxes
        other = bases[rng.choice(range(r, n, n_boxes))]
        letter = rng.choice(report.labels_kept)
        source = build_example(
            tokenizer, other.objects, other.labels, other.query_index, query_label=letter, token_ids=report.token_ids
        )
        out.append(CounterfactualPair(base, source, base.answer, base.answer_id, "path_patching"))
    check_same_length([e for p in out for e in (p.base, p.source)], n_boxes)
    return out


def positional_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM positional desideratum. The source has objects disjoint from the base's, queries
    segment ``j != base.query_index``, and its query label does not occur in the base context
    (so the label reading predicts nothing and the object reading predicts an object not in
    the base). ``target = base.objects[j]``: the source's query position applied to the
    base's context."""

    def make(
        rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport
    ) -> tuple[EntityTrackingExample, str]:
        n_b = base.n_boxes
        objects = _other_objects(rng, base, rep)
        j = rng.choice([k for k in range(n_b) if k != base.query_index])
        q_label = rng.choice([L for L in rep.labels_kept if L not in base.labels])
        labels = rng.sample([L for L in rep.labels_kept if L != q_label], n_b - 1)
        labels.insert(j, q_label)
        source = build_example(tokenizer, objects, labels, j, token_ids=rep.token_ids)
        return source, base.objects[j]

    return _pairs("positional", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes + 1)


def object_value_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM object-value desideratum. The source is a different context (objects disjoint
    from the base's, fresh random labels, random query segment); ``target`` is the source's
    answer, the value fetched in the source run, which never occurs in the base context."""

    def make(
        rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport
    ) -> tuple[EntityTrackingExample, str]:
        objects = _other_objects(rng, base, rep)
        labels = rng.sample(rep.labels_kept, base.n_boxes)
        q = rng.randrange(base.n_boxes)
        source = build_example(tokenizer, objects, labels, q, token_ids=rep.token_ids)
        return source, source.answer[1:]

    return _pairs("object_value", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes)


def label_value_pairs(
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """DCM box-label-value desideratum. The source (objects disjoint from the base's) queries
    segment ``j`` with label ``L = base.labels[k]`` where ``k != base.query_index`` and
    ``k != j``; ``target = base.objects[k]`` (the base's object in the box labelled with the
    source's query label), which is never the base answer. With 2 boxes ``j`` equals the
    base's query index (no third segment exists); otherwise ``j`` is uniform."""

    def make(
        rng: random.Random, base: EntityTrackingExample, rep: VocabularyReport
    ) -> tuple[EntityTrackingExample, str]:
        n_b = base.n_boxes
        i = base.query_index
        j = i if n_b == 2 else rng.randrange(n_b)
        k = rng.choice([s for s in range(n_b) if s not in (i, j)])
        q_label = base.labels[k]
        objects = _other_objects(rng, base, rep)
        labels = rng.sample([L for L in rep.labels_kept if L != q_label], n_b - 1)
        labels.insert(j, q_label)
        source = build_example(tokenizer, objects, labels, j, token_ids=rep.token_ids)
        target = base.objects[base.labels.index(source.query_label)]
        return source, target

    return _pairs("label_value", make, tokenizer, n, n_boxes, seed, vocabulary, letters, n_boxes)


PAIR_GENERATORS: dict[str, Callable[..., list[CounterfactualPair]]] = {
    "path_patching": path_patching_pairs,
    "positional": positional_pairs,
    "object_value": object_value_pairs,
    "label_value": label_value_pairs,
}


def counterfactual_pairs(
    kind: str,
    tokenizer: "PreTrainedTokenizerBase",
    n: int,
    n_boxes: int = DEFAULT_N_BOXES,
    seed: int = 0,
    vocabulary: Vocabulary = None,
    letters: Sequence[str] | None = None,
) -> list[CounterfactualPair]:
    """Dispatch on ``kind`` (one of `PAIR_KINDS`)."""
    if kind not in PAIR_GENERATORS:
        raise ValueError(f"unknown counterfactual kind {kind!r}; choose one of {', '.join(PAIR_KINDS)}")
    return PAIR_GENERATORS[kind](tokenizer, n, n_boxes=n_boxes, seed=seed, vocabulary=vocabulary, letters=letters)


def parse_pair_kinds(text: str) -> list[str]:
    """``"positional,object_value"`` -> the kinds, each one of `PAIR_KINDS` (empty text: none)."""
    kinds = [k for k in text.split(",") if k]
    unknown = sorted(set(kinds) - set(PAIR_KINDS))
    if unknown:
        raise ValueError(f"unknown pair kinds {unknown}; choose from {', '.join(PAIR_KINDS)}")
    return kinds
