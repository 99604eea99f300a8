"""Cost of reaching each checkpoint of a trajectory: a swap of LoRA adapters in one peft model over the base loaded
once (mechdiff.methods.checkpoints.Checkpoints) against loading each checkpoint by itself (load_model: the base loaded
and the adapter merged). Checks that both give the same fingerprint.

    python benchmarks/trajectory_swap.py smollm2-et@0 smollm2-et@5 smollm2-et@100
"""

from __future__ import annotations

import argparse
import time

from mechdiff.methods.checkpoints import Checkpoints
from mechdiff.models.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    args = p.parse_args()
    t = time.perf_counter()
    cp = Checkpoints(args.checkpoints)
    setup = time.perf_counter() - t
    swaps, loads = [], []
    for name in args.checkpoints:
        t = time.perf_counter()
        cp.model(name)
        swaps.append(time.perf_counter() - t)
        swapped = cp.fingerprint(name)
        t = time.perf_counter()
        loaded = load_model(name)
        loads.append(time.perf_counter() - t)
        if loaded.fingerprint != swapped:
            raise SystemExit(f"{name}: swapped fingerprint {swapped} != loaded {loaded.fingerprint}")
        print(f"{name:20s} swap {swaps[-1]:6.2f} s   load_model {loads[-1]:6.1f} s   fingerprint {swapped}")
    print(
        f"setup (base once + every adapter) {setup:.1f} s; {len(swaps)} checkpoints: swaps {sum(swaps):.1f} s "
        f"+ setup against loads {sum(loads):.1f} s (ratio {(setup + sum(swaps)) / sum(loads):.2f})"
    )


if __name__ == "__main__":
    main()
