"""Edge-level circuit discovery: EAP / EAP-IG attribution over all edges, and ACDC-style pruning.

- `attribution_scores`: ``score_e = d metric / d m_e`` averaged over facts, where ``metric`` is
  the answer's log-probability and ``m_e`` the edge mask of `.forward`. ``method="eap"``: one
  forward + backward per batch with every mask at 1 (Syed et al. 2023: ``(a_clean - a_abl) . grad``).
  ``method="eap-ig"``: integrated gradients over the edge masks, the mean of the gradients at
  ``alpha = (k + 0.5) / steps`` for k < steps (the straight path from the empty circuit to the
  full model), times the path length 1; ``steps`` forward + backward passes per batch. The scores
  of all edges then sum to about ``metric(full) - metric(empty)``.
  Removing edge ``e`` changes the metric by about ``-score_e``.
- ACDC (exact pruning, edge by edge) lives in `.acdc`.
- `top_edges`: the circuit of the ``k`` highest-|score| edges, optionally without dangling edges.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ...common.metrics import answer_logprob
from ...common.progress import progress_bar
from ...models.loading import LoadedModel
from ...tasks.relation_data import FactBatch
from .forward import Ablation, edge_gradients
from .graph import Graph, prune_dangling

log = logging.getLogger(__name__)

#: EAP-IG's steps along the masks' path.
IG_STEPS = 5


def attribution_scores(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[FactBatch],
    method: str = "eap-ig",
    steps: int = IG_STEPS,
    ablation: Ablation = Ablation(),
    progress: bool = True,
) -> np.ndarray:
    """Per-edge attribution score, averaged over the facts of ``batches``."""
    if method not in ("eap", "eap-ig"):
        raise ValueError(f"unknown attribution method {method!r}; use eap or eap-ig")
    alphas = [1.0] if method == "eap" else [(k + 0.5) / steps for k in range(steps)]
    total = np.zeros(graph.n_edges)
    n = 0
    jobs = [(b, a) for b in batches for a in alphas]
    for b, alpha in progress_bar(jobs, desc=f"{method} ({model.name})", disable=not progress, leave=False):

        def metric(logits, answers=b.answers):
            return answer_logprob(logits, answers).sum()

        total += edge_gradients(model, graph, b.ids, metric, alpha=alpha, ablation=ablation) / len(alphas)
    n = sum(len(b) for b in batches)
    return total / max(n, 1)


def top_edges(
    graph: Graph, scores: np.ndarray, k: int, prune: bool = True, signed: bool = False, forward: bool = True
) -> np.ndarray:
    """Mask of the ``k`` edges of highest |score| (highest score with ``signed``), dangling edges pruned."""
    key = scores if signed else np.abs(scores)
    mask = np.zeros(graph.n_edges, dtype=bool)
    if k > 0:
        mask[np.argsort(-key, kind="stable")[:k]] = True
    return prune_dangling(graph, mask, forward) if prune else mask


def greedy_edges(
    graph: Graph, scores: np.ndarray, k: int, signed: bool = False, prune: bool = True, forward: bool = True
) -> np.ndarray:
    """Grow a connected circuit from ``LOGITS`` backwards: repeatedly add the best-scoring edge whose
    receiver feeds a node already in the circuit (Hanna et al. 2024's greedy selection, as in MIB).

    Every edge then leads to the logits; edges from senders that end up without inputs are pruned
    (``prune``).
    """
    import heapq

    key = scores if signed else np.abs(scores)
    recv_of_node: dict[str, list[int]] = {}
    for ri, r in enumerate(graph.receivers):
        for n in graph.receiver_node(r):
            recv_of_node.setdefault(n, []).append(ri)
    blocks = []  # receiver index -> (offset, n_senders)
    for _, _, off, r, s in graph.blocks:
        blocks += [(off + i * s, s) for i in range(r)]
    heap: list = []
    opened: set[int] = set()

    def open_node(node: str) -> None:
        for ri in recv_of_node.get(node, ()):
            if ri not in opened:
                opened.add(ri)
                off, s = blocks[ri]
                for e in range(off, off + s):
                    heapq.heappush(heap, (-key[e], e))

    mask = np.zeros(graph.n_edges, dtype=bool)
    in_circuit = {"LOGITS"}
    open_node("LOGITS")
    n = 0
    while heap and n < k:
        _, e = heapq.heappop(heap)
        mask[e] = True
        n += 1
        sender = graph.senders[graph.edge_sender[e]]
        if sender not in in_circuit and sender != "EMB":
            in_circuit.add(sender)
            open_node(sender)
    return prune_dangling(graph, mask, forward) if prune else mask


def iterative_pruning(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[FactBatch],
    sizes: Sequence[float],
    ablation: Ablation = Ablation(),
    shrink: float = 0.5,
    progress: bool = True,
    forward: bool = True,
) -> tuple[dict[float, np.ndarray], np.ndarray]:
    """Prune by attribution recomputed at the current circuit ("iterative EAP").

    From the full graph, repeatedly: the gradient of the answer log-probability with respect to
    every edge mask *at the current circuit* (one forward + backward per batch); keep the edges of
    highest score (removing edge ``e`` lowers the metric by about ``score_e``), at most ``shrink``
    of the current count or the next requested size; drop dangling edges. The linearisation is
    redone where the circuit is, so it stays accurate as the circuit shrinks, where one pass of
    EAP from the full model is not. Returns the circuit at each of ``sizes`` and the last scores.
    """
    targets = sorted(sizes, reverse=True)
    schedule, f = [], 1.0
    for t in targets:
        while f * shrink > t:
            f *= shrink
            schedule.append(f)
        schedule.append(t)
        f = t
    mask = np.ones(graph.n_edges, dtype=bool)
    out: dict[float, np.ndarray] = {}
    scores = np.zeros(graph.n_edges)
    n = sum(len(b) for b in batches)
    for frac in progress_bar(schedule, desc="iterative pruning", disable=not progress, leave=False):
        scores = np.zeros(graph.n_edges)
        for b in batches:

            def metric(logits, answers=b.answers):
                return answer_logprob(logits, answers).sum()

            scores += edge_gradients(model, graph, b.ids, metric, ablation=ablation, mask=mask) / n
        k = max(1, int(round(frac * graph.n_edges)))
        kept = np.flatnonzero(mask)
        best = kept[np.argsort(-scores[kept], kind="stable")[:k]]
        mask = np.zeros(graph.n_edges, dtype=bool)
        mask[best] = True
        mask = prune_dangling(graph, mask, forward)
        if frac in targets:
            out[frac] = mask.copy()
        log.info("iterative pruning: %.4f -> %d edges", frac, int(mask.sum()))
    return out, scores
