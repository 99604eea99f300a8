"""HeadMap (ICLR 2025, "HeadMap: Locating and Enhancing Knowledge Circuits in LLMs").

Three parts:

1. **Sample selection** (`select_samples`): the ``n`` examples of a task with the lowest
   answer loss under the model.
2. **Layer-conditioned locating** (`locate`): layer by layer from the first, every head
   of the layer is zero-masked together with the heads already selected in earlier layers, and
   the ``k`` heads whose masking raises the mean answer loss on the selected samples most are
   kept. One layer is one batch of ``(n_heads + 1) * n`` rows (the extra block masks only the
   earlier layers' heads, giving the loss curve), so it costs ``ceil((n_heads + 1) * n / batch)``
   forward passes through `mechdiff.patching.core.run` (per-row masks on site ``z``). These
   passes resume at the layer from the residual entering it (earlier selections zeroed), which is
   carried forward one block at a time: over the whole model locating costs about half the blocks
   that full passes would.
3. **HeadMap fine-tuning** (`HeadMap`): for each layer with located heads, their
   concatenated outputs ``"batch pos (k d_head)"`` go through ``Linear(k*d_head -> r)`` and
   ``Linear(r -> d_model)`` (the second zero-initialised) and are added to the attention output
   (a forward hook on the output projection). Only the maps train.

Tasks (the registry `mechdiff.tasks.base.TASKS`, those with training batches): ``entity-tracking`` (7-box prompts
for locating and evaluation, 2-7 boxes for training, as `mechdiff.methods.finetune`; evaluation on held-out
objects) and ``multiple-choice`` (alias ``arithmetic-mc``; `mechdiff.tasks.multiple_choice`; evaluation on held-out
names).
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from einops import rearrange

from ..circuits.circuit import Circuit
from ..common.components import Head
from ..common.metrics import answer_is_top1, answer_logprob
from ..common.progress import progress_bar
from ..models.loading import LoadedModel
from ..patching.core import Patch, Resume, run
from ..tasks.base import Task, trainable_tasks
from ..tasks.base import get_task as base_task
from .finetune import FinetuneConfig, add_lora, answer_loss, last_logits

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
GROUP = "headmap"


@dataclass
class LocateConfig:
    """Locating on a task: the ``n`` lowest-loss samples of a pool of ``pool`` prompts (seeded), ``k`` heads
    kept per layer, ``batch_size`` rows per forward pass."""

    n: int = 64
    pool: int = 256
    k: int = 8
    batch_size: int = 64
    seed: int = 0


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------


def get_task(name: str) -> Task:
    """A registered task (`mechdiff.tasks.base.TASKS`) with a locating pool, training and held-out batches."""
    task = base_task(name)
    if task.pool_batch is None or task.train_batch is None or task.eval_batch is None:
        raise ValueError(
            f"task {name!r} has no training batches for HeadMap; choose one of {', '.join(trainable_tasks())}"
        )
    return task


# --------------------------------------------------------------------------------------
# Losses under head masks (nnsight, through core.run)
# --------------------------------------------------------------------------------------


def head_mask(model: LoadedModel, heads: Iterable[int]) -> torch.Tensor:
    """``"1 1 (head d_head)"`` mask: 0 on the columns of ``heads`` of site z, 1 elsewhere."""
    s = model.shape
    mask = torch.ones(1, 1, s.n_heads * s.d_head)
    for h in heads:
        mask[..., model.arch.columns("z", h, s)] = 0.0
    return mask


def mask_patches(model: LoadedModel, heads: Iterable[Head]) -> list[Patch]:
    """Patches that zero the outputs of ``heads`` at every position (one patch per layer)."""
    by_layer: dict[int, list[int]] = {}
    for h in heads:
        by_layer.setdefault(h.layer, []).append(h.head)
    zero = torch.zeros(1)
    return [Patch("z", layer, zero, mask=head_mask(model, hs)) for layer, hs in sorted(by_layer.items())]


def example_losses(
    model: LoadedModel,
    batch: Batch,
    masked: Iterable[Head] = (),
    batch_size: int = LocateConfig.batch_size,
    progress: bool = False,
) -> torch.Tensor:
    """Answer cross-entropy ``[n]`` of every example with ``masked`` heads zeroed (no heads: the plain model)."""
    patches = mask_patches(model, masked)
    ids, answers = batch["input_ids"], batch["answer_ids"]
    out = []
    for i in progress_bar(range(0, len(ids), batch_size), desc="losses", disable=not progress, leave=False):
        logits = run(model, ids[i : i + batch_size], patches).logits.float().cpu()
        out.append(-answer_logprob(logits, answers[i : i + batch_size]))  # the answer cross-entropy
    return torch.cat(out)


def select_samples(
    model: LoadedModel, pool: Batch, n: int, batch_size: int = LocateConfig.batch_size
) -> tuple[Batch, torch.Tensor]:
    """The ``n`` lowest-loss examples of ``pool`` (ties: lower index first) and every pool loss."""
    losses = example_losses(model, pool, batch_size=batch_size)
    if n > len(losses):
        raise ValueError(f"asked for {n} samples from a pool of {len(losses)}; raise --pool")
    keep = torch.sort(torch.argsort(losses, stable=True)[:n]).values
    return {k: v[keep] for k, v in pool.items()}, losses


# --------------------------------------------------------------------------------------
# Layer-conditioned locating
# --------------------------------------------------------------------------------------


@dataclass
class LocateResult:
    """Selected heads per layer, every candidate's loss, the loss curve and the cost."""

    heads: list[Head]
    candidate_loss: dict[Head, float]  # mean loss with the head masked (and earlier selections)
    curve: list[float]  # curve[l]: mean loss with the heads selected in layers < l masked; curve[L]: all
    base_loss: float  # curve[0]: selected samples, nothing masked
    pool_loss: float  # mean loss of the whole pool, nothing masked
    forward_passes: int
    rows: int  # prompt rows pushed through the model while locating
    seconds: float
    settings: dict = field(default_factory=dict)

    def by_layer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for h in self.heads:
            out.setdefault(h.layer, []).append(h.head)
        return out

    def circuit(self, model: str, task: str) -> Circuit:
        """The located heads as a `Circuit` (one group, masked at every position)."""
        return Circuit(
            model=model,
            task=task,
            groups={GROUP: sorted(self.heads)},
            positions={GROUP: "last"},
            names={GROUP: "HeadMap located heads (zero-masked at every position)"},
            scores={GROUP: {h.name: v for h, v in sorted(self.candidate_loss.items())}},
            meta={
                "method": "headmap-layer-conditioned",
                **self.settings,
                "curve": self.curve,
                "base_loss": self.base_loss,
                "pool_loss": self.pool_loss,
                "forward_passes": self.forward_passes,
                "rows": self.rows,
                "seconds": round(self.seconds, 1),
            },
        )


