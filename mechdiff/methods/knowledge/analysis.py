"""Analysis of a knowledge circuit: logit lens on its nodes and the residual stream, and head roles.

- Logit lens: ``lm_head(final_norm(x))`` for ``x`` a node's output (a head's output after
  ``o_proj``, an MLP's output) at the last token, and for the residual stream after each layer at
  the last subject token and the last token. The answer's rank (0 = top) per fact.
- Head roles (Yao et al.): from the attention of the last token,
  ``subject`` = attention mass on the subject's tokens, ``relation`` = mass on the template's
  tokens (every non-subject position but 0, the attention sink, the last token included).
  ``mixed``: both at least ``attn_threshold``; ``mover``: attends the subject (at least the
  threshold) and its logit-lens output ranks the answer within ``rank_threshold`` (median over
  facts); ``relation``: attends the relation tokens; ``other``: neither (usually the sink).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...models.loading import LoadedModel
from ...patching.core import run
from ...tasks.relation_data import FactBatch
from .forward import apply_norm, edge_forward, receiver_weights
from .graph import Graph


def _ranks(model: LoadedModel, x: torch.Tensor, answers: torch.Tensor) -> np.ndarray:
    """Rank of ``answers`` ``"n"`` in ``lm_head(final_norm(x))`` for ``x`` ``"n d"``."""
    W = receiver_weights(model)
    unembed = model.arch.unembed_module(model.model)
    out = []
    with torch.no_grad():
        for i in range(0, len(x), 256):
            logits = unembed(apply_norm(W.final_norm, x[i : i + 256])).float()
            a = answers[i : i + 256].to(logits.device)
            target = logits[torch.arange(len(a)), a]
            out.append(((logits >= target[:, None]).sum(-1) - 1).cpu().numpy())  # ties count against
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def logit_lens(
    model: LoadedModel, graph: Graph, batches: Sequence[FactBatch], nodes: Sequence[str] = (), max_node_facts: int = 24
) -> dict:
    """Answer ranks per layer (residual stream) at the last subject token and last token, and per node.

    ``nodes``: sender names (``L3H5``, ``MLP7``, ``EMB``) whose own output is read at the last
    token, on the first ``max_node_facts`` facts (the unembedding of every node is the costly part).
    """
    sender_pos = {n: i for i, n in enumerate(graph.senders)}
    idx = [sender_pos[n] for n in nodes]
    after_layer = [graph.mlp_index(l) for l in range(graph.n_layers)]
    res_last, res_subj, node_ranks = [], [], []
    n_node_facts = 0
    for b in batches:
        with torch.no_grad():
            outs = edge_forward(model, graph, b.ids, None, keep_outputs=True).outputs  # s b p d
        rows = torch.arange(len(b))
        for pos, store in ((torch.full((len(b),), b.ids.shape[1] - 1), res_last), (b.last_subject, res_subj)):
            x = outs[:, rows, pos]  # s b d
            resid = torch.cumsum(x, 0)[[0] + after_layer]  # (1 + L) b d: after the embedding, after each layer
            r = _ranks(model, resid.reshape(-1, x.shape[-1]), b.answers.repeat(resid.shape[0]))
            store.append(r.reshape(resid.shape[0], len(b)))
        take = min(len(b), max_node_facts - n_node_facts)
        if idx and take > 0:
            x = outs[idx][:, :take, -1]  # n take d
            r = _ranks(model, x.reshape(-1, x.shape[-1]), b.answers[:take].repeat(len(idx)))
            node_ranks.append(r.reshape(len(idx), take))
            n_node_facts += take
        del outs
    out = {
        "layers": ["EMB"] + [f"L{l}" for l in range(graph.n_layers)],
        "last": np.concatenate(res_last, 1),
        "last_subject": np.concatenate(res_subj, 1),
    }
    out["nodes"] = {n: np.concatenate([nr[i] for nr in node_ranks]) for i, n in enumerate(nodes)} if node_ranks else {}
    return out


def attention_mass(model: LoadedModel, batches: Sequence[FactBatch], heads: Sequence[str]) -> dict[str, dict]:
    """Mean attention of the last token to the subject and to the relation tokens, per head."""
    parsed = [(h, int(h[1:].split("H")[0]), int(h.split("H")[1])) for h in heads]
    layers = sorted({l for _, l, _ in parsed})
    subj = {h: [] for h in heads}
    rel = {h: [] for h in heads}
    for b in batches:
        with torch.no_grad():
            pats = run(model, b.ids, capture=[("pattern", l) for l in layers]).captured
        for i, f in enumerate(b.facts):
            s0, s1 = f.subject_span
            rp = f.relation_positions()
            for h, l, hh in parsed:
                row = pats[("pattern", l)][i, hh, -1].float()
                subj[h].append(float(row[s0:s1].sum()))
                rel[h].append(float(row[rp].sum()))
    return {h: {"subject": float(np.mean(subj[h])), "relation": float(np.mean(rel[h]))} for h in heads}


def head_roles(
    attention: dict[str, dict],
    node_ranks: dict[str, np.ndarray],
    attn_threshold: float = 0.2,
    rank_threshold: int = 100,
) -> dict[str, dict]:
    """Role of each head from its attention masses and its logit-lens ranks (see the module docstring)."""
    roles = {}
    for h, a in attention.items():
        ranks = node_ranks.get(h)
        med = float(np.median(ranks)) if ranks is not None and len(ranks) else float("nan")
        promotes = med <= rank_threshold
        s, r = a["subject"], a["relation"]
        if s >= attn_threshold and r >= attn_threshold:
            role = "mixed"
        elif s >= attn_threshold and promotes:
            role = "mover"
        elif r >= attn_threshold:
            role = "relation"
        else:
            role = "other"
        roles[h] = {"role": role, "subject_attention": s, "relation_attention": r, "answer_rank_median": med}
    return roles
