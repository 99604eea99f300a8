"""A task's circuit of one model by path patching, as ``mechdiff circuit`` runs it: the task's plan, its pairs
(checked before the weights load), `mechdiff.circuits.discovery.discover`, and the circuit, scores, heatmaps
and ``run.log`` it writes."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from tabulate import tabulate

from ...circuits.discovery import DiscoverySettings, StepResult, discover
from ...common.io import write_json
from ...common.metrics import metric_label
from ...models.loading import LoadedModel
from ...report.figures import head_heatmap
from ...tasks.base import Task
from ...tasks.plan import Plan, load_plan

log = logging.getLogger("mechdiff.circuit")  # the name run.log has always shown


def task_plan(task: Task, path: Optional[str]) -> Plan:
    """The plan file ``path``, else the task's plan; a task without one needs a plan file."""
    if path is not None:
        return load_plan(path)
    if task.plan is None:
        raise ValueError(
            f"task {task.name} has no discovery plan; write one (see mechdiff/tasks/plans/) and pass --plan FILE"
        )
    return load_plan(task.plan)


def check_positions(plan: Plan, pairs: list) -> None:
    """Every position the plan reads must be one the task's records name (before any patching)."""
    named = set(pairs[0].base.positions)
    missing = sorted(plan.positions() - named)
    if missing:
        raise ValueError(
            f"plan {plan.source or plan.name} reads positions {missing} that the task's records do not "
            f"name (they name {sorted(named)})"
        )


class _LogFile(logging.Handler):
    """Collects the run's log lines and rewrites ``path`` atomically after each one."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path, self.lines = path, []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join(self.lines) + "\n")
        tmp.replace(self.path)


@contextmanager
def logged_to(path: Path) -> Iterator[None]:
    """Every ``mechdiff`` log line at INFO and above also goes to ``path`` while the block runs."""
    handler = _LogFile(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mechdiff")
    root.addHandler(handler)
    previous = root.level
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        handler.close()


def discover_circuit(
    model_name: str,
    task: Task,
    plan: Plan,
    settings: DiscoverySettings,
    options: Mapping[str, Any],
    out: Path,
    load_tokenizer: Callable[[], Any],
    load_model: Callable[[Any], LoadedModel],
    dtype: str,
) -> str:
    """Path patching of ``model_name`` on ``task``'s pairs (generator ``options``) step by step as ``plan`` says,
    logged to ``out/run.log``: ``out/circuit.json``, ``out/scores.json`` and a heatmap per step. The tokenizer
    (``load_tokenizer()``) builds and checks the pairs before the weights load (``load_model(tokenizer)``).
    Returns the table of the steps the command prints."""
    out.mkdir(parents=True, exist_ok=True)
    with logged_to(out / "run.log"):
        return _discover(model_name, task, plan, settings, options, out, load_tokenizer, load_model, dtype)


def _discover(
    model_name: str,
    task: Task,
    plan: Plan,
    settings: DiscoverySettings,
    options: Mapping[str, Any],
    out: Path,
    load_tokenizer: Callable[[], Any],
    load_model: Callable[[Any], LoadedModel],
    dtype: str,
) -> str:
    t0 = time.perf_counter()
    log.info(
        "mechdiff circuit: model=%s task=%s plan=%s settings=%s threads=%d",
        model_name,
        task.name,
        plan.name,
        settings,
        torch.get_num_threads(),
    )
    tokenizer = load_tokenizer()
    pairs = task.discovery_pairs(tokenizer, settings.n_prompts, settings.seed, **options)
    check_positions(plan, pairs)  # the pairs and the plan's positions checked before the weights load
    model = load_model(tokenizer)
    shape = model.shape
    log.info(
        "loaded %s (%d layers x %d heads, %d KV heads) in %.1f s; fingerprint %s",
        model.name,
        shape.n_layers,
        shape.n_heads,
        shape.n_kv_heads,
        time.perf_counter() - t0,
        model.fingerprint,
    )

    def figure(r: StepResult) -> None:
        for name, scores in (("exact", r.exact), ("attribution", r.attribution)):
            if scores:
                path = head_heatmap(
                    scores,
                    shape.n_layers,
                    shape.n_heads,
                    out / f"heatmap_{r.step}_{name}.png",
                    title=f"{model.name} step {r.step} ({name}): senders at {r.sender_position}",
                    selected=r.selected,
                    label=f"(p_patched - p_clean) / p_clean, p: {metric_label(task.metric)}",
                )
                log.info("wrote %s", path)

    circuit, results = discover(model, pairs, settings, task=task.name, on_step=figure, plan=plan, metric=task.metric)
    circuit.meta["load_s"] = round(time.perf_counter() - t0 - circuit.meta["timings_s"]["total"], 2)
    circuit.meta["dtype"] = dtype
    circuit.save(out / "circuit.json")
    write_json(
        out / "scores.json",
        {
            s: {
                "exact": {h.name: v for h, v in r.exact.items()},
                "attribution": {h.name: v for h, v in r.attribution.items()},
            }
            for s, r in results.items()
        },
    )
    rows = [
        [
            s,
            circuit.names.get(s, ""),
            circuit.positions[s],
            len(hs),
            len(results[s].exact),
            " ".join(h.name for h in hs),
        ]
        for s, hs in circuit.groups.items()
    ]
    text = (
        tabulate(rows, headers=["step", "group", "position", "heads", "tested", "selected"])
        + f"\np_clean={circuit.meta['p_clean']:.3f}  total {time.perf_counter() - t0:.0f} s  -> {out}/circuit.json"
    )
    log.info("done in %.1f s: sizes %s", time.perf_counter() - t0, circuit.sizes())
    return text
