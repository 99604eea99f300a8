"""Benchmark patching on a real model, every figure measured in this process, as a ratio to a plain forward.

On one batch of clean/counterfactual pairs it prints:

1. a plain forward pass of the batch (the unit);
2. exact path patching, steps A-D as discovery runs them (B's receivers are A's selection, and so
   on): seconds per eligible sender / plain forward, averaged over every eligible sender; step A
   also with full-length runs (layer resume only, the previous implementation);
3. a per-head z scan at the last position (:func:`mechdiff.patching.scan.scan`): seconds per head /
   plain forward;
4. the same step A and z scan by an independent one-head-per-pass torch-hook loop (plain HF
   forwards), its cost, and the agreement (max |diff|);
5. the attribution screen's top-k recall against exact path patching, per step;
6. a DCM training epoch (forward and backward over the pair cache) on suffix runs against the same
   epoch on full-length runs (layer resume only, the previous implementation), for masks at the
   last and at the query-label position (``--sections dcm``);
7. peak resident memory above the loaded model during each measurement (sampled every 5 ms);
8. mixed lengths (``--sections mixed``): a z scan at the last position over pairs of three token lengths
   (entity tracking with 3, 5 and 7 boxes, ``--n`` pairs each) against the sum of the three single-length
   scans: the cost of grouping (target: at most 1.2x).

The plain forward is timed again just before and after each measurement and the ratio uses the mean
of the two medians, so that a machine shared with other work (load drifting) biases ratios less.
The hook loops cost one full forward per head; ``--hook-every K`` runs them on every K-th head.

    python benchmarks/patching.py --model smollm2-135m --n 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time

import torch

from mechdiff.circuits.discovery import DEFAULT_K, STEPS, select
from mechdiff.common.components import Head
from mechdiff.models.loading import load_model
from mechdiff.patching.attribution import attribution_scores
from mechdiff.patching.core import run
from mechdiff.patching.path import Receivers, eligible_senders, path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.patching.scan import scan, scan_pairs
from mechdiff.tasks.entity_tracking import path_patching_pairs

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """Peak resident memory (bytes above the start) while the ``with`` block runs; GPU: max allocated."""

    def __enter__(self) -> "Peak":
        self.base, self.peak, self.done = rss(), 0, False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done:
            self.peak = max(self.peak, rss() - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.done = True
        self.thread.join()
        if torch.cuda.is_available():
            self.peak = torch.cuda.max_memory_allocated()

    @property
    def mb(self) -> float:
        return self.peak / 2**20


def plain_forward(model, ids, repeats: int = 3) -> float:
    """Median seconds of a plain forward of ``ids`` (after a warm-up)."""
    with torch.no_grad():
        run(model, ids)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(model, ids)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def timed(fn, model, ids):
    """``(result, seconds, plain forward seconds around it, peak MB)`` of one call."""
    before = plain_forward(model, ids)
    with Peak() as peak:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return out, seconds, (before + plain_forward(model, ids)) / 2, peak.mb


# ------------------------------------------------------------------ the independent torch-hook loops
def hooked_logits(lm, ids, pre_hooks=()):
    handles = [m.register_forward_pre_hook(f) for m, f in pre_hooks]
    try:
        with torch.no_grad():
            return lm.model(input_ids=ids, use_cache=False).logits[:, -1]
    finally:
        for h in handles:
            h.remove()


def hooked_z(lm, ids):
    zs = {}
    hooks = [
        (lm.arch.module(lm.model, "z", l), (lambda l: lambda m, a: zs.__setitem__(l, a[0].clone()))(l))
        for l in range(lm.shape.n_layers)
    ]
    hooked_logits(lm, ids, hooks)
    return zs


def prob(logits, answers):
    return logits.softmax(-1)[torch.arange(len(answers)), answers]


def hooks_step_a(lm, batch, senders):
    """Step A by torch hooks, one sender per forward: every z frozen to clean, the sender's slice at last from
    source."""
    clean_z, source_z = hooked_z(lm, batch.clean_ids), hooked_z(lm, batch.source_ids)
    rows, pos, d = torch.arange(len(batch)), batch.positions["last"], lm.shape.d_head
    p0 = prob(hooked_logits(lm, batch.clean_ids), batch.answer_ids).mean()
    out = {}
    for s in senders:

        def make(layer):
            def hook(m, a):
                z = clean_z[layer].clone()
                if layer == s.layer:
                    cols = slice(s.head * d, (s.head + 1) * d)
                    z[rows, pos, cols] = source_z[layer][rows, pos, cols]
                return (z,)

            return hook

        hooks = [(lm.arch.module(lm.model, "z", l), make(l)) for l in range(lm.shape.n_layers)]
        p = prob(hooked_logits(lm, batch.clean_ids, hooks), batch.answer_ids).mean()
        out[s] = float((p - p0) / p0)
    return out


def hooks_z_scan(lm, clean, source, answers, heads):
    """Activation patching of one head's z at the last position per forward: ``"layer head"`` change in p."""
    source_z = hooked_z(lm, source)
    d, shape = lm.shape.d_head, lm.shape
    p0 = prob(hooked_logits(lm, clean), answers).mean()
    grid = torch.full((shape.n_layers, shape.n_heads), float("nan"))
    for h in heads:
        cols = slice(h.head * d, (h.head + 1) * d)

        def hook(m, a):
            z = a[0].clone()
            z[:, -1, cols] = source_z[h.layer][:, -1, cols]
            return (z,)

        grid[h.layer, h.head] = (
            prob(hooked_logits(lm, clean, [(lm.arch.module(lm.model, "z", h.layer), hook)]), answers).mean() - p0
        )
    return grid


