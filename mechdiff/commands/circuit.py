"""``mechdiff circuit``: find the entity-tracking circuit (groups A-D) of one model by path patching."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from tabulate import tabulate

from ..circuits.discovery import DEFAULT_K, STEPS, DiscoverySettings, StepResult, discover
from ..report.figures import head_heatmap
from ..tasks.entity_tracking import path_patching_pairs
from ._options import add_model_options, load_from_args, write_json

log = logging.getLogger("mechdiff.circuit")


def parse_k(text: str) -> dict[str, int]:
    """``"A=10,B=4,C=6,D=3"`` -> ``{"A": 10, ...}`` (unnamed steps keep their defaults)."""
    k = dict(DEFAULT_K)
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, _, value = part.partition("=")
        if step not in STEPS or not value.isdigit():
            raise ValueError(f"bad --top-k item {part!r}; expected STEP=INT with STEP in {list(STEPS)}, e.g. A=10,B=4")
        k[step] = int(value)
    return k


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("circuit", help="discover the entity-tracking circuit (A-D) by exact path patching")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--task", default="entity-tracking", choices=["entity-tracking"])
    p.add_argument("--n", type=int, default=DiscoverySettings.n_prompts, help="number of path-patching pairs")
    p.add_argument("--n-boxes", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", default=",".join(f"{s}={k}" for s, k in DEFAULT_K.items()),
                   help="heads kept per step, e.g. A=10,B=4,C=6,D=3")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--exact", dest="screen", action="store_false", default=False,
                      help="exact path patching of every sender (default)")
    mode.add_argument("--screen", dest="screen", action="store_true",
                      help="attribution screen, then exact path patching of the shortlist (for large models)")
    p.add_argument("--screen-multiple", type=float, default=DiscoverySettings.screen_multiple,
                   help="path patch this many times k of the best-screened senders")
    p.add_argument("--senders-per-pass", type=int, default=DiscoverySettings.senders_per_pass,
                   help="sender copies stacked in one forward pass")
    p.add_argument("--out", default=None, help="output directory (default results/circuits/<model>/)")
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    settings = DiscoverySettings(k=parse_k(args.top_k), screen=args.screen, screen_multiple=args.screen_multiple,
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
        return _run(args, settings, out)
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


def _run(args: argparse.Namespace, settings: DiscoverySettings, out: Path) -> int:
    t0 = time.perf_counter()
    log.info("mechdiff circuit: model=%s settings=%s threads=%d", args.model, settings, torch.get_num_threads())
    model = load_from_args(args.model, args)
    shape = model.shape
    log.info("loaded %s (%d layers x %d heads, %d KV heads) in %.1f s; fingerprint %s", model.name, shape.n_layers,
             shape.n_heads, shape.n_kv_heads, time.perf_counter() - t0, model.fingerprint)
    pairs = path_patching_pairs(model.tokenizer, settings.n_prompts, n_boxes=settings.n_boxes, seed=settings.seed)

    def figure(r: StepResult) -> None:
        for name, scores in (("exact", r.exact), ("attribution", r.attribution)):
            if scores:
                path = head_heatmap(scores, shape.n_layers, shape.n_heads, out / f"heatmap_{r.step}_{name}.png",
                                    title=f"{model.name} step {r.step} ({name}): senders at {r.sender_position}",
                                    selected=r.selected, label="(p_patched - p_clean) / p_clean")
                log.info("wrote %s", path)

    circuit, results = discover(model, pairs, settings, task=args.task, on_step=figure)
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
