"""Task accuracy, answer probability and (for records with alternative answers) the logit difference
answer - mean(alternatives) of a model, with or without patches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from ..common.metrics import answer_is_top1, answer_prob, logit_diff
from ..common.outcomes import outcome_record, rounded
from ..common.progress import progress_bar
from ..common.stats import Estimate, bootstrap, proportion
from ..models.loading import LoadedModel
from ..models.remote import keep
from ..tasks.base import Record, batch_tensors, grouped_batches, record_order, take
from .core import Patch, run

Rows = Sequence[int]  # the records of one batch (grouped_batches)
PatchFn = Callable[[dict, Rows], Iterable[Patch]]
ForwardFn = Callable[[dict, Rows], torch.Tensor]  # (batch, rows) -> the read-out logits "batch vocab"


@dataclass
class EvalResult:
    """Per-prompt correctness (exact binomial interval) and answer probability (bootstrap interval)."""

    correct: np.ndarray  # bool [n]
    prob: np.ndarray  # probability of the answer token [n]
    logit_diff: Optional[np.ndarray] = None  # answer logit - mean alternative logit [n], where records have them

    @property
    def accuracy(self) -> Estimate:
        return proportion(self.correct.astype(float))

    @property
    def answer_prob(self) -> Estimate:
        return bootstrap(self.prob)

    @property
    def mean_logit_diff(self) -> Estimate:
        if self.logit_diff is None:
            raise ValueError("these records have no alternative answers, so no logit difference")
        return bootstrap(self.logit_diff)

    def to_dict(self) -> dict:
        """The estimates, and the per-prompt outcomes they came from (:mod:`mechdiff.common.outcomes`), so two
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
        return out


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
    targets: Optional[Sequence[int]] = None,
    desc: str = "eval",
    progress: bool = True,
    forward: Optional[ForwardFn] = None,
) -> EvalResult:
    """Accuracy (top-1 over the whole vocabulary) and probability of the answer at the last token.

    Records of any token length and template: batched by :func:`~mechdiff.tasks.base.grouped_batches`,
    per-prompt outcomes returned in the records' order. ``patches(batch, rows)`` returns the patches for
    one batch (``rows``: the indices of its records);
    ``targets`` overrides the answer ids (e.g. a DCM desideratum's target). ``forward(batch, rows)``
    replaces the patched run: it returns the batch's read-out logits itself (e.g. an incremental run
    that resumes from a cached one).
    """
    if not records:
        raise ValueError("no records to evaluate")
    bar = progress and not model.remote
    with model.session():  # remote: every batch in one request
        if forward is None:

            def forward(batch: dict, rows: slice) -> torch.Tensor:
                return run(model, batch["input_ids"], patches(batch, rows) if patches else ()).logits

        results = keep(_eval_batches(records, batch_size, forward, targets, desc, bar))
    order = record_order([rows for rows, _ in results])
    diffs = [d for _, (_, _, d) in results]
    return EvalResult(
        np.concatenate([c for _, (c, _, _) in results])[order],
        np.concatenate([p for _, (_, p, _) in results])[order],
        None if any(d is None for d in diffs) else np.concatenate(diffs)[order],
    )


def _eval_batches(
    records: Sequence[Record],
    batch_size: int,
    forward: ForwardFn,
    targets: Optional[Sequence[int]],
    desc: str,
    progress: bool,
) -> list[tuple[list[int], tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]]:
    """``(rows, (correct, prob, logit_diff or None))`` of every batch, on the model's side."""
    out = []
    for rows in progress_bar(grouped_batches(records, batch_size), desc=desc, disable=not progress, leave=False):
        batch = batch_tensors(take(records, rows))
        answer = batch["answer_ids"] if targets is None else torch.as_tensor(take(targets, rows))
        with torch.no_grad():
            logits = forward(batch, rows)
        alternatives = batch.get("alternative_ids")
        diff = None if alternatives is None else logit_diff(logits, answer, alternatives).cpu().numpy()
        out.append(
            (rows, (answer_is_top1(logits, answer).cpu().numpy(), answer_prob(logits, answer).cpu().numpy(), diff))
        )
    return out