def entry_residual(
    model: LoadedModel,
    samples: Batch,
    layer: int,
    masked: Sequence[Head],
    start: Optional[tuple[int, torch.Tensor]] = None,
    batch_size: int = LocateConfig.batch_size,
) -> tuple[torch.Tensor, int]:
    """The residual stream entering ``layer`` (``"sample pos d_model"``) with ``masked`` heads zeroed, and
    the passes it took. ``start = (a, hidden)`` resumes at block ``a`` from ``hidden`` (the residual entering
    ``a`` with the masked heads of layers ``< a`` already zeroed), so only blocks ``a .. layer-1`` run."""
    if layer == 0:
        raise ValueError("nothing precedes layer 0: its entry is the embedding")
    first = 0 if start is None else start[0]
    patches = mask_patches(model, [h for h in masked if first <= h.layer < layer])
    ids = samples["input_ids"]
    out, passes = [], 0
    for i in range(0, len(ids), batch_size):
        resume = Resume(first, start[1][i : i + batch_size]) if start is not None else None
        r = run(model, ids[i : i + batch_size], patches, capture=[("resid", layer - 1)], stop=True, resume=resume)
        out.append(r.captured[("resid", layer - 1)])
        passes += 1
    return torch.cat(out), passes


def layer_losses(
    model: LoadedModel,
    samples: Batch,
    layer: int,
    fixed: Sequence[Head],
    batch_size: int = LocateConfig.batch_size,
    entry: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, int]:
    """Mean loss on ``samples`` for each variant of ``layer``: ``[n_heads + 1]``, entry ``h`` with head ``h``
    of ``layer`` zeroed and entry ``n_heads`` with nothing more, all with ``fixed`` heads zeroed; and the
    number of forward passes used. Rows are ``"(variant sample)"``; each chunk carries its per-row mask.

    ``entry``: the residual entering ``layer`` with ``fixed`` heads (all in earlier layers) zeroed, from
    `entry_residual`; the variants then resume at ``layer`` (exact, and the blocks before it are
    not run again). Without it every variant runs the whole model."""
    s = model.shape
    n = len(samples["input_ids"])
    n_var = s.n_heads + 1
    if entry is not None and any(h.layer >= layer for h in fixed):
        raise ValueError("resuming from an entry residual needs every fixed head before the layer")
    variant_mask = torch.cat([head_mask(model, [h]) for h in range(s.n_heads)] + [head_mask(model, [])])
    ids = samples["input_ids"].repeat(n_var, 1)  # "(variant sample) pos"
    answers = samples["answer_ids"].repeat(n_var)
    row_mask = variant_mask.repeat_interleave(n, dim=0)  # "(variant sample) 1 cols"
    fixed_patches = [] if entry is not None else mask_patches(model, fixed)
    losses, passes = [], 0
    for i in range(0, len(ids), batch_size):
        patches = fixed_patches + [Patch("z", layer, torch.zeros(1), mask=row_mask[i : i + batch_size])]
        rows = torch.arange(i, min(i + batch_size, len(ids))) % n  # row "(variant sample)" -> its sample
        resume = Resume(layer, entry[rows]) if entry is not None else None
        logits = run(model, ids[i : i + batch_size], patches, resume=resume).logits.float().cpu()
        losses.append(-answer_logprob(logits, answers[i : i + batch_size]))
        passes += 1
    per_row = rearrange(torch.cat(losses), "(variant sample) -> variant sample", variant=n_var)
    return per_row.mean(-1), passes


