"""The size of a trajectory's ``attributions.h5`` at its task file's shape, on simulated attributions.

The committed trajectories' attributions are not at hand before they are regenerated, so each checkpoint's
per-prompt attribution is simulated: every (class, layer, head) pair has a scale (log-normal with sd ``--spread``:
0 puts every pair at one scale, the worst case for the store; larger values make many pairs near zero, as heads at
positions that do not matter are) and a heavy-tailed mean (Student t, 3 degrees of freedom) at that scale; each
prompt adds noise at the pair's scale (t, 5 degrees of freedom) and is scaled as a whole (log-normal, sd 0.5).
The means' size is set so that the within-checkpoint null on the first 32 prompts is the committed tables' (about
0.40 for entity tracking at 351 of 3510 pairs, 0.47 for IOI at 108 of 2160). Each checkpoint is its own draw, the
population drifting from the first to the last. The structure stage's record is then computed as the stage does
(`structure_record`, the task file's ``[structure]``, ``[discovery] n``/``runs_n`` and ``[runs]``), the store
written from it (`write_attributions`), and its size printed beside the layout before (every row of a checkpoint at
every pair any comparison selected).

    OMP_NUM_THREADS=1 python benchmarks/attribution_store.py --spread 0 0.5 1
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import tomllib

from mechdiff.methods.structure import (
    ATTRIBUTIONS_BOUND,
    MARGIN,
    RESAMPLE_SPLITS,
    STABLE,
    STRUCTURE_DRAWS,
    STRUCTURE_RESAMPLES,
    half_weights,
    structure_record,
    to_half,
    top_masks,
    write_attributions,
)

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS = 30, 9  # SmolLM2-135M
#: Per task file: position classes and the within-checkpoint null its committed tables show at 32 prompts.
TASKS = {"entity_tracking_trajectory.toml": (13, 0.40), "ioi_trajectory.toml": (8, 0.47)}


def population(rng: np.random.Generator, pairs: int, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's mean (heavy-tailed, unit size) and scale."""
    scale = np.exp(spread * rng.standard_normal(pairs))
    return scale * rng.standard_t(3, pairs), scale


def draw(rng: np.random.Generator, n: int, mean: np.ndarray, scale: np.ndarray, size: float) -> np.ndarray:
    """``n`` prompts: the pairs' means times ``size`` plus noise at each pair's scale, each prompt scaled as a whole."""
    prompt = np.exp(0.5 * rng.standard_normal((n, 1)))
    return prompt * (size * mean + scale * rng.standard_t(5, (n, mean.size)))


def null32(x: np.ndarray, top: int) -> float:
    """The within-checkpoint null of ``x``'s first 32 prompts (100 splits)."""
    wa, wb = half_weights(np.ones((1, 32)), 100, 0)
    a, b = (top_masks(x[:32], w, top) for w in (wa, wb))
    inter = (a & b).sum(1)
    return float(np.mean(inter / (2 * top - inter)))


def calibrate(pairs: int, top: int, spread: float, target: float) -> float:
    """The means' size giving the null ``target`` on 32 prompts (bisection on a log scale over four populations,
    the same noise at every size tried)."""
    pops = [population(np.random.default_rng(k), pairs, spread) for k in range(4)]
    lo, hi = -4.0, 3.0
    for _ in range(16):
        mid = (lo + hi) / 2
        got = np.mean([null32(draw(np.random.default_rng(k), 32, *p, np.exp(mid)), top) for k, p in enumerate(pops)])
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return float(np.exp((lo + hi) / 2))


