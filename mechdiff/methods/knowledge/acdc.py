"""Exact ACDC (Conmy et al. 2023) on the edge graph, made affordable on a 30-layer model.

The algorithm is Conmy et al.'s: receivers in reverse topological order (``LOGITS``, then each layer's
MLP and attention receivers from the last layer down), each receiver's incoming edges from the latest
sender back; an edge is removed when removing it (from the current circuit) raises the metric by less
than ``tau``, and the current circuit is then the one without it. Three ways to pay less, none of which
changes which edges are kept (up to float rounding of the metric):

- **incremental recomputation** (``incremental``): an edge into a receiver of layer ``l`` changes
  nothing below ``l``, and every edge into a layer below ``l`` is still in the circuit when ACDC tries
  it; so the senders' outputs below ``l`` are the full model's, cached once, and a trial computes only
  blocks ``l ..`` (`.forward.EdgeResume`, on the engine's block skip).
- **speculative batching** (``batch``): the next edges of a receiver (at most ``batch``) are tried in one
  forward, copy ``j`` of the prompts carrying the current circuit without edges ``1 .. j``. Walking them in
  order reproduces the sequential decisions as long as each edge is removed (most are); at the first edge
  that is kept the later copies assumed the wrong circuit and are tried again in the next forward. The
  number of copies halves after a kept edge and doubles (up to ``batch``) after a chunk removed whole.
- **dead nodes** (``skip_dead``): when a receiver's node(s) no longer send any kept edge to a receiver
  that reaches the logits, nothing it computes reaches the output (under any ablation: a removed edge
  carries the ablated value, not the sender's); its incoming edges are removed without a forward, with
  effect 0, which is what a forward would measure. Conmy et al.'s implementation does the same (it never
  visits nodes without children in the current graph).

An optional **EAP pre-filter** (``prefilter``): only the top ``prefilter`` fraction of edges by |EAP
score| are tried; every other edge is removed, without a forward, when ACDC reaches it (the metric is
re-measured before the next trial). When full ACDC would remove each of those edges too (the pre-filter
keeps every edge full ACDC keeps), every trial sees the circuit full ACDC's would, so the result is full
ACDC's exactly (a test checks it); otherwise it is an approximation, and its fraction is recorded.
(Removing the other edges at the start instead would begin from a circuit far from the model: on
SmolLM2 with zero ablation the top 2% of edges alone give the answer NLL 13.5 against the model's 0.33.)

Metrics (``metric``):

- ``match_nll`` (default; the paper's setting): Yao et al. run Conmy et al.'s ACDC code with
  ``--metric=match_nll --zero-ablation`` (zjunlp/KnowledgeCircuits, ``acdc/run.sh``). Conmy et al.'s
  ``MatchNLLMetric`` is the negative log-probability of the label averaged over the positions where the
  *full model's* top-1 prediction equals the label; here: the answer token's negative log-probability at
  the last position, averaged over the facts whose answer is the full model's top-1 token (an error
  when there are none). It is not a KL divergence.
- ``nll``: the same over every fact (what this module's predecessor called MatchNLL).
- ``kl``: KL(full model || circuit) of the next-token distribution at the last position (Conmy et al.'s
  default for most tasks), averaged over facts.

The paper's thresholds: ``tau`` in ``TAUS`` = (0.02, 0.01, 0.005), with zero ablation.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ...common.progress import progress_bar
from ...models.loading import LoadedModel
from ...tasks.relation_data import FactBatch, batches
from .discovery import attribution_scores, top_edges
from .forward import Ablation, EdgeResume, edge_forward
from .graph import Graph

log = logging.getLogger(__name__)

METRICS = ("match_nll", "nll", "kl")
TAUS = (0.02, 0.01, 0.005)  # Yao et al.'s thresholds


@dataclass
class AcdcResult:
    """The kept edges, each edge's metric change when it was tried, and what the run cost."""

    mask: np.ndarray  # "edge" bool: kept
    effect: np.ndarray  # "edge": metric(without it) - metric(with it) when tried; 0 for dead-node edges;
    #                     nan for edges never tried (outside the pre-filter, or past max_trials)
    metric: str
    tau: float
    metric_full: float  # the metric of the full model
    metric_final: float  # the metric of the circuit found
    prefilter: Optional[float] = None  # fraction of edges the EAP pre-filter kept (None: every edge)
    n_candidates: int = 0  # edges ACDC may try (all, or the pre-filter's)
    trials: int = 0  # edges tried with a forward
    skipped: int = 0  # edges into dead nodes, removed without a forward
    forwards: int = 0  # traced forward passes over all facts
    copies: int = 0  # circuits evaluated (stacked copies summed over forwards, tries that were redone included)
    cost: float = 0.0  # forward-pass equivalents over all facts: copies x (blocks computed + 1) / (layers + 1)
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (what one core would take on an idle machine)
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Everything but the per-edge arrays (for ``results.json``)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("mask", "effect")} | {
            "n_edges": int(self.mask.sum())
        }


