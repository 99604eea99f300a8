"""The HeadMap kind's resource plan: every stage's cost in the order a run meets them, each counted by its
stage's module (`locate_cost`, `evaluation_cost`, `train_cost`)."""

from __future__ import annotations

from typing import Any

from ..planner import StageCost
from .locate import locate_cost
from .settings import LORA_RUNS, MAP_RUNS, TASK, UNSEEDED, HeadMapSettings
from .training import evaluation_cost, stage_name, train_cost


def headmap_costs(meter: Any, st: HeadMapSettings, tokens: dict[str, int]) -> list[StageCost]:
    """Every stage of the study in the order `HeadMapStudy.stages` meets them: the evaluations, the learning-rate
    sweep on the first seed, each seed's runs (the sweep's run at the chosen rate is the first seed's run of
    ``located`` and ``lora-small``: not counted twice), each locating stage before the first run that reads it
    (that of `TASK` at the end where none does)."""
    runs, first = st.runs, st.seeds[0]
    maps_swept, lora_swept = bool(st.lrs and set(runs) & set(MAP_RUNS)), bool(st.lrs and set(runs) & set(LORA_RUNS))
    out, located = [], set()

    def locate(task: str) -> None:
        if task not in located:
            located.add(task)
            n = st.n if task == TASK else st.transfer_n or st.n
            out.append(locate_cost(meter, st, task, n, tokens[task], f"locate-{task}"))

    if "base" in runs:
        out.append(evaluation_cost(meter, st, tokens[TASK], "train-base"))
    if "lora-zoo" in runs:
        out.append(evaluation_cost(meter, st, tokens[TASK], "train-lora-zoo", 2))
    for lr in st.lrs if maps_swept else ():
        locate(TASK)
        out.append(train_cost(meter, st, "located", tokens[TASK], f"train-located-seed{first}-hlr{lr:g}"))
    for lr in st.lrs if lora_swept else ():
        out.append(train_cost(meter, st, "lora-small", tokens[TASK], f"train-lora-small-seed{first}-lr{lr:g}"))

    def name(r: str, seed: int) -> str:
        if st.lrs:
            return f"train-{r}-seed{seed} (at the chosen rates)"
        lora = {"lora-large": st.lora_large, "lora-small": st.lora_small, "headmap+lora": st.lora_small}.get(r, 0)
        return stage_name(r, st.train_config(TASK, lora, seed), {0: [0]} if r in MAP_RUNS else None)

    for seed in st.seeds:
        for r in (r for r in runs if r not in UNSEEDED):
            if seed == first and ((r == "located" and maps_swept) or (r == "lora-small" and lora_swept)):
                continue  # the sweep's run at the chosen rate
            if r in ("located", "outside", "headmap+lora"):
                locate(TASK)
            if r == "transfer":
                locate(st.transfer_task)
            out.append(train_cost(meter, st, r, tokens[TASK], name(r, seed)))
    locate(TASK)
    return out
