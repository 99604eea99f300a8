"""Desiderata-based component masking (DCM; Davies et al. 2023, as used by Prakash et al. 2024, Sec. 4).

For a group of heads acting at one dataset position and a *desideratum* (a list of the
task's counterfactual pairs (`PairRecord`) whose ``target`` is the answer the
base run should give if the heads encode the property the source differs in), learn one mask
value ``m`` per head. At the group's position (read per example from ``pair.base.positions``
and ``pair.source.positions`` under the same name), each head's output is mixed::

    z_head <- m * z_base + (1 - m) * z_source

A group at a position class of several tokens (a ``position_classes`` mask or a tuple of indices, read through
`position_mask` as completeness reads it) is mixed at EVERY token of the class in
each prompt, the source's ``j``-th token of the class into the base's ``j``-th (`class_z_patches`); a prompt
whose class is empty is not patched, and a pair whose two prompts hold different numbers of the class's tokens is
refused. The paper's groups sit at one position; classes are mechdiff's extension.

and the mask minimises ``-logit(target) + lambda * sum(1 - m)``: the target should win while
as FEW heads as possible are patched (``m = 0``). A target of several tokens is scored by teacher forcing (the
target's tokens but its last appended to the base prompt; patches write the prompt's positions only): the loss is
its negative summed log-probability, and it is reached where greedy decoding gives the whole target.
The model is frozen; gradients reach only
the mask (through `mechdiff.patching.core.run` with ``grad=True`` and a mixing
`Patch`).

Two parameterisations:

- ``"continuous"`` (the paper's): ``m`` in [0, 1], clamped after every Adam step (lr 0.1),
  rounded for evaluation; the step with the best validation accuracy is kept.

The paper's training (``Nix07/finetuning`` ``experiment_2/DCM.py``) is `DCMConfig.paper`: an absolute
lambda = 0.01, 32 pairs per step, 2 epochs over the training pairs in order, validation after every 4th batch
of each epoch (batches 0, 4, 8, ...), a 50/25/25 split. mechdiff's defaults differ (see `DCMConfig`).
- ``"hard_concrete"`` (L0, Louizos et al. 2018): a stochastic gate ``g = 1 - m`` per head
  ("patch this head") with learned ``log_alpha``; the penalty is the expected number of open
  gates; evaluation uses the deterministic gate, rounded.

Semantic patching (`semantic_patching`) patches the heads a mask selected into each
model of a set and reports the target accuracy per model with exact binomial intervals.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch
from einops import rearrange, repeat

from ..circuits.circuit import Circuit
from ..circuits.scoring import class_indices, is_one_token
from ..common import inference as inf
from ..common.components import Head, all_heads, layer_matched
from ..common.metrics import answer_is_top1, answer_logit, sequence_is_greedy, sequence_logprob
from ..common.outcomes import bits, outcome_record
from ..common.progress import progress_bar
from ..common.stats import pooled_proportion
from ..models.loading import LoadedModel
from ..patching.core import Patch, Prefix, Resume, run
from ..patching.evaluate import batches
from ..patching.store import MemoryRows, RowStore
from ..tasks.base import (
    PairRecord,
    group_batches,
    grouped_batches,
    pair_batch_tensors,
    record_order,
    take,
    target_tokens,
    token_tensors,
)

#: A batch's targets: ids ``"batch"`` (one token each), or tokens ``"batch a"`` and lengths ``"batch"`` (several).
Target = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def target_score(logits: torch.Tensor, target: Target) -> torch.Tensor:
    """Per pair, what DCM's loss raises: the target's logit (one token, the paper's loss) or, for targets of
    several tokens (teacher-forced ``logits`` ``"batch a vocab"``), its summed log-probability."""
    if isinstance(target, tuple):
        return sequence_logprob(logits, *target)
    return answer_logit(logits, target)


def target_correct(logits: torch.Tensor, target: Target) -> torch.Tensor:
    """Per pair, whether the run gives the target: its top-1 token, or greedy decoding of its every token."""
    if isinstance(target, tuple):
        return sequence_is_greedy(logits, *target)
    return answer_is_top1(logits, target)


log = logging.getLogger(__name__)

PARAMETERISATIONS = ("continuous", "hard_concrete")

# Hard-concrete constants (Louizos et al. 2018).
_BETA, _GAMMA, _ZETA = 2.0 / 3.0, -0.1, 1.1


LAM_SCALES = ("loss", "absolute")
#: When validation runs: "steps" (mechdiff: before training, every ``eval_every`` optimiser steps and after the
#: last) or "epoch_batches" (the paper: after batch b of each epoch whenever b % eval_every == 0, b from 0).
SCHEDULES = ("steps", "epoch_batches")
#: Where the random heads of the baseline come from (the first is the default): each selected head's own layer
#: (at the group's position class), every head of the model, or the group's heads.
RANDOM_POOLS = ("layer", "all", "group")


@dataclass
class DCMConfig:
    """Training settings. The mask, the loss form, Adam with lr 0.1, clamping, rounding, the best validation
    step and its tie-break are the paper's; the defaults of ``lam_scale``, the batch, the split and the
    validation schedule are mechdiff's (small prompt sets on CPU). `paper` gives the paper's."""

    parameterisation: str = "continuous"
    lam: float = 0.01  # weight of the sparsity term sum(1 - m) (or the expected L0 of the gates)
    # "loss" (mechdiff): lam is relative to the unpatched model's loss mean |logit(target)| on the first training
    # batch, so the sparsity term has the same weight on any model's logit scale (a several-fold stronger penalty
    # than the paper's on LLaMA's logits); "absolute" (the paper's): lam as is.
    lam_scale: str = "loss"
    lr: float = 0.1
    # the one default of each training setting (a study's [dcm] section takes these too): 4 epochs of 8 pairs per
    # step, validation every 4 steps (32 training pairs: 16 mask updates)
    epochs: int = 4
    batch_size: int = 8  # pairs per optimiser step (gradient accumulated over micro-batches)
    micro_batch: int = 8  # pairs per forward/backward pass (bounds memory)
    eval_batch: int = 32  # pairs per forward pass when evaluating (no gradients)
    eval_every: int = (
        4  # optimiser steps (schedule "steps") or batches of an epoch ("epoch_batches") between validations
    )
    schedule: str = "steps"
    shuffle: bool = True  # shuffle the training pairs each epoch (the paper: in order)
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)  # train / validation / test fractions
    init: float = 1.0  # initial mask value (1 = nothing patched); hard-concrete gates start at least half open
    n_random: int = 20  # random head sets of the selected size for the baseline (and for semantic patching)
    # random heads: "layer" (each selected head replaced by a head of its own layer, patched at the same position
    # class: the selection's depth profile), from "all" heads of the model, or from the "group" only
    random_pool: str = "layer"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.parameterisation not in PARAMETERISATIONS:
            raise ValueError(f"parameterisation must be one of {PARAMETERISATIONS}, got {self.parameterisation!r}")
        if self.lam_scale not in LAM_SCALES:
            raise ValueError(f"lam_scale must be 'loss' or 'absolute', got {self.lam_scale!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.eval_every < 1:
            raise ValueError("eval_every must be at least 1")
        if self.random_pool not in RANDOM_POOLS:
            raise ValueError(f"random_pool must be one of {RANDOM_POOLS}, got {self.random_pool!r}")
        if len(self.split) != 3 or min(self.split) <= 0 or abs(sum(self.split) - 1) > 1e-6:
            raise ValueError(f"split must be three positive fractions summing to 1, got {self.split}")
        if min(self.micro_batch, self.batch_size, self.eval_batch) < 1:
            raise ValueError("batch_size, micro_batch and eval_batch must be at least 1")

    @classmethod
    def paper(cls, **overrides) -> "DCMConfig":
        """The paper's training (``experiment_2/DCM.py``): loss -logit(target) + 0.01 sum(1 - m) with an absolute
        lambda, Adam lr 0.1, 32 pairs per step, 2 epochs in order, validation after batches 0, 4, 8, ... of each
        epoch, split 50/25/25 (of 2000 pairs). ``overrides``: memory and bookkeeping settings (``micro_batch``,
        ``eval_batch``, ``seed``, ``n_random``, ``random_pool``)."""
        return cls(**{**PAPER_DCM, **overrides})


#: The settings `DCMConfig.paper` fixes.
PAPER_DCM = {
    "parameterisation": "continuous",
    "lam": 0.01,
    "lam_scale": "absolute",
    "lr": 0.1,
    "epochs": 2,
    "batch_size": 32,
    "eval_every": 4,
    "schedule": "epoch_batches",
    "shuffle": False,
    "split": (0.5, 0.25, 0.25),
    "init": 1.0,
}


@dataclass
class DCMResult:
    """What DCM learned for one group of heads and one desideratum."""

    desideratum: str
    position: str
    heads: list[Head]  # the candidate heads (the group)
    mask: list[float]  # m per head at the best validation step (1 = keep base, 0 = patch)
    selected: list[Head]  # heads with m < 0.5 (rounded to 0): they carry the desideratum's property
    test_accuracy: inf.Interval  # target accuracy with the selected heads patched
    floor: inf.Interval  # target accuracy with nothing patched (m = 1)
    full_group: inf.Interval  # target accuracy with every head of the group patched
    random: Optional[inf.Interval]  # random head sets of the selected size (pooled over draws)
    n_split: tuple[int, int, int]
    best_step: int
    history: list[dict] = field(default_factory=list)
    group: str = ""
    config: dict = field(default_factory=dict)
    random_heads: list[list[Head]] = field(default_factory=list)  # each draw's heads (at ``position``)
    random_outcomes: list[list[int]] = field(default_factory=list)  # each draw's per-pair outcomes on the test pairs

    def to_dict(self) -> dict:
        return {
            "group": self.group,
            "desideratum": self.desideratum,
            "position": self.position,
            "heads": [h.name for h in self.heads],
            "mask": self.mask,
            "selected": [h.name for h in self.selected],
            "test_accuracy": self.test_accuracy.to_dict(),
            "floor": self.floor.to_dict(),
            "full_group": self.full_group.to_dict(),
            "random": None if self.random is None else self.random.to_dict(),
            "n_train": self.n_split[0],
            "n_val": self.n_split[1],
            "n_test": self.n_split[2],
            "best_step": self.best_step,
            "history": self.history,
            "config": self.config,
            "random_heads": [[h.name for h in hs] for hs in self.random_heads],
            "random_outcomes": [bits(o) for o in self.random_outcomes],
        }


# ---------------------------------------------------------------------------------------------
# Patching heads' z under a mask
# ---------------------------------------------------------------------------------------------


def split_indices(
    n: int, fractions: Sequence[float], seed: int, items: Optional[Sequence] = None
) -> tuple[list[int], list[int], list[int]]:
    """Seeded shuffle of ``range(n)`` into train / validation / test indices (each non-empty), disjoint by item
    (``items``: one per index, e.g. a pair's clean prompt; default: each index its own): each split takes whole
    items in the shuffled order until it has its share of rows, the test split the rest. Where every item is one
    index this is the plain seeded split it always was."""
    if n < 3:
        raise ValueError(f"DCM needs at least 3 pairs (train/validation/test), got {n}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_train = max(1, int(round(fractions[0] * n)))
    n_val = max(1, int(round(fractions[1] * n)))
    n_train = min(n_train, n - 2)
    n_val = min(n_val, n - n_train - 1)
    if items is None or len(set(items)) == n:
        return order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    return _split_items(order, list(items), n_train, n_val)


def _split_items(order: list[int], items: list, n_train: int, n_val: int) -> tuple[list[int], list[int], list[int]]:
    """Whole items of ``order`` (their rows in its order, items by first row) into train and validation until
    each has ``n_train`` (``n_val``) rows, the rest to test; refused where fewer than three items."""
    by_item: dict = {}
    for i in order:
        by_item.setdefault(items[i], []).append(i)
    groups = list(by_item.values())
    if len(groups) < 3:
        raise ValueError(
            f"DCM needs pairs of at least 3 items (train/validation/test disjoint by item), got {len(groups)}; "
            "add pairs with other clean prompts"
        )
    parts: list[list[int]] = [[], [], []]
    target, k = (n_train, n_val), 0
    for done, rows in enumerate(groups):
        left = len(groups) - done  # items not yet dealt, this one included
        while k < 2 and parts[k] and (len(parts[k]) >= target[k] or left <= 2 - k):  # full, or the rest is needed
            k += 1
        parts[k].extend(rows)
    return parts[0], parts[1], parts[2]


def split_pairs(
    pairs: Sequence[PairRecord], fractions: Sequence[float], seed: int, items: Optional[Sequence] = None
) -> tuple[list, list, list]:
    """Seeded shuffle of ``pairs`` into train / validation / test (each non-empty), disjoint by item (``items``:
    one per pair; default: its clean prompt, `clean_key`)."""
    parts = split_indices(len(pairs), fractions, seed, pair_items(pairs, items))
    return tuple([pairs[i] for i in part] for part in parts)  # type: ignore[return-value]


def pair_items(pairs: Sequence[PairRecord], items: Optional[Sequence] = None) -> list:
    """Each pair's item: ``items`` where given, else its clean prompt's token ids."""
    from ..tasks.base import clean_key

    if items is not None:
        if len(items) != len(pairs):
            raise ValueError(f"{len(items)} items for {len(pairs)} pairs; give one item per pair")
        return list(items)
    return [clean_key(p) for p in pairs]


def _positions(batch: dict, name: str, which: str) -> torch.Tensor:
    pos = batch[which]["positions"][name]
    if (pos < 0).any():
        raise ValueError(
            f"position {name!r} is absent from some {which} prompts (e.g. path-patching sources); "
            "DCM needs the group's position in both prompts of every pair"
        )
    return pos


def source_run(model: LoadedModel, batch: dict, layers: Iterable[int]) -> dict[int, torch.Tensor]:
    """The source run's z (``"batch pos (head d_head)"``) at every layer of ``layers``, one forward for them all."""
    with torch.no_grad():
        out = run(model, batch["source"]["input_ids"], capture=[("z", layer) for layer in sorted(set(layers))])
    return {layer: z for (_, layer), z in out.captured.items()}


def z_at(z: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str) -> dict[int, torch.Tensor]:
    """The source run's z (`source_run`) at ``position``, per layer of ``layers`` (``"batch (head d_head)"``)."""
    pos = _positions(batch, position, "source")
    rows = torch.arange(pos.shape[0])
    return {layer: z[layer][rows, pos.to(z[layer].device)].detach() for layer in layers}


def source_z(model: LoadedModel, batch: dict, layers: Sequence[int], position: str) -> dict[int, torch.Tensor]:
    """The source run's z (``"batch (head d_head)"``) at ``position``, per layer."""
    return z_at(source_run(model, batch, layers), batch, layers, position)


def masked_z_patches(
    model: LoadedModel,
    heads: Sequence[Head],
    mask: torch.Tensor,
    values: dict[int, torch.Tensor],
    positions: torch.Tensor,
) -> list[Patch]:
    """One mixing patch per layer: ``z <- m * z + (1 - m) * value`` for ``heads`` (mask ``[len(heads)]``),
    other heads of the layer untouched (m = 1). Differentiable in ``mask``."""
    shape = model.shape
    index = torch.tensor([h.layer * shape.n_heads + h.head for h in heads], device=mask.device)
    full = torch.ones(shape.n_layers * shape.n_heads, dtype=mask.dtype, device=mask.device)
    full = full.index_put((index,), mask)  # out of place: keeps the graph to ``mask``
    per_layer = rearrange(full, "(layer head) -> layer head", head=shape.n_heads)
    return [
        Patch("z", layer, values[layer], positions, mask=repeat(per_layer[layer], "head -> (head d)", d=shape.d_head))
        for layer in sorted({h.layer for h in heads})
    ]


def class_z_at(
    z: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str, k: int
) -> dict[int, torch.Tensor]:
    """The source run's z (`source_run`) at every token of position class ``position``, in order
    (``"batch k (head d_head)"``, zero-filled past a prompt's own tokens), per layer of ``layers``."""
    index, real = class_indices(batch["source"], position)
    if index.shape[1] > k:
        raise ValueError(f"class {position!r} has {index.shape[1]} tokens in a source prompt; the cache holds {k}")
    rows = torch.arange(index.shape[0])[:, None]
    values = {}
    for layer in layers:
        at = z[layer][rows.to(z[layer].device), index.clamp(min=0).to(z[layer].device)]
        keep = real[..., None].to(at.device)
        values[layer] = _pad(torch.where(keep, at, torch.zeros_like(at)), 1, k).detach()
    return values


def source_class_z(
    model: LoadedModel, batch: dict, layers: Sequence[int], position: str, k: int
) -> dict[int, torch.Tensor]:
    """The source run's z at every token of position class ``position`` (`class_z_at`), per layer."""
    return class_z_at(source_run(model, batch, layers), batch, layers, position, k)


def class_z_patches(
    model: LoadedModel,
    heads: Sequence[Head],
    mask: torch.Tensor,
    values: dict[int, torch.Tensor],
    index: torch.Tensor,
    real: torch.Tensor,
    length: int,
) -> list[Patch]:
    """`masked_z_patches` at every token of a position class: the ``j``-th real token ``index[:, j]`` of each
    prompt mixes in ``values[layer][:, j]`` (``"batch k (head d_head)"``); a prompt whose class is empty is left as
    it is. Each patch covers positions from the batch's first class token to the prompt's end (``length``), its
    mask 1 (keep) outside the class, so suffix runs start at the class. Differentiable in ``mask``."""
    shape = model.shape
    slot = torch.tensor([h.layer * shape.n_heads + h.head for h in heads], device=mask.device)
    full = torch.ones(shape.n_layers * shape.n_heads, dtype=mask.dtype, device=mask.device).index_put((slot,), mask)
    per_layer = rearrange(full, "(layer head) -> layer head", head=shape.n_heads)
    rows, cols = real.nonzero(as_tuple=True)
    tokens = index[rows, cols]
    start = int(tokens.min()) if len(tokens) else length - 1
    cell = torch.zeros(index.shape[0], length, dtype=torch.bool)
    cell[rows, tokens] = True
    cell = cell[:, start:, None].to(mask.device)
    patches = []
    for layer in sorted({h.layer for h in heads}):
        value = values[layer].new_zeros(index.shape[0], length, values[layer].shape[-1])
        value[rows, tokens] = values[layer][rows, cols]
        keep = repeat(per_layer[layer], "head -> (head d)", d=shape.d_head)
        mix = torch.where(cell, keep[None, None], torch.ones_like(keep)[None, None])  # "batch pos cols"
        patches.append(Patch("z", layer, value[:, start:], slice(start, length), mask=mix))
    return patches


class UnequalClass(ValueError):
    """A pair whose base and source prompts hold different numbers of a position class's tokens."""


def class_widths(pairs: Sequence[PairRecord], positions: Iterable[str], batch_size: int) -> dict[str, int]:
    """For each of ``positions`` that is a class (not one named token a prompt), the most tokens it has in a
    prompt of ``pairs`` (at least 1). A pair whose base and source prompts hold different numbers of the class's
    tokens is refused: DCM writes the source's ``j``-th token of the class into the base's ``j``-th."""
    widths: dict[str, int] = {}
    for rows in grouped_batches(pairs, batch_size):
        batch = pair_batch_tensors(take(pairs, rows))
        for name in positions:
            if is_one_token(batch["base"], name):
                continue
            (_, base), (_, source) = class_indices(batch["base"], name), class_indices(batch["source"], name)
            counts = base.sum(1), source.sum(1)
            bad = (counts[0] != counts[1]).nonzero()
            if len(bad):
                i = int(bad[0])
                raise UnequalClass(
                    f"pair {rows[i]}: position class {name!r} has {int(counts[0][i])} tokens in the base prompt "
                    f"and {int(counts[1][i])} in the source prompt; DCM patches the class token for token"
                )
            widths[name] = max(widths.get(name, 1), base.shape[1])
    return widths


#: How a `PairCache` holds what patched runs read (``[dcm] cache``; the plan's choice where "auto"):
#: ``"file"`` streams a scratch file of the base runs' keys, values and entering residual streams and the sources'
#: ``z`` (patched runs are suffix runs from the group's layer and position); ``"memory"`` holds only the sources'
#: ``z`` at the groups' heads and positions in host memory, as the paper does (patched runs are full runs);
#: ``"recompute"`` holds nothing but the floor and runs each batch's sources again (full runs). The three give the
#: same outcomes but for float rounding (a suffix run over a stored prefix and a full run sum in another order).
CACHE_MODES = ("file", "memory", "recompute")


@dataclass
class PairCache:
    """What every DCM run on one list of pairs shares, computed in one pass over them and streamed from disk.

    Per pair: the source run's z at each ``(layer, position)`` a group patches (at every token of a position
    class, zero-padded to the most tokens a prompt has: `classes`); the base run's
    residual stream entering each group's first layer, so that patched runs resume there and
    skip the blocks before (`Resume`; exact, since nothing
    before that layer is patched); the base run's keys and values, so that patched runs (and DCM's
    backward passes) compute only the positions from the patched one on (suffix runs); and whether
    the unpatched base already gives the target (the floor). Training, validation, test and the
    random baseline all read from it.

    The activations are written to a scratch HDF5 file (`RowStore`, under
    ``TMPDIR``) a batch at a time and read back by the rows each patched run needs, so memory holds one batch's
    activations whatever the number of pairs (the paper-form study's 2000 SmolLM2 pairs: about 17 GB on disk);
    the values read back are the ones computed, bit for bit. The file is deleted with the cache. Where that file
    does not fit (`CACHE_MODES`), ``mode="memory"`` holds only the sources' ``z`` in host memory and
    ``mode="recompute"`` runs the sources again for every batch; both run patched runs in full (no keys, values or
    residual streams stored).

    Pairs of several token lengths and templates are run group by group
    (`grouped_batches`); the residual streams and keys/values of shorter pairs
    are stored zero-filled to the longest pair's length and cut back to their own length when read, so
    no padding ever enters a run. Every per-pair result is in the pairs' order.
    """

    pairs: list[PairRecord]
    store: Union[RowStore, MemoryRows]  # "source/<position>", "resid/<layer>", "keys", "values": one row per pair
    sites: dict[str, list[int]]  # position -> the layers whose source z is stored there (in the row's order)
    starts: list[int]  # the layers whose entering residual stream is stored (patched runs resume there)
    floor: np.ndarray  # bool per pair: target is the unpatched base's top-1
    suffix: bool = True  # patched runs read the base's keys and values (suffix runs); False: full-length runs
    #: The most tokens a target has: runs append the first ``width - 1`` (right-padded) to every base prompt, and the
    #: stored residual streams, keys and values cover them (one teacher-forced base run per pair).
    width: int = 1
    #: Position classes of several tokens among the sites -> the most tokens a prompt has there: the source z of
    #: every token of the class is stored (``"row layer k (head d_head)"``) and patched (`class_z_patches`).
    classes: dict[str, int] = field(default_factory=dict)
    mode: str = "file"  # one of CACHE_MODES

    @classmethod
    def build(
        cls,
        model: LoadedModel,
        pairs: Sequence[PairRecord],
        groups: Iterable[tuple[Sequence[Head], str]],
        batch_size: int = 32,
        progress: bool = False,
        mode: str = "file",
    ) -> "PairCache":
        """Two forward passes per pair, one source run (the sites of every ``(heads, position)`` in ``groups``; none
        under ``mode="recompute"``) and one base run; a target of several tokens is appended to the base prompt
        (teacher forcing), and the base run covers it. ``mode``: one of `CACHE_MODES`."""
        if mode not in CACHE_MODES:
            raise ValueError(f"DCM's cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        pairs = list(pairs)
        groups = [(list(heads), pos) for heads, pos in groups]
        sites = {pos: sorted({h.layer for hs, p in groups if p == pos for h in hs}) for _, pos in groups}
        sites = {pos: layers for pos, layers in sorted(sites.items()) if layers}
        starts = sorted({min(h.layer for h in heads) for heads, _ in groups if heads} - {0})
        width = max((len(target_tokens(p)) for p in pairs), default=1)
        classes = class_widths(pairs, sites, batch_size)
        store = RowStore(len(pairs)) if mode == "file" else MemoryRows(len(pairs))
        floor = np.zeros(len(pairs), dtype=bool)
        suffix = mode == "file"
        starts = starts if suffix else []  # full runs: nothing to resume from
        cache = cls(pairs, store, sites, starts, floor, suffix, width=width, classes=classes, mode=mode)
        length = max((len(p.base.input_ids) for p in pairs), default=0) + width - 1
        batches = grouped_batches(pairs, batch_size)
        for rows in progress_bar(batches, desc="dcm cache", disable=not progress, leave=False):
            cache._write(model, rows, length)
        return cache

    def _write(self, model: LoadedModel, rows: list[int], length: int) -> None:
        """One batch's source z, base residual streams, keys and values and floor, stored at ``rows``."""
        batch = pair_batch_tensors(take(self.pairs, rows))
        if self.mode != "recompute":
            self._write_sources(model, batch, rows)  # its run freed before the base run
        ids, readout, target = self._teacher(batch, rows)
        with torch.no_grad():
            capture = [("resid", layer - 1) for layer in self.starts]
            out = run(model, ids, capture=capture, keep_kv=self.suffix, readout=readout)
        for layer in self.starts:
            self.store.write(f"resid/{layer}", rows, _pad(out.captured[("resid", layer - 1)], -2, length))
        self.floor[rows] = target_correct(out.logits, target).cpu().numpy()
        if self.suffix:
            for name, kv in (("keys", out.kv.keys), ("values", out.kv.values)):
                self.store.write(name, rows, _pad(torch.stack(kv, dim=1), -2, length))

    def _write_sources(self, model: LoadedModel, batch: dict, rows: list[int]) -> None:
        """One batch's source z at every site, from one source run, stored at ``rows``."""
        source = source_run(model, batch, [layer for layers in self.sites.values() for layer in layers])
        for position, layers in self.sites.items():
            self.store.write(f"source/{position}", rows, self._site_z(source, batch, layers, position))

    def _site_z(
        self, source: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str
    ) -> torch.Tensor:
        """The source run's z at ``position`` for ``layers``, stacked ``"batch layer ..."`` as a row stores it."""
        if position in self.classes:
            z = class_z_at(source, batch, layers, position, self.classes[position])
        else:
            z = z_at(source, batch, layers, position)
        return torch.stack([z[layer] for layer in layers], dim=1)

    def _source_values(
        self, model: LoadedModel, batch: dict, rows: Sequence[int], heads: Sequence[Head], position: str
    ) -> dict[int, torch.Tensor]:
        """The sources' z of pairs ``rows`` at ``position`` for each layer of ``heads``: read from the cache, or
        (``mode="recompute"``) from a source run of the batch now."""
        layers = sorted({h.layer for h in heads})
        if self.mode == "recompute":
            z = self._site_z(source_run(model, batch, layers), batch, layers, position)
            return {layer: z[:, i] for i, layer in enumerate(layers)}
        z = self.store.read(f"source/{position}", rows)
        return {layer: z[:, self.sites[position].index(layer)] for layer in layers}

    def _teacher(self, batch: dict, rows: Sequence[int]) -> tuple[torch.Tensor, Optional[torch.Tensor], Target]:
        """The base run's input ids (the prompts, then the first ``width - 1`` target tokens where a target has
        several), its read-out positions (None: the last) and the batch's `Target`."""
        ids = batch["base"]["input_ids"]
        if self.width == 1:
            return ids, None, batch["target_ids"]
        tokens, lengths = token_tensors([target_tokens(self.pairs[i]) for i in rows])
        tokens = _pad(tokens, 1, self.width)
        n = ids.shape[1]
        readout = (n - 1 + torch.arange(self.width))[None].expand(ids.shape[0], -1)
        return torch.cat([ids, tokens[:, :-1]], 1), readout, (tokens, lengths)

    def close(self) -> None:
        """Delete the cache's file now (it is deleted with the cache otherwise)."""
        self.store.close()

    def logits(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        heads: Sequence[Head],
        mask: torch.Tensor,
        position: str,
        grad: bool = False,
    ) -> tuple[torch.Tensor, Target]:
        """(logits at the last token, target ids) of pairs ``rows`` with ``heads`` mixed under ``mask``, in
        the order of ``rows`` (pairs of several lengths run group by group); for targets of several tokens, the
        teacher-forced logits ``"batch width vocab"`` and (tokens, lengths)."""
        rows = list(rows)
        groups = group_batches(take(self.pairs, rows))
        if len(groups) == 1:
            return self._logits(model, rows, heads, mask, position, grad)
        outs = [self._logits(model, take(rows, g), heads, mask, position, grad) for g in groups]
        back = torch.as_tensor(record_order(groups), dtype=torch.long)
        logits = torch.cat([o[0] for o in outs])[back.to(outs[0][0].device)]
        if self.width == 1:
            return logits, torch.cat([o[1] for o in outs])[back.to(outs[0][1].device)]
        tokens, lengths = (torch.cat([o[1][i] for o in outs])[back] for i in (0, 1))
        return logits, (tokens.to(logits.device), lengths.to(logits.device))

    def _logits(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        heads: Sequence[Head],
        mask: torch.Tensor,
        position: str,
        grad: bool = False,
    ) -> tuple[torch.Tensor, Target]:
        """`logits` of pairs of one length."""
        batch = pair_batch_tensors([self.pairs[i] for i in rows])
        ids, readout, target = self._teacher(batch, rows)
        n = ids.shape[1]
        values = self._source_values(model, batch, rows, heads, position)
        if position in self.classes:
            index, real = class_indices(batch["base"], position)
            patches = class_z_patches(model, heads, mask, values, index, real, batch["base"]["input_ids"].shape[1])
        else:
            patches = masked_z_patches(model, heads, mask, values, _positions(batch, position, "base"))
        first = min(h.layer for h in heads)
        start = max((layer for layer in self.starts if layer <= first), default=0)
        resume = Resume(start, self.store.read(f"resid/{start}", rows)[:, :n]) if start else None
        out = run(model, ids, patches, grad=grad, resume=resume, prefix=self._prefix(rows, n), readout=readout)
        if isinstance(target, tuple):
            return out.logits, (target[0].to(out.logits.device), target[1].to(out.logits.device))
        return out.logits, target.to(out.logits.device)

    def _prefix(self, rows: Sequence[int], n: int) -> Optional[Prefix]:
        """The base run's keys and values of pairs ``rows`` cut to their length ``n`` (None: full-length runs)."""
        if not self.suffix:
            return None
        keys, values = (self.store.read(name, rows)[..., :n, :] for name in ("keys", "values"))
        return Prefix(list(keys.unbind(1)), list(values.unbind(1)))

    def accuracy(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        patched: Sequence[Head],
        position: str,
        batch_size: int = 32,
        progress: bool = False,
    ) -> np.ndarray:
        """Per-pair correctness (top-1 == target) of pairs ``rows`` with ``patched`` heads' z from the source."""
        rows, patched = list(rows), list(patched)
        if not patched:
            return self.floor[rows]
        mask = torch.zeros(len(patched), device=model.device)
        correct = []
        for chunk in progress_bar(batches(len(rows), batch_size), desc="dcm eval", disable=not progress, leave=False):
            with torch.no_grad():
                logits, target = self.logits(model, rows[chunk], patched, mask, position)
            correct.append(target_correct(logits, target).cpu().numpy())
        return np.concatenate(correct)


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` zero-filled along ``dim`` to ``length`` (a shorter pair's stored run; cut back when read)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def target_accuracy(
    model: LoadedModel,
    pairs: Sequence[PairRecord],
    patched: Sequence[Head],
    position: str,
    batch_size: int = 32,
    progress: bool = False,
    mode: str = "file",
) -> np.ndarray:
    """Per-pair correctness (top-1 == target) with ``patched`` heads' z taken from the source at ``position``
    (``mode``: the `PairCache`'s, one of `CACHE_MODES`)."""
    cache = PairCache.build(model, pairs, [(list(patched), position)], batch_size, progress, mode)
    try:
        return cache.accuracy(model, range(len(pairs)), patched, position, batch_size, progress)
    finally:
        cache.close()


# ---------------------------------------------------------------------------------------------
# Mask parameterisations
# ---------------------------------------------------------------------------------------------


class _Mask:
    """Learnable per-head mask ``m`` (1 = keep base, 0 = patch from source)."""

    def __init__(self, n: int, config: DCMConfig, device: torch.device):
        self.kind = config.parameterisation
        if self.kind == "continuous":
            self.param = torch.full((n,), float(config.init), device=device, requires_grad=True)
        else:  # log_alpha of the gate g = 1 - m; at least half open (log_alpha >= 0): a mostly closed
            # hard-concrete gate samples exactly 0 and gets no gradient
            g0 = min(max(1.0 - config.init, 0.5), 0.95)
            s0 = (g0 - _GAMMA) / (_ZETA - _GAMMA)
            self.param = torch.full((n,), math.log(s0 / (1 - s0)), device=device, requires_grad=True)

    def sample(self) -> torch.Tensor:
        """The mask used in a training step (hard-concrete: a stochastic gate sample)."""
        if self.kind == "continuous":
            return self.param
        u = torch.rand_like(self.param).clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + self.param) / _BETA)
        return 1 - (s * (_ZETA - _GAMMA) + _GAMMA).clamp(0, 1)

    def penalty(self) -> torch.Tensor:
        """sum(1 - m), or the expected number of open gates (patched heads) for hard-concrete."""
        if self.kind == "continuous":
            return (1 - self.param).sum()
        return torch.sigmoid(self.param - _BETA * math.log(-_GAMMA / _ZETA)).sum()

    def values(self) -> torch.Tensor:
        """The deterministic mask in [0, 1]."""
        with torch.no_grad():
            if self.kind == "continuous":
                return self.param.detach().clone()
            return 1 - (torch.sigmoid(self.param) * (_ZETA - _GAMMA) + _GAMMA).clamp(0, 1)

    def after_step(self) -> None:
        if self.kind == "continuous":
            with torch.no_grad():
                self.param.clamp_(0, 1)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def train_mask(
    model: LoadedModel,
    heads: Sequence[Head],
    position: str,
    cache: PairCache,
    train: Sequence[int],
    val: Sequence[int],
    config: DCMConfig,
    progress: bool = True,
) -> tuple[torch.Tensor, int, list[dict]]:
    """Learn the mask on pairs ``train`` of ``cache``, validating on ``val``; returns (mask at the best
    validation step, that step, history)."""
    torch.manual_seed(config.seed)
    heads = list(heads)
    mask = _Mask(len(heads), config, model.device)
    optimiser = torch.optim.Adam([mask.param], lr=config.lr)
    rng = random.Random(config.seed)
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    best = (-1.0, 0, 0, mask.values())  # (val accuracy, n patched, step, mask)
    scale = loss_scale(model, heads, position, cache, train, config)
    history: list[dict] = []

    def validate(step: int, loss: float) -> None:
        nonlocal best
        values = mask.values()
        chosen = [h for h, m in zip(heads, values.tolist()) if m < 0.5]
        acc = float(cache.accuracy(model, val, chosen, position, config.eval_batch).mean())
        history.append({"step": step, "loss": loss, "val_accuracy": acc, "n_selected": len(chosen)})
        # Ties on validation accuracy go to the mask that patches MORE heads (Prakash et al.'s rule).
        if (acc, len(chosen)) > best[:2]:
            best = (acc, len(chosen), step, values)

    if config.schedule == "steps":
        validate(0, float("nan"))
    bar = progress_bar(total=config.epochs * steps_per_epoch, desc=f"dcm {position}", disable=not progress, leave=False)
    step = 0
    for _ in range(config.epochs):
        order = list(train)
        if config.shuffle:
            rng.shuffle(order)
        for b, chunk in enumerate(batches(len(order), config.batch_size)):
            loss = _step(model, heads, position, cache, order[chunk], mask, optimiser, config, scale)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if validates(config, step, b, config.epochs * steps_per_epoch):
                validate(step, loss)
    bar.close()
    return best[3], best[2], history


def validates(config: DCMConfig, step: int, batch: int, total: int) -> bool:
    """Whether validation runs after optimiser step ``step`` (1-based), batch ``batch`` (0-based) of its epoch."""
    if config.schedule == "epoch_batches":
        return batch % config.eval_every == 0
    return step % config.eval_every == 0 or step == total


def loss_scale(
    model: LoadedModel, heads: Sequence[Head], position: str, cache: PairCache, train: Sequence[int], config: DCMConfig
) -> float:
    """The factor on ``lam``: 1 (``lam_scale="absolute"``) or mean |logit(target)| of the unpatched
    model on the first training micro-batch (``"loss"``), so the sparsity weight is relative to the loss."""
    if config.lam_scale == "absolute" or not train:
        return 1.0
    rows = list(train)[: config.micro_batch]
    with torch.no_grad():
        logits, target = cache.logits(model, rows, list(heads), torch.ones(len(heads), device=model.device), position)
    return max(float(target_score(logits, target).abs().mean()), 1e-6)


def _step(
    model: LoadedModel,
    heads: list[Head],
    position: str,
    cache: PairCache,
    rows: list[int],
    mask: _Mask,
    optimiser: torch.optim.Optimizer,
    config: DCMConfig,
    scale: float = 1.0,
) -> float:
    """One optimiser step over pairs ``rows``, accumulating gradients over micro-batches."""
    optimiser.zero_grad()
    total = 0.0
    for chunk in batches(len(rows), config.micro_batch):
        logits, target = cache.logits(model, rows[chunk], heads, mask.sample(), position, grad=True)
        loss = -target_score(logits, target).sum() / len(rows)
        loss.backward()
        total += loss.item()
    penalty = config.lam * scale * mask.penalty()
    penalty.backward()
    optimiser.step()
    mask.after_step()
    return total + penalty.item()


def run_dcm(
    model: LoadedModel,
    heads: Sequence[Head],
    position: str,
    pairs: Sequence[PairRecord],
    config: Optional[DCMConfig] = None,
    desideratum: str = "custom",
    group: str = "",
    progress: bool = True,
    cache: Optional[PairCache] = None,
    items: Optional[Sequence] = None,
    mode: str = "file",
) -> DCMResult:
    """Learn a DCM mask over ``heads`` at ``position`` for a desideratum's ``pairs`` and evaluate it on a
    held-out test split against the no-intervention floor, the whole group and random head sets.
    ``cache``: a `PairCache` of ``pairs`` covering these heads (built here in ``mode`` if absent);
    ``items``: each pair's item (default: its clean prompt), the splits disjoint by it (`split_indices`)."""
    config = config or DCMConfig()
    heads = list(heads)
    if not heads:
        raise ValueError("DCM needs at least one head")
    if cache is None:
        cache = PairCache.build(
            model,
            pairs,
            [(heads, position), (random_pool(model, heads, config), position)],
            config.eval_batch,
            progress,
            mode,
        )
    train, val, test = split_indices(len(cache.pairs), config.split, config.seed, pair_items(cache.pairs, items))
    values, best_step, history = train_mask(model, heads, position, cache, train, val, config, progress)
    selected = [h for h, m in zip(heads, values.tolist()) if m < 0.5]
    bs = config.eval_batch
    acc = cache.accuracy(model, test, selected, position, bs)
    full = cache.accuracy(model, test, heads, position, bs)
    drawn = random_heads(model, heads, selected, config, config.n_random, config.seed + 1)
    outcomes = [cache.accuracy(model, test, hs, position, bs) for hs in drawn]
    random_est = pooled_proportion(outcomes) if outcomes else None
    return DCMResult(
        desideratum,
        position,
        heads,
        [round(float(v), 4) for v in values.tolist()],
        selected,
        inf.proportion(acc),
        inf.proportion(cache.floor[test]),
        inf.proportion(full),
        random_est,
        (len(train), len(val), len(test)),
        best_step,
        history,
        group,
        asdict(config),
        drawn,
        [np.asarray(o).astype(int).tolist() for o in outcomes],
    )


def random_pool(model: LoadedModel, heads: Sequence[Head], config: DCMConfig) -> list[Head]:
    """The heads whose layers random baselines draw from (a pair cache holds every head of each layer it covers):
    the group's own (``"group"``, and ``"layer"``: the selection's layers are the group's) or every head of the
    model (``"all"``)."""
    if config.random_pool != "all" or config.n_random < 1:
        return list(heads)
    return all_heads(model.shape.n_layers, model.shape.n_heads)


def random_heads(
    model: LoadedModel, group: Sequence[Head], selected: Sequence[Head], config: DCMConfig, n: int, seed: int
) -> list[list[Head]]:
    """``n`` random head sets of the selection's size, seeded, by ``config.random_pool``: ``"layer"`` (each selected
    head replaced by a head drawn from its own layer; patched at the group's position class, as the selection is),
    ``"all"`` heads of the model, or the ``"group"``'s. None where nothing was selected."""
    if not selected or n < 1:
        return []
    rng, k = random.Random(seed), len(selected)
    if config.random_pool == "layer":
        return [layer_matched(selected, model.shape.n_heads, rng) for _ in range(n)]
    pool = random_pool(model, group, config)
    return [rng.sample(pool, k) for _ in range(n)]


def dcm_circuit(
    model: LoadedModel,
    circuit: Circuit,
    desiderata: dict[str, Sequence[PairRecord]],
    config: Optional[DCMConfig] = None,
    groups: Optional[Iterable[str]] = None,
    progress: bool = True,
    items: Optional[Sequence] = None,
    mode: str = "file",
) -> list[DCMResult]:
    """DCM for every (group, desideratum) of a circuit; each group at its own position. One
    `PairCache` per desideratum (in ``mode``, one of `CACHE_MODES`) serves every group; ``items``:
    each pair's item (every desideratum's pairs are of the same rows; default: a pair's clean prompt), train,
    validation and test disjoint by it."""
    config = config or DCMConfig()
    results = []
    wanted = list(groups) if groups is not None else list(circuit.groups)
    for g in wanted:
        if g not in circuit.groups:
            raise ValueError(f"group {g!r} is not in the circuit (groups: {sorted(circuit.groups)})")
    wanted = [g for g in wanted if circuit.groups[g]]
    for name, pairs in desiderata.items():
        sites = [
            (heads, circuit.positions[g])
            for g in wanted
            for heads in (circuit.groups[g], random_pool(model, circuit.groups[g], config))
        ]
        cache = PairCache.build(model, pairs, sites, config.eval_batch, progress, mode)
        for g in wanted:
            log.info(
                "DCM group %s (%d heads at %s), desideratum %s", g, len(circuit.groups[g]), circuit.positions[g], name
            )
            results.append(
                run_dcm(model, circuit.groups[g], circuit.positions[g], pairs, config, name, g, progress, cache, items)
            )
        cache.close()  # one desideratum's file at a time (each holds every layer's keys and values)
    order = {g: i for i, g in enumerate(wanted)}
    return sorted(results, key=lambda r: order[r.group])  # grouped as before: per group, each desideratum


# ---------------------------------------------------------------------------------------------
# Semantic patching across models
# ---------------------------------------------------------------------------------------------


@dataclass
class SemanticResult:
    """Target accuracy of one model with the selected heads patched (source -> base), its unpatched floor and
    random heads of the selection's layers and position (`random_heads`), per pair, with the paired tests of
    the patched heads against each (`paired`)."""

    model: str
    accuracy: inf.Interval
    floor: inf.Interval
    outcomes: list[int] = field(default_factory=list)  # per pair: 1 where the patched run gives the target
    floor_outcomes: list[int] = field(default_factory=list)  # per pair: 1 where the unpatched run gives it
    random_heads: list[list[Head]] = field(default_factory=list)  # each draw's heads
    random_outcomes: list[list[int]] = field(default_factory=list)  # each draw's per-pair outcomes
    random: Optional[inf.Interval] = None  # the draws' mean, resampling draws and pairs

    def tests(self) -> dict[str, inf.Test]:
        """The patched heads against the floor (exact McNemar on the same pairs) and against the random heads (the
        per-pair share of draws that give the target: the sign-flip test over pairs)."""
        if not self.outcomes or not self.floor_outcomes:
            return {}
        out = {"floor": inf.paired(self.outcomes, self.floor_outcomes, claim="patched - unpatched floor")}
        if self.random_outcomes:
            share = np.mean(self.random_outcomes, 0)
            out["random"] = inf.paired(self.outcomes, share, claim="patched - random heads (per-pair mean of draws)")
        return out

    def to_dict(self) -> dict:
        out = {"model": self.model, "accuracy": self.accuracy.to_dict(), "floor": self.floor.to_dict()}
        if self.outcomes:
            out["outcomes"] = outcome_record(self.outcomes)
        if self.floor_outcomes:
            out["floor_outcomes"] = bits(self.floor_outcomes)
        if self.random_outcomes:
            out["random"] = self.random.to_dict() if self.random is not None else None
            out["random_heads"] = [[h.name for h in hs] for hs in self.random_heads]
            out["random_outcomes"] = [bits(o) for o in self.random_outcomes]
        out.update({f"vs_{k}": t.row() for k, t in self.tests().items()})
        return out


def semantic_patching(
    models: Iterable[LoadedModel],
    heads: Sequence[Head],
    position: str,
    pairs: Sequence[PairRecord],
    batch_size: int = 32,
    progress: bool = True,
    n_random: int = 0,
    seed: int = 0,
    mode: str = "file",
) -> list[SemanticResult]:
    """Patch ``heads`` (e.g. a DCM selection) from each pair's source into its base, within each model,
    and report the desideratum's target accuracy per model (with the unpatched floor); with ``n_random``, also
    that many random head sets of the selection's layers at ``position`` (`random_heads`, drawn once by
    ``seed`` and patched into every model), each draw's per-pair outcomes kept; ``mode``: each
    `PairCache`'s."""
    return semantic_selections(models, [(heads, position)], pairs, batch_size, progress, n_random, seed, mode)[0]


def semantic_selections(
    models: Iterable[LoadedModel],
    selections: Sequence[tuple[Sequence[Head], str]],
    pairs: Sequence[PairRecord],
    batch_size: int = 32,
    progress: bool = True,
    n_random: int = 0,
    seed: int = 0,
    mode: str = "file",
) -> list[list[SemanticResult]]:
    """`semantic_patching` of each ``(heads, position)`` of ``selections`` (the selections of one desideratum, on its
    ``pairs``): per selection, one `SemanticResult` per model. One `PairCache` per model serves every selection (two
    forward passes a pair, then the patched runs of each): each selection's patched runs resume at its own lowest
    layer from the same base run as a cache of its own, so its outcomes are the same, for a third of the forwards
    where a desideratum's three groups select heads."""
    selections = [(list(heads), position) for heads, position in selections]
    if not selections or not all(heads for heads, _ in selections):
        raise ValueError("semantic patching needs at least one head (the DCM selection was empty)")
    models = list(models)
    config = DCMConfig(random_pool="layer")
    drawn = [random_heads(models[0], h, h, config, n_random, seed) if models else [] for h, _ in selections]
    out: list[list[SemanticResult]] = [[] for _ in selections]
    for model in models:
        cache = PairCache.build(model, pairs, selections, batch_size, progress, mode)
        for (heads, position), draws_heads, results in zip(selections, drawn, out):
            acc = cache.accuracy(model, range(len(pairs)), heads, position, batch_size, progress)
            draws = [cache.accuracy(model, range(len(pairs)), hs, position, batch_size) for hs in draws_heads]
            results.append(
                SemanticResult(
                    model.name,
                    inf.proportion(acc),
                    inf.proportion(cache.floor),
                    np.asarray(acc).astype(int).tolist(),
                    np.asarray(cache.floor).astype(int).tolist(),
                    draws_heads,
                    [np.asarray(d).astype(int).tolist() for d in draws],
                    pooled_proportion(draws) if draws else None,
                )
            )
        cache.close()
    return out