# ------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="clean/counterfactual pairs")
    ap.add_argument("--senders-per-pass", type=int, default=32)
    ap.add_argument("--no-hooks", action="store_true", help="skip the torch-hook reference loops")
    ap.add_argument("--hook-every", type=int, default=1, help="hook loops on every K-th head only")
    ap.add_argument(
        "--sender-every",
        type=int,
        default=1,
        help="path patch every K-th eligible sender of each step only (a busy machine)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--sections",
        default="steps,baseline,scan,hooks,dcm,mixed",
        help="comma-separated: steps, baseline (step A on full-length runs), scan, hooks, dcm, mixed",
    )
    ap.add_argument("--dcm-pairs", type=int, default=32, help="training pairs of the DCM epoch")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    pairs = path_patching_pairs(model.tokenizer, args.n, seed=0)
    batch = prepare(model, pairs)
    shape, spp = model.shape, args.senders_per_pass
    ids = batch.clean_ids
    plain = plain_forward(model, ids)
    fig: dict = {
        "sender_every": args.sender_every,
        "model": args.model,
        "device": str(model.device),
        "dtype": args.dtype,
        "n_pairs": args.n,
        "tokens": int(batch.clean_ids.shape[1]),
        "threads": torch.get_num_threads(),
        "senders_per_pass": spp,
        "plain_forward_s": plain,
    }
    print(
        f"{args.model} on {model.device} ({args.dtype}), {torch.get_num_threads()} threads; "
        f"{args.n} pairs x {batch.clean_ids.shape[1]} tokens; plain forward {plain * 1e3:.1f} ms"
    )
    print(f"{'measurement':<58}{'per unit / plain fwd':>22}{'peak MB':>10}")

    def line(name, ratio, mb, extra=""):
        print(f"{name:<58}{ratio:>22.4f}{mb:>10.0f}  {extra}")

    sections = set(args.sections.split(","))
    if "mixed" in sections:
        fig["mixed_lengths"] = mixed_scan(model, args.n, spp, line)
    if "dcm" in sections:
        fig["dcm"] = dcm_epochs(model, args.dcm_pairs, line)
    if not sections & {"steps", "baseline", "scan", "hooks"}:
        _write(args.out, fig)
        return
    receivers, exact = None, {}
    for step, (position, _kind, _) in STEPS.items():
        senders = eligible_senders(model, receivers)[:: args.sender_every]
        scores, secs, plain, mb = timed(
            lambda: path_patch(model, batch, senders, position, receivers, spp, progress=False), model, ids
        )
        exact[step] = scores
        ratio = secs / len(senders) / plain
        fig[f"step_{step}"] = {
            "senders": len(senders),
            "seconds": secs,
            "plain_s": plain,
            "per_sender": ratio,
            "peak_mb": mb,
            "receivers": None if receivers is None else [h.name for h in receivers.heads],
        }
        line(
            f"exact path patching step {step} ({len(senders)} senders at {position})",
            ratio,
            mb,
            f"{secs:.1f} s, plain forward {plain:.3f} s",
        )
        attr = attribution_scores(model, batch, position, receivers, senders)
        k = DEFAULT_K[step]
        recall = len(set(select(attr, 2 * k)) & set(select(scores, k))) / k
        fig[f"step_{step}"]["screen_recall_top_k"] = recall
        print(f"    attribution screen: exact top-{k} found in its top-{2 * k}: {recall:.2f}")
        chosen = select(scores, k)
        if step != "D":
            nxt_position, nxt_kind, _ = STEPS[chr(ord(step) + 1)]
            receivers = Receivers(tuple(chosen), nxt_kind, nxt_position)
    senders_a = eligible_senders(model, None)[:: args.sender_every]
    if "baseline" in sections:
        full = dataclasses.replace(batch, clean_kv=None)
        old, secs, plain, mb = timed(
            lambda: path_patch(model, full, senders_a, "last", None, 8, progress=False), model, ids
        )
        diff = max(abs(old[h] - exact["A"][h]) for h in senders_a)
        fig["step_A_full_runs"] = {
            "per_sender": secs / len(senders_a) / plain,
            "plain_s": plain,
            "peak_mb": mb,
            "max_abs_diff_to_suffix": diff,
        }
        line(
            "step A with full-length runs (resume only, 8 per pass)",
            secs / len(senders_a) / plain,
            mb,
            f"max |diff| to suffix runs {diff:.1e}",
        )
    if sections & {"scan", "hooks"}:
        result, secs, plain, mb = timed(
            lambda: scan(model, batch.clean_ids, batch.source_ids, batch.answer_ids, "z", "last", per_pass=spp),
            model,
            ids,
        )
        n_heads = shape.n_layers * shape.n_heads
        fig["z_scan_last"] = {
            "heads": n_heads,
            "seconds": secs,
            "plain_s": plain,
            "per_head": secs / n_heads / plain,
            "peak_mb": mb,
        }
        line(f"z scan at last ({n_heads} heads)", secs / n_heads / plain, mb)
    if "hooks" in sections and not args.no_hooks:
        sample = senders_a[:: args.hook_every]
        ref, secs, plain, mb = timed(lambda: hooks_step_a(model, batch, sample), model, ids)
        diff = max(abs(ref[h] - exact["A"][h]) for h in sample)
        fig["hooks_step_A"] = {
            "senders": len(sample),
            "per_sender": secs / len(sample) / plain,
            "peak_mb": mb,
            "max_abs_diff": diff,
        }
        line(
            f"torch hooks, step A, one sender per forward ({len(sample)})",
            secs / len(sample) / plain,
            mb,
            f"max |diff| to mechdiff {diff:.1e}",
        )
        grid, secs, plain, mb = timed(
            lambda: hooks_z_scan(model, batch.clean_ids, batch.source_ids, batch.answer_ids, sample), model, ids
        )
        diff = max(abs(float(grid[h.layer, h.head] - result.effects[h.layer, h.head])) for h in sample)
        fig["hooks_z_scan_last"] = {
            "heads": len(sample),
            "per_head": secs / len(sample) / plain,
            "peak_mb": mb,
            "max_abs_diff": diff,
        }
        line(
            f"torch hooks, z scan at last, one head per forward ({len(sample)})",
            secs / len(sample) / plain,
            mb,
            f"max |diff| to mechdiff {diff:.1e}",
        )
    _write(args.out, fig)


