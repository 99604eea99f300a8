"""Circuit scoring by mean ablation (Wang et al. 2022): the reference means, the ablation patches and `Scorer`;
faithfulness, its random baseline, completeness and the circuit x model matrix are in `mechdiff.circuits.measures`,
minimality and pruning in `mechdiff.circuits.pruning`.

A circuit is a set of (head, position-name) pairs. Evaluating a circuit replaces every head's
output ``z`` by its position-wise mean over a reference set, EXCEPT the circuit's pairs: a
circuit head keeps the value it computes *in the ablated run* at its group's position (and is
mean-ablated at every other position). MLPs and embeddings are untouched. Per layer this is one
mixing patch on ``z``: ``z <- z * mask + mean * (1 - mask)`` with ``mask`` 1 at the kept
(head columns, position) cells (`mechdiff.patching.core.Patch` with ``mask``).

Template-consistent means: a prompt's position-wise mean is taken over the reference prompts of its own
template and token length (its `group_key`), never across templates or
lengths; a prompt whose group has no reference prompt is refused (`check_reference`).
Where records name no template their group is their token length. (Prakash et al. average over one
template's prompts; this keeps their rule for tasks of several templates.)

The metric ``F`` is task accuracy (per prompt: is the answer the top-1 token; for an answer of several tokens,
is it what greedy decoding gives) or the answer probability (for several tokens, the product of the tokens'
teacher-forced probabilities); faithfulness is ``F(C) / F(M)``. Ablations write the prompt's positions only,
never an appended answer token's (`evaluate`). The position
`EVERY_POSITION` (``"*"``) keeps or ablates a head at every position (the "all heads at all positions" circuit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional, Sequence

import numpy as np
import torch
from einops import repeat

from ..common.components import Head
from ..common.metrics import CONTINUOUS_LABELS, continuous_key, faithfulness_key, metric_name  # noqa: F401
from ..models.loading import LoadedModel
from ..patching.ablation import site_means
from ..patching.core import Patch, Resume, run, suffix_supported
from ..patching.evaluate import EvalResult, evaluate
from ..tasks.base import (
    GroupKey,
    Record,
    batch_tensors,
    check_reference,
    group_key,
    group_name,
    grouped_batches,
    max_answer_length,
    take,
)

log = logging.getLogger(__name__)

EVERY_POSITION = "*"
Pair = tuple[Head, str]
Metric = Literal["accuracy", "prob", "logit_diff"]
Means = dict[GroupKey, torch.Tensor]  # (template, length) -> "layer pos (head d_head)"


# --------------------------------------------------------------------------------------
# Position-wise means (the reference set comes from the task: Task.reference_records)
# --------------------------------------------------------------------------------------


def position_means(
    model: LoadedModel,
    records: Sequence[Record],
    batch_size: int = 32,
    progress: bool = True,
    store: Optional[str | Path] = None,
) -> torch.Tensor:
    """Mean over ``records`` (of one template and token length) of every layer's ``z`` at each position:
    ``"layer pos (head d_head)"`` (float32); `group_means` takes records of several groups.

    The one place the activation cache plugs in: with ``store`` (an HDF5 path) the means are
    read from / written to `mechdiff.patching.store.ActivationStore`, keyed by the model's
    fingerprint and the reference set's hash; without it they are computed in memory. Both sum in
    float64 through `mechdiff.patching.ablation`.
    """
    if not records:
        raise ValueError("no reference records to average; give at least one")
    groups = list(dict.fromkeys(group_key(r) for r in records))
    if len(groups) > 1:
        raise ValueError(
            f"position-wise means never mix templates or lengths; these records are of "
            f"{'; '.join(group_name(g) for g in groups)} (group_means takes each apart)"
        )
    if store is not None:
        from ..patching.store import ActivationStore

        return ActivationStore(store).means(model, records, "z", batch_size, progress)
    ids = (batch_tensors(take(records, rows))["input_ids"] for rows in grouped_batches(records, batch_size))
    return site_means(model, ids, "z", progress, desc=f"means {model.name}")


def group_means(
    model: LoadedModel,
    records: Sequence[Record],
    batch_size: int = 32,
    progress: bool = True,
    store: Optional[str | Path] = None,
) -> Means:
    """`position_means` of each group (template, token length) of ``records``: ``{group: means}``."""
    if not records:
        raise ValueError("no reference records to average; give at least one")
    groups: dict[GroupKey, list] = {}
    for r in records:
        groups.setdefault(group_key(r), []).append(r)
    return {k: position_means(model, rs, batch_size, progress, store) for k, rs in groups.items()}


def means_for(means: Means | torch.Tensor, batch: dict) -> torch.Tensor:
    """The means of one batch's group (``means`` a single tensor: those, for prompts of one group)."""
    if isinstance(means, torch.Tensor):
        return means
    key = batch.get("group")
    if key is None and len(means) == 1:
        return next(iter(means.values()))
    if key not in means:
        raise ValueError(
            f"no reference means for the prompts of {group_name(key) if key else 'mixed templates'}; "
            f"means exist for {'; '.join(group_name(k) for k in means)}"
        )
    return means[key]


