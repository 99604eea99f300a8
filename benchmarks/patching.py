"""Benchmark path patching on a real model, every figure measured in this process.

1. Patching overhead: time of one path-patching pass (step A: one frozen forward; step B:
   frozen forward stopped at the receivers + receiver forward) / a plain forward on the
   same stacked batch (target <= 1.3 for the step-A pass).
2. Exact-all vs screened for one step: wall time of exact path patching of every eligible
   sender against attribution screen + exact patching of the top ``screen_multiple * k``;
   recovered fraction = |exact top-k  intersect  screened top-k| / k (target >= 0.9 at <= 0.1 of the time).

    python benchmarks/patching.py --model smollm2-135m --n 8 --step A --k 8 --screen-multiple 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from einops import repeat

from mechdiff.circuits.discovery import STEPS, select
from mechdiff.components import Head
from mechdiff.models.loading import load_model
from mechdiff.patching.attribution import attribution_scores
from mechdiff.patching.core import run
from mechdiff.patching.path import Receivers, _patched_prob, eligible_senders, path_patch, prepare
from mechdiff.tasks.entity_tracking import path_patching_pairs


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # GPU work is asynchronous
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--senders-per-pass", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step", default="A", choices=list(STEPS), help="step for exact-all vs screened")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--screen-multiple", type=float, default=2.0)
    ap.add_argument("--skip-exact-all", action="store_true", help="only the overhead figures")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1")
    ap.add_argument("--device-map", default=None, help="auto: shard over the GPUs (accelerate)")
    ap.add_argument("--dtype", default="float32", help="float32 (as the paper), bfloat16, float16")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map)
    print(f"loaded {args.model} on {model.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
    pairs = path_patching_pairs(model.tokenizer, args.n, seed=0)
    batch = prepare(model, pairs)
    s = args.senders_per_pass
    shape = model.shape
    senders = [Head(shape.n_layers - 1 - i % shape.n_layers, i % shape.n_heads) for i in range(s)]
    b_senders = [Head(i % (shape.n_layers - 1), i % shape.n_heads) for i in range(s)]
    ids = repeat(batch.clean_ids, "b p -> (s b) p", s=s)
    receivers = Receivers((Head(shape.n_layers - 1, 0), Head(shape.n_layers - 1, 1)), "q", "last")
    with torch.no_grad():
        plain = timed(lambda: run(model, ids), args.repeats)
        pass_a = timed(lambda: _patched_prob(model, batch, senders, "last", None), args.repeats)
        pass_b = timed(lambda: _patched_prob(model, batch, b_senders, "last", receivers), args.repeats)
    fig = {"model": args.model, "device": str(model.device), "dtype": args.dtype,
           "n_prompts": args.n, "senders_per_pass": s, "batch": int(ids.shape[0]),
           "threads": torch.get_num_threads(), "plain_forward_s": plain,
           "overhead_step_A": pass_a / plain, "overhead_step_B_two_runs": pass_b / plain}
    print(f"plain forward ({ids.shape[0]} x {ids.shape[1]} tokens): {plain:.2f} s")
    print(f"patching overhead, step-A pass (frozen forward): {pass_a / plain:.2f}x  (target <= 1.3)")
    print(f"patching overhead, step-B pass (frozen forward to layer {receivers.max_layer} + receiver forward): "
          f"{pass_b / plain:.2f}x")
    if not args.skip_exact_all:
        position, kind, _ = STEPS[args.step]
        rec = None if kind is None else Receivers((Head(shape.n_layers - 2, 0), Head(shape.n_layers - 3, 4)), kind,
                                                  position)
        eligible = eligible_senders(model, rec)
        t0 = time.perf_counter()
        exact = path_patch(model, batch, eligible, position, rec, s)
        t_exact = time.perf_counter() - t0
        t0 = time.perf_counter()
        attr = attribution_scores(model, batch, position, rec, eligible)
        t_attr = time.perf_counter() - t0
        shortlist = select(attr, int(args.screen_multiple * args.k))
        screened = path_patch(model, batch, shortlist, position, rec, s)
        t_screen = time.perf_counter() - t0
        top_exact, top_screen = set(select(exact, args.k)), set(select(screened, args.k))
        recovered = len(top_exact & top_screen) / args.k
        fig.update(step=args.step, k=args.k, screen_multiple=args.screen_multiple, eligible=len(eligible),
                   exact_all_s=t_exact, attribution_s=t_attr, screened_s=t_screen,
                   time_ratio=t_screen / t_exact, recovered=recovered,
                   exact_top=[h.name for h in select(exact, args.k)], screened_top=[h.name for h in select(screened, args.k)])
        print(f"step {args.step}: exact all {len(eligible)} senders {t_exact:.1f} s ({t_exact / plain:.0f} plain forwards); "
              f"screened ({len(shortlist)} exact) {t_screen:.1f} s, of which attribution {t_attr:.1f} s")
        print(f"screened / exact time: {t_screen / t_exact:.3f}  (target <= 0.1); "
              f"recovered {recovered:.2f} of exact top-{args.k}  (target >= 0.9)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
