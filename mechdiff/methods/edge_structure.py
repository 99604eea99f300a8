"""Edges as well as nodes across a trajectory's checkpoints: the top-n edges of the EAP graph and their nodes.

Wang et al. (ICML 2025) found, across fine-tuning checkpoints, that a circuit's nodes stay while its edges move. Here
each checkpoint's edges are scored per prompt on the task's ranking prompts (`mechdiff.methods.knowledge.task_graph`:
the graph of heads and MLPs, position-free), and on any set of prompts the checkpoint's discovery is the top ``n``
edges by |mean attribution| with **their nodes** (every head or MLP an edge leaves or enters; ``EMB`` and ``LOGITS``,
in nearly every circuit, are left out). The edge overlap and the node overlap (Jaccard) are then compared exactly as
the node structure compares (head, position class) pairs (`mechdiff.methods.structure.structure`): the
within-checkpoint null from two discoveries on disjoint random halves of the prompts, the cross overlap of two
checkpoints on opposite halves, the paired difference ``(null_s + null_t) / 2 - cross``, and each one's interval
over prompts from the node structure's resamples (the same cluster resamples of the prompts, the same seeds, halves
drawn inside each), decided by `decided` (changed / the same within the margin / neither).

"Nodes stable, edges move" is read (`reading`) only where the node difference is shown the same within the margin
and the edge difference is shown above 0; anything else is "not shown".
"""

from __future__ import annotations

import base64
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from ..common.inference import cluster_resamples
from ..runs.seeds import derive
from .knowledge.graph import Graph
from .structure import (
    INTERVAL,
    MARGIN,
    RESAMPLE_SPLITS,
    STRUCTURE_DRAWS,
    STRUCTURE_RESAMPLES,
    _against,
    _Overlaps,
    estimate,
    half_weights,
)

#: Edges each discovery keeps.
EDGES_N = 500
#: Weight rows (halves) whose top-n edges are held at once.
EDGE_CHUNK = 200
#: What `reading` writes where the intervals carry Wang et al.'s finding, and where they do not.
STABLE_MOVE, NOT_SHOWN = "nodes stable, edges move", "not shown"


@lru_cache(maxsize=8)
def edge_nodes(graph: Graph) -> np.ndarray:
    """``"edge slot"``: the nodes (indices into ``graph.senders``) each edge touches, its sender and its receiver's
    node(s) (a KV group's K or V: every head of the group), padded with ``graph.n_senders``; ``EMB`` and
    ``LOGITS`` are written as that pad (not nodes of the comparison)."""
    pos = {s: i for i, s in enumerate(graph.senders)}
    pad = graph.n_senders
    recv = []
    for r in graph.receivers:
        nodes = [pos[x] for x in graph.receiver_node(r) if x in pos]
        recv.append(nodes + [pad] * (graph.group_size - len(nodes)))
    out = np.concatenate([graph.edge_sender[:, None], np.asarray(recv, dtype=np.int64)[graph.edge_receiver]], axis=1)
    out[out == 0] = pad  # EMB
    return out