# --------------------------------------------------------------------------------------
# Ablation patches
# --------------------------------------------------------------------------------------


def _pairs_by_layer(pairs: Iterable[Pair]) -> dict[int, list[Pair]]:
    out: dict[int, list[Pair]] = {}
    for head, pos in pairs:
        out.setdefault(head.layer, []).append((head, pos))
    return out


def position_mask(batch: dict, name: str) -> torch.Tensor:
    """Boolean ``"batch pos"``: where position ``name`` lies in each prompt. ``name`` is a position class
    the task defines as a mask (``batch["position_classes"]``), a class of indices ``[batch, k]`` or one
    index per prompt (``batch["positions"]``)."""
    classes = batch.get("position_classes", {})
    if name in classes:
        return classes[name]
    if name not in batch["positions"]:
        raise ValueError(
            f"unknown position {name!r}; valid: {sorted(batch['positions'])}, the classes "
            f"{sorted(classes)} or {EVERY_POSITION!r}"
        )
    where = batch["positions"][name]
    if (where < 0).any():
        kind = "position class" if where.ndim == 2 else "position"
        raise ValueError(f"{kind} {name!r} is missing in some prompts; score on prompts that contain it")
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    rows = torch.arange(len(where))
    mask[rows[:, None] if where.ndim == 2 else rows, where] = True
    return mask


def is_one_token(batch: dict, name: str) -> bool:
    """Whether ``name`` is one named token per prompt (``batch["positions"]``, ``[batch]``; DCM and CMAP patch it
    as before) rather than a position class of any number of tokens (read through `position_mask`)."""
    where = batch["positions"].get(name)
    return where is not None and where.dim() == 1


