"""Benchmark the contiguous-input unembedding (``mechdiff.models.loading.contiguous_unembedding``).

With ``logits_to_keep=1`` transformers hands the unembedding ``hidden[:, -1:, :]``, a strided view; on CPU
``linear`` on that view is several times slower than on a contiguous copy. ``load_model`` registers a pre-hook
that makes the input contiguous. In one process, on the real model, this prints the median seconds of

1. the unembedding on the strided view and on a contiguous copy;
2. a forward pass (``logits_to_keep=1``) of ``--batch`` prompts of ``--tokens`` tokens with and without the
   hook (the hook is removed and put back between measurements), as a ratio,

and checks that the logits agree.

    OMP_NUM_THREADS=1 python benchmarks/unembedding.py --batch 32 --tokens 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mechdiff.models.loading import load_model


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    hf = load_model(args.model).model
    head = hf.get_output_embeddings()
    hooks = dict(head._forward_pre_hooks)
    hidden = torch.randn(args.batch, args.tokens, head.in_features, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 1000, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    head._forward_pre_hooks.clear()
    strided = median_seconds(lambda: head(hidden[:, -1:, :]), args.repeats)
    contiguous = median_seconds(lambda: head(hidden[:, -1:, :].contiguous()), args.repeats)
    plain = median_seconds(lambda: hf(input_ids=ids, logits_to_keep=1), args.repeats)
    without = hf(input_ids=ids, logits_to_keep=1).logits
    head._forward_pre_hooks.update(hooks)
    hooked = median_seconds(lambda: hf(input_ids=ids, logits_to_keep=1), args.repeats)
    with_hook = hf(input_ids=ids, logits_to_keep=1).logits
    print(f"{args.model}: {args.batch} prompts x {args.tokens} tokens, torch threads {torch.get_num_threads()}")
    print(f"unembedding on hidden[:, -1:, :]   {1000 * strided:8.1f} ms")
    print(f"unembedding on a contiguous copy   {1000 * contiguous:8.1f} ms   ({strided / contiguous:.1f}x faster)")
    print(f"forward without the hook           {1000 * plain:8.1f} ms")
    print(f"forward with the hook              {1000 * hooked:8.1f} ms   ({plain / hooked:.2f}x faster)")
    print(f"max |logit difference|             {float((with_hook - without).abs().max()):.1e}")


if __name__ == "__main__":
    main()