def top_edges(flat: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Per weight row, the indices of the top ``n`` edges by |weighted sum of the prompts' attribution|."""
    h = np.abs(weights @ flat)
    return np.argpartition(-h, n - 1, axis=1)[:, :n]


def masks(idx: np.ndarray, graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """Edge and node masks ``(row, edge)``, ``(row, node)`` of the top-n edge indices ``idx`` (nodes: the senders
    but ``EMB``)."""
    rows = idx.shape[0]
    e = np.zeros((rows, graph.n_edges), dtype=bool)
    np.put_along_axis(e, idx, True, axis=1)
    v = np.zeros((rows, graph.n_senders + 1), dtype=bool)
    np.put_along_axis(v, edge_nodes(graph)[idx].reshape(rows, -1), True, axis=1)
    return e, v[:, 1:-1]


def jaccard_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row by row |a & b| / |a | b| of two boolean masks (1 where both are empty)."""
    inter = np.count_nonzero(a & b, axis=1).astype(float)
    union = np.count_nonzero(a | b, axis=1).astype(float)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def edge_overlaps(
    scores: Mapping[str, np.ndarray],
    graph: Graph,
    wa: np.ndarray,
    wb: np.ndarray,
    n: int,
    pairs: Sequence[tuple[str, str]],
) -> tuple[_Overlaps, _Overlaps]:
    """The edge and the node overlaps (`_Overlaps`) on the halves ``wa``/``wb`` (`half_weights`): a checkpoint's
    null is the Jaccard of its top-n edges (their nodes) on half A and on half B; the cross overlap of ``(s, t)`` is
    that of ``s`` on one half and ``t`` on the other, both ways, averaged."""
    flat = {c: np.asarray(a, dtype=np.float64) for c, a in scores.items()}
    acc: dict[str, dict] = {k: {"null": {c: [] for c in flat}, "cross": {p: [] for p in pairs}} for k in ("e", "v")}
    for lo in range(0, wa.shape[0], EDGE_CHUNK):
        a = {c: masks(top_edges(x, wa[lo : lo + EDGE_CHUNK], n), graph) for c, x in flat.items()}
        b = {c: masks(top_edges(x, wb[lo : lo + EDGE_CHUNK], n), graph) for c, x in flat.items()}
        for i, k in enumerate(("e", "v")):
            for c in flat:
                acc[k]["null"][c].append(jaccard_rows(a[c][i], b[c][i]))
            for s, t in pairs:
                acc[k]["cross"][(s, t)].append((jaccard_rows(a[s][i], b[t][i]) + jaccard_rows(a[t][i], b[s][i])) / 2)
    return tuple(  # type: ignore[return-value]
        _Overlaps(
            {c: np.concatenate(v) for c, v in acc[k]["null"].items()},
            {p: np.concatenate(v) for p, v in acc[k]["cross"].items()},
            {},
        )
        for k in ("e", "v")
    )


def encode_half(a: np.ndarray) -> dict:
    """An array as JSON at float16 (shape and base64 bytes, 2 bytes a value): the per-prompt edge scores as the stage
    keeps them (70651 edges x 256 prompts on SmolLM2: 36 MB)."""
    a = np.ascontiguousarray(a, dtype=np.float16)
    return {"shape": list(a.shape), "float16": base64.b64encode(a.tobytes()).decode()}


def decode_half(d: dict) -> np.ndarray:
    """The array `encode_half` wrote, as float64 (what the comparison computes on, so it recomputes from the stage)."""
    return np.frombuffer(base64.b64decode(d["float16"]), dtype=np.float16).reshape(d["shape"]).astype(np.float64)


def reading(edges: dict, nodes: dict) -> str:
    """Wang et al.'s "nodes stable, edges move" where the node difference is shown the same within the margin and
    the edge difference shown above 0 (`decided`); "not shown" otherwise."""
    return STABLE_MOVE if nodes["same"] and edges["changed"] else NOT_SHOWN


def checkpoint_top(scores: np.ndarray, graph: Graph, n: int) -> dict:
    """A checkpoint's discovery on all its prompts: the top ``n`` edges by |mean attribution| (highest first) and
    their nodes (topological order)."""
    mean = np.asarray(scores, dtype=np.float64).mean(0)
    idx = np.argsort(-np.abs(mean), kind="stable")[:n]
    _, v = masks(idx[None], graph)
    return {
        "edges": [graph.edges[i] for i in idx],
        "scores": [float(mean[i]) for i in idx],
        "nodes": [graph.senders[i + 1] for i in np.flatnonzero(v[0])],
    }


def edge_structure(
    scores: Mapping[str, np.ndarray],
    graph: Graph,
    n: int = EDGES_N,
    draws: int = STRUCTURE_DRAWS,
    seed: int = 0,
    resamples: int = STRUCTURE_RESAMPLES,
    resample_splits: int = RESAMPLE_SPLITS,
    margin: float = MARGIN,
) -> dict:
    """Edge and node overlap across checkpoints (module docstring). ``scores``: checkpoint (in order) -> per-prompt
    edge attribution ``"prompt edge"`` on the same prompts. Returns per checkpoint its top-n edges and nodes and the
    null of each; per consecutive pair and per checkpoint against the final one, for edges and for nodes, the cross
    overlap and ``(null_s + null_t) / 2 - cross`` decided as the node structure decides (`_against`), with the
    `reading`."""
    names = list(scores)
    shapes = {np.shape(a) for a in scores.values()}
    if len(names) < 2 or len(shapes) != 1 or next(iter(shapes))[1:] != (graph.n_edges,):
        raise ValueError(
            f"edge structure needs at least two checkpoints scored on the same prompts over the graph's "
            f"{graph.n_edges} edges; got {len(names)} of shapes {sorted(shapes)}"
        )
    k = next(iter(shapes))[0]
    if not 1 <= n < graph.n_edges:
        raise ValueError(f"top-n edges: n must lie in [1, {graph.n_edges}), got {n}")
    wanted = list(dict.fromkeys(list(zip(names, names[1:])) + [(c, names[-1]) for c in names[:-1]]))
    point = edge_overlaps(scores, graph, *half_weights(np.ones((1, k)), draws, seed), n, wanted)
    counts = cluster_resamples(k, resamples, derive(seed, "structure-resamples"))
    boot = edge_overlaps(
        scores, graph, *half_weights(counts, resample_splits, derive(seed, "structure-halves")), n, wanted
    )

    def compare(s: str, t: str) -> dict:
        out = {}
        for i, kind in enumerate(("edges", "nodes")):

            def est(stat: Any, i: int = i) -> dict:
                return estimate(stat(point[i]), stat(boot[i]).reshape(resamples, resample_splits).mean(1), k)

            out[kind] = _against(est, s, t, margin)
        return {**out, "reading": reading(out["edges"], out["nodes"])}

    def null(c: str) -> dict:
        return {
            kind: estimate(point[i].null[c], boot[i].null[c].reshape(resamples, resample_splits).mean(1), k)
            for i, kind in enumerate(("edges", "nodes"))
        }

    return {
        "top_n": n,
        "graph": graph.to_dict(),
        "draws": draws,
        "seed": seed,
        "prompts": k,
        "resamples": resamples,
        "resample_splits": resample_splits,
        "margin": margin,
        "interval": INTERVAL,
        "top": {c: checkpoint_top(scores[c], graph, n) for c in names},
        "null": {c: null(c) for c in names},
        "consecutive": [{"from": s, "to": t, **compare(s, t)} for s, t in zip(names, names[1:])],
        "against_final": [{"checkpoint": c, **compare(c, names[-1])} for c in names[:-1]],
    }