def locate(
    model: LoadedModel,
    samples: Batch,
    k: int = LocateConfig.k,
    batch_size: int = LocateConfig.batch_size,
    pool_loss: float = float("nan"),
    layers: Optional[Sequence[int]] = None,
    progress: bool = True,
) -> LocateResult:
    """Layer-conditioned locating of ``k`` heads per layer on ``samples`` (see the module docstring).

    Each layer's variants resume from the residual entering it (earlier selections zeroed), carried
    forward one layer at a time, so layer ``l`` costs the blocks from ``l`` on, not the whole model."""
    s = model.shape
    if not 1 <= k <= s.n_heads:
        raise ValueError(f"k={k} heads per layer must lie in 1..{s.n_heads} (the model's heads per layer)")
    layers = sorted(range(s.n_layers) if layers is None else set(layers))
    t0 = time.time()
    selected: list[Head] = []
    candidate: dict[Head, float] = {}
    curve: list[float] = []
    passes = 0
    start: Optional[tuple[int, torch.Tensor]] = None  # (layer, residual entering it), selections so far zeroed
    bar = progress_bar(layers, desc="locate", disable=not progress)
    for layer in bar:
        if layer > 0:
            entry, p = entry_residual(model, samples, layer, selected, start, batch_size)
            start, passes = (layer, entry), passes + p
        means, p = layer_losses(model, samples, layer, selected, batch_size, start[1] if start else None)
        passes += p
        curve.append(float(means[-1]))
        for h in range(s.n_heads):
            candidate[Head(layer, h)] = float(means[h])
        order = torch.argsort(-means[:-1], stable=True)[:k]
        selected += [Head(layer, int(h)) for h in sorted(order.tolist())]
        bar.set_postfix(loss=f"{curve[-1]:.3f}")
    final = example_losses(model, samples, selected, batch_size)
    passes += math.ceil(len(final) / batch_size)
    curve.append(float(final.mean()))
    n = len(samples["input_ids"])
    settings = {"k": k, "n_samples": n, "batch_size": batch_size, "layers": layers}
    return LocateResult(
        selected,
        candidate,
        curve,
        curve[0],
        pool_loss,
        passes,
        len(layers) * (s.n_heads + 1) * n + n,
        time.time() - t0,
        settings,
    )


def locate_task(
    model: LoadedModel, task: str, cfg: LocateConfig = LocateConfig(), progress: bool = True
) -> LocateResult:
    """Sample selection on a pool of ``task`` prompts (seeded), then `locate`."""
    pool_batch = get_task(task).pool_batch(model.tokenizer, cfg.pool, cfg.seed)
    t0 = time.time()
    samples, losses = select_samples(model, pool_batch, cfg.n, cfg.batch_size)
    select_s = time.time() - t0
    res = locate(model, samples, cfg.k, cfg.batch_size, float(losses.mean()), progress=progress)
    res.settings.update(
        task=task,
        pool=cfg.pool,
        seed=cfg.seed,
        selection_seconds=round(select_s, 1),
        selection_passes=math.ceil(cfg.pool / cfg.batch_size),
    )
    return res


