"""Answer metrics (probability, top-1 accuracy, log-probability, logit difference, rank) at every place
that reports them, each against the plain model's last-token logits computed here in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny

from mechdiff.common.metrics import accuracy, answer_prob, kl_divergence, logit_diff, task_metric
from mechdiff.tasks import ioi
from mechdiff.tasks.base import answer_batch, batch_tensors
from mechdiff.tasks.entity_tracking import generate, object_value_pairs, pair_batch_tensors


def _last(model, ids: torch.Tensor) -> np.ndarray:
    """The plain HF model's last-token logits, float64: the independent reference."""
    with torch.no_grad():
        return model.model(input_ids=ids).logits[:, -1].double().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _take(x: np.ndarray, ids) -> np.ndarray:
    return x[np.arange(len(x)), np.asarray(ids)]


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return make_tiny("llama", smollm2_tokenizer, seed=3)


@pytest.fixture(scope="module")
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 6, n_boxes=3, seed=0)


@pytest.fixture(scope="module")
def ioi_records(smollm2_tokenizer):
    return ioi.generate(smollm2_tokenizer, 5, seed=0, templates=ioi.TEMPLATES[:1])  # one length: one batch


def _planted_answers(model, records) -> list[int]:
    """Answers that make half the prompts right under the tiny model (its top-1 token), half wrong."""
    top = _last(model, batch_tensors(records)["input_ids"]).argmax(-1)
    return [int(t) if i % 2 == 0 else int(t) + 1 for i, t in enumerate(top)]


