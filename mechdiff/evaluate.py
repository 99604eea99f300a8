"""Task accuracy and answer probability of a model, with or without patches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .models.loading import LoadedModel
from .models.remote import keep
from .patching.core import Patch, run
from .stats import Estimate, bootstrap, proportion
from .tasks.entity_tracking import EntityTrackingExample, batch_tensors

PatchFn = Callable[[dict, slice], Iterable[Patch]]


@dataclass
class EvalResult:
    """Per-prompt correctness (exact binomial interval) and answer probability (bootstrap interval)."""

    correct: np.ndarray  # bool [n]
    prob: np.ndarray  # probability of the answer token [n]

    @property
    def accuracy(self) -> Estimate:
        return proportion(self.correct.astype(float))

    @property
    def answer_prob(self) -> Estimate:
        return bootstrap(self.prob)

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy.to_dict(), "answer_prob": self.answer_prob.to_dict()}


def batches(n: int, batch_size: int) -> list[slice]:
    """Consecutive slices covering ``range(n)``."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def evaluate(
    model: LoadedModel,
    records: Sequence[EntityTrackingExample],
    batch_size: int = 32,
    patches: Optional[PatchFn] = None,
    targets: Optional[Sequence[int]] = None,
    desc: str = "eval",
    progress: bool = True,
) -> EvalResult:
    """Accuracy (top-1 over the whole vocabulary) and probability of the answer at the last token.

    ``patches(batch, rows)`` returns the patches for one batch (``rows`` indexes ``records``);
    ``targets`` overrides the answer ids (e.g. a DCM desideratum's target).
    """
    if not records:
        raise ValueError("no records to evaluate")
    bar = progress and not model.remote
    with model.session():  # remote: every batch in one request
        results = keep(_eval_batches(model, records, batch_size, patches, targets, desc, bar))
    return EvalResult(np.concatenate([c for c, _ in results]), np.concatenate([p for _, p in results]))


def _eval_batches(model: LoadedModel, records: Sequence[EntityTrackingExample], batch_size: int,
                  patches: Optional[PatchFn], targets: Optional[Sequence[int]], desc: str,
                  progress: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(correct, prob)`` of every batch, on the model's side."""
    out = []
    for rows in tqdm(batches(len(records), batch_size), desc=desc, disable=not progress, leave=False):
        batch = batch_tensors(records[rows])
        answer = batch["answer_ids"] if targets is None else torch.as_tensor(targets[rows])
        with torch.no_grad():
            run_out = run(model, batch["input_ids"], patches(batch, rows) if patches else ())
        logits = run_out.logits.float()
        correct = (logits.argmax(-1).cpu() == answer).numpy()
        prob = logits.softmax(-1).gather(1, answer.to(logits.device)[:, None])[:, 0].cpu().numpy()
        out.append((correct, prob))
    return out