# --------------------------------------------------------------------------------------
# HeadMap module
# --------------------------------------------------------------------------------------


class HeadMap(torch.nn.Module):
    """Low-rank maps from located heads' outputs into the residual stream, one per layer.

    ``heads_by_layer``: layer -> query heads. Layer ``l``'s map is ``Linear(k_l*d_head -> rank)``
    then ``Linear(rank -> d_model)`` (zero-initialised, no biases), added to that layer's attention
    output. Trainable parameters: ``sum_l rank * (k_l * d_head + d_model)`` (`n_params`)."""

    def __init__(
        self, heads_by_layer: Mapping[int, Sequence[int]], d_head: int, d_model: int, rank: int, seed: int = 0
    ):
        super().__init__()
        torch.manual_seed(seed)
        self.heads = {int(l): sorted(int(h) for h in hs) for l, hs in sorted(heads_by_layer.items()) if hs}
        self.d_head, self.rank = d_head, rank
        self.maps = torch.nn.ModuleDict(
            {
                str(l): torch.nn.Sequential(
                    torch.nn.Linear(len(hs) * d_head, rank, bias=False), torch.nn.Linear(rank, d_model, bias=False)
                )
                for l, hs in self.heads.items()
            }
        )
        for m in self.maps.values():
            torch.nn.init.zeros_(m[1].weight)
        self._handles: list[Any] = []

    @staticmethod
    def n_params_for(heads_by_layer: Mapping[int, Sequence[int]], d_head: int, d_model: int, rank: int) -> int:
        return sum(rank * (len(hs) * d_head + d_model) for hs in heads_by_layer.values() if hs)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def delta(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """The map's output ``"batch pos d_model"`` for site ``z`` (``"batch pos (head d_head)"``) of ``layer``."""
        heads = rearrange(z, "b p (h d) -> b p h d", d=self.d_head)[:, :, self.heads[layer]]
        m = self.maps[str(layer)]
        # the maps train in float32 whatever the model's dtype (AdamW's small steps on bfloat16 weights would round
        # away): the heads' outputs are cast to float32 in, the map's output back to the model's dtype out
        return m(rearrange(heads, "b p k d -> b p (k d)").to(m[0].weight.dtype)).to(z.dtype)

    def attach(self, model: LoadedModel, root: Any = None) -> "HeadMap":
        """Hook the maps into ``root`` (default ``model.model``; a peft model's base model for HeadMap+LoRA)."""
        self.detach()
        root = model.model if root is None else root
        self.to(device=next(root.parameters()).device)  # float32 (see delta)
        for layer in self.heads:
            out_proj = model.arch.module(root, "z", layer)
            self._handles.append(
                out_proj.register_forward_hook(lambda mod, args, out, layer=layer: out + self.delta(layer, args[0]))
            )
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def lora_params(shape: Any, rank: int, targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> int:
    """Trainable parameters of a LoRA of ``rank`` on ``targets`` in every layer of a llama-family model."""
    kv = shape.n_kv_heads * shape.d_head
    q = shape.n_heads * shape.d_head
    dims = {
        "q_proj": (shape.d_model, q),
        "k_proj": (shape.d_model, kv),
        "v_proj": (shape.d_model, kv),
        "o_proj": (q, shape.d_model),
    }
    return shape.n_layers * sum(rank * sum(dims[t]) for t in targets)


# --------------------------------------------------------------------------------------
# Head sets for the ablations
# --------------------------------------------------------------------------------------


def random_heads(
    shape: Any, per_layer: Mapping[int, int], seed: int = 0, exclude: Iterable[Head] = ()
) -> dict[int, list[int]]:
    """``per_layer[l]`` random heads of each layer, drawn from the heads not in ``exclude``."""
    rng = random.Random(seed)
    banned = set(exclude)
    out = {}
    for layer, k in sorted(per_layer.items()):
        allowed = [h for h in range(shape.n_heads) if Head(layer, h) not in banned]
        if len(allowed) < k:
            raise ValueError(f"layer {layer} has only {len(allowed)} heads outside the excluded set, need {k}")
        out[layer] = sorted(rng.sample(allowed, k))
    return out


def heads_by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for h in sorted(heads):
        out.setdefault(h.layer, []).append(h.head)
    return out


# --------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """One HeadMap/LoRA training run (the LoRA options reuse `mechdiff.methods.finetune.FinetuneConfig`)."""

    task: str = "entity-tracking"
    steps: int = 30
    batch_size: int = 16
    lr: float = 1e-3  # LoRA learning rate
    headmap_lr: float = 5e-3  # HeadMap maps' learning rate
    seed: int = 0
    data_seed: int = 0
    rank: int = 4  # HeadMap map rank
    lora_rank: int = 0  # 0: no LoRA
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    eval_n: int = 200
    eval_seed: int = 1_000_000


def validation_batch(task: str, tokenizer: Any, n: int, seed: int) -> Batch:
    """Validation prompts for choosing training settings: the task's locating-pool prompts (training objects,
    never the held-out evaluation objects) drawn with their own ``seed``."""
    return get_task(task).pool_batch(tokenizer, n, seed)


def choose_lr(validation_accuracy: Mapping[float, float]) -> float:
    """The learning rate with the highest validation accuracy; ties go to the smallest rate."""
    if not validation_accuracy:
        raise ValueError("no learning rates to choose from")
    return min(validation_accuracy, key=lambda lr: (-validation_accuracy[lr], lr))


@torch.no_grad()
def correct(model: Any, batch: Batch, batch_size: int = 50) -> np.ndarray:
    """Per-example top-1 correctness (0/1) of the answer token."""
    out = []
    for i in range(0, len(batch["input_ids"]), batch_size):
        logits = last_logits(model, batch["input_ids"][i : i + batch_size])
        out.append(answer_is_top1(logits, batch["answer_ids"][i : i + batch_size]).cpu().numpy())
    return np.concatenate(out).astype(float)


def train(
    base: LoadedModel,
    cfg: TrainConfig,
    heads: Optional[Mapping[int, Sequence[int]]] = None,
    eval_batches: Optional[Mapping[str, Batch]] = None,
    progress: bool = True,
) -> dict:
    """Train HeadMap maps on ``heads`` (None: none), a LoRA (``cfg.lora_rank > 0``), or both, on a deep copy of
    ``base.model``. Returns trainable parameters, losses, seconds and per-example correctness on ``eval_batches``."""
    task = get_task(cfg.task)
    model = copy.deepcopy(base.model)
    model.requires_grad_(False)
    loaded = LoadedModel(base.name, base.spec, model, base.tokenizer, base.provenance)
    hf = model
    if cfg.lora_rank:
        model = add_lora(
            model,
            FinetuneConfig(
                base=base.name,
                rank=cfg.lora_rank,
                alpha=2.0 * cfg.lora_rank,
                target_modules=cfg.lora_targets,
                seed=cfg.seed,
            ),
        )
        hf = model.get_base_model()
    hm = None
    if heads:
        hm = HeadMap(heads, base.shape.d_head, base.shape.d_model, cfg.rank, seed=cfg.seed).attach(loaded, hf)
    lora = [p for p in model.parameters() if p.requires_grad]
    maps = list(hm.parameters()) if hm else []
    params = lora + maps
    if not params:
        raise ValueError("nothing to train: give heads, a LoRA rank, or both")
    groups = [g for g in ({"params": lora, "lr": cfg.lr}, {"params": maps, "lr": cfg.headmap_lr}) if g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    losses = []
    t0 = time.time()
    model.train()
    bar = progress_bar(range(cfg.steps), desc=f"train {cfg.task}", disable=not progress, leave=False)
    for step in bar:
        loss = answer_loss(model, task.train_batch(base.tokenizer, cfg.batch_size, cfg.data_seed, step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.time() - t0
    model.eval()
    results = {name: correct(model, b).tolist() for name, b in (eval_batches or {}).items()}
    if hm:
        hm.detach()
    return {
        "config": asdict(cfg),
        "heads": {str(l): hs for l, hs in (hm.heads if hm else {}).items()},
        "trainable": sum(p.numel() for p in params),
        "headmap_params": hm.n_params() if hm else 0,
        "losses": losses,
        "train_seconds": round(seconds, 1),
        "correct": results,
    }