def class_indices(batch: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of position ``name`` (`position_mask`) in each prompt, in order: indices ``"batch k"``
    padded with ``-1`` (``k``: the most tokens a prompt has, at least 1) and where they are real (``"batch k"``,
    boolean). A prompt where the class is empty has no real index."""
    mask = position_mask(batch, name)
    counts = mask.sum(1)
    k = max(1, int(counts.max()) if len(counts) else 0)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :k]  # the class's tokens first, in order
    real = torch.arange(k)[None] < counts[:, None]
    return torch.where(real, order, torch.full_like(order, -1)), real


def _head_mask(layer_pairs: Sequence[Pair], batch: dict, n_pos: int, n_heads: int, fill: float) -> torch.Tensor:
    """``"batch pos head"``: ``1 - fill`` everywhere, ``fill`` at each pair's (position, head)."""
    n = batch["input_ids"].shape[0]
    mask = torch.full((n, n_pos, n_heads), 1.0 - fill)
    for head, pos in layer_pairs:
        column = mask[:, :, head.head]  # a view: writing it writes the mask
        if pos == EVERY_POSITION:
            column.fill_(fill)
        else:
            column[position_mask(batch, pos)] = fill
    return mask


def ablation_patches(
    model: LoadedModel, means: torch.Tensor, batch: dict, pairs: Iterable[Pair], keep: bool = True
) -> list[Patch]:
    """The ``z`` patches of a mean ablation for one batch.

    ``keep=True``: every head is mean-ablated except ``pairs`` (the circuit, evaluated as F(C)).
    ``keep=False``: only ``pairs`` are mean-ablated, everything else runs clean (F(M \\ K)).
    """
    shape = model.shape
    n_pos = batch["input_ids"].shape[1]
    means = means_for(means, batch)
    if means.shape[:2] != (shape.n_layers, n_pos):
        raise ValueError(
            f"means have shape {tuple(means.shape)} but the model has {shape.n_layers} layers and the "
            f"prompts {n_pos} tokens; compute the means on prompts with the same n_boxes"
        )
    by_layer = _pairs_by_layer(pairs)
    patches = []
    for layer in range(shape.n_layers):
        layer_pairs = by_layer.get(layer, [])
        if not keep and not layer_pairs:
            continue  # nothing ablated in this layer
        mask = None
        if layer_pairs:
            heads = _head_mask(layer_pairs, batch, n_pos, shape.n_heads, fill=1.0 if keep else 0.0)
            if keep and bool(heads.all()):
                continue  # every head kept everywhere: the clean value, exactly
            mask = repeat(heads, "batch pos head -> batch pos (head d)", d=shape.d_head)
        patches.append(Patch("z", layer, means[layer][None], mask=mask))
    return patches


# --------------------------------------------------------------------------------------
# The scorer: cached evaluations of one model on one prompt set
# --------------------------------------------------------------------------------------


@dataclass
class Scorer:
    """Evaluates one model under mean ablations on fixed prompts, caching every result by pair set."""

    model: LoadedModel
    records: Sequence[Record]
    means: Means | torch.Tensor  # per group (template, length), or one tensor for prompts of one group
    batch_size: int = 32
    progress: bool = True
    #: The task's metric (``Task.metric``): the continuous measure of faithfulness, the curve and completeness.
    metric: str = "prob"
    cache: dict = field(default_factory=dict, repr=False)
    runs: dict = field(default_factory=dict, repr=False)  # (circuit, batch start) -> its run's residuals and keys

    @classmethod
    def build(
        cls,
        model: LoadedModel,
        records: Sequence[Record],
        reference: Sequence[Record],
        batch_size: int = 32,
        progress: bool = True,
        store: Optional[str | Path] = None,
        metric: str = "prob",
    ) -> "Scorer":
        """Compute (or read from ``store``) the position-wise means on ``reference``, per group; a scorer for
        ``records`` (refused, before any forward pass, where a group of ``records`` has no reference prompt).
        ``metric``: the task's (``prob`` or ``logit_diff``, the latter refused on records without alternatives)."""
        faithfulness_key(metric)
        if metric_name(metric) == "logit_diff" and not all(getattr(r, "alternative_ids", ()) for r in records):
            raise ValueError("metric logit_diff needs records with alternative answers (alternative_ids)")
        check_reference(records, reference)
        means = group_means(model, reference, batch_size, progress, store)
        only = next(iter(means.values())) if len(means) == 1 else None  # prompts of one group: its tensor
        return cls(model, records, means if only is None else only, batch_size, progress, metric_name(metric))

    def subset(self, rows: Sequence[int]) -> "Scorer":
        """A scorer of the same model and means on the prompts ``rows`` (indices into ``records``), with a cache of
        its own."""
        return Scorer(self.model, take(self.records, rows), self.means, self.batch_size, self.progress, self.metric)

    def full(self) -> EvalResult:
        """F(M): the unablated model."""
        return self._eval("full", frozenset(), lambda batch, rows: ())

    def keep(self, pairs: Iterable[Pair]) -> EvalResult:
        """F(C): every head mean-ablated except ``pairs``."""
        key = frozenset(pairs)
        return self._eval("keep", key, lambda batch, rows: ablation_patches(self.model, self.means, batch, key, True))

    def keep_without(self, pairs: Iterable[Pair], removed: Iterable[Pair]) -> EvalResult:
        """F(C \\ removed), computed only where it differs from F(C) (``C = pairs``).

        Removing pairs changes nothing below the lowest removed layer nor before the first position of the
        removed pairs' classes, so each batch resumes from F(C)'s own run (its residual stream entering that
        layer, its keys and values before that position; `Resume`, a suffix
        run) and recomputes only the rest. Equal to ``keep(C - removed)`` up to float rounding; cached
        under the same key, so either call serves the other. Answers of several tokens (teacher-forced runs)
        are scored as ``keep(C - removed)``."""
        base, removed = frozenset(pairs), frozenset(removed)
        key = base - removed
        if not removed or ("keep", key) in self.cache or self.model.remote or self.several_tokens:
            return self.keep(key)
        layer = min(head.layer for head, _ in removed)
        self.cache[("keep", key)] = evaluate(
            self.model,
            self.records,
            self.batch_size,
            desc=f"keep {len(key)} pairs (from layer {layer})",
            progress=self.progress,
            forward=lambda batch, rows: self._resumed(base, key, removed, layer, batch, rows),
        )
        return self.cache[("keep", key)]

    @property
    def several_tokens(self) -> bool:
        """Whether an answer of the scorer's prompts has several tokens (scored by teacher forcing)."""
        return max_answer_length(self.records) > 1

    def _resumed(
        self, base: frozenset, key: frozenset, removed: frozenset, layer: int, batch: dict, rows: Sequence[int]
    ) -> torch.Tensor:
        """The read-out logits of F(key) on one batch, resumed from F(base)'s run at ``layer``."""
        resid, kv = self._base_run(base, batch, rows)
        start, classes = 0, {pos for _, pos in removed}
        if suffix_supported(self.model) and EVERY_POSITION not in classes:
            where = torch.stack([position_mask(batch, pos) for pos in classes]).any(0).any(0)
            start = int(where.nonzero()[0]) if bool(where.any()) else batch["input_ids"].shape[1] - 1
        patches = [
            Patch(
                p.kind,
                p.layer,
                p.value[:, start:],
                slice(start, None),
                mask=None if p.mask is None else p.mask[:, start:],
            )
            for p in ablation_patches(self.model, self.means, batch, key, True)
            if p.layer >= layer
        ]
        resume = Resume(layer, resid[layer - 1]) if layer > 0 else None
        return run(
            self.model,
            batch["input_ids"],
            patches,
            resume=resume,
            prefix=kv if start > 0 else None,
            start=start if start > 0 else None,
        ).logits

    def _base_run(self, base: frozenset, batch: dict, rows: Sequence[int]) -> tuple[list[torch.Tensor], object]:
        """F(base)'s residual stream after every block and its keys and values on one batch (cached)."""
        if (base, rows[0]) not in self.runs:
            layers = range(self.model.shape.n_layers)
            with torch.no_grad():
                out = run(
                    self.model,
                    batch["input_ids"],
                    ablation_patches(self.model, self.means, batch, base, True),
                    capture=[("resid", layer) for layer in layers],
                    keep_kv=True,
                )
            self.runs[(base, rows[0])] = ([out.captured[("resid", layer)] for layer in layers], out.kv)
        return self.runs[(base, rows[0])]

    def ablate(self, pairs: Iterable[Pair]) -> EvalResult:
        """F(M \\ K): only ``pairs`` mean-ablated."""
        key = frozenset(pairs)
        if not key:
            return self.full()
        return self._eval(
            "ablate", key, lambda batch, rows: ablation_patches(self.model, self.means, batch, key, False)
        )

    def batches(self) -> Iterator[tuple[list[int], dict]]:
        """``(rows, batch tensors)`` over the scorer's prompts, ``batch_size`` at a time, each batch of one
        group (`grouped_batches`; ``rows`` index ``records``)."""
        for rows in grouped_batches(self.records, self.batch_size):
            yield rows, batch_tensors(take(self.records, rows))

    def _eval(self, mode: str, key: frozenset, patches) -> EvalResult:
        if (mode, key) not in self.cache:
            self.cache[(mode, key)] = evaluate(
                self.model,
                self.records,
                self.batch_size,
                patches=patches,
                desc=f"{mode} {len(key)} pairs",
                progress=self.progress,
            )
        return self.cache[(mode, key)]


def per_prompt(result: EvalResult, metric: Metric = "accuracy") -> np.ndarray:
    """Per-prompt values of ``metric``: correctness (0/1), answer probability (``prob``) or the logit difference
    (``logit_diff``: summed log-probabilities for answers of several tokens)."""
    metric = metric_name(metric)  # type: ignore[assignment]
    if metric == "accuracy":
        return result.correct.astype(float)
    if metric == "prob":
        return result.prob.astype(float)
    if metric == "logit_diff":
        if result.logit_diff is None:
            raise ValueError("metric logit_diff needs records with alternative answers (alternative_ids)")
        return result.logit_diff.astype(float)
    raise ValueError(f"unknown metric {metric!r}; use 'accuracy', 'prob' or 'logit_diff'")
