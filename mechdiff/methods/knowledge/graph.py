"""The model as a computational graph of nodes and edges, and the edge circuit (JSON round-trip).

Nodes (senders, in topological order): ``EMB``, then per layer ``L{l}H0`` ... ``L{l}H{n-1}``
and ``MLP{l}``. Receivers (inputs, in topological order): per layer the Q input of every
query head (``L{l}H{h}.q``), the K and V inputs of every KV group (``L{l}KV{g}.k``,
``L{l}KV{g}.v``; with one query head per group ``L{l}H{h}.k``), the MLP input (``MLP{l}``),
and ``LOGITS`` (the final norm's input).

Grouped-query attention is not ungrouped: the K and V projections exist once per KV group,
so the graph has one K and one V receiver per group. Removing an edge into ``L7KV1.k``
changes the keys of every query head of that group (as patching K does everywhere in
mechdiff).

Edges run from every sender to every later receiver: into layer ``l``'s attention from
``EMB`` and all nodes of layers ``< l``; into ``MLP{l}`` also from the heads of layer ``l``
(not in a model with parallel blocks, whose MLP reads the block input: GPT-J, GPT-NeoX, Phi,
Cohere); into ``LOGITS`` from every node. An edge is named ``"L3H5->L7H2.q"``.

The edge order (receiver-major, senders in topological order) makes every receiver's
incoming edges one contiguous block, so a mask over all edges reshapes per layer into
``"receiver sender"`` matrices (see `Graph.blocks`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from ...common.io import write_json
from ...models.architectures import ModelShape


@dataclass(frozen=True)
class Graph:
    """The computational graph of a model of ``n_layers`` layers, ``n_heads`` query heads and ``n_kv_heads`` KV
    groups; ``parallel``: each block's MLP reads the block input, not the input plus the attention output."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool = False

    @classmethod
    def from_shape(cls, shape: ModelShape, parallel: bool = False) -> "Graph":
        return cls(shape.n_layers, shape.n_heads, shape.n_kv_heads, parallel)

    @classmethod
    def for_model(cls, model: Any) -> "Graph":
        """The graph of a loaded model (its shape and, from its adapter, whether its blocks are parallel)."""
        return cls.from_shape(model.shape, model.arch.parallel)

    # ---- senders -------------------------------------------------------------------------------------------
    @property
    def per_layer(self) -> int:
        """Senders per layer: the heads and the MLP."""
        return self.n_heads + 1

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * self.per_layer

    def head_index(self, layer: int, head: int) -> int:
        return 1 + layer * self.per_layer + head

    def mlp_index(self, layer: int) -> int:
        return 1 + layer * self.per_layer + self.n_heads

    @cached_property
    def senders(self) -> list[str]:
        names = ["EMB"]
        for layer in range(self.n_layers):
            names += [f"L{layer}H{h}" for h in range(self.n_heads)] + [f"MLP{layer}"]
        return names

    def senders_before_attn(self, layer: int) -> int:
        """Number of senders whose output reaches layer ``layer``'s attention (a prefix of ``senders``)."""
        return 1 + layer * self.per_layer

    def senders_before_mlp(self, layer: int) -> int:
        return self.senders_before_attn(layer) + (0 if self.parallel else self.n_heads)

    # ---- receivers -----------------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_name(self, layer: int, group: int) -> str:
        return f"L{layer}H{group}" if self.group_size == 1 else f"L{layer}KV{group}"

    def attn_receivers(self, layer: int) -> list[str]:
        """Layer ``layer``'s attention receivers: Q per query head, then K and V per KV group."""
        return (
            [f"L{layer}H{h}.q" for h in range(self.n_heads)]
            + [f"{self.kv_name(layer, g)}.k" for g in range(self.n_kv_heads)]
            + [f"{self.kv_name(layer, g)}.v" for g in range(self.n_kv_heads)]
        )

    @property
    def n_attn_receivers(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads

    @cached_property
    def receivers(self) -> list[str]:
        names = []
        for layer in range(self.n_layers):
            names += self.attn_receivers(layer) + [f"MLP{layer}"]
        return names + ["LOGITS"]

    def receiver_node(self, receiver: str) -> list[str]:
        """The sender node(s) a receiver feeds: a head, the heads of a KV group, an MLP, or ``LOGITS``."""
        if receiver == "LOGITS" or receiver.startswith("MLP"):
            return [receiver]
        node, _, kind = receiver.partition(".")
        if kind == "q" or self.group_size == 1:
            return [node]
        layer, group = node[1:].split("KV")
        return [f"L{layer}H{h}" for h in range(int(group) * self.group_size, (int(group) + 1) * self.group_size)]

    # ---- edges ---------------------------------------------------------------------------------------------
    @cached_property
    def blocks(self) -> list[tuple[str, int, int, int, int]]:
        """``(kind, layer, offset, n_receivers, n_senders)`` for each contiguous block of the edge vector.

        kind ``attn`` (layer's Q/K/V receivers), ``mlp`` or ``logits`` (layer -1)."""
        out, offset = [], 0
        for layer in range(self.n_layers):
            r, s = self.n_attn_receivers, self.senders_before_attn(layer)
            out.append(("attn", layer, offset, r, s))
            offset += r * s
            s = self.senders_before_mlp(layer)
            out.append(("mlp", layer, offset, 1, s))
            offset += s
        out.append(("logits", -1, offset, 1, self.n_senders))
        return out

    @property
    def n_edges(self) -> int:
        _, _, offset, r, s = self.blocks[-1]
        return offset + r * s

    @cached_property
    def edges(self) -> list[str]:
        names = []
        for kind, layer, _, _, s in self.blocks:
            recv = self.attn_receivers(layer) if kind == "attn" else [f"MLP{layer}"] if kind == "mlp" else ["LOGITS"]
            for r in recv:
                names += [f"{self.senders[i]}->{r}" for i in range(s)]
        return names

    @cached_property
    def edge_index(self) -> dict[str, int]:
        return {e: i for i, e in enumerate(self.edges)}

    @cached_property
    def edge_sender(self) -> np.ndarray:
        """Sender index of every edge."""
        out = np.empty(self.n_edges, dtype=np.int64)
        for _, _, offset, r, s in self.blocks:
            out[offset : offset + r * s] = np.tile(np.arange(s), r)
        return out

    @cached_property
    def edge_receiver(self) -> np.ndarray:
        """Receiver index (into ``receivers``) of every edge."""
        out = np.empty(self.n_edges, dtype=np.int64)
        base = 0
        for _, _, offset, r, s in self.blocks:
            out[offset : offset + r * s] = np.repeat(np.arange(base, base + r), s)
            base += r
        return out

    def mask(self, edges: Iterable[str] = (), fill: bool = False) -> np.ndarray:
        """A boolean vector over all edges: ``True`` for ``edges`` (or every edge with ``fill``)."""
        m = np.full(self.n_edges, fill, dtype=bool)
        for e in edges:
            if e not in self.edge_index:
                raise ValueError(f"unknown edge {e!r}; edges look like 'L3H5->L7H2.q', 'EMB->MLP0', 'MLP4->LOGITS'")
            m[self.edge_index[e]] = True
        return m

    def to_dict(self) -> dict:
        out = {
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "n_edges": self.n_edges,
        }
        return {**out, "parallel": True} if self.parallel else out


def expected_edge_count(n_layers: int, n_heads: int, n_kv_heads: int, parallel: bool = False) -> int:
    """Closed form of the edge count: ``sum_l [(H + 2G)(1 + l(H+1)) + (1 + l(H+1) + H)] + 1 + L(H+1)``
    (without the ``+ H`` into each MLP for parallel blocks)."""
    total = 0
    for l in range(n_layers):
        before = 1 + l * (n_heads + 1)
        total += (n_heads + 2 * n_kv_heads) * before + before + (0 if parallel else n_heads)
    return total + 1 + n_layers * (n_heads + 1)


def prune_dangling(graph: Graph, mask: np.ndarray, forward: bool = True) -> np.ndarray:
    """Drop edges whose sender is not reached from ``EMB`` or whose receiver's node cannot reach ``LOGITS``.

    A node is *reached* when it is ``EMB`` or one of its receivers has an edge from a reached node;
    it *reaches logits* when it is ``LOGITS`` or it sends an edge to a receiver whose node reaches logits.
    Repeats until nothing changes. Dropping edges into nodes that do not reach the logits never
    changes the circuit's output. Dropping edges from unreached senders (``forward``) is exact under
    zero ablation only (the sender's inputs are all zero, so is its output); under mean ablation such
    a sender still outputs something: ``forward=False`` keeps its edges.
    """
    mask = mask.copy()
    node_of_recv = [graph.receiver_node(r) for r in graph.receivers]
    sender_pos = {n: i for i, n in enumerate(graph.senders)}
    while True:
        idx = np.flatnonzero(mask)
        reached = np.zeros(graph.n_senders, dtype=bool)
        reached[0] = True
        # topological order: edges sorted by receiver are in topological order of receivers
        order = idx[np.argsort(graph.edge_receiver[idx], kind="stable")]
        for e in order:
            if reached[graph.edge_sender[e]]:
                for node in node_of_recv[graph.edge_receiver[e]]:
                    if node in sender_pos:
                        reached[sender_pos[node]] = True
        alive = np.zeros(graph.n_senders, dtype=bool)
        for e in order[::-1]:
            nodes = node_of_recv[graph.edge_receiver[e]]
            if any(n == "LOGITS" or (n in sender_pos and alive[sender_pos[n]]) for n in nodes):
                alive[graph.edge_sender[e]] = True
        keep = reached[graph.edge_sender[idx]] if forward else np.ones(len(idx), dtype=bool)
        recv_alive = np.array(
            [
                any(
                    n == "LOGITS" or (n in sender_pos and alive[sender_pos[n]])
                    for n in node_of_recv[graph.edge_receiver[e]]
                )
                for e in idx
            ],
            dtype=bool,
        )
        keep &= recv_alive if len(idx) else keep
        new = np.zeros_like(mask)
        new[idx[keep]] = True
        if (new == mask).all():
            return new
        mask = new


@dataclass
class EdgeCircuit:
    """A set of edges of a model's graph; the JSON file follows the head circuit's conventions."""

    model: str
    task: str
    graph: Graph
    edges: list[str]
    scores: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mask(
        cls,
        model: str,
        task: str,
        graph: Graph,
        mask: np.ndarray,
        scores: Optional[np.ndarray] = None,
        meta: Optional[dict] = None,
    ) -> "EdgeCircuit":
        idx = np.flatnonzero(mask)
        edges = [graph.edges[i] for i in idx]
        sc = {graph.edges[i]: float(scores[i]) for i in idx} if scores is not None else {}
        return cls(model, task, graph, edges, sc, dict(meta or {}))

    def mask(self) -> np.ndarray:
        return self.graph.mask(self.edges)

    def nodes(self) -> list[str]:
        """Sender nodes with at least one edge in the circuit (plus ``LOGITS`` if it receives one)."""
        out = set()
        for e in self.edges:
            s, _, r = e.partition("->")
            out.add(s)
            out.update(self.graph.receiver_node(r))
        order = {n: i for i, n in enumerate(self.graph.senders + ["LOGITS"])}
        return sorted(out, key=order.__getitem__)

    def heads(self) -> list[str]:
        return [n for n in self.nodes() if n.startswith("L") and "H" in n and n != "LOGITS"]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "task": self.task,
            "kind": "edges",
            "graph": self.graph.to_dict(),
            "n_edges": len(self.edges),
            "fraction": len(self.edges) / self.graph.n_edges,
            "nodes": self.nodes(),
            "edges": self.edges,
            "scores": self.scores,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "EdgeCircuit":
        if data.get("kind") != "edges":
            raise ValueError(
                'not an edge circuit (its JSON has no "kind": "edges"); head circuits load with '
                "mechdiff.circuits.Circuit"
            )
        g = data["graph"]
        graph = Graph(int(g["n_layers"]), int(g["n_heads"]), int(g["n_kv_heads"]), bool(g.get("parallel", False)))
        graph.mask(data["edges"])  # validates every edge name
        return cls(
            data["model"],
            data["task"],
            graph,
            list(data["edges"]),
            dict(data.get("scores", {})),
            dict(data.get("meta", {})),
        )

    @classmethod
    def load(cls, path: str | Path) -> "EdgeCircuit":
        return cls.from_dict(json.loads(Path(path).read_text()))
