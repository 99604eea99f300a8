"""A LoRA fine-tune, as ``mechdiff finetune`` runs it: `mechdiff.methods.finetune.finetune`, its history table and
``history.json``."""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from ..common.io import write_json
from ..methods.finetune import FinetuneConfig, FinetuneResult, finetune
from ..models.loading import LoadedModel


def history_table(res: FinetuneResult) -> str:
    """One row per evaluation: the step and each metric."""
    keys = [k for k in res.history[0] if k != "step"]
    return tabulate([[h["step"], *(h[k] for k in keys)] for h in res.history], headers=["step", *keys])


def finetune_and_write(base: LoadedModel, cfg: FinetuneConfig, out: str | Path) -> str:
    """Train a LoRA on ``base`` as ``cfg`` says, adapters under ``out``; writes ``out/history.json`` (the options,
    evaluations, losses, saved adapters, time); returns the history table and the saved adapters."""
    res = finetune(base, cfg, out)
    write_json(
        f"{out}/history.json",
        {
            "options": vars(cfg) | {"target_modules": list(cfg.target_modules)},
            "history": res.history,
            "losses": res.losses,
            "saved": res.saved,
            "seconds": res.seconds,
        },
    )
    return f"{history_table(res)}\nsaved: {res.saved or 'nothing'}; {res.seconds:.0f} s"
