"""Circuit discovery by path patching, step by step as a plan says (`mechdiff.tasks.plan`),
with an optional attribution screen. The default plan is entity tracking's four steps (Prakash et
al. 2024): A value fetcher, B position transmitter, C position detector, D structure reader.

| step | senders at            | receivers                          |
|------|-----------------------|------------------------------------|
| A    | last                  | logits                             |
| B    | last                  | A's Q at last                      |
| C    | query_label           | B's V at query_label               |
| D    | query_label_context   | C's V at query_label_context       |

Positions are the dataset's position records; a task's own plan names its own steps and positions. Only heads in layers
below the deepest receiver are tested. A head is selected by the largest *drop* in answer probability (most negative
score), top ``k`` per step; a head may be selected in several steps.
By default every eligible sender is path patched exactly (suffix runs over the clean key/value
cache make each a small fraction of a forward pass). With ``screen=True`` (for large models)
every eligible sender is first ranked by attribution (`mechdiff.patching.attribution`)
and only the ``screen_multiple * k`` most negative are path patched exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..common.components import Head
from ..models.loading import LoadedModel
from ..patching.attribution import attribution_scores
from ..patching.path import SCORES, Receivers, auto_senders_per_pass, eligible_senders, path_patch
from ..patching.path_pairs import PairBatch, prepare
from ..tasks.base import PairRecord
from ..tasks.plan import Plan, PlanStep, default_plan
from .circuit import Circuit

log = logging.getLogger(__name__)

# The default plan's steps: step -> (sender position, receiver kind, receiver step); A has no receivers.
# Its k are the paper's pruned LLaMA-7B group sizes 40/7/20/5 of 1024 heads (its path-patching k were 58/10/25/5),
# scaled to SmolLM2's 270 (about 10/2/5/1.3),
# rounded up where a step would otherwise keep one or two heads. With n_prompts=16 and screen_multiple=2
# a run is 60 exact sender passes plus 7 forward+backward passes: minutes on 2 CPU cores.
STEPS: dict[str, tuple[str, Optional[str], Optional[str]]] = {
    s.name: (s.sender, s.site, s.receiver) for s in default_plan().steps
}
DEFAULT_K = default_plan().k


@dataclass
class DiscoverySettings:
    """Everything that decides a discovery run; recorded in the circuit's meta."""

    k: dict[str, int] = field(default_factory=dict)  # step -> heads kept, overriding the plan's k
    # step -> heads the circuit keeps from the step's scores (default: its k). The paper keeps k heads as the next
    # step's receivers (LLaMA-7B: 20/5/10/5) and cuts its circuit from the same scores at other sizes (58/10/25/5).
    circuit_k: dict[str, int] = field(default_factory=dict)
    screen: bool = False  # True: attribution screen, then exact path patching of the shortlist
    screen_multiple: float = 2.0
    senders_per_pass: int | str = "auto"  # sender copies per pass; "auto": sized by free GPU memory (8 on CPU)
    n_prompts: int = 16
    n_boxes: int = 7
    seed: int = 0
    score: str = SCORES[0]  # "ratio_of_means" (mechdiff's) or "mean_of_ratios" (the paper's)
    # step -> position of the counterfactual prompt its senders' values are read at (a position class: one at random
    # per sender and prompt, drawn from ``seed``); a step not named reads them at the clean sender index. The paper:
    # D at a random box label, {"D": "labels"} (pp_utils.patching_sender_heads)
    source_position: dict[str, str] = field(default_factory=dict)
    # pairs whose activations are held at once (`PairStream`); None: every pair's
    pairs_per_part: Optional[int] = None


@dataclass
class StepResult:
    """Scores of one step: exact path-patching scores, attribution estimates, the selection."""

    step: str
    sender_position: str
    receivers: Optional[Receivers]
    exact: dict[Head, float]
    attribution: dict[Head, float]
    selected: list[Head]
    seconds: dict[str, float]


def select(scores: dict[Head, float], k: int) -> list[Head]:
    """The ``k`` heads with the most negative scores (largest drop in answer probability)."""
    return sorted(scores, key=lambda h: (scores[h], h))[:k]