def test_pure_metrics_match_numpy():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    answer, alt = torch.tensor([0, 3, 3, 10, 7]), torch.tensor([[1, 2], [3, 4], [0, 0], [5, 6], [9, 8]])
    x = logits.double().numpy()
    np.testing.assert_allclose(
        task_metric(logits, answer, "prob").numpy(), np.exp(_take(_log_softmax(x), answer)), rtol=1e-6
    )
    want = _take(x, answer) - (_take(x, alt[:, 0]) + _take(x, alt[:, 1])) / 2
    np.testing.assert_allclose(task_metric(logits, answer, "logit_diff", alt).numpy(), want, rtol=1e-5, atol=1e-6)
    from mechdiff.patching.scan import METRICS as SCAN

    other = alt[:, 0]
    np.testing.assert_allclose(
        SCAN["logit_diff"][0](logits, answer, other).numpy(), _take(x, answer) - _take(x, other), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(SCAN["answer_logit"][0](logits, answer, None).numpy(), _take(x, answer), rtol=1e-6)
    np.testing.assert_allclose(
        SCAN["prob"][0](logits, answer, None).numpy(), np.exp(_take(_log_softmax(x), answer)), rtol=1e-6
    )
    # one vocabulary: the answer's probability is "prob" everywhere; the scan's earlier "answer_prob" is read as it
    from mechdiff.common.metrics import metric_name

    assert metric_name("answer_prob") == "prob" and metric_name("logit_diff") == "logit_diff"
    np.testing.assert_array_equal(
        task_metric(logits, answer, "answer_prob").numpy(), task_metric(logits, answer, "prob").numpy()
    )
    from mechdiff.methods.cmap import _score

    correct, prob, diff = _score(logits, answer)
    assert diff is None  # a prob task keeps no logit difference
    np.testing.assert_array_equal(correct, x.argmax(-1) == answer.numpy())
    np.testing.assert_allclose(prob, np.exp(_take(_log_softmax(x), answer)), rtol=1e-6)
    from mechdiff.methods.knowledge.discovery import answer_logprob

    np.testing.assert_allclose(answer_logprob(logits, answer).numpy(), _take(_log_softmax(x), answer), rtol=1e-6)
    with pytest.raises(ValueError, match="alternative"):
        task_metric(logits, answer, "logit_diff")
    with pytest.raises(ValueError, match="unknown metric"):
        task_metric(logits, answer, "rank", alt)


def test_evaluate_reports_the_models_own_metrics(tiny, ioi_records):
    from mechdiff.patching.evaluate import evaluate

    res = evaluate(tiny, ioi_records, batch_size=2, progress=False)
    t = batch_tensors(ioi_records)
    x = _last(tiny, t["input_ids"])
    np.testing.assert_array_equal(res.correct, x.argmax(-1) == t["answer_ids"].numpy())
    np.testing.assert_allclose(res.prob, np.exp(_take(_log_softmax(x), t["answer_ids"])), rtol=1e-5)
    alt = t["alternative_ids"].numpy()
    want = _take(x, t["answer_ids"]) - np.stack([_take(x, alt[:, j]) for j in range(alt.shape[1])]).mean(0)
    np.testing.assert_allclose(res.logit_diff, want, rtol=1e-4, atol=1e-5)
    targets = _planted_answers(tiny, ioi_records)
    planted = evaluate(tiny, ioi_records, batch_size=3, targets=targets, progress=False)
    np.testing.assert_array_equal(planted.correct, [i % 2 == 0 for i in range(len(targets))])


def test_scoring_per_prompt_reads_the_evaluation(tiny, records):
    from mechdiff.circuits.scoring import per_prompt
    from mechdiff.patching.evaluate import evaluate

    res = evaluate(tiny, records, progress=False)
    np.testing.assert_array_equal(per_prompt(res, "accuracy"), res.correct.astype(float))
    np.testing.assert_array_equal(per_prompt(res, "prob"), res.prob)
    with pytest.raises(ValueError, match="unknown metric"):
        per_prompt(res, "rank")


def test_headmap_and_finetune_accuracy(tiny, records):
    from mechdiff.methods.finetune import accuracy
    from mechdiff.methods.headmap import correct

    batch = answer_batch(records)
    batch["answer_ids"] = torch.tensor(_planted_answers(tiny, records))
    want = np.array([i % 2 == 0 for i in range(len(records))], dtype=float)
    np.testing.assert_array_equal(correct(tiny.model, batch, batch_size=4), want)
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    assert accuracy(tiny.model, halves) == want.mean()
    from mechdiff.methods.headmap import example_losses

    x = _last(tiny, batch["input_ids"])
    np.testing.assert_allclose(
        example_losses(tiny, batch, batch_size=4).numpy(), -_take(_log_softmax(x), batch["answer_ids"]), rtol=1e-5
    )


def test_dcm_floor_and_target_logit(tiny, smollm2_tokenizer):
    from mechdiff.common.components import Head
    from mechdiff.methods.dcm import DCMConfig, PairCache, loss_scale

    pairs = object_value_pairs(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    t = pair_batch_tensors(pairs)
    x = _last(tiny, t["base"]["input_ids"])
    cache = PairCache.build(tiny, pairs, [([Head(1, 0)], "last")], 4, False)
    np.testing.assert_array_equal(cache.accuracy(tiny, range(6), [], "last"), x.argmax(-1) == t["target_ids"].numpy())
    heads = [Head(1, 0)]
    cfg = DCMConfig(lam_scale="loss", micro_batch=3)
    with torch.no_grad():  # every mask entry 1 keeps the base's own z: the unpatched target logit
        scale = loss_scale(tiny, heads, "last", cache, range(6), cfg)
    assert scale == pytest.approx(np.abs(_take(x, t["target_ids"])[:3]).mean(), rel=1e-5)


def test_path_patching_clean_probability(tiny, smollm2_tokenizer):
    from mechdiff.patching.path import prepare

    pairs = object_value_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=1)
    batch = prepare(tiny, pairs)
    x = _last(tiny, batch.clean_ids)
    np.testing.assert_allclose(batch.p_clean.numpy(), np.exp(_take(_log_softmax(x), batch.answer_ids)), rtol=1e-5)


def test_knowledge_evaluation_hits_ranks_and_logprob(smollm2_tokenizer):
    from mechdiff.methods.knowledge.evaluate import evaluate
    from mechdiff.methods.knowledge.graph import Graph
    from mechdiff.tasks.relation_data import FactBatch

    model = make_tiny("llama", None, seed=1)
    ids = torch.randint(0, 2000, (5, 6), generator=torch.Generator().manual_seed(0))
    x = _last(model, ids)
    order = np.argsort(-x, -1)
    answers = torch.tensor([int(order[i, r]) for i, r in enumerate([0, 3, 12, 1, 40])])
    ev = evaluate(
        model, Graph.from_shape(model.shape), [FactBatch([None] * 5, ids, answers, torch.zeros(5))], None, k=10
    )
    np.testing.assert_array_equal(ev.rank, [0, 3, 12, 1, 40])
    np.testing.assert_array_equal(ev.hit, [True, True, False, True, False])
    np.testing.assert_allclose(ev.logprob, _take(_log_softmax(x), answers), rtol=1e-4, atol=1e-5)


def test_metrics_module_against_numpy():
    from mechdiff.common import metrics as M

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, -1.0, 0.0, 4.0]])
    x = logits.double().numpy()
    answer = torch.tensor([2, 0])
    np.testing.assert_array_equal(M.answer_rank(logits, answer).numpy(), [1, 1])  # a tie counts against the answer
    np.testing.assert_array_equal(M.answer_is_top1(logits, answer).numpy(), [False, False])
    np.testing.assert_array_equal(M.accuracy(logits, torch.tensor([1, 3])).numpy(), [1.0, 1.0])
    np.testing.assert_allclose(M.answer_logprob(logits, answer).numpy(), _take(_log_softmax(x), answer), rtol=1e-6)
    # exact (numpy's default rtol=1e-7): picks of small integers and their differences and halves, all representable
    np.testing.assert_allclose(M.answer_logit(logits, answer).numpy(), [3.0, 2.0])
    one = M.logit_diff(logits, answer, torch.tensor([0, 3]))
    np.testing.assert_allclose(one.numpy(), [2.0, -2.0])
    np.testing.assert_allclose(M.logit_diff(logits, answer, torch.tensor([[0], [3]])).numpy(), one.numpy())
    np.testing.assert_allclose(
        M.task_metric(logits, answer, "logit_diff", torch.tensor([[0, 3], [1, 2]])).numpy(), [3.0 - 0.75, 2.0 + 0.5]
    )
    # half-precision logits are scored in float32
    assert M.answer_prob(logits.bfloat16(), answer).dtype == torch.float32
    with pytest.raises(ValueError, match="alternative_ids"):
        M.task_metric(logits, answer, "logit_diff")


def test_metrics():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    answers = torch.tensor([0, 1])
    probs = logits.softmax(-1)
    torch.testing.assert_close(answer_prob(logits, answers), probs[[0, 1], [0, 1]])
    torch.testing.assert_close(logit_diff(logits, answers, torch.tensor([1, 2])), torch.tensor([1.0, -3.0]))
    assert accuracy(logits, answers).tolist() == [1.0, 0.0]
    assert kl_divergence(logits, logits).abs().max() < 1e-6
    assert (kl_divergence(logits, logits.flip(-1)) > 0).all()