def _write(path, fig: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(fig, f, indent=2)


def mixed_scan(model, n: int, per_pass: int, line, repeats: int = 3) -> dict:
    """A z scan at the last position over ``3 n`` pairs of three token lengths (one call, grouped inside)
    against the sum of the three single-length scans. Each round times the three single scans and the mixed
    one back to back (so load drifting on a shared machine hits both alike); the fastest of ``repeats``
    rounds is kept for each."""
    groups = {k: path_patching_pairs(model.tokenizer, n, n_boxes=k, seed=0) for k in (3, 5, 7)}
    mixed = [p for i in range(n) for k in groups for p in (groups[k][i],)]  # interleaved: grouping must sort them
    jobs = {**{str(k): ps for k, ps in groups.items()}, "mixed": mixed}
    times: dict = {name: [] for name in jobs}
    results: dict = {}
    for _ in range(repeats):
        for name, ps in jobs.items():
            t0 = time.perf_counter()
            results[name] = scan_pairs(model, ps, "z", "last", per_pass=per_pass)
            times[name].append(time.perf_counter() - t0)
    best = {name: min(t) for name, t in times.items()}
    total = sum(best[str(k)] for k in groups)
    want = sum(results[str(k)].effects.double() for k in groups) / len(groups)
    diff = float((results["mixed"].effects.double() - want).abs().max())
    lengths = sorted({len(p.base.input_ids) for p in mixed})
    line(
        f"z scan over {len(mixed)} pairs of {lengths} tokens / sum of the 3 scans",
        best["mixed"] / total,
        0,
        f"{best['mixed']:.2f} s vs {total:.2f} s, max |diff| {diff:.1e}",
    )
    return {
        "lengths": lengths,
        "n_per_length": n,
        "repeats": repeats,
        "mixed_s": best["mixed"],
        "single_s": {str(k): best[str(k)] for k in groups},
        "ratio": best["mixed"] / total,
        "max_abs_diff": diff,
        "all_s": times,
    }


def dcm_epochs(model, n_pairs: int, line) -> dict:
    """One DCM training epoch (DCMConfig defaults, validation included) on suffix runs vs full-length runs."""
    from mechdiff.methods.dcm import DCMConfig, train_mask
    from mechdiff.methods.dcm_cache import PairCache

    pairs = path_patching_pairs(model.tokenizer, n_pairs + 8, seed=1)
    shape = model.shape
    out = {}
    for position, heads in (
        ("last", [Head(shape.n_layers - 7 + i % 6, i % shape.n_heads) for i in range(6)]),
        ("query_label", [Head(shape.n_layers // 2 + i, i % shape.n_heads) for i in range(4)]),
    ):
        cache = PairCache.build(model, pairs, [(heads, position)], batch_size=16)
        full = dataclasses.replace(cache, suffix=False)
        config = DCMConfig(epochs=1)
        times = {}
        for name, c in (("suffix", cache), ("full", full)):
            t0 = time.perf_counter()
            train_mask(model, heads, position, c, range(n_pairs), range(n_pairs, n_pairs + 8), config, progress=False)
            times[name] = time.perf_counter() - t0
        out[position] = {**times, "ratio": times["suffix"] / times["full"], "heads": [h.name for h in heads]}
        line(
            f"DCM epoch at {position} ({len(heads)} heads), suffix / full-length runs",
            times["suffix"] / times["full"],
            0,
            f"{times['suffix']:.1f} s vs {times['full']:.1f} s",
        )
    return out


if __name__ == "__main__":
    main()
