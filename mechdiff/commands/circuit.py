"""``mechdiff circuit``: find a task's circuit of one model by path patching, step by step as its plan says
(entity tracking: groups A-D)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from tabulate import tabulate

from ..circuits.discovery import DiscoverySettings, StepResult, discover
from ..circuits.plan import Plan, default_plan, load_plan
from ..report.figures import head_heatmap
from ..tasks.base import Task
from ._options import (add_model_options, add_task_option, load_from_args, task_from_args, task_options,
                       tokenizer_from_args, write_json)

log = logging.getLogger("mechdiff.circuit")


def parse_k(text: str, plan: Plan | None = None) -> dict[str, int]:
    """``"A=10,B=4,C=6,D=3"`` -> ``{"A": 10, ...}`` (unnamed steps keep the plan's k)."""
    steps = list((plan or default_plan()).k)
    k: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        step, _, value = part.partition("=")
        if step not in steps or not value.isdigit():
            raise ValueError(f"bad --top-k item {part!r}; expected STEP=INT with STEP in {steps}, e.g. "
                             f"{steps[0]}=10")
        k[step] = int(value)
    return k


def task_plan(task: Task, path: str | None) -> Plan:
    """``--plan FILE``, else the task's plan; a task without one needs ``--plan``."""
    if path is not None:
        return load_plan(path)
    if task.plan is None:
        raise ValueError(f"task {task.name} has no discovery plan; write one (see mechdiff/tasks/plans/) "
                         "and pass --plan FILE")
    return load_plan(task.plan)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("circuit", help="discover a task's circuit by exact path patching, as its plan says")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    add_task_option(p)
    p.add_argument("--plan", default=None, help="discovery plan TOML (default: the task's plan)")
    p.add_argument("--n", type=int, default=DiscoverySettings.n_prompts, help="number of path-patching pairs")
    p.add_argument("--n-boxes", type=int, default=7, help="entity tracking: boxes per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", default="", help="heads kept per step, overriding the plan's k, e.g. A=10,B=4,C=6,D=3")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--exact", dest="screen", action="store_false", default=False,
                      help="exact path patching of every sender (default)")
    mode.add_argument("--screen", dest="screen", action="store_true",
                      help="attribution screen, then exact path patching of the shortlist (for large models)")
    p.add_argument("--screen-multiple", type=float, default=DiscoverySettings.screen_multiple,
                   help="path patch this many times k of the best-screened senders")
    p.add_argument("--senders-per-pass", type=senders_arg, default=DiscoverySettings.senders_per_pass,
                   help="sender copies stacked in one forward pass, or auto (from free GPU memory, as "
                        "--batch-size auto; 8 on CPU)")
    p.add_argument("--out", default=None, help="output directory (default results/circuits/<model>/)")
    add_model_options(p)
    p.set_defaults(func=main)


def senders_arg(text: str) -> int | str:
    """``--senders-per-pass``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--senders-per-pass must be a positive integer or auto, not {text!r}")
    return int(text)


def main(args: argparse.Namespace) -> int:
    task = task_from_args(args)
    plan = task_plan(task, args.plan)
    settings = DiscoverySettings(k=parse_k(args.top_k, plan), screen=args.screen, screen_multiple=args.screen_multiple,
                                 senders_per_pass=args.senders_per_pass, n_prompts=args.n, n_boxes=args.n_boxes,
                                 seed=args.seed)
    out = Path(args.out or f"results/circuits/{Path(args.model).name}")
    out.mkdir(parents=True, exist_ok=True)
    handler = _LogFile(out / "run.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mechdiff")
    root.addHandler(handler)
    previous = root.level
    root.setLevel(logging.INFO)
    try:
        return _run(args, settings, out, task, plan)
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        handler.close()


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


def _run(args: argparse.Namespace, settings: DiscoverySettings, out: Path, task: Task, plan: Plan) -> int:
    t0 = time.perf_counter()
    log.info("mechdiff circuit: model=%s task=%s plan=%s settings=%s threads=%d", args.model, task.name, plan.name,
             settings, torch.get_num_threads())
    tokenizer = tokenizer_from_args(args.model, args)
    pairs = task.discovery_pairs(tokenizer, settings.n_prompts, settings.seed, **task_options(args))
    _check_positions(plan, pairs)  # the pairs and the plan's positions checked before the weights load
    model = load_from_args(args.model, args, tokenizer)
    shape = model.shape
    log.info("loaded %s (%d layers x %d heads, %d KV heads) in %.1f s; fingerprint %s", model.name, shape.n_layers,
             shape.n_heads, shape.n_kv_heads, time.perf_counter() - t0, model.fingerprint)

    def figure(r: StepResult) -> None:
        for name, scores in (("exact", r.exact), ("attribution", r.attribution)):
            if scores:
                path = head_heatmap(scores, shape.n_layers, shape.n_heads, out / f"heatmap_{r.step}_{name}.png",
                                    title=f"{model.name} step {r.step} ({name}): senders at {r.sender_position}",
                                    selected=r.selected, label="(p_patched - p_clean) / p_clean")
                log.info("wrote %s", path)

    circuit, results = discover(model, pairs, settings, task=task.name, on_step=figure, plan=plan)
    circuit.meta["load_s"] = round(time.perf_counter() - t0 - circuit.meta["timings_s"]["total"], 2)
    circuit.meta["dtype"] = args.dtype
    circuit.save(out / "circuit.json")
    write_json(out / "scores.json", {s: {"exact": {h.name: v for h, v in r.exact.items()},
                                         "attribution": {h.name: v for h, v in r.attribution.items()}}
                                     for s, r in results.items()})
    rows = [[s, circuit.names.get(s, ""), circuit.positions[s], len(hs), len(results[s].exact),
             " ".join(h.name for h in hs)] for s, hs in circuit.groups.items()]
    print(tabulate(rows, headers=["step", "group", "position", "heads", "tested", "selected"]))
    print(f"p_clean={circuit.meta['p_clean']:.3f}  total {time.perf_counter() - t0:.0f} s  -> {out}/circuit.json")
    log.info("done in %.1f s: sizes %s", time.perf_counter() - t0, circuit.sizes())
    return 0


def _check_positions(plan: Plan, pairs: list) -> None:
    """Every position the plan reads must be one the task's records name (before any patching)."""
    named = set(pairs[0].base.positions)
    missing = sorted(plan.positions() - named)
    if missing:
        raise ValueError(f"plan {plan.source or plan.name} reads positions {missing} that the task's records do not "
                         f"name (they name {sorted(named)})")