class _Metric:
    """The ACDC metric of each copy's circuit, from the full model's logits of every fact batch."""

    def __init__(self, kind: str, batches: Sequence[FactBatch], full_logits: Sequence[torch.Tensor]):
        if kind not in METRICS:
            raise ValueError(f"unknown ACDC metric {kind!r}; use one of {', '.join(METRICS)}")
        self.kind = kind
        self.answers = [b.answers.to(l.device) for b, l in zip(batches, full_logits)]
        self.full_logp = [torch.log_softmax(l.float(), -1) for l in full_logits]
        if kind == "match_nll":
            self.weights = [(lp.argmax(-1) == a).double() for lp, a in zip(self.full_logp, self.answers)]
        else:
            self.weights = [torch.ones(len(a), dtype=torch.float64, device=a.device) for a in self.answers]
        self.total = float(sum(w.sum() for w in self.weights))
        if self.total == 0:
            raise ValueError(
                "ACDC metric match_nll: no fact's answer is the full model's top-1 token, so the "
                "metric is undefined; use metric 'nll' (every fact) or 'kl'"
            )

    def sums(self, i: int, logits: torch.Tensor, n_copies: int) -> np.ndarray:
        """``"copy"``: the weighted sum over batch ``i``'s facts for each stacked copy."""
        logp = torch.log_softmax(logits.float(), -1).view(n_copies, len(self.answers[i]), -1)
        if self.kind == "kl":
            full = self.full_logp[i].unsqueeze(0)
            per = (full.exp() * (full - logp)).sum(-1).double()
        else:
            idx = self.answers[i].view(1, -1, 1).expand(n_copies, -1, 1)
            per = -logp.gather(-1, idx).squeeze(-1).double()
        return (per * self.weights[i]).sum(-1).cpu().numpy()


class _Evaluator:
    """Evaluates stacks of circuits over every fact batch, from a layer on when ``incremental``."""

    def __init__(
        self,
        model: LoadedModel,
        graph: Graph,
        batches: Sequence[FactBatch],
        ablation: Ablation,
        start: np.ndarray,
        metric: str,
        incremental: bool,
    ):
        self.model, self.graph, self.batches, self.ablation = model, graph, list(batches), ablation
        self.incremental = incremental
        self.forwards, self.copies, self.cost = 0, 0, 0.0
        with torch.no_grad():
            full = [edge_forward(model, graph, b.ids, None, ablation).logits for b in self.batches]
            self.metric = _Metric(metric, self.batches, full)
            runs = [edge_forward(model, graph, b.ids, start, ablation, keep_outputs=incremental) for b in self.batches]
        self.cache = [r.outputs for r in runs] if incremental else None
        self.start_value = float(
            sum(self.metric.sums(i, r.logits, 1)[0] for i, r in enumerate(runs)) / self.metric.total
        )

    def __call__(self, masks: np.ndarray, layer: int) -> np.ndarray:
        """``"copy"`` metric of each row of ``masks`` (which differ from the start only in edges into layers
        ``>= layer``; ``layer = n_layers`` for ``LOGITS``)."""
        n = masks.shape[0]
        first = layer if self.incremental and layer > 0 else 0
        total = np.zeros(n)
        with torch.no_grad():
            for i, b in enumerate(self.batches):
                resume = EdgeResume(first, self.cache[i]) if first else None
                logits = edge_forward(self.model, self.graph, b.ids, masks, self.ablation, resume=resume).logits
                total += self.metric.sums(i, logits, n)
        L = self.graph.n_layers
        self.forwards += 1
        self.copies += n
        self.cost += n * (L - first + 1) / (L + 1)
        return total / self.metric.total


