"""The one rule for comparing floats in the tests.

Two float32 computations of one quantity that differ only in the order of their sums -- another kernel
path (``ATEN_CPU_CAPABILITY=avx512``, ``avx2``, ``default``), another thread count, a batched run against
one at a time, a patched run against plain torch hooks, a suffix run against a full run -- agree to a few
float32 epsilons of the magnitudes involved per rounding step, not exactly. So a float32 tolerance is

    tol32(scale, depth) = EPS32 * scale * depth

- ``scale``: the magnitude of the operands the compared quantity is computed from, not of the result:
  a difference of two logits of size 3 that should vanish is compared at ``3 * EPS32 * depth``, not at 0;
  a relative change ``p / p0 - 1`` has operands of size ``1 + |p / p0 - 1|``.
- ``depth``: the roundings that can pile up along the computation's longest chain. A forward pass
  counts ``ROUNDINGS_PER_LAYER`` per layer plus one layer's worth for the embedding and unembedding
  (``forward_depth``); a tiny three-layer test model gives ``TINY_FORWARD`` = 40.

Measured (``python tests/tolerances.py``): on the tiny models the logits of the AVX512, AVX2 and default
kernel paths, and of 1 against 2 threads, differ by at most a few ``EPS32 * max|logit|``, well inside
``TINY_FORWARD``.

Exact equality (``==``, ``rtol=0, atol=0``, ``torch.equal``) only where the two sides are exact by
construction: a copy or a value read back, the same kernel on the same input in the same process,
``x * 1 + y * 0``, a count; where that is not evident, a comment says why. A bound that is measured rather
than derived (finite differences against a gradient, a Monte-Carlo mean) states what it was measured on.
No float32 result is compared to an absolute tolerance under 1e-6 unless a comment says why it is exact.
"""

from __future__ import annotations

import pytest
import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 1.19e-07
# roundings per transformer layer: two norms, the q/k/v and o projections, the attention scores, their
# softmax, the mix of values, two or three MLP matmuls and the residual adds
ROUNDINGS_PER_LAYER = 10


def forward_depth(n_layers: int) -> int:
    """Roundings along a forward pass of ``n_layers`` layers, counting the embedding/unembedding as one more."""
    return ROUNDINGS_PER_LAYER * (n_layers + 1)


TINY_FORWARD = forward_depth(3)  # the tiny random models of tests/conftest.py (3 layers)


def tol32(scale: float, depth: int = TINY_FORWARD) -> float:
    """Absolute tolerance for two float32 computations of a quantity whose operands have size ``scale``."""
    return EPS32 * float(scale) * depth


def _magnitude(*xs) -> float:
    return max(float(torch.as_tensor(x, dtype=torch.float64).abs().max()) for x in xs)


def assert_close32(got, want, *, scale: float | None = None, depth: int = TINY_FORWARD, msg: str = "") -> None:
    """``|got - want| <= tol32(scale, depth)`` elementwise; ``scale`` defaults to the larger magnitude of
    the two sides (pass the operands' magnitude where the compared quantity is a difference)."""
    got64, want64 = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    assert got64.shape == want64.shape, f"{msg} shapes {tuple(got64.shape)} != {tuple(want64.shape)}"
    bound = tol32(_magnitude(got64, want64) if scale is None else scale, depth)
    err = float((got64 - want64).abs().max()) if got64.numel() else 0.0
    assert err <= bound, f"{msg} max |got - want| = {err:.3g} > {bound:.3g} (EPS32 * scale * depth)"


def approx32(want: float, scale: float | None = None, depth: int = TINY_FORWARD):
    """``pytest.approx`` of a float32 result: absolute ``tol32``, ``scale`` defaulting to ``|want|``."""
    return pytest.approx(want, rel=0, abs=tol32(abs(want) if scale is None else scale, depth))


def relative_change_approx(want: float, depth: int = TINY_FORWARD):
    """``pytest.approx`` of a relative change ``p / p0 - 1`` (a path-patching score): operands ``1 + |want|``."""
    return approx32(want, scale=1 + abs(want), depth=depth)


if __name__ == "__main__":  # measure the kernel paths' disagreement on the tiny models' logits
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); from conftest import make_tiny, _smollm2_tokenizer;"
        "tok = _smollm2_tokenizer(); ids = torch.randint(0, 49152, (4, 24), generator=torch.Generator()"
        ".manual_seed(0)); out = [make_tiny(f, tok).model(input_ids=ids).logits.detach() for f in "
        "('llama', 'gpt2', 'gpt_neox')]; torch.save(out, sys.argv[1])"
    )
    runs = {}
    for name, env in {
        "native, 2 threads": {},
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
        "default": {"ATEN_CPU_CAPABILITY": "default"},
        "1 thread": {"OMP_NUM_THREADS": "1"},
    }.items():
        path = f"/tmp/tolerances_{abs(hash(name))}.pt"
        subprocess.run(
            [sys.executable, "-c", code, path], check=True, env={**os.environ, **env}, stderr=subprocess.DEVNULL
        )
        runs[name] = torch.load(path)
    base = runs.pop("native, 2 threads")
    for name, logits in runs.items():
        worst = max(float((a - b).abs().max()) / (EPS32 * float(b.abs().max())) for a, b in zip(logits, base))
        print(f"{name} vs native: max |d logit| = {worst:.2f} EPS32 * max|logit| (TINY_FORWARD = {TINY_FORWARD})")
