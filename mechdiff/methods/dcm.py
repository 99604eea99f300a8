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

Semantic patching (`mechdiff.methods.semantic`) patches the heads a mask selected into each
model of a set and reports the target accuracy per model with exact binomial intervals. What every run on one list
of pairs reads (the sources' z, the mixing patches, `PairCache`) is `mechdiff.methods.dcm_cache`.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..circuits.circuit import Circuit
from ..common import inference as inf
from ..common.components import Head, all_heads, layer_matched
from ..common.outcomes import bits
from ..common.progress import progress_bar
from ..common.stats import pooled_proportion
from ..models.loading import LoadedModel
from ..patching.evaluate import batches
from ..tasks.base import PairRecord
from .dcm_cache import PairCache, target_score

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
# Splitting pairs into train / validation / test (disjoint by item)
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