def _receivers(graph: Graph) -> list[tuple[int, int, list[int]]]:
    """``(receiver index, layer, incoming edges latest sender first)`` in reverse topological order
    (``layer = n_layers`` for ``LOGITS``)."""
    out, base = [], 0
    spans = []
    for kind, layer, off, r, s in graph.blocks:
        spans.append((base, graph.n_layers if kind == "logits" else layer, off, r, s))
        base += r
    for base, layer, off, r, s in reversed(spans):
        for ri in reversed(range(r)):
            out.append((base + ri, layer, list(range(off + ri * s + s - 1, off + ri * s - 1, -1))))
    return out


class _Liveness:
    """Whether a receiver's node still reaches the logits, given the decisions on every later receiver."""

    def __init__(self, graph: Graph):
        self.graph = graph
        order = np.argsort(graph.edge_sender, kind="stable")
        bounds = np.searchsorted(graph.edge_sender[order], np.arange(graph.n_senders + 1))
        self.out_edges = [order[bounds[s] : bounds[s + 1]] for s in range(graph.n_senders)]
        pos = {n: i for i, n in enumerate(graph.senders)}
        self.nodes = [[pos[n] for n in graph.receiver_node(r) if n in pos] for r in graph.receivers]
        self.alive = np.zeros(len(graph.receivers), dtype=bool)

    def check(self, receiver: int, mask: np.ndarray) -> bool:
        """Record and return whether ``receiver`` is alive (``LOGITS`` always is)."""
        nodes = self.nodes[receiver]
        alive = not nodes or any(
            bool((mask[e] & self.alive[self.graph.edge_receiver[e]]).any()) for e in (self.out_edges[n] for n in nodes)
        )
        self.alive[receiver] = alive
        return alive


def discovery_batch(fact_batches: Sequence[FactBatch], top1: np.ndarray, n: int) -> FactBatch:
    """One batch of at most ``n`` facts for ACDC: facts whose answer is the full model's top-1 token (the
    ones ``match_nll`` counts; ``top1`` is aligned with the facts of ``fact_batches`` in order), all of the
    most common token length among them, so every trial is one forward."""
    facts = [f for b in fact_batches for f in b.facts]
    right = [f for f, ok in zip(facts, top1) if ok]
    if not right:
        raise ValueError("ACDC: no fact's answer is the full model's top-1 token; use metric nll or kl on all facts")
    lengths = [len(f.ids) for f in right]
    common = max(sorted(set(lengths)), key=lengths.count)
    return batches([f for f in right if len(f.ids) == common][:n], n)[0]


