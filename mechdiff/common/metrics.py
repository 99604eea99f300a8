"""Answer metrics on last-token logits, written once: every evaluation, scan, patching score, DCM,
HeadMap, fine-tuning and knowledge-circuit metric calls these. Torch only (no nnsight), so task
definitions can use them without loading the intervention layer.

Every function takes ``logits`` ``"batch vocab"`` (any dtype, any device; computed in float32) and
answer ids ``"batch"`` (moved to the logits' device) and returns one value per example, ``"batch"``,
on the logits' device. Training losses (fine-tuning's and HeadMap's mean answer cross-entropy) stay
torch's fused ``cross_entropy``; per-example losses are ``-answer_logprob``.

Answers of several tokens are scored by teacher forcing (`mechdiff.patching.core.answer_logits`): the
``sequence_*`` functions take the logits ``"batch a vocab"`` predicting each answer token, the answer's tokens
``"batch a"`` (right-padded) and their lengths ``"batch"``. An answer is correct where greedy decoding gives it
(every token the top-1); its log-probability is the sum over its tokens, its probability the product
(``exp`` of that sum: for one token, the token's probability).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

TASK_METRICS = ("prob", "logit_diff")
"""The per-prompt metrics a task can name (``Task.metric``, ``dataset import --metric``)."""
#: The one vocabulary of metric names: ``prob`` is the answer's probability wherever a metric is chosen (task
#: files, every command's ``--metric``, the API). Other names once used for it are read as it.
METRIC_ALIASES = {"answer_prob": "prob"}


def metric_name(name: str) -> str:
    """The one name of metric ``name`` (``answer_prob`` -> ``prob``; others as they are)."""
    return METRIC_ALIASES.get(name, name)


#: What a task's metric (``Task.metric``) names as a stage's continuous measure, in captions.
CONTINUOUS_LABELS = {"prob": "answer probability", "logit_diff": "logit difference"}


def scored_metric(choice: str, task_metric: str) -> str:
    """The metric a stage scores on where a setting chooses ``accuracy`` or ``prob``, the continuous one: the task's
    own metric (``task_metric``: the answer's probability, or the logit difference on a ``logit_diff`` task)."""
    return task_metric if metric_name(choice) == "prob" else choice


def metric_label(metric: str) -> str:
    """The caption words of a metric a stage scored on: ``accuracy``, or a task's continuous metric
    (`CONTINUOUS_LABELS`: ``answer probability``, ``logit difference``)."""
    return CONTINUOUS_LABELS.get(metric_name(metric), metric)


def faithfulness_key(metric: str) -> str:
    """The record key of the continuous faithfulness under a task's ``metric``: ``faithfulness_prob`` or
    ``faithfulness_logit_diff``."""
    metric = metric_name(metric)
    if metric not in CONTINUOUS_LABELS:
        raise ValueError(f"unknown task metric {metric!r}; choose one of {', '.join(CONTINUOUS_LABELS)}")
    return f"faithfulness_{metric}"


def continuous_key(record: Mapping[str, object]) -> str:
    """The continuous-faithfulness key a record holds (``faithfulness_logit_diff`` where it was scored under a
    logit-difference task, else ``faithfulness_prob``)."""
    return "faithfulness_logit_diff" if "faithfulness_logit_diff" in record else "faithfulness_prob"


def continuous_label(record: Mapping[str, object]) -> str:
    """The caption words of a record's continuous measure (``answer probability``, ``logit difference``)."""
    return CONTINUOUS_LABELS[continuous_key(record).removeprefix("faithfulness_")]


def _ids(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(ids).to(logits.device)


def answer_logit(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """The logit of each example's answer token."""
    return logits.float().gather(-1, _ids(logits, answer_ids)[:, None])[:, 0]


def answer_prob(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """The probability (softmax over the whole vocabulary) of each example's answer token."""
    return logits.float().softmax(-1).gather(-1, _ids(logits, answer_ids)[:, None])[:, 0]


def answer_logprob(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """The log-probability of each example's answer token."""
    return logits.float().log_softmax(-1).gather(-1, _ids(logits, answer_ids)[:, None])[:, 0]


def answer_is_top1(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """Bool: the top-1 token over the whole vocabulary is the answer (ties: the first maximum)."""
    return logits.argmax(-1) == _ids(logits, answer_ids)


def accuracy(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """1.0 where the top-1 token is the answer, else 0.0 (`answer_is_top1` as floats)."""
    return answer_is_top1(logits, answer_ids).float()


def answer_rank(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """The answer's rank, 0 for the top token; tokens tied with the answer count against it."""
    logits = logits.float()
    return (logits >= answer_logit(logits, answer_ids)[:, None]).sum(-1) - 1


def logit_diff(logits: torch.Tensor, answer_ids: torch.Tensor, alternative_ids: torch.Tensor) -> torch.Tensor:
    """The answer's logit minus the mean logit of its alternatives (e.g. IO - S in IOI).

    ``alternative_ids``: ``"batch"`` (one alternative each) or ``"batch k"``."""
    alt = _ids(logits, alternative_ids)
    alt = alt[:, None] if alt.ndim == 1 else alt
    logits = logits.float()
    return answer_logit(logits, answer_ids) - logits.gather(-1, alt).mean(-1)


def _real(tokens: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Boolean ``"batch a"``: the answer tokens within each answer's length (not padding)."""
    return torch.arange(tokens.shape[1], device=device)[None] < torch.as_tensor(lengths).to(device)[:, None]


def sequence_logprob(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each answer's summed log-probability over its tokens (teacher-forced ``logits`` ``"batch a vocab"``)."""
    tokens = _ids(logits, tokens)
    per_token = logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    return per_token.masked_fill(~_real(tokens, lengths, logits.device), 0.0).sum(-1)


def sequence_is_greedy(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Bool: greedy decoding gives the whole answer (each of its tokens the top-1 under teacher forcing)."""
    tokens = _ids(logits, tokens)
    hit = (logits.argmax(-1) == tokens) | ~_real(tokens, lengths, logits.device)
    return hit.all(-1)


def first_and_rest(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``"batch"`` each, from teacher-forced ``logits`` ``"batch a vocab"``: the answer's first token is the
    top-1 after the prompt, and every later token is the top-1 given the answer's tokens before it (true for a
    one-token answer, which has none). `sequence_is_greedy` is the two together."""
    hit = (logits.argmax(-1) == _ids(logits, tokens)) | ~_real(tokens, lengths, logits.device)
    return hit[:, 0], hit[:, 1:].all(-1)


def task_metric(
    logits: torch.Tensor, answer_ids: torch.Tensor, metric: str = "prob", alternative_ids: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """A task's per-prompt metric by name: ``prob`` (`answer_prob`) or ``logit_diff``
    (`logit_diff` against ``alternative_ids``)."""
    metric = metric_name(metric)
    if metric == "prob":
        return answer_prob(logits, answer_ids)
    if metric == "logit_diff":
        if alternative_ids is None:
            raise ValueError("metric logit_diff needs records with alternative answers (alternative_ids)")
        return logit_diff(logits, answer_ids, alternative_ids)
    raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(TASK_METRICS)}")


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) over the vocabulary."""
    ref = reference_logits.float().log_softmax(-1)
    new = logits.float().log_softmax(-1)
    return (ref.exp() * (ref - new)).sum(-1)
