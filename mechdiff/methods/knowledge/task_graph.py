"""The edge graph scored on a task's records: the adapter from a task's prompts and metric to EAP's batches.

The knowledge study (Yao et al. 2024, "Knowledge circuits") scores edges on the facts of one relation: batches of
`FactBatch` (subject prompts of one token length, the object token as answer), the answer's log-probability as
metric, a removed edge carrying zero or its sender's mean over the relation's facts (one mean at position 0, one
for all later positions). A task study (entity tracking, IOI) ranks its node circuit otherwise, and the edge graph
compared with it must be scored as that circuit is:

- **prompts**: the task's records, batched by `grouped_batches` (one template and token length a batch, no
  padding), the rows the node ranking reads (`TaskBatch.rows`);
- **metric**: the node ranking's (`mechdiff.circuits.curve` ``_objective``): ``log p(answer)`` for ``prob``, or the
  answer's logit minus the mean of its alternatives' for ``logit_diff``; an answer of several tokens is refused (the
  edge forward reads the last position's logits only, where the node ranking teacher-forces the answer);
- **ablation**: a removed edge carries its sender's **position-wise** mean over the task's reference prompts of the
  prompt's own template and token length (`group_ablations`), the node circuit's mean-ablation rule, not the
  knowledge study's two position buckets over the facts;
- **scores per prompt** (`prompt_edge_scores`): kept per prompt, so that the top-n edges can be recomputed on any
  resample or half of the prompts (`mechdiff.methods.edge_structure`), where the knowledge study keeps their mean.

Not built: an ablation from each prompt's counterfactual run (Syed et al.'s corrupted input); the node circuit it
is compared with is ranked against mean ablation. The graph's nodes are heads and MLPs at every position at once
(position-free), where the node circuit's are (head, position class) pairs with the MLPs never ablated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...common.metrics import answer_logprob, logit_diff, metric_name
from ...common.progress import progress_bar
from ...models.loading import LoadedModel
from ...patching.ablation import PositionMeans
from ...tasks.base import GroupKey, batch_tensors, group_key, group_name, grouped_batches, max_answer_length, take
from .discovery import IG_STEPS
from .forward import Ablation, edge_forward, edge_gradients
from .graph import Graph

#: Edge attribution methods (`.discovery`): EAP at the full model (one pass), or EAP-IG over the masks.
METHODS = ("eap", "eap-ig")
#: Prompts a forward and backward of the edge graph (every receiver reads its own copy of the residual stream).
EDGE_BATCH = 8


@dataclass
class TaskBatch:
    """Records of one template and token length as the edge graph reads them: ``rows`` (indices into the records),
    ``ids`` ``"batch pos"``, ``answers`` ``"batch"``, ``alternatives`` ``"batch k"`` (``logit_diff`` only)."""

    rows: list[int]
    ids: torch.Tensor
    answers: torch.Tensor
    group: GroupKey
    metric: str = "prob"
    alternatives: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.rows)

    def values(self, logits: torch.Tensor) -> torch.Tensor:
        """The metric per prompt from the last position's ``logits`` (``"batch vocab"``)."""
        if self.metric == "logit_diff":
            return logit_diff(logits, self.answers, self.alternatives)
        return answer_logprob(logits, self.answers)


def task_batches(records: Sequence, batch_size: int, metric: str = "prob") -> list[TaskBatch]:
    """The task's ``records`` in the batches the edge graph scores (the node scorer's `grouped_batches`), with the
    node ranking's ``metric`` (``prob``: the answer's log-probability; ``logit_diff``). Refused before any pass:
    answers of several tokens, and ``logit_diff`` on records without alternatives."""
    metric = metric_name(metric)
    if metric not in ("prob", "logit_diff"):
        raise ValueError(f"the edge graph scores the metric 'prob' or 'logit_diff', not {metric!r}")
    if max_answer_length(records) > 1:
        raise ValueError(
            "the edge graph reads the last position's logits only; these records have answers of several tokens "
            "(score a task whose answers are one token, or rank its nodes only)"
        )
    out = []
    for rows in grouped_batches(records, batch_size):
        t = batch_tensors(take(records, rows))
        alt = t.get("alternative_ids")
        if metric == "logit_diff" and alt is None:
            raise ValueError("metric logit_diff needs records with alternative answers (alternative_ids)")
        out.append(TaskBatch(rows, t["input_ids"], t["answer_ids"], t["group"], metric, alt))
    return out


@dataclass
class PositionAblation(Ablation):
    """Mean ablation with one mean per position: ``means`` ``"sender pos d_model"`` over reference prompts of one
    template and token length (the node circuit's rule)."""

    kind: str = "mean"

    def values(self, n_pos: int) -> torch.Tensor:
        if self.means is None or self.means.shape[1] != n_pos:
            have = None if self.means is None else self.means.shape[1]
            raise ValueError(f"position-wise means of {have} positions cannot ablate prompts of {n_pos} tokens")
        return self.means.unsqueeze(1)


def group_ablations(
    model: LoadedModel, graph: Graph, reference: Sequence, batch_size: int = EDGE_BATCH
) -> dict[GroupKey, PositionAblation]:
    """Per (template, token length) of ``reference``: every sender's clean output averaged over those reference
    prompts at each position."""
    means: dict[GroupKey, PositionMeans] = {}
    with torch.no_grad():
        for rows in grouped_batches(reference, batch_size):
            ids = batch_tensors(take(reference, rows))["input_ids"]
            key = group_key(reference[rows[0]])
            outputs = edge_forward(model, graph, ids, None, keep_outputs=True).outputs  # "sender batch pos d"
            means.setdefault(key, PositionMeans()).add(outputs)
    return {k: PositionAblation(means=m.mean()) for k, m in means.items()}


def prompt_edge_scores(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[TaskBatch],
    ablations: dict[GroupKey, Ablation],
    method: str = METHODS[0],
    steps: int = IG_STEPS,
    progress: bool = True,
) -> np.ndarray:
    """Each prompt's attribution of every edge, ``"prompt edge"`` (row ``i``: record ``i`` of the batches' rows):
    ``d metric / d m_e`` at every mask 1 (``eap``), or its mean over ``alpha = (k + 0.5) / steps`` (``eap-ig``), each
    prompt's ablation its group's (``ablations``, `group_ablations`; a group without reference prompts is refused)."""
    if method not in METHODS:
        raise ValueError(f"unknown edge attribution method {method!r}; use {' or '.join(METHODS)}")
    missing = [group_name(b.group) for b in batches if b.group not in ablations]
    if missing:
        raise ValueError(f"no reference prompts for {', '.join(dict.fromkeys(missing))}: add reference prompts there")
    alphas = [1.0] if method == "eap" else [(k + 0.5) / steps for k in range(steps)]
    out = np.zeros((1 + max((r for b in batches for r in b.rows), default=-1), graph.n_edges), dtype=np.float64)
    jobs = [(b, a) for b in batches for a in alphas]
    for b, alpha in progress_bar(jobs, desc=f"edges {method} ({model.name})", disable=not progress, leave=False):
        scores = edge_gradients(
            model, graph, b.ids, lambda lg, b=b: b.values(lg).sum(), alpha, ablations[b.group], per_prompt=True
        )
        out[b.rows] += scores / len(alphas)
    return out
