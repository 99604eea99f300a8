"""Evaluation of edge circuits: Hit@k against the full model and random circuits, and the MIB-style curve.

- Hit@k: the answer's first token is among the ``k`` highest logits at the last position.
- Faithfulness at a size: ``f = (m(C) - m(empty)) / (m(full) - m(empty))`` with ``m`` the mean
  answer log-probability; the curve is over the top-|score| circuits at ``SIZES`` (fractions of
  all edges, no pruning). ``CPR`` is the area under ``f`` and ``CMD`` the area under ``|1 - f|``,
  both by the trapezoid rule over the fraction of edges on a linear axis from 0 (``f = 0``, the
  empty circuit) to 1 (``f = 1``); MIB's own weighting of the sizes was not available offline and
  may differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...common.inference import proportion
from ...common.metrics import answer_logprob, answer_rank
from ...common.progress import progress_bar
from ...common.stats import bootstrap
from ...models.loading import LoadedModel
from ...tasks.relation_data import FactBatch
from .discovery import top_edges
from .forward import Ablation, edge_forward
from .graph import Graph

SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class CircuitEval:
    hit: np.ndarray  # "fact" bool
    logprob: np.ndarray  # "fact"
    rank: np.ndarray  # "fact": the answer's rank (0 = top)

    def subset(self, keep: np.ndarray) -> "CircuitEval":
        """The facts where ``keep`` is true."""
        return CircuitEval(self.hit[keep], self.logprob[keep], self.rank[keep])

    def summary(self, k: int = 10) -> dict:
        return {
            f"hit@{k}": proportion(self.hit).to_dict(),  # exact binomial: a proportion
            "logprob": bootstrap(self.logprob).to_dict(),
            "median_rank": float(np.median(self.rank)),
        }


def evaluate(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[FactBatch],
    mask: Optional[np.ndarray],
    ablation: Ablation = Ablation(),
    k: int = 10,
) -> CircuitEval:
    """Hit@k, answer log-probability and rank of every fact with only ``mask``'s edges (None: full model)."""
    hits, lps, ranks = [], [], []
    with torch.no_grad():
        for b in batches:
            logits = edge_forward(model, graph, b.ids, mask, ablation).logits.float()
            rank = answer_rank(logits, b.answers)
            ranks.append(rank.cpu().numpy())
            hits.append((rank < k).cpu().numpy())
            lps.append(answer_logprob(logits, b.answers).cpu().numpy())
    return CircuitEval(np.concatenate(hits), np.concatenate(lps), np.concatenate(ranks))


def random_mask(graph: Graph, n_edges: int, seed: int) -> np.ndarray:
    """``n_edges`` edges drawn uniformly without replacement."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(graph.n_edges, dtype=bool)
    mask[rng.choice(graph.n_edges, size=n_edges, replace=False)] = True
    return mask


def faithfulness_curve(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[FactBatch],
    scores: np.ndarray,
    ablation: Ablation = Ablation(),
    sizes: Sequence[float] = SIZES,
    k: int = 10,
    full: Optional[CircuitEval] = None,
    empty: Optional[CircuitEval] = None,
    progress: bool = True,
    masks: Optional[dict] = None,
) -> dict:
    """The faithfulness curve over circuit sizes, with CPR and CMD.

    The circuit at each size is the top-|score| edges, or ``masks[size]`` where given (iterative pruning)."""
    full = full or evaluate(model, graph, batches, None, ablation, k)
    empty = empty or evaluate(model, graph, batches, np.zeros(graph.n_edges, dtype=bool), ablation, k)
    m_full, m_empty = float(full.logprob.mean()), float(empty.logprob.mean())
    rows = []
    for frac in progress_bar(sizes, desc="faithfulness curve", disable=not progress, leave=False):
        n = max(1, int(round(frac * graph.n_edges)))
        if masks is not None and frac in masks:
            mask = masks[frac]
            n = int(mask.sum())
        else:
            mask = top_edges(graph, scores, n, prune=False)
        ev = full if n >= graph.n_edges else evaluate(model, graph, batches, mask, ablation, k)
        f = (float(ev.logprob.mean()) - m_empty) / (m_full - m_empty) if m_full != m_empty else float("nan")
        rows.append(
            {
                "fraction": frac,
                "n_edges": n,
                "faithfulness": f,
                f"hit@{k}": float(ev.hit.mean()),
                "logprob": float(ev.logprob.mean()),
            }
        )
    x = np.array([0.0] + [r["fraction"] for r in rows])
    f = np.array([0.0] + [r["faithfulness"] for r in rows])
    return {
        "rows": rows,
        "cpr": float(np.trapezoid(f, x)),
        "cmd": float(np.trapezoid(np.abs(1 - f), x)),
        "m_full": m_full,
        "m_empty": m_empty,
        "metric": "mean answer log-probability",
        "area": "trapezoid over the fraction of edges, linear axis, (0, 0) included",
    }


#: What orders the edges of the faithfulness curve, per method (others: their |score|). ACDC scores no edge
#: but measures each one it tries: the curve keeps the top edges by that |metric change| (0 for edges into
#: dead nodes), a departure from ACDC, which yields one circuit per threshold, not a ranking.
CURVE_RANKING = {"acdc": "|metric change when ACDC tried the edge|", "iterative": "iterative pruning's circuits"}
