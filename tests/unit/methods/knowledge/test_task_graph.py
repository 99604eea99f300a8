"""The adapter from a task's records to the edge graph's batches (`mechdiff.methods.knowledge.task_graph`), on a tiny
random llama: its batches give the metric the task's own scorer gives on the same rows (log answer probability;
IOI's logit difference over several templates), its ablation is the node scorer's position-wise means, and each
prompt's edge scores sum to the batch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from einops import rearrange
from tolerances import assert_close32

from mechdiff.circuits.scoring import Scorer, per_prompt
from mechdiff.methods.knowledge.forward import edge_forward, edge_gradients
from mechdiff.methods.knowledge.graph import Graph
from mechdiff.methods.knowledge.task_graph import group_ablations, prompt_edge_scores, task_batches
from mechdiff.tasks.base import Example, get_task, group_key


def task_rows(tokenizer, name: str, n: int, ref: int) -> tuple[list, list]:
    task = get_task(name)
    opts = {"n_boxes": 3} if name == "entity-tracking" else {}
    return task.records(tokenizer, n, 0, **opts), task.reference_records(tokenizer, ref, 1, **opts)


def metric_of(lm, graph, batches, n: int) -> np.ndarray:
    """The adapter's per-prompt metric of the unablated model, in the records' order."""
    out = np.full(n, np.nan)
    with torch.no_grad():
        for b in batches:
            out[b.rows] = b.values(edge_forward(lm, graph, b.ids, None).logits).numpy()
    return out


@pytest.mark.parametrize(("task", "metric"), [("entity-tracking", "prob"), ("ioi", "prob"), ("ioi", "logit_diff")])
def test_the_adapters_batches_give_the_metric_of_the_tasks_own_scorer(tiny_llama, smollm2_tokenizer, task, metric):
    records, reference = task_rows(smollm2_tokenizer, task, 10, 20)
    graph = Graph.for_model(tiny_llama)
    batches = task_batches(records, 4, metric)
    scorer = Scorer.build(tiny_llama, records, reference, 4, False, metric=metric)
    want = per_prompt(scorer.full(), metric)
    got = metric_of(tiny_llama, graph, batches, len(records))
    assert_close32(got, np.log(want) if metric == "prob" else want)
    assert sorted(r for b in batches for r in b.rows) == list(range(len(records)))
    assert all(len({group_key(records[r]) for r in b.rows}) == 1 for b in batches)


def test_the_ablation_is_the_node_scorers_position_wise_means_through_each_heads_output(tiny_llama, smollm2_tokenizer):
    """Each head's ablated output at each position is its mean ``z`` (the node scorer's group means) through
    ``W_o``: the same mean ablation as the node circuit's, per template and length."""
    records, reference = task_rows(smollm2_tokenizer, "ioi", 10, 20)
    graph = Graph.for_model(tiny_llama)
    ablations = group_ablations(tiny_llama, graph, reference, 4)
    means = Scorer.build(tiny_llama, records, reference, 4, False).means
    means = means if isinstance(means, dict) else {group_key(reference[0]): means}
    assert set(ablations) == set(means) and len(means) > 1
    H = graph.n_heads
    for key, z in means.items():
        for layer in range(graph.n_layers):
            wo = tiny_llama.model.model.layers[layer].self_attn.o_proj.weight  # "d (h e)"
            wo = wo.view(-1, H, wo.shape[1] // H)  # "d h e"
            per_head = torch.einsum("phe,dhe->hpd", rearrange(z[layer], "p (h e) -> p h e", h=H), wo)
            got = ablations[key].means[[graph.head_index(layer, h) for h in range(H)]]
            assert_close32(got, per_head)


def test_each_prompts_edge_scores_sum_to_the_batchs_and_refusals_come_first(tiny_llama, smollm2_tokenizer):
    records, reference = task_rows(smollm2_tokenizer, "entity-tracking", 6, 12)
    graph = Graph.for_model(tiny_llama)
    batches = task_batches(records, 3)
    ablations = group_ablations(tiny_llama, graph, reference, 6)
    per = prompt_edge_scores(tiny_llama, graph, batches, ablations, "eap", progress=False)
    for b in batches:
        whole = edge_gradients(tiny_llama, graph, b.ids, lambda lg, b=b: b.values(lg).sum(), 1.0, ablations[b.group])
        assert_close32(per[b.rows].sum(0), whole)
    assert np.abs(per).sum(1).min() > 0  # every prompt scored
    ig = prompt_edge_scores(tiny_llama, graph, batches[:1], ablations, "eap-ig", steps=2, progress=False)
    first = batches[0].rows
    assert ig.shape == (1 + max(first), graph.n_edges) and not np.allclose(ig[first], per[first])
    with pytest.raises(ValueError, match="no reference prompts"):
        prompt_edge_scores(tiny_llama, graph, batches, {}, progress=False)
    with pytest.raises(ValueError, match="unknown edge attribution"):
        prompt_edge_scores(tiny_llama, graph, batches, ablations, "acdc", progress=False)
    long = Example("a b", (1, 2), " c d", 3, answer_tokens=(3, 4))
    with pytest.raises(ValueError, match="several tokens"):
        task_batches([long], 2)
    with pytest.raises(ValueError, match="alternative answers"):
        task_batches(records, 3, "logit_diff")


def test_identical_checkpoints_scored_on_one_prompt_overlap_fully_in_edges_and_nodes(tiny_llama, smollm2_tokenizer):
    """A tiny model's own edge scores, one prompt repeated (every half's top-n the same), the model twice: edge and
    node overlap 1 with their intervals at 1, and nothing read as moved."""
    from mechdiff.methods.edge_structure import NOT_SHOWN, edge_structure

    records, reference = task_rows(smollm2_tokenizer, "entity-tracking", 1, 12)
    graph = Graph.for_model(tiny_llama)
    ablations = group_ablations(tiny_llama, graph, reference, 6)
    x = prompt_edge_scores(tiny_llama, graph, task_batches(records * 8, 4), ablations, progress=False)
    rec = edge_structure({"a": x, "b": x.copy()}, graph, 10, draws=10, seed=0, resamples=20, resample_splits=2)
    step = rec["consecutive"][0]
    for kind in ("edges", "nodes"):
        for est in (step[kind]["cross"], rec["null"]["a"][kind]):
            assert est["value"] == est["low"] == est["high"] == 1.0
    assert step["reading"] == NOT_SHOWN and len(rec["top"]["a"]["edges"]) == 10
