"""The HeadMap kind's settings: the ``[headmap]`` section of a task file (``tasks/headmap.toml``; the command's
flags override it), the runs it may choose and how a task file is read into it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...methods.headmap import LocateConfig, TrainConfig, get_task
from ..base import load_section_file

#: The runs a study may choose (``[headmap] runs``).
RUNS = ("base", "located", "random", "lora-large", "lora-small", "outside", "headmap+lora", "transfer", "lora-zoo")
MAP_RUNS = ("located", "random", "outside", "transfer", "headmap+lora")  # runs that train HeadMap maps
LORA_RUNS = ("lora-small", "lora-large", "headmap+lora")  # runs that train a LoRA
TASK = "entity-tracking"  # the task HeadMap and LoRA train on
UNSEEDED = ("base", "lora-zoo")  # evaluations of fixed models: one record, not one per seed
VAL = "validation"  # key of the validation prompts' outcomes in a training record


@dataclass
class HeadMapSettings:
    """The ``[headmap]`` section of a task file: the model, locating, training, and which runs to make."""

    model: str = "smollm2-135m"
    transfer_task: str = "arithmetic-mc"  # task whose located circuit is transferred to entity tracking
    path_patching: tuple = ("results/headmap-smollm2/path-patching/smollm2-et-early.json",)  # circuits to compare
    lora_small: int = 1  # rank of the LoRA near HeadMap's parameter count
    lora_large: int = 8
    transfer_n: int = 0  # samples for locating on the transfer task (0: n)
    lora_zoo: str = "smollm2-et-early"  # a saved LoRA of the same recipe, evaluated instead of trained
    runs: tuple = RUNS
    notes: str = ""  # how the stages were computed (machine load, processes), printed under the report's first line
    # locating
    n: int = LocateConfig.n
    pool: int = LocateConfig.pool
    k: int = LocateConfig.k
    batch_size: int = LocateConfig.batch_size
    seed: int = LocateConfig.seed
    # training
    steps: int = TrainConfig.steps
    batch: int = TrainConfig.batch_size
    lr: float = TrainConfig.lr  # LoRA's rate when lrs is empty
    headmap_lr: float = TrainConfig.headmap_lr  # HeadMap's rate when lrs is empty
    lrs: tuple = ()  # learning-rate sweep for HeadMap and LoRA alike (first seed; chosen on validation prompts)
    val_n: int = 100  # validation prompts (training objects) the learning rate is chosen on
    val_seed: int = 2_000_000
    rank: int = TrainConfig.rank
    eval_n: int = TrainConfig.eval_n
    seeds: tuple = (TrainConfig.seed,)  # training seeds: each trained run once per seed
    data_seed: int = TrainConfig.data_seed  # seed s trains on the batches of data seed data_seed + s

    def locate_config(self, n: Optional[int] = None) -> LocateConfig:
        return LocateConfig(n=n or self.n, pool=self.pool, k=self.k, batch_size=self.batch_size, seed=self.seed)

    def lora_rank(self, run_id: str) -> int:
        """The rank of the LoRA run ``run_id`` trains (0: none)."""
        return {"lora-large": self.lora_large, "lora-small": self.lora_small, "headmap+lora": self.lora_small}.get(
            run_id, 0
        )

    def train_config(
        self,
        task: str = TASK,
        lora_rank: int = 0,
        seed: Optional[int] = None,
        lr: Optional[float] = None,
        headmap_lr: Optional[float] = None,
    ) -> TrainConfig:
        """One run's training: seed ``s`` (default the first) initialises from ``s`` and trains on data seed
        ``data_seed + s``; ``lr``/``headmap_lr`` default to the settings' rates."""
        seed = self.seeds[0] if seed is None else seed
        return TrainConfig(
            task=task,
            steps=self.steps,
            batch_size=self.batch,
            lr=self.lr if lr is None else lr,
            headmap_lr=self.headmap_lr if headmap_lr is None else headmap_lr,
            seed=seed,
            data_seed=self.data_seed + seed,
            rank=self.rank,
            lora_rank=lora_rank,
            eval_n=self.eval_n,
        )


def load_settings(path: str | Path) -> HeadMapSettings:
    """The ``[headmap]`` section of the task file ``path`` (unknown keys, runs and tasks refused with their line)."""
    return load_file(path)[0]


def load_file(path: str | Path) -> tuple[HeadMapSettings, str]:
    """The ``[headmap]`` settings and the ``[output] dir`` of the task file ``path`` (checked with their line)."""
    from ...tasks.base import trainable_tasks

    choices = {("headmap", "runs"): RUNS, ("headmap", "transfer_task"): tuple(trainable_tasks())}
    return load_section_file(path, "headmap", HeadMapSettings, choices, "tasks/headmap.toml")


def check_runs(settings: HeadMapSettings) -> None:
    """Refuse unknown runs, and a transfer task without training batches, before anything loads."""
    unknown = sorted(set(settings.runs) - set(RUNS))
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if not settings.seeds or len(set(settings.seeds)) != len(settings.seeds):
        raise ValueError(f"seeds must be distinct and at least one; got {settings.seeds}")
    if any(lr <= 0 for lr in settings.lrs) or len(set(settings.lrs)) != len(settings.lrs):
        raise ValueError(f"learning rates must be distinct and positive; got {settings.lrs}")
    if "transfer" in settings.runs:
        get_task(settings.transfer_task)
