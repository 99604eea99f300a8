"""Circuit scoring by mean ablation: faithfulness and completeness (Wang et al. 2022); minimality and pruning
are in `mechdiff.circuits.pruning`.

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
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional, Sequence

import numpy as np
import torch
from einops import repeat

from ..common import inference as inf
from ..common.components import Head, all_heads, layer_matched
from ..common.metrics import CONTINUOUS_LABELS, continuous_key, faithfulness_key, metric_name  # noqa: F401
from ..common.outcomes import bits
from ..common.progress import progress_bar
from ..common.stats import bootstrap, bootstrap_ratio, mean_estimate
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
from .circuit import Circuit

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


# --------------------------------------------------------------------------------------
# Faithfulness and the random baseline
# --------------------------------------------------------------------------------------


RANDOM_MATCH = ("layer", "all")  # the first is the default


def random_circuit(
    circuit: Circuit, n_layers: int, n_heads: int, rng: random.Random, match: str = RANDOM_MATCH[0]
) -> Circuit:
    """A circuit with the same per-group sizes and positions. ``match="layer"``: each head is replaced
    by a head of the same layer (same position), so the draw keeps the circuit's depth profile;
    ``"all"``: heads drawn from all heads of the model."""
    if match not in RANDOM_MATCH:
        raise ValueError(f"match must be one of {RANDOM_MATCH}, got {match!r}")
    if match == "all":
        pool = all_heads(n_layers, n_heads)
        groups = {g: sorted(rng.sample(pool, len(hs))) for g, hs in circuit.groups.items()}
    else:
        groups = {g: layer_matched(hs, n_heads, rng) for g, hs in circuit.groups.items()}
    return Circuit(
        circuit.model,
        circuit.task,
        groups,
        dict(circuit.positions),
        names=dict(circuit.names),
        meta={"random_baseline_of": circuit.model},
    )


def full_circuit(n_layers: int, n_heads: int, model: str = "", task: str = "") -> Circuit:
    """The whole model as a circuit: every head at every position (`EVERY_POSITION`), one group
    per layer (``"L0"``, ``"L1"``...). Its faithfulness is exactly 1 and its completeness exactly 0.
    It scores in memory; `Circuit.load` rejects the ``"*"`` position."""
    groups = {f"L{layer}": [Head(layer, h) for h in range(n_heads)] for layer in range(n_layers)}
    circuit = Circuit(model, task, groups, dict.fromkeys(groups, "last"), names={g: "" for g in groups})
    circuit.positions = dict.fromkeys(groups, EVERY_POSITION)
    return circuit


def control_prompts(records: Sequence[Record], n: int, seed: int) -> list[int]:
    """The prompts random circuits are scored on: every one where ``n`` is 0 or at least their number; else ``n``
    of them, stratified by group (template and token length: each group's share of ``n`` by largest remainder),
    drawn within each group by ``seed``; indices into ``records``, sorted."""
    if n <= 0 or n >= len(records):
        return list(range(len(records)))
    groups: dict[GroupKey, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(group_key(r), []).append(i)
    share = {g: n * len(ix) / len(records) for g, ix in groups.items()}
    quota = {g: int(q) for g, q in share.items()}
    order = sorted(groups, key=lambda g: quota[g] - share[g])  # largest remainder first; stable: first seen first
    for g in order[: n - sum(quota.values())]:
        quota[g] += 1
    rng = random.Random(seed)
    return sorted(i for g, ix in groups.items() for i in rng.sample(ix, quota[g]))


def faithfulness(
    scorer: Scorer,
    circuit: Circuit,
    n_random: int = 0,
    seed: int = 0,
    match: str = RANDOM_MATCH[0],
    random_prompts: Optional[Sequence[int]] = None,
    items: Optional[Sequence] = None,
) -> dict:
    """F(M), F(C), faithfulness F(C)/F(M) for accuracy and the scorer's continuous metric (answer probability,
    ``faithfulness_prob``; or the logit difference, ``logit_diff`` and ``faithfulness_logit_diff``), with CIs
    (exact binomial for accuracy, bootstrap for the rest and the ratios).

    With ``n_random > 0`` also ``n_random`` random circuits of the same group sizes (seeded, layer-matched by
    default), each scored on the prompts ``random_prompts`` (indices into the scorer's records; None: all):
    ``random`` holds their mean figures with intervals resampling draws and items both
    (`control_ratio`), each draw's accuracy (``draws``), each draw's per-prompt
    outcomes (``outcomes``, 0/1 strings over ``prompts``) and the circuit's rank among the draws on those prompts
    (``rank``: `control_rank` on accuracy; on the same prompts faithfulness has
    the same denominator, so the rank is the faithfulness rank too). ``items``: one item id per record (None: each
    prompt its own item).
    """
    shape = scorer.model.shape
    circuit.validate(shape.n_layers, shape.n_heads)
    full, circ, empty = scorer.full(), scorer.keep(circuit.pairs()), scorer.keep(())
    m = scorer.metric
    out = {"full": _figures(full, full, m), "circuit": _figures(circ, full, m), "n_prompts": len(scorer.records)}
    out["empty"] = _figures(empty, full, m)
    out["circuit"].update(normalised_figures(circ, full, empty, m))
    out["outcomes"] = {"full": full.outcomes(), "circuit": circ.outcomes(), "empty": empty.outcomes()}
    if n_random > 0:
        out["random"] = _random_control(scorer, circuit, full, circ, n_random, seed, match, random_prompts, items)
    return out


def normalised_figures(circ: EvalResult, full: EvalResult, empty: EvalResult, metric: str = "prob") -> dict:
    """Faithfulness with the empty circuit subtracted, (m(C) - m(empty)) / (m(M) - m(empty)) (MIB's normalised
    form; the paper's is m(C) / m(M)), for accuracy (``faithfulness_normalised``) and the task's continuous
    metric (``faithfulness_normalised_<metric>``), each with its bootstrap over prompts; NaN where the model is not
    shown above its empty circuit by the paired test (exact McNemar or sign-flip): the ratio is then undefined or
    a ratio of noise."""
    out = {}
    for name, key in (("accuracy", "faithfulness_normalised"), (metric, f"faithfulness_normalised_{metric}")):
        c, f, e = (per_prompt(r, name) for r in (circ, full, empty))
        beats = inf.paired(f, e)  # the model above its empty circuit, by its own paired test
        if beats.interval.value > 0 and beats.p <= inf.ALPHA:
            out[key] = inf.ratio(c - e, f - e).to_dict()
        else:
            out[key] = {"value": float("nan"), "low": float("nan"), "high": float("nan"), "n": int(c.size)}
    return out


def _random_control(
    scorer: Scorer,
    circuit: Circuit,
    full: EvalResult,
    circ: EvalResult,
    n_random: int,
    seed: int,
    match: str,
    prompts: Optional[Sequence[int]],
    items: Optional[Sequence],
) -> dict:
    """`faithfulness`'s ``random``: ``n_random`` random circuits on ``prompts``, against the circuit there."""
    n, shape = len(scorer.records), scorer.model.shape
    prompts = list(range(n)) if prompts is None else sorted(int(i) for i in prompts)
    if not prompts or len(set(prompts)) != len(prompts) or prompts[0] < 0 or prompts[-1] >= n:
        raise ValueError(f"random_prompts must be distinct indices into the {n} scored prompts")
    sub = scorer if len(prompts) == n else scorer.subset(prompts)
    on = None if items is None else [items[i] for i in prompts]
    rng = random.Random(seed)
    draws = [
        sub.keep(random_circuit(circuit, shape.n_layers, shape.n_heads, rng, match).pairs())
        for _ in progress_bar(range(n_random), desc="random circuits", disable=not scorer.progress, leave=False)
    ]
    full_on, circ_on = _rows(full, prompts), _rows(circ, prompts)
    rank = inf.control_rank(circ_on.correct.astype(float), [d.correct.astype(float) for d in draws], on, seed=seed)
    full_acc = float(full_on.correct.mean())
    return {
        **_random_figures(draws, full_on, scorer.metric, on, seed),
        "n_draws": n_random,
        "seed": seed,
        "match": match,
        "draws": [float(d.correct.mean()) for d in draws],
        "prompts": prompts,
        "outcomes": [bits(d.correct) for d in draws],
        "rank": {
            "rank": rank.rank,
            "n_draws": rank.n_draws,
            "p": rank.p,
            "circuit_accuracy": rank.value,
            "full_accuracy": full_acc,
            "q05": rank.quantiles[0],
            "q50": rank.quantiles[1],
            "q95": rank.quantiles[2],
            "draws": rank.draws.to_dict(detail=True),
            "n_prompts": len(prompts),
        },
    }


def _rows(result: EvalResult, rows: Sequence[int]) -> EvalResult:
    """``result`` on the prompts ``rows`` only."""

    def cut(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
        return None if a is None else a[rows]

    return EvalResult(
        result.correct[rows], result.prob[rows], cut(result.logit_diff), cut(result.first), cut(result.rest)
    )


def _random_figures(draws: Sequence[EvalResult], full: EvalResult, metric: str, items, seed: int) -> dict:
    """The draws' mean accuracy, answer probability and faithfulness (and the continuous metric's), each with an
    interval resampling draws and items both (`control_ratio`)."""

    def stacked(name: str) -> np.ndarray:
        return np.stack([per_prompt(d, name) for d in draws])  # type: ignore[arg-type]

    def ratio(num: np.ndarray, den: Optional[np.ndarray] = None) -> dict:
        return inf.control_ratio(num, den, items, seed=seed).to_dict(detail=True)

    acc = stacked("accuracy")
    out = {
        "accuracy": ratio(acc),
        "answer_prob": ratio(stacked("prob")),
        "faithfulness": ratio(acc, per_prompt(full, "accuracy")),
    }
    if metric == "logit_diff":
        out["logit_diff"] = ratio(stacked(metric))
    out[faithfulness_key(metric)] = ratio(stacked(metric), per_prompt(full, metric))  # type: ignore[arg-type]
    return out


def _figures(result: EvalResult, full: EvalResult, metric: str = "prob") -> dict:
    """Accuracy, answer probability, faithfulness, and the continuous faithfulness of ``metric`` (and, for
    ``logit_diff``, the logit difference itself)."""
    acc, prob = per_prompt(result, "accuracy"), per_prompt(result, "prob")
    out = {
        "accuracy": mean_estimate(acc).to_dict(),
        "answer_prob": bootstrap(prob).to_dict(),
        "faithfulness": bootstrap_ratio(acc, per_prompt(full, "accuracy")).to_dict(),
    }
    if metric == "logit_diff":
        out["logit_diff"] = bootstrap(per_prompt(result, metric)).to_dict()
    out[faithfulness_key(metric)] = bootstrap_ratio(per_prompt(result, metric), per_prompt(full, metric)).to_dict()
    return out


# --------------------------------------------------------------------------------------
# Completeness
# --------------------------------------------------------------------------------------


def group_pairs(circuit: Circuit, group: str) -> list[Pair]:
    """The (head, position) pairs of one group."""
    return [(h, circuit.positions[group]) for h in circuit.groups[group]]


def completeness(
    scorer: Scorer,
    circuit: Circuit,
    n_draws: int = 5,
    p: float = 0.5,
    seed: int = 0,
    metric: Metric = "accuracy",
    groups: Optional[Sequence[str]] = None,
) -> dict:
    """|F(C \\ K) - F(M \\ K)| for random K (each pair kept in K with probability ``p``) and each whole group
    (``groups``: those groups only; default every group).

    Random K: mean, std and the per-draw values, with a bootstrap CI over the draws. Per group:
    the signed difference with a bootstrap CI over prompts, and its absolute value.
    """
    pairs = circuit.pairs()
    rng = random.Random(seed)
    diffs = []
    for _ in progress_bar(range(n_draws), desc="completeness draws", disable=not scorer.progress, leave=False):
        k = [pr for pr in pairs if rng.random() < p]
        diffs.append(abs(float(_difference(scorer, pairs, k, metric).mean())))
    out: dict = {"metric": metric, "p": p, "seed": seed, "n_prompts": len(scorer.records)}
    if diffs:
        out["random"] = {
            "mean": float(np.mean(diffs)),
            "std": float(np.std(diffs)),
            "draws": diffs,
            "ci": bootstrap(diffs).to_dict(),
        }
    out["groups"] = {}
    for g in circuit.groups if groups is None else groups:
        if not circuit.groups[g]:  # K empty: F(C) - F(M) says nothing about the group
            out["groups"][g] = {"completeness": None, "difference": None, "size": 0, "note": "n/a: the group is empty"}
            continue
        signed = bootstrap(_difference(scorer, pairs, group_pairs(circuit, g), metric))
        out["groups"][g] = {
            "completeness": abs(signed.value),
            "difference": signed.to_dict(),
            "size": len(circuit.groups[g]),
        }
    return out


def _difference(scorer: Scorer, pairs: Sequence[Pair], k: Sequence[Pair], metric: Metric) -> np.ndarray:
    """Per prompt, F(C \\ K) - F(M \\ K)."""
    without = [pr for pr in pairs if pr not in set(k)]
    return per_prompt(scorer.keep(without), metric) - per_prompt(scorer.ablate(k), metric)


# --------------------------------------------------------------------------------------
# Across models
# --------------------------------------------------------------------------------------


def matrix_rows(
    model_name: str,
    circuits: dict[str, Circuit],
    scorer: Scorer,
    n_random: int = 0,
    seed: int = 0,
    random_for: Optional[Sequence[str]] = None,
    outcomes: Optional[dict] = None,
    random_prompts: int = 0,
    items: Optional[Sequence] = None,
) -> list[dict]:
    """One row per circuit for one model: full and circuit accuracy, faithfulness (and the random
    baseline, for the circuits named in ``random_for``, default all), each as ``x``, ``x_low``, ``x_high``
    columns (see `mechdiff.report.tables`); ``draws``: each random draw's accuracy; ``random_rank``,
    ``random_p`` and ``random_q05/q50/q95``: the circuit's rank among the draws, its +1-corrected p and the draws'
    accuracy quantiles, on the ``random_prompts`` prompts the draws are scored on (`control_prompts`; 0:
    all). ``outcomes`` (a dict): filled with each circuit's per-prompt outcomes, full model and circuit, and for
    the circuits with random draws their per-draw outcomes (``random``: ``prompts`` and ``outcomes``)."""
    rows = []
    prompts = control_prompts(scorer.records, random_prompts, seed) if n_random > 0 and random_prompts else None
    for label, circuit in circuits.items():
        draws = n_random if random_for is None or label in random_for else 0
        res = faithfulness(scorer, circuit, n_random=draws, seed=seed, random_prompts=prompts, items=items)
        if outcomes is not None:
            outcomes[label] = res["outcomes"]
            if "random" in res:
                outcomes[label]["random"] = {"prompts": res["random"]["prompts"], "outcomes": res["random"]["outcomes"]}
        row = {
            "circuit": label,
            "model": model_name,
            "n_heads": len(circuit.heads()),
            "n_pairs": len(circuit.pairs()),
            "n_prompts": res["n_prompts"],
        }
        row.update(_cols("full_accuracy", res["full"]["accuracy"]))
        row.update(_cols("accuracy", res["circuit"]["accuracy"]))
        row.update(_cols("faithfulness", res["circuit"]["faithfulness"]))
        row.update(_cols("empty_accuracy", res["empty"]["accuracy"]))
        for key in (k for k in res["circuit"] if k.startswith("faithfulness_normalised")):
            row.update(_cols(key, res["circuit"][key]))
        row.update(_cols("answer_prob", res["circuit"]["answer_prob"]))
        if "logit_diff" in res["circuit"]:
            row.update(_cols("logit_diff", res["circuit"]["logit_diff"]))
        key = faithfulness_key(scorer.metric)
        row.update(_cols(key, res["circuit"][key]))
        if "random" in res:
            row.update(_random_cols(res["random"], key))
        rows.append(row)
    return rows


def _random_cols(random_res: dict, key: str) -> dict:
    """A matrix row's random-control columns: the draws' figures, their accuracies, and the circuit's rank."""
    rank = random_res["rank"]
    return {
        **_cols("random_accuracy", random_res["accuracy"]),
        **_cols("random_faithfulness", random_res["faithfulness"]),
        **_cols(f"random_{key}", random_res[key]),
        "random_draws": random_res["draws"],
        "random_n_prompts": rank["n_prompts"],
        "random_rank": rank["rank"],
        "random_p": rank["p"],
        "random_circuit_accuracy": rank["circuit_accuracy"],
        "random_q05": rank["q05"],
        "random_q50": rank["q50"],
        "random_q95": rank["q95"],
    }


def _cols(name: str, d: dict) -> dict:
    return {name: d["value"], f"{name}_low": d["low"], f"{name}_high": d["high"]}