def memory_batch(
    model: LoadedModel, graph: Graph, batches: Sequence[FactBatch], budget_bytes: float = 2**30, most: int = 16
) -> int:
    """Copies per forward that fit ``budget_bytes`` of sender outputs (the edge forward's buffer dominates)."""
    largest = max(b.ids.numel() for b in batches)
    per_copy = graph.n_senders * largest * model.shape.d_model * 4 * 2  # buffer + receivers' inputs and work
    return int(max(1, min(most, budget_bytes // per_copy)))


def acdc(
    model: LoadedModel,
    graph: Graph,
    batches: Sequence[FactBatch],
    tau: float = TAUS[0],
    ablation: Ablation = Ablation(),
    metric: str = "match_nll",
    incremental: bool = True,
    batch: int = 0,
    skip_dead: bool = True,
    prefilter: Optional[float] = None,
    scores: Optional[np.ndarray] = None,
    max_trials: Optional[int] = None,
    progress: bool = True,
) -> AcdcResult:
    """ACDC pruning of ``graph`` on ``batches`` (see the module docstring).

    ``batch``: candidate edges per forward (0: as many as `memory_batch` allows; 1: one at a time).
    ``incremental=False, batch=1, skip_dead=False``: the plain algorithm, one full forward per edge.
    ``prefilter``: try only the top fraction of edges by |``scores``| (EAP scores, computed here when
    ``None``); each other edge is removed, without a forward, when ACDC reaches it. ``max_trials``: stop
    after that many tried edges (the rest stay in), for cost estimates.
    """
    if tau <= 0:
        raise ValueError(f"ACDC threshold tau must be positive (the paper's: {TAUS}); got {tau}")
    if prefilter is not None and not 0 < prefilter <= 1:
        raise ValueError(f"the pre-filter is a fraction of edges in (0, 1]; got {prefilter}")
    t0, c0 = time.time(), time.process_time()
    candidate = np.ones(graph.n_edges, dtype=bool)
    if prefilter is not None:
        if scores is None:
            with torch.enable_grad():
                scores = attribution_scores(model, graph, batches, "eap", ablation=ablation, progress=progress)
        candidate = top_edges(graph, scores, int(math.ceil(prefilter * graph.n_edges)), prune=False)
    mask = np.ones(graph.n_edges, dtype=bool)
    batch = batch or memory_batch(model, graph, batches)
    evaluate = _Evaluator(model, graph, batches, ablation, mask, metric, incremental)
    effect = np.full(graph.n_edges, np.nan)
    current, stale = evaluate.start_value, False  # stale: edges removed untried since ``current``
    live = _Liveness(graph)
    trials = skipped = 0
    bar = progress_bar(total=graph.n_edges, desc=f"acdc tau={tau}", disable=not progress, leave=False)
    size, last_layer = batch, None
    for receiver, layer, incoming in _receivers(graph):
        if layer != last_layer and last_layer is not None:
            log.info(
                "acdc: layer %s done: %d tried, %d skipped, %d kept so far, metric %.4f, %.0f s",
                last_layer,
                trials,
                skipped,
                int(mask.sum()),
                current,
                time.time() - t0,
            )
        last_layer = layer
        bar.update(len(incoming))
        edges = [e for e in incoming if mask[e]]
        if not live.check(receiver, mask) and skip_dead:  # exact: the metric does not move
            mask[edges], effect[edges] = False, 0.0
            skipped += len(edges)
            continue
        i = 0
        while i < len(edges) and (max_trials is None or trials < max_trials):
            while i < len(edges) and not candidate[edges[i]]:  # outside the pre-filter: removed untried
                mask[edges[i]], stale, i = False, True, i + 1
            n = 0
            while i + n < len(edges) and candidate[edges[i + n]] and n < min(size, (max_trials or 1 << 62) - trials):
                n += 1
            if n == 0:
                continue
            chunk = edges[i : i + n]
            stack = np.repeat(mask[None], n + stale, 0)  # row 0 re-measures the current circuit when stale
            for j, e in enumerate(chunk):
                stack[j + stale :, e] = False
            values = evaluate(stack, layer)
            if stale:
                current, values, stale = values[0], values[1:], False
            for j, e in enumerate(chunk):
                effect[e] = values[j] - current
                trials += 1
                i += 1
                if effect[e] < tau:
                    mask[e], current = False, values[j]
                else:
                    break
            # speculation pays while edges are removed: halve after a kept edge, double after a clean chunk
            size = max(1, size // 2) if mask[e] else min(batch, size * 2)
        if max_trials is not None and trials >= max_trials:
            break
    bar.close()
    if stale:
        current = float(evaluate(mask[None], 0)[0])
    return AcdcResult(
        mask,
        effect,
        metric,
        tau,
        evaluate.start_value,
        current,
        prefilter,
        int(candidate.sum()),
        trials,
        skipped,
        evaluate.forwards,
        evaluate.copies,
        evaluate.cost,
        time.time() - t0,
        time.process_time() - c0,
        {
            "incremental": incremental,
            "batch": batch,
            "skip_dead": skip_dead,
            "ablation": ablation.kind,
            "n_facts": sum(len(b) for b in batches),
        },
    )