def trajectory(task: str, spread: float, seed: int = 0) -> dict[str, Any]:
    """The task file's shape with simulated float16 attributions: checkpoints, other runs, settings, classes."""
    spec = tomllib.loads((ROOT / "tasks" / task).read_text())
    n_classes, target = TASKS[task]
    pairs, d, st = n_classes * LAYERS * HEADS, spec["discovery"], spec["structure"]
    names = spec["models"]["checkpoints"]
    steps = {c: int(c.rsplit("@", 1)[1]) for c in names}
    read = spec.get("runs", {}).get("steps", [])
    runs = {
        c: [f"run{r}@{steps[c]}" for r in range(1, 1 + len(spec["runs"]["dirs"]))] for c in names if steps[c] in read
    }
    size = calibrate(pairs, st["n_pairs"], spread, target)
    rng = np.random.default_rng(seed)
    first, last = population(rng, pairs, spread), population(rng, pairs, spread)
    attribution = {}
    at = {c: i for i, c in enumerate(names)} | {o: names.index(c) for c, os in runs.items() for o in os}
    for c, i in at.items():  # another run's checkpoint drawn from its step's population
        w = i / (len(names) - 1)
        mean = np.sqrt(1 - w) * first[0] + np.sqrt(w) * last[0]
        scale = np.sqrt((1 - w) * first[1] ** 2 + w * last[1] ** 2)
        rows = d.get("runs_n", d["n"]) if c not in names or c in runs else d["n"]
        x = draw(rng, rows, mean, scale, size).reshape(rows, n_classes, LAYERS, HEADS)
        attribution[c] = to_half(x.astype(np.float32))
    settings = {
        k: st.get(k, v)
        for k, v in dict(
            draws=STRUCTURE_DRAWS,
            stable=STABLE,
            resamples=STRUCTURE_RESAMPLES,
            resample_splits=RESAMPLE_SPLITS,
            margin=MARGIN,
        ).items()
    }
    return {
        "attribution": attribution,
        "names": names,
        "runs": runs,
        "classes": [f"class{i}" for i in range(n_classes)],
        "n_pairs": st["n_pairs"],
        "ranking_n": d["n"],
        "settings": settings,
    }


def store_size(t: dict[str, Any], out: Path) -> dict[str, Any]:
    """The store's size in bytes (``size``), that of its rows past the shared prompts (``further``), that of the
    layout before (``before``), and the structure record."""
    import h5py

    record = structure_record(
        t["attribution"], t["names"], t["runs"], t["classes"], t["n_pairs"], t["ranking_n"], t["settings"], 0
    )
    path = write_attributions(out / "store.h5", t["attribution"], record, t["classes"], {})
    with h5py.File(path) as f:
        further = sum(g["dense_attribution"].id.get_storage_size() for g in f.values() if "dense_attribution" in g)
    before = copy.deepcopy(record)  # every row at every pair either comparison selected
    for c, inner in before.get("dense", {}).get("kept", {}).items():
        before["dense"]["kept"][c] = sorted(set(inner) | set(before["kept"][c]))
    old = write_attributions(out / "before.h5", t["attribution"], before, t["classes"], {}).stat().st_size
    return {"size": path.stat().st_size, "further": further, "before": old, "record": record}


def fraction(kept: dict[str, list[int]], pairs: int) -> float:
    """The mean share of the ``pairs`` each checkpoint keeps (nan for none)."""
    return float(np.mean([len(k) for k in kept.values()]) / pairs) if kept else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spread", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    args = ap.parse_args()
    for spread in args.spread:
        total, further, per_share = 0, 0, 0.0
        for task in TASKS:
            t = trajectory(task, spread)
            with tempfile.TemporaryDirectory() as tmp:
                got = store_size(t, Path(tmp))
            record = got["record"]
            pairs = int(np.prod(next(iter(t["attribution"].values())).shape[1:]))
            inner = fraction(record.get("dense", {}).get("kept", {}), pairs)
            nulls = [np.mean([e["value"] for e in r["null"].values()]) for r in (record, record.get("dense")) if r]
            raw = sum(a.size for a in t["attribution"].values()) * 2
            print(
                f"spread {spread} {task}: null {' / '.join(f'{v:.3f}' for v in nulls)}; pairs kept "
                f"{fraction(record['kept'], pairs):.2f} on {t['ranking_n']} prompts, {inner:.2f} on the further ones "
                f"({got['further'] / 1e6:.2f} MB); {raw / 1e6:.1f} MB as float16, store {got['size'] / 1e6:.2f} MB "
                f"(layout before {got['before'] / 1e6:.2f} MB)",
                flush=True,
            )
            total, further = total + got["size"], further + got["further"]
            per_share += got["further"] / inner if got["further"] else 0.0
        line = f"spread {spread}: both {total / 1e6:.2f} MB (bound {ATTRIBUTIONS_BOUND / 1e6:.0f} MB)"
        if per_share:  # the rest fixed, the further rows growing with the share of the pairs they keep
            most = (ATTRIBUTIONS_BOUND - (total - further)) / per_share
            line += f"; within it while the further rows keep at most {most:.2f} of the pairs"
        print(line, flush=True)


if __name__ == "__main__":
    main()
