"""Task accuracy, answer probability and (for records with alternative answers) the logit difference
answer - mean(alternatives) of a model, with or without patches; answers of several tokens by teacher forcing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from ..common.inference import Interval, mean, proportion
from ..common.metrics import (
    answer_is_top1,
    answer_prob,
    first_and_rest,
    logit_diff,
    sequence_is_greedy,
    sequence_logprob,
)
from ..common.outcomes import bits, outcome_record, rounded
from ..common.progress import progress_bar
from ..common.stats import bootstrap
from ..models.loading import LoadedModel
from ..models.remote import keep
from ..tasks.base import (
    Record,
    answer_tokens,
    batch_tensors,
    check_one_token,
    grouped_batches,
    record_order,
    take,
    token_tensors,
)
from .core import Patch, answer_logits, run

Rows = Sequence[int]  # the records of one batch (grouped_batches)
PatchFn = Callable[[dict, Rows], Iterable[Patch]]
ForwardFn = Callable[[dict, Rows], torch.Tensor]  # (batch, rows) -> the read-out logits "batch vocab"


@dataclass
class EvalResult:
    """Per-prompt correctness (exact binomial interval) and answer probability (bootstrap interval)."""

    correct: np.ndarray  # bool [n]
    prob: np.ndarray  # probability of the answer token [n]
    logit_diff: Optional[np.ndarray] = None  # answer logit - mean alternative logit [n], where records have them
    # where some answer has several tokens (else None): the first answer token is the top-1 after the prompt, and
    # every later one the top-1 given the answer's tokens before it (teacher forced; true for one-token answers);
    # ``correct`` is the two together
    first: Optional[np.ndarray] = None  # bool [n]
    rest: Optional[np.ndarray] = None  # bool [n]

    @property
    def accuracy(self) -> Interval:
        return proportion(self.correct.astype(float))

    def by_answer_length(
        self, records: Sequence[Record], metric: str = "prob", items: Optional[Sequence] = None
    ) -> list[dict]:
        """`by_answer_length` of these outcomes on their ``records``, with the task's ``metric``, intervals
        over ``items`` (one per record; default: each record its own item)."""
        diff = metric == "logit_diff" and self.logit_diff is not None
        values, column = (self.logit_diff, "logit_diff") if diff else (self.prob, "answer_prob")
        return by_answer_length(records, self.correct, values, column, self.first, self.rest, items)

    @property
    def answer_prob(self) -> Interval:
        return bootstrap(self.prob)

    @property
    def mean_logit_diff(self) -> Interval:
        if self.logit_diff is None:
            raise ValueError("these records have no alternative answers, so no logit difference")
        return bootstrap(self.logit_diff)

    def to_dict(self) -> dict:
        """The estimates, and the per-prompt outcomes they came from (`mechdiff.common.outcomes`), so two
        models on the same prompts get a paired interval."""
        out = {"accuracy": self.accuracy.to_dict(), "answer_prob": self.answer_prob.to_dict()}
        if self.logit_diff is not None:
            out["logit_diff"] = self.mean_logit_diff.to_dict()
        out["outcomes"] = self.outcomes()
        return out

    def outcomes(self) -> dict:
        """The compact per-prompt record: correctness, answer probability (and logit difference, where kept)."""
        out = outcome_record(self.correct, self.prob)
        if self.logit_diff is not None:
            out["logit_diff"] = rounded(self.logit_diff)
        if self.first is not None and self.rest is not None:
            out["first"], out["rest"] = bits(self.first), bits(self.rest)
        return out


#: The answer lengths accuracy is reported by where a task's answers have several (tokens: 1, 2, 3 or more).
LENGTH_BINS = ("1", "2", "3+")


def length_bin(n_tokens: int) -> str:
    """The `LENGTH_BINS` entry of an answer of ``n_tokens`` tokens."""
    return LENGTH_BINS[min(n_tokens, len(LENGTH_BINS)) - 1]


def length_bins(records: Sequence[Record]) -> np.ndarray:
    """Each record's `LENGTH_BINS` entry (its answer's own tokens), in their order."""
    return np.array([length_bin(len(answer_tokens(r))) for r in records])


def by_answer_length(
    records: Sequence[Record],
    correct: np.ndarray,
    values: Optional[np.ndarray] = None,
    column: str = "answer_prob",
    first: Optional[np.ndarray] = None,
    rest: Optional[np.ndarray] = None,
    items: Optional[Sequence] = None,
) -> list[dict]:
    """Accuracy and the mean of the continuous per-prompt ``values`` (the task's metric, as ``column``), each with
    its interval over ``items`` (one per record; default each record its own: exact binomial and bootstrap; else
    `proportion` and `mean` clustered by item) per
    answer length (`LENGTH_BINS`, the answer's own tokens) of ``records``, in their
    order; empty where every answer has one length (nothing to split). With ``first`` and ``rest``
    (`EvalResult`'s), accuracy split by first token against the rest: ``first_token``, the first answer
    token the top-1 after the prompt, and ``rest``, every later token the top-1 given the answer's tokens before it
    (teacher forced; None for one-token answers, which have no rest)."""
    lengths = length_bins(records)
    if len(lengths) != len(correct):
        raise ValueError(f"{len(records)} records but {len(correct)} outcomes")
    present = [b for b in LENGTH_BINS if (lengths == b).any()]
    if len(present) < 2:
        return []
    rows, ids = [], None if items is None else np.asarray(items)
    for b in present:
        at = lengths == b
        its = None if ids is None else ids[at]
        row = {"answer_tokens": b, "n": int(at.sum()), "accuracy": proportion(correct[at], its)}
        if its is not None:
            row["items"] = len(set(its.tolist()))
        if values is not None:
            vals = np.asarray(values, dtype=float)[at]
            row[column] = bootstrap(vals) if its is None else mean(vals, its)
        if first is not None and rest is not None:
            row["first_token"] = proportion(np.asarray(first, dtype=float)[at], its)
            row["rest"] = None if b == LENGTH_BINS[0] else proportion(np.asarray(rest, dtype=float)[at], its)
        rows.append(row)
    return rows


def batches(n: int, batch_size: int) -> list[slice]:
    """Consecutive slices covering ``range(n)``."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def evaluate(
    model: LoadedModel,
    records: Sequence[Record],
    batch_size: int = 32,
    patches: Optional[PatchFn] = None,
    targets: Optional[Sequence[int | Sequence[int]]] = None,
    desc: str = "eval",
    progress: bool = True,
    forward: Optional[ForwardFn] = None,
) -> EvalResult:
    """Accuracy and probability of each record's answer after its prompt (and the logit difference to its
    alternatives, where every record has them).

    A one-token answer is read at the prompt's last token: correct where it is the top-1 over the whole
    vocabulary, its probability the softmax's, the logit difference answer logit - mean alternative logit.
    An answer of several tokens is scored by teacher forcing (one run per answer, the answer's tokens appended
    to the prompt, `answer_logits`): correct where greedy decoding gives it
    (every token the top-1), its probability the product of its tokens' (``exp`` of the summed log-probability),
    the logit difference that summed log-probability minus the mean over alternatives of theirs (for one
    token, the same number as the logits' difference). Patches write the prompt's positions only.

    Records of any token length and template: batched by `grouped_batches`,
    per-prompt outcomes returned in the records' order. ``patches(batch, rows)`` returns the patches for
    one batch (``rows``: the indices of its records);
    ``targets`` overrides the answers (token ids, one int or a sequence each; e.g. a DCM desideratum's target).
    ``forward(batch, rows)`` replaces the patched run: it returns the batch's read-out logits itself (e.g. an
    incremental run that resumes from a cached one); it reads one token, so answers of one token only.
    """
    if not records:
        raise ValueError("no records to evaluate")
    if forward is not None:
        check_one_token(records, "evaluate with forward=")
        if targets is not None and any(len(_tokens(t)) > 1 for t in targets):
            raise ValueError("evaluate with forward= scores one answer token; these targets have several")
    bar = progress and not model.remote
    with model.session():  # remote: every batch in one request
        if forward is None:

            def forward(batch: dict, rows: Rows) -> torch.Tensor:
                return run(model, batch["input_ids"], patches(batch, rows) if patches else ()).logits

        def answers(batch: dict, rows: Rows) -> AnswerFn:
            written = list(patches(batch, rows)) if patches else []
            return lambda tokens: answer_logits(model, batch["input_ids"], tokens, written)

        results = keep(_eval_batches(records, batch_size, forward, answers, targets, desc, bar))
    order = record_order([rows for rows, _ in results])
    diffs = [o[2] for _, o in results]
    first, rest = _first_and_rest([o for _, o in results])
    return EvalResult(
        np.concatenate([o[0] for _, o in results])[order],
        np.concatenate([o[1] for _, o in results])[order],
        None if any(d is None for d in diffs) else np.concatenate(diffs)[order],
        None if first is None else first[order],
        None if rest is None else rest[order],
    )


def _first_and_rest(outcomes: list["Outcomes"]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """The batches' first-token and rest outcomes, concatenated; a batch of one-token answers counts its
    correctness as the first token's and has no rest (true); None where no batch had several tokens."""
    if all(o[3] is None for o in outcomes):
        return None, None
    first = np.concatenate([o[0] if o[3] is None else o[3] for o in outcomes])
    rest = np.concatenate([np.ones(len(o[0]), bool) if o[4] is None else o[4] for o in outcomes])
    return first, rest


#: A batch's correct, prob, logit_diff (or None), and, answers of several tokens only (else None), the first token's
#: top-1 and the rest's (teacher forced).
Outcomes = tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray], Optional[np.ndarray]]
AnswerFn = Callable[[torch.Tensor], torch.Tensor]  # answer tokens "batch a" -> teacher-forced logits "batch a vocab"


def _tokens(target: int | Sequence[int]) -> tuple[int, ...]:
    return (int(target),) if np.ndim(target) == 0 else tuple(int(t) for t in target)


def _eval_batches(
    records: Sequence[Record],
    batch_size: int,
    forward: ForwardFn,
    answers: Callable[[dict, Rows], AnswerFn],
    targets: Optional[Sequence[int | Sequence[int]]],
    desc: str,
    progress: bool,
) -> list[tuple[list[int], Outcomes]]:
    """``(rows, (correct, prob, logit_diff or None))`` of every batch, on the model's side."""
    out = []
    for rows in progress_bar(grouped_batches(records, batch_size), desc=desc, disable=not progress, leave=False):
        batch = batch_tensors(take(records, rows))
        answer = None if targets is None else [_tokens(t) for t in take(targets, rows)]
        with torch.no_grad():
            if "answer_tokens" in batch or (answer is not None and max(map(len, answer)) > 1):
                out.append((rows, _several_tokens(batch, answers(batch, rows), answer)))
            else:
                out.append((rows, _one_token(batch, forward(batch, rows), answer)))
    return out


def _one_token(batch: dict, logits: torch.Tensor, targets: Optional[list[tuple[int, ...]]]) -> Outcomes:
    """Outcomes of one-token answers from the read-out logits ``"batch vocab"``."""
    answer = batch["answer_ids"] if targets is None else torch.tensor([t[0] for t in targets])
    alternatives = batch.get("alternative_ids")
    diff = None if alternatives is None else logit_diff(logits, answer, alternatives).cpu().numpy()
    return answer_is_top1(logits, answer).cpu().numpy(), answer_prob(logits, answer).cpu().numpy(), diff, None, None


def _several_tokens(batch: dict, answers: AnswerFn, targets: Optional[list[tuple[int, ...]]]) -> Outcomes:
    """Outcomes by teacher forcing: one run per answer (the record's or the target's, then each alternative)."""
    if targets is None:
        tokens, lengths = batch["answer_tokens"], batch["answer_lengths"]
    else:
        tokens, lengths = token_tensors(targets)
    logits = answers(tokens)
    logprob = sequence_logprob(logits, tokens, lengths)
    diff = None
    if "alternative_tokens" in batch:
        alt, alt_lengths = batch["alternative_tokens"], batch["alternative_lengths"]
        others = [sequence_logprob(answers(alt[:, k]), alt[:, k], alt_lengths[:, k]) for k in range(alt.shape[1])]
        diff = (logprob - torch.stack(others, -1).mean(-1)).cpu().numpy()
    prob = np.exp(logprob.cpu().double().numpy())  # float64: a long answer's product stays above 0
    first, rest = (t.cpu().numpy() for t in first_and_rest(logits, tokens, lengths))
    return sequence_is_greedy(logits, tokens, lengths).cpu().numpy(), prob, diff, first, rest
