"""LoRA fine-tuning of a loaded checkpoint (peft), with the loss on the answer token only.

The trainer wraps ``LoadedModel.model`` (any checkpoint mechdiff loads, including an
adapter already merged into its base) in a fresh peft LoRA, trains it on generated prompts
and saves adapters at chosen steps. Each saved adapter directory holds
``adapter_model.safetensors`` (float16), ``adapter_config.json`` (``base_model_name_or_path``
is the base's registry name or path) and ``recipe.json``: every option, the data seeds, the
torch/transformers/peft versions, the base fingerprint and the accuracy at every evaluation.

Tasks: ``entity-tracking`` (prompts with ``min_boxes``-``max_boxes`` boxes, one box count per
step, objects from `mechdiff.tasks.splits.train_objects`) and ``arithmetic``
(`mechdiff.tasks.arithmetic`, one form per step). Validation is always done on 7-box
entity-tracking prompts built from the training objects (and, for arithmetic, on arithmetic
problems too). Runs are deterministic given ``seed`` and ``data_seed`` on one torch build
and thread count.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..common.metrics import answer_is_top1
from ..common.progress import progress_bar
from ..models.loading import LoadedModel
from ..models.registry import step_dirname
from ..tasks import arithmetic, fact_edit
from ..tasks import entity_tracking as et
from ..tasks.base import get_task, step_seed, trainable_tasks  # noqa: F401 (step_seed: re-exported)
from ..tasks.entity_tracking.splits import HOLDOUT_EVERY, train_objects

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
Batch = dict[str, torch.Tensor]


@dataclass
class FinetuneConfig:
    """Every option of a fine-tuning run (all of it is written into each recipe)."""

    base: str = "smollm2-135m"
    task: str = "entity-tracking"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = 160
    batch_size: int = 16
    seed: int = 0
    data_seed: int = 0
    min_boxes: int = 2
    max_boxes: int = 7
    eval_every: int = 5
    eval_steps: tuple[int, ...] = ()  # extra evaluation steps besides every eval_every
    eval_n: int = 100
    eval_boxes: int = 7
    eval_seed: int = 1_000_000
    save_steps: dict[str, int] = field(default_factory=dict)  # adapter name -> step
    save_every: int = 0  # also save "step-NNNN" every this many steps (0: never)
    stop_accuracy: Optional[float] = None  # stop once validation accuracy reaches this (after last save)

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        self.eval_steps = tuple(sorted(int(s) for s in self.eval_steps))
        if get_task(self.task).train_batch is None:
            raise ValueError(
                f"task {self.task!r} has no training batches; fine-tune on one of {', '.join(trainable_tasks())}"
            )
        if not et.MIN_BOXES <= self.min_boxes <= self.max_boxes <= et.MAX_BOXES:
            raise ValueError(f"need {et.MIN_BOXES} <= min_boxes <= max_boxes <= {et.MAX_BOXES}")
        if self.steps < 0 or self.batch_size < 1 or self.rank < 1 or self.eval_every < 1:
            raise ValueError("steps >= 0, batch_size >= 1, rank >= 1 and eval_every >= 1 are required")
        late = {k: s for k, s in self.save_steps.items() if not 0 <= s <= self.steps}
        if late:
            raise ValueError(f"save steps {late} lie outside 0..{self.steps}; raise --steps or lower them")


@dataclass
class FinetuneResult:
    """What a run did: the evaluations (step -> metric -> value), losses, saved adapters, time."""

    history: list[dict[str, Any]]
    losses: list[float]
    saved: dict[str, str]
    seconds: float
    stopped_at: int


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def et_batch(tokenizer: Any, n: int, n_boxes: int, seed: int, vocabulary: Sequence[str]) -> Batch:
    """A batch of entity-tracking prompts: ``input_ids`` [batch, pos] and ``answer_ids`` [batch]."""
    records = et.generate(tokenizer, n=n, n_boxes=n_boxes, seed=seed, vocabulary=vocabulary)
    t = et.batch_tensors(records)
    return {"input_ids": t["input_ids"], "answer_ids": t["answer_ids"]}


def training_batch(cfg: FinetuneConfig, tokenizer: Any, step: int, vocabulary: Sequence[str]) -> Batch:
    """The task's training batch of ``step`` (entity tracking: one box count per step; arithmetic: one
    form per step), seeded by the step."""
    return get_task(cfg.task).train_batch(
        tokenizer,
        cfg.batch_size,
        cfg.data_seed,
        step,
        min_boxes=cfg.min_boxes,
        max_boxes=cfg.max_boxes,
        vocabulary=vocabulary,
    )


def validation_sets(cfg: FinetuneConfig, tokenizer: Any, vocabulary: Sequence[str]) -> dict[str, list[Batch]]:
    """Validation batches: 7-box entity tracking on training objects, plus arithmetic or the edited and retained
    facts for those tasks."""
    sets = {"et_accuracy": [et_batch(tokenizer, cfg.eval_n, cfg.eval_boxes, cfg.eval_seed, vocabulary)]}
    if cfg.task == "arithmetic":
        per_form = max(1, cfg.eval_n // len(arithmetic.FORMS))
        sets["arith_accuracy"] = [
            arithmetic.batch_tensors(arithmetic.generate(tokenizer, per_form, seed=cfg.eval_seed + i, form=f))
            for i, f in enumerate(arithmetic.FORMS)
        ]
    if cfg.task == "fact-edit":
        sets.update(fact_edit.validation(tokenizer))
    return sets


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def add_lora(model: Any, cfg: FinetuneConfig) -> Any:
    """Wrap an HF model in a fresh peft LoRA (initialised from ``torch.manual_seed(cfg.seed)``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def last_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, vocab]`` at the last position (only that position goes through the head)."""
    return model(input_ids=input_ids.to(_device(model)), logits_to_keep=1).logits[:, -1].float()


def answer_loss(model: Any, batch: Batch) -> torch.Tensor:
    """Cross-entropy of the answer token at the last position (no other position is trained)."""
    logits = last_logits(model, batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits, batch["answer_ids"].to(logits.device))


@torch.no_grad()
def accuracy(model: Any, batches: Iterable[Batch]) -> float:
    """Top-1 accuracy of the answer token over ``batches``."""
    hits = total = 0
    for b in batches:
        top1 = answer_is_top1(last_logits(model, b["input_ids"]), b["answer_ids"])
        hits += int(top1.sum())
        total += len(top1)
    return hits / total


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Versions of everything that changes the numbers (the CPU kernel path too: the same torch build rounds
    differently with AVX2 and AVX-512 kernels, so a rerun elsewhere is not bit for bit)."""
    import peft
    import transformers

    from ..version import __version__ as mechdiff_version

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "mechdiff": mechdiff_version,
        "python": platform.python_version(),
        "torch_threads": str(torch.get_num_threads()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def save_adapter(peft_model: Any, out_dir: str | Path, base_name: str, recipe: dict) -> Path:
    """Save the adapter (weights as float16), its config (base = ``base_name``) and ``recipe.json``, atomically."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    weights = tmp / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
    weights.chmod(0o644)
    cfg_path = tmp / "adapter_config.json"
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base_name
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True))
    (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2, default=str))
    (tmp / "README.md").unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def make_recipe(
    cfg: FinetuneConfig,
    name: str,
    step: int,
    history: list[dict],
    losses: list[float],
    base: LoadedModel,
    objects: Sequence[str],
    seconds: float,
) -> dict:
    """The JSON recipe of an adapter saved at ``step``."""
    return {
        "name": name,
        "step": step,
        "options": asdict(cfg),
        "data": {
            "train_step_seed": "data_seed * 1000003 + step",
            "validation_seed": cfg.eval_seed,
            "objects": f"mechdiff.tasks.splits.train_objects() (sorted vocabulary minus every "
            f"{HOLDOUT_EVERY}th object)",
            "n_objects": len(objects),
            "evaluation_objects": "mechdiff.tasks.splits.eval_objects() (never seen in training)",
        },
        "versions": versions(),
        "base": {"name": cfg.base, "fingerprint": base.fingerprint, "provenance": base.provenance},
        "history": [h for h in history if h["step"] <= step],
        "train_loss": losses[:step],
        "seconds": round(seconds, 1),
        "adapter_dtype": "float16",
    }


# --------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------


def finetune(
    base: LoadedModel,
    cfg: FinetuneConfig,
    out_dir: str | Path,
    progress: bool = True,
    on_eval: Optional[Callable[[dict], None]] = None,
) -> FinetuneResult:
    """Train a new LoRA on ``base.model`` and save ``cfg.save_steps`` adapters under ``out_dir/<name>``.

    Evaluates at step 0, every ``cfg.eval_every`` steps, at ``cfg.eval_steps``, at every save step and at the last
    step. Note: the base model's weights are wrapped in place (``base.model`` is not usable as
    the plain base afterwards).
    """
    t0 = time.time()
    tokenizer, objects = base.tokenizer, train_objects()
    val = validation_sets(cfg, tokenizer, objects)
    peft_model = add_lora(base.model, cfg)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    history: list[dict] = []
    losses: list[float] = []
    saved: dict[str, str] = {}
    by_step: dict[int, list[str]] = {}
    for name, s in cfg.save_steps.items():
        by_step.setdefault(s, []).append(name)
    for s in range(0, cfg.steps + 1, cfg.save_every) if cfg.save_every > 0 else ():
        by_step.setdefault(s, []).append(step_dirname(s))
    last_save = max(cfg.save_steps.values(), default=0)
    step = 0
    bar = progress_bar(total=cfg.steps, desc=f"finetune {cfg.task}", disable=not progress)
    while True:
        if step % cfg.eval_every == 0 or step in cfg.eval_steps or step in cfg.save_steps.values() or step == cfg.steps:
            peft_model.eval()
            row = {
                "step": step,
                **{k: accuracy(peft_model, v) for k, v in val.items()},
                "seconds": round(time.time() - t0, 1),
            }
            history.append(row)
            log.info("step %d: %s", step, row)
            bar.set_postfix({k: v for k, v in row.items() if k.endswith("accuracy")})
            if on_eval:
                on_eval(row)
        for name in by_step.get(step, []):
            recipe = make_recipe(cfg, name, step, history, losses, base, objects, time.time() - t0)
            saved[name] = str(save_adapter(peft_model, Path(out_dir) / name, cfg.base, recipe))
        done = step >= cfg.steps or (
            cfg.stop_accuracy is not None
            and step >= last_save
            and history
            and history[-1]["step"] == step
            and history[-1]["et_accuracy"] >= cfg.stop_accuracy
        )
        if done:
            break
        peft_model.train()
        loss = answer_loss(peft_model, training_batch(cfg, tokenizer, step, objects))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_description(f"finetune {cfg.task} loss {losses[-1]:.3f}")
    bar.close()
    return FinetuneResult(history, losses, saved, time.time() - t0, step)
