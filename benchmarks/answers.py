"""Benchmark answers of several tokens in ``mechdiff.patching.evaluate.evaluate`` (#40 item 2), in CPU time.

In one process, on the real model, cases interleaved repetition by repetition (this machine's wall times vary
several-fold under load, so CPU time, ``time.process_time``, and ratios measured side by side):

1. a one-token task: ``evaluate`` against the evaluation loop as it was before answers of several tokens (a copy
   of it below: one run, the read-out logits at the last token); target: the ratio within 5% of 1;
2. answers of ``a`` tokens on prompts of ``p`` tokens (no alternatives: one answer scored per prompt) against the
   one-token ``evaluate`` of the same prompts; target: at most about ``(p + a) / p``.

    OMP_NUM_THREADS=1 python benchmarks/answers.py --model smollm2-135m --n 32 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mechdiff.common.metrics import answer_is_top1, answer_prob
from mechdiff.models.loading import load_model
from mechdiff.patching.core import run
from mechdiff.patching.evaluate import evaluate
from mechdiff.tasks.base import Example, batch_tensors, grouped_batches, take


def records(n: int, p: int, a: int, vocab: int, seed: int = 0) -> list[Example]:
    """``n`` prompts of ``p`` random tokens with answers of ``a`` random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab, (n, p + a), generator=g).tolist()
    out = []
    for row in ids:
        prompt, answer = tuple(row[:p]), tuple(row[p:])
        out.append(Example("", prompt, "", answer[0], {"last": p - 1}, answer_tokens=answer if a > 1 else ()))
    return out


def before(model, recs: list[Example], batch_size: int) -> None:
    """The one-token evaluation loop before answers of several tokens (its forward and its metrics)."""
    for rows in grouped_batches(recs, batch_size):
        batch = batch_tensors(take(recs, rows))
        with torch.no_grad():
            logits = run(model, batch["input_ids"]).logits
        answer_is_top1(logits, batch["answer_ids"]).cpu().numpy()
        answer_prob(logits, batch["answer_ids"]).cpu().numpy()


def cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=32, help="prompts (one batch)")
    ap.add_argument("--prompt-tokens", default="8,32")
    ap.add_argument("--answer-tokens", default="2,4,6")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    lm = load_model(args.model)
    vocab = lm.model.config.vocab_size
    cases = {}
    for p in (int(v) for v in args.prompt_tokens.split(",")):
        one = records(args.n, p, 1, vocab)
        cases[(p, 1, "before")] = lambda one=one: before(lm, one, args.n)
        cases[(p, 1, "now")] = lambda one=one: evaluate(lm, one, args.n, progress=False)
        for a in (int(v) for v in args.answer_tokens.split(",")):
            recs = records(args.n, p, a, vocab)
            cases[(p, a, "now")] = lambda recs=recs: evaluate(lm, recs, args.n, progress=False)
    times: dict = {k: [] for k in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for k, fn in cases.items():
            times[k].append(cpu_seconds(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{args.model}, {args.n} prompts in one batch, torch threads {torch.get_num_threads()}, "
        f"median CPU s of {args.repeats}"
    )
    print("| prompt tokens p | answer tokens a | CPU s | ratio to one token now | (p + a) / p | ratio now / before |")
    print("|---|---|---|---|---|---|")
    for (p, a, when), t in med.items():
        if when == "before":
            continue
        one = med[(p, 1, "now")]
        last = f"{one / med[(p, 1, 'before')]:.3f}" if a == 1 else ""
        print(f"| {p} | {a} | {t:.3f} | {t / one:.2f} | {(p + a) / p:.2f} | {last} |")


if __name__ == "__main__":
    main()
