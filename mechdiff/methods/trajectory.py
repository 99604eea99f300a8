"""Checkpoint trajectories: when a mechanism forms along one training run, by function and by structure.

The checkpoints are LoRA adapters over one base (``smollm2-et@0`` ... ``smollm2-et@100``).
`mechdiff.methods.checkpoints.Checkpoints` loads the base once, loads every adapter into one peft model
(``load_adapter``) and swaps them (``set_adapter`` + ``merge_adapter`` over the base's own weights, restored before
each swap), so each checkpoint's weights are bit for bit those `load_model` merges, at the cost of a restore and a
merge instead of a load.

Per checkpoint, each measure keeps its per-prompt outcomes so that it can be compared with the first checkpoint
on the same prompts (a paired interval):

- `checkpoint_accuracy`: accuracy (exact binomial interval);
- `own_circuit`: the checkpoint's own circuit at the target (the (head, position class) ranking and
  faithfulness curve of `curve`) with its size, its per-prompt attribution and the
  bootstrap selection frequency of its pairs;
- `circuits_scored`: given circuits (the final checkpoint's, the first trained one's, its own) scored
  in the checkpoint (`matrix_rows`: faithfulness with bootstrap intervals);
- `cmap_gain`: CMAP of each position-class group from the checkpoint into the first
  (`run_cmap`), the gain as a paired difference against the first's own run;
- `semantic`: semantic patching of DCM-labelled heads (`semantic_patching`).

Structure against function (`mechdiff.methods.structure`). Two discoveries on one model differ too, so a structural
change counts only beyond the within-checkpoint spread (`structure`): each of many draws splits the ranking prompts
into two disjoint random halves (`splits`; no prompt drawn twice); the top-``n`` pairs of each half are two
discoveries of one model on disjoint prompts, and their overlap (Jaccard) is the within-checkpoint null. Two
checkpoints are compared on the same halves (one's half A against the other's half B, both ways), and the
spread-corrected difference ``(null_s + null_t) / 2 - cross`` is taken per split (paired): the circuits "changed"
only where the range of that difference over splits lies above 0. Every checkpoint is compared so with the next one
and with the final one, and the mean overlaps of every two checkpoints form a matrix. A pair "changed" only where
its bootstrap selection frequency (`selection_stability`, same resamples in every checkpoint) puts it robustly in
(>= ``stable``) at one checkpoint and robustly out (<= ``1 - stable``) at the other. When each component forms, with
intervals: `formation`.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence

import numpy as np

from ..circuits.circuit import Circuit
from ..circuits.curve import curve_circuit
from ..circuits.measures import matrix_rows
from ..circuits.pruning import pair_name
from ..circuits.scoring import Scorer, per_prompt
from ..common.components import parse_heads
from ..common.stats import paired_difference
from ..models.loading import LoadedModel
from ..patching.evaluate import evaluate

# --------------------------------------------------------------------------------------
# Per-checkpoint measures
# --------------------------------------------------------------------------------------


def checkpoint_accuracy(lm: LoadedModel, records: Sequence, batch_size: int = 32, progress: bool = True) -> dict:
    """Accuracy (exact binomial interval) and answer probability, with each prompt's outcome."""
    res = evaluate(lm, records, batch_size, desc=f"accuracy {lm.name}", progress=progress)
    return {**res.to_dict(), "correct": res.correct.astype(int).tolist()}


def own_circuit(
    ranker: Scorer,
    curve_scorer: Scorer,
    classes: Sequence[str],
    sizes: Sequence[float],
    target: float,
    select: str,
    draws: int,
    seed: int,
    task: str = "",
) -> dict:
    """The checkpoint's circuit at ``target`` (`curve_circuit`, as the circuits
    study finds it), its size, the curve, its pairs' bootstrap selection frequency and the per-prompt
    attribution (``"prompt class layer head"``, float32, `encode_array`) for `structure`."""
    found = curve_circuit(ranker, curve_scorer, classes, sizes, target, select, draws, seed, ranker.model.name, task)
    chosen = found.curve["chosen"] or found.curve["rows"][-1]
    return {
        "circuit": found.circuit.to_dict(),
        "n_pairs": found.n,
        "n_heads": len(found.circuit.heads()),
        "reached_target": found.reached_target,
        "faithfulness": chosen["faithfulness"],
        "curve": found.curve,
        "classes": list(classes),
        "stability": {pair_name(p): found.stability[p] for p in found.ranked[: found.n]},
        "attribution": encode_array(found.attribution.float().numpy()),
    }