def run_step(
    model: LoadedModel,
    batch: PairBatch,
    step: str,
    k: int,
    receivers: Optional[Receivers],
    settings: DiscoverySettings,
    progress: bool = True,
    sender_position: Optional[str] = None,
) -> StepResult:
    """Screen (optionally) and path patch the senders of one step, then select its top ``k``."""
    sender_position = sender_position or STEPS[step][0]
    senders = eligible_senders(model, receivers)
    seconds: dict[str, float] = {}
    attribution: dict[Head, float] = {}
    if settings.screen:
        t0 = time.perf_counter()
        attribution = attribution_scores(model, batch, sender_position, receivers, senders)
        seconds["attribution"] = time.perf_counter() - t0
        n_keep = min(len(senders), int(np.ceil(settings.screen_multiple * k)))
        senders = select(attribution, n_keep)
        log.info("step %s: attribution screen kept %d of %d eligible senders", step, n_keep, len(attribution))
    t0 = time.perf_counter()
    per_pass = settings.senders_per_pass
    if per_pass == "auto":
        per_pass = auto_senders_per_pass(model, batch)
        log.info("step %s: %d senders per pass (auto, from free memory)", step, per_pass)
    exact = path_patch(
        model,
        batch,
        senders,
        sender_position,
        receivers,
        per_pass,
        progress,
        settings.score,
        settings.source_position.get(step),
        settings.seed,
    )
    seconds["path_patching"] = time.perf_counter() - t0
    chosen = select(exact, k)
    log.info(
        "step %s: path patched %d senders in %.1f s; selected %s",
        step,
        len(senders),
        seconds["path_patching"],
        [h.name for h in chosen],
    )
    return StepResult(step, sender_position, receivers, exact, attribution, chosen, seconds)


def circuit_heads(result: StepResult, k: Optional[int] = None) -> list[Head]:
    """The heads a step puts in the circuit: its ``k`` most negative exact scores (None: the receivers it kept for
    the next step, ``result.selected``). With a screen only the shortlist was scored, so at most that many."""
    return result.selected if k is None else select(result.exact, k)


def discover(
    model: LoadedModel,
    pairs: Sequence[PairRecord],
    settings: DiscoverySettings,
    task: str = "entity-tracking",
    progress: bool = True,
    on_step: Optional[Callable[[StepResult], None]] = None,
    plan: Optional[Plan] = None,
    metric: str = "prob",
) -> tuple[Circuit, dict[str, StepResult]]:
    """Run the plan's steps (default: entity tracking's A-D) and return the `Circuit` plus
    each step's full result. ``settings.k`` overrides the plan's ``k`` of the steps it names. ``metric``: the
    task's, what every sender's score measures (`prepare`)."""
    plan = (plan or default_plan()).with_k(settings.k)
    steps: dict[str, PlanStep] = {s.name: s for s in plan.steps}
    t_start = time.perf_counter()
    batch = prepare(model, pairs, metric, settings.pairs_per_part)
    t_prepare = time.perf_counter() - t_start
    results: dict[str, StepResult] = {}
    for step, spec in steps.items():
        sender_position, kind, receiver_step, k = spec.sender, spec.site, spec.receiver, spec.k
        if k <= 0:
            log.info("step %s skipped: k=0", step)
            continue
        receivers = None
        if receiver_step is not None:
            if receiver_step not in results or not results[receiver_step].selected:
                log.warning("step %s skipped: step %s selected no receivers", step, receiver_step)
                continue
            receivers = Receivers(tuple(results[receiver_step].selected), kind, spec.receiver_position)
            if kind in ("k", "v") and model.shape.n_kv_heads < model.shape.n_heads:
                log.info(
                    "step %s: GQA (%d KV groups for %d heads): patching a receiver's V patches its whole KV group",
                    step,
                    model.shape.n_kv_heads,
                    model.shape.n_heads,
                )
            if receivers.max_layer == 0:
                log.warning("step %s skipped: every receiver is in layer 0, no head can send to it", step)
                continue
        results[step] = run_step(model, batch, step, k, receivers, settings, progress, sender_position)
        if on_step is not None:
            on_step(results[step])
    groups = {s: circuit_heads(r, settings.circuit_k.get(s)) for s, r in results.items()}
    circuit = Circuit(
        model=model.name,
        task=task,
        groups=groups,
        positions={s: r.sender_position for s, r in results.items()},
        scores={s: {h.name: r.exact[h] for h in groups[s]} for s, r in results.items()},
        names={s: steps[s].group for s in results},
        meta={
            "method": "path patching"
            + (" after an attribution screen" if settings.screen else " (exact, all senders)"),
            "settings": asdict(settings),
            "plan": plan.to_dict(),
            "fingerprint": model.fingerprint,
            "n_prompts": len(pairs),
            "p_clean": float(batch.p_clean.mean()),
            "timings_s": {
                "prepare": t_prepare,
                **{s: r.seconds for s, r in results.items()},
                "total": time.perf_counter() - t_start,
            },
            "receivers": {
                s: {
                    "kind": r.receivers.kind,
                    "position": r.receivers.position,
                    "heads": [h.name for h in r.receivers.heads],
                }
                for s, r in results.items()
                if r.receivers is not None
            },
            "n_tested": {s: len(r.exact) for s, r in results.items()},
            "gqa_note": (
                "V receivers are patched per KV group (all query heads sharing it)"
                if model.shape.n_kv_heads < model.shape.n_heads
                else None
            ),
            "torch_threads": torch.get_num_threads(),
        },
    )
    return circuit, results
