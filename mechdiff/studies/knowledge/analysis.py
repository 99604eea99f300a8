"""The ``analysis`` stage of the knowledge kind (per model, given its circuit): the logit lens of the residual
stream and of the circuit's nodes, attention mass and head roles; its key (the circuit's edges) and its cost."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...methods.knowledge.analysis import attention_mass, head_roles, logit_lens
from ...methods.knowledge.graph import EdgeCircuit, Graph
from ..planner import StageCost
from .facts import FactSet
from .model_run import ModelRun
from .settings import KnowledgeSettings


def analysis_stage(run: ModelRun, circuit: EdgeCircuit) -> dict:
    """Logit lens of the residual stream and of the circuit's nodes, attention mass and head roles."""
    t = time.time()
    nodes = [n for n in circuit.nodes() if n != "LOGITS"]
    lens = logit_lens(run.model, run.graph, run.batches, nodes)
    attn = attention_mass(run.model, run.batches, [n for n in nodes if n.startswith("L")])
    roles = head_roles(attn, lens["nodes"])
    lens_json = {
        "layers": list(lens["layers"]),
        "last": np.asarray(lens["last"]).tolist(),
        "last_subject": np.asarray(lens["last_subject"]).tolist(),
        "nodes": {n: np.asarray(r).tolist() for n, r in lens["nodes"].items()},
    }
    return {"lens": lens_json, "roles": roles, "timings": {"analysis": time.time() - t}}


def saved_lens(saved: dict) -> dict:
    """The logit lens as `analysis_stage` computed it (arrays), from its record's lists."""
    return {
        "layers": saved["layers"],
        "last": np.asarray(saved["last"]),
        "last_subject": np.asarray(saved["last_subject"]),
        "nodes": {n: np.asarray(r) for n, r in saved["nodes"].items()},
    }


def analysis_cost(meter: Any, s: KnowledgeSettings, graph: Graph, kept: FactSet, stage: str) -> StageCost:
    """`analysis_stage`: the logit lens's edge forward of every kept fact (the senders' outputs kept) with the
    unembedding of the residual stream after every layer at two positions, and `attention_mass`'s plain forward."""
    d, n = meter.dims, sum(kept.lengths.values())
    lens = 2 * (1 + d.n_layers) * n * 2 * d.d_model * d.vocab_size
    flops = kept.flops(1) + sum(meter.fwd(c, t) for t, c in kept.lengths.items()) + lens
    return StageCost(
        stage, len(s.models), n, meter.rows(n, s.batch_size), flops, len(s.models) * meter.weights, 0,
        kept.transient(kept_outputs=True), batch_option="[knowledge] batch_size",
        reads=meter.reads(2 * kept.passes),
    )  # fmt: skip