def circuits_scored(scorer: Scorer, circuits: dict[str, Circuit]) -> dict:
    """Each circuit scored in the scorer's model (`matrix_rows`: accuracy, faithfulness F(C)/F(M) with
    bootstrap intervals), with each prompt's outcome with the circuit alone kept and with the whole model."""
    rows = matrix_rows(scorer.model.name, circuits, scorer)
    outcomes = {label: per_prompt(scorer.keep(c.pairs())).astype(int).tolist() for label, c in circuits.items()}
    return {
        "rows": {r["circuit"]: r for r in rows},
        "outcomes": outcomes,
        "full": per_prompt(scorer.full()).astype(int).tolist(),
    }


def cmap_gain(
    first: LoadedModel,
    checkpoint: LoadedModel,
    circuit: Circuit,
    records: Sequence,
    kinds: Sequence[str] = ("z",),
    batch_size: int = 32,
    progress: bool = True,
) -> dict:
    """CMAP from ``checkpoint`` into ``first`` for each group of ``circuit`` and the whole circuit (rule
    ``"base"``), and each (group, kind)'s gain: accuracy of the patched first checkpoint minus its own, paired
    over prompts."""
    from .cmap import run_cmap

    res = run_cmap(first, checkpoint, circuit, records, kinds, batch_size, progress=progress)
    gains = {f"{r.scope}/{r.kind}": _gain(res.paired(f"{r.scope}/{r.kind}", "base")) for r in res.rows}
    return {**res.to_dict(), "gain": gains}


def _gain(test: Any) -> dict:
    """A CMAP gain as the trajectory keeps it (an estimate's ``value``, ``low``, ``high``, ``n``) with its p."""
    iv = test.interval
    return {"value": iv.value, "low": iv.low, "high": iv.high, "n": iv.n_rows, "p": test.p}


def semantic(
    lm: LoadedModel, labels: Sequence[dict], tests: dict[str, Sequence], batch_size: int = 32, progress: bool = True
) -> list[dict]:
    """Semantic patching in ``lm`` of each non-empty DCM selection of ``labels`` (`DCMResult.to_dict`
    records: group, desideratum, position, selected) on its desideratum's test pairs: the target accuracy with the
    selected heads patched from source to base (exact binomial), the unpatched floor and each pair's outcome, as
    `semantic_selections` gives them (one `PairCache` per desideratum serves all its selections)."""
    from .semantic import semantic_selections

    chosen = [lab for lab in labels if lab["selected"]]
    out = []
    for desideratum in dict.fromkeys(lab["desideratum"] for lab in chosen):
        mine = [lab for lab in chosen if lab["desideratum"] == desideratum]
        selections = [(parse_heads(lab["selected"]), lab["position"]) for lab in mine]
        found = semantic_selections([lm], selections, tests[desideratum], batch_size, progress)
        for lab, [result] in zip(mine, found):
            out.append(
                {
                    "group": lab["group"],
                    "desideratum": desideratum,
                    "position": lab["position"],
                    "heads": lab["selected"],
                    "model": lm.name,
                    "accuracy": result.accuracy.to_dict(),
                    "floor": result.floor.to_dict(),
                    "outcomes": result.outcomes,
                }
            )
    return out


# --------------------------------------------------------------------------------------
# Against the first checkpoint
# --------------------------------------------------------------------------------------


def against_first(outcomes: Sequence[Optional[Sequence[float]]]) -> list[Optional[dict]]:
    """Per checkpoint, the paired difference (bootstrap interval) of its per-prompt outcomes minus the first's
    on the same prompts; None for the first itself and where a checkpoint has no outcomes."""
    first = outcomes[0]
    return [
        None if i == 0 or o is None or first is None else paired_difference(o, first).to_dict()
        for i, o in enumerate(outcomes)
    ]


def encode_array(a: np.ndarray) -> dict:
    """A float32 array as JSON: shape and base64 bytes (exact, 4 bytes a value)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return {"shape": list(a.shape), "float32": base64.b64encode(a.tobytes()).decode()}


def decode_array(d: dict) -> np.ndarray:
    """The array `encode_array` wrote."""
    return np.frombuffer(base64.b64decode(d["float32"]), dtype=np.float32).reshape(d["shape"]).copy()


def membership(circuits: Sequence[Circuit]) -> dict[tuple[str, int], list[int]]:
    """``(position class, layer) -> [number of the circuit's heads there, per checkpoint]`` for every
    (class, layer) holding a head in some checkpoint's circuit."""
    cells: dict[tuple[str, int], list[int]] = {}
    for i, c in enumerate(circuits):
        for head, pos in c.pairs():
            cells.setdefault((pos, head.layer), [0] * len(circuits))[i] += 1
    return dict(sorted(cells.items()))
