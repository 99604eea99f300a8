"""The HeadMap study's tables, from its records: accuracy per method (seeds pooled) and per seed, the paired
differences, the learning-rate sweep, the locating cost, the paper's settings beside this study's and the located
heads' overlap with path-patching circuits. A record is one training or evaluation run (its ``correct`` outcomes
keyed by `TASK` and `VAL`); ``st`` is the study's settings (`HeadMapSettings`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...circuits.circuit import Circuit
from ...circuits.overlap import overlap_row
from ...common.stats import bootstrap, paired_difference, pooled_mean, pooled_proportion
from .settings import TASK, UNSEEDED, VAL

#: Paired comparisons of the report (first minus second), where both runs are chosen.
COMPARISONS = (
    ("located", "random"),
    ("located", "outside"),
    ("located", "transfer"),
    ("located", "lora-small"),
    ("headmap+lora", "lora-small"),
)


def validation_accuracy(records: dict[float, dict]) -> dict[float, float]:
    """Learning rate -> accuracy on the validation prompts (the only outcomes a rate is chosen on)."""
    return {lr: float(np.mean(r["correct"][VAL])) for lr, r in records.items()}


def _accuracies(records: list[dict]) -> np.ndarray:
    """``"seed prompt"`` 0/1 outcomes on the held-out prompts."""
    return np.asarray([r["correct"][TASK] for r in records], dtype=float)


def method_rows(
    results: dict[str, list[dict]], names: dict[str, str], lora_ref: int, lora_large: int
) -> tuple[list[dict], dict]:
    """One row per run: parameters (and their ratio to the large LoRA's), every seed's accuracy, their mean,
    standard deviation and range, the mean's interval (two-stage bootstrap over seeds and prompts), the mean
    final training loss and seconds. Runs without records (an interrupted study) are left out."""
    rows, estimates = [], {}
    for run_id, records in results.items():
        if not records:
            continue
        acc = _accuracies(records)
        per_seed = acc.mean(axis=1)
        est = pooled_proportion(acc)
        estimates[run_id] = est
        losses = [float(np.mean(r["losses"][-5:])) for r in records if r["losses"]]
        rows.append(
            {
                "method": names[run_id],
                "trainable_params": records[0]["trainable"],
                f"ratio_to_lora_r{lora_large}": records[0]["trainable"] / lora_ref,
                "seeds": len(records),
                "per_seed": " / ".join(f"{a:.3f}" for a in per_seed),
                "accuracy": est.value,
                "sd": float(np.std(per_seed, ddof=1)) if len(records) > 1 else float("nan"),
                "min": float(per_seed.min()),
                "max": float(per_seed.max()),
                "ci_low": est.low,
                "ci_high": est.high,
                "final_train_loss": float(np.mean(losses)) if losses else float("nan"),
                "train_seconds": float(np.mean([r["train_seconds"] for r in records])),
            }
        )
    return rows, estimates


def seed_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """One row per run and seed: held-out accuracy with its bootstrap interval over prompts, validation accuracy."""
    rows = []
    for run_id, records in results.items():
        for seed, r in zip(seeds if run_id not in UNSEEDED else ("-",), records):
            est = bootstrap(r["correct"][TASK])
            val, cfg = r["correct"].get(VAL), r.get("config", {})
            rows.append(
                {
                    "method": names[run_id],
                    "seed": seed,
                    "accuracy": est.value,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "val_accuracy": float(np.mean(val)) if val else float("nan"),
                    "lr": cfg["lr"] if cfg.get("lora_rank") else float("nan"),
                    "headmap_lr": cfg["headmap_lr"] if r.get("heads") else float("nan"),
                }
            )
    return rows


def paired_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """For each comparison of `COMPARISONS` with both runs present: the accuracy difference on the same
    held-out prompts seed by seed (paired bootstrap over prompts) and pooled over seeds x prompts (two-stage
    bootstrap of the per-prompt differences, resampling seeds then prompts)."""
    rows = []
    for a, b in COMPARISONS:
        if not results.get(a) or not results.get(b):
            continue
        m = min(len(results[a]), len(results[b]))  # seeds both runs finished
        x, y = _accuracies(results[a][:m]), _accuracies(results[b][:m])
        label = f"{names[a]} - {names[b]}"
        for seed, xs, ys in zip(seeds, x, y):
            d = paired_difference(xs, ys)
            rows.append(
                {"comparison": label, "seed": str(seed), "difference": d.value, "ci_low": d.low, "ci_high": d.high}
            )
        d = pooled_mean(x - y)
        rows.append(
            {
                "comparison": label,
                "seed": f"pooled ({m} seeds x {x.shape[1]} prompts)",
                "difference": d.value,
                "ci_low": d.low,
                "ci_high": d.high,
            }
        )
    return rows


def sweep_rows(sweep: dict[str, dict[float, dict]], names: dict[str, str], chosen: tuple[float, float]) -> list[dict]:
    """One row per method and learning rate: validation accuracy (bootstrap interval over the prompts), the
    final training loss, and which rate was chosen."""
    label = {"headmap": names["located"], "lora": names["lora-small"]}
    pick = {"lora": chosen[0], "headmap": chosen[1]}
    rows = []
    for method, records in sweep.items():
        for lr, r in records.items():
            est = bootstrap(r["correct"][VAL])
            rows.append(
                {
                    "method": label[method],
                    "lr": lr,
                    "val_accuracy": est.value,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "final_train_loss": float(np.mean(r["losses"][-5:])),
                    "chosen": "yes" if lr == pick[method] else "",
                }
            )
    return rows


def verdict(rows: list[dict], label: str) -> str:
    """What the pooled interval of comparison ``label`` carries, in one sentence."""
    pooled = [r for r in rows if r["comparison"] == label and r["seed"].startswith("pooled")]
    if not pooled:
        return ""
    r = pooled[0]
    interval = f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
    if r["ci_low"] > 0:
        return f"{label}: {interval}; the interval lies above 0, so the first beats the second here."
    if r["ci_high"] < 0:
        return f"{label}: {interval}; the interval lies below 0, so the second beats the first here."
    return (
        f"{label}: {interval}; the interval includes 0, so this study cannot tell the two apart "
        "(it does not show that the first beats the second)."
    )


def locating_rows(located: dict[str, Circuit]) -> list[dict]:
    return [
        {
            "task": t,
            "n_samples": c.meta["n_samples"],
            "pool": c.meta["pool"],
            "k": c.meta["k"],
            "heads": len(c.heads()),
            "forward_passes": c.meta["forward_passes"],
            "rows": c.meta["rows"],
            "seconds": c.meta["seconds"],
            "selection_seconds": c.meta["selection_seconds"],
            "pool_loss": c.meta["pool_loss"],
            "selected_loss": c.meta["base_loss"],
            "loss_all_masked": c.meta["curve"][-1],
        }
        for t, c in located.items()
    ]


def settings_rows(st: Any) -> list[dict]:
    """The paper's setting beside this study's, one row per setting (where they differ, the row says so)."""
    lrs = (
        f"swept over {', '.join(f'{x:g}' for x in st.lrs)} for each method"
        if st.lrs
        else f"{st.lr:g} (LoRA), {st.headmap_lr:g} (HeadMap)"
    )
    return [
        {
            "setting": "locating samples",
            "paper": "the 64 lowest-loss samples of the task",
            "here": f"the {st.n} lowest-loss of a pool of {st.pool}",
            "same": "yes" if st.n == 64 else "no",
        },
        {"setting": "models", "paper": "LLaMA-family 7-8B models (e.g. Llama3-8B)", "here": st.model, "same": "no"},
        {
            "setting": "tasks",
            "paper": "commonsense reasoning datasets (e.g. SIQA, HellaSwag)",
            "here": f"{TASK} (7-box prompts; transfer from {st.transfer_task})",
            "same": "no",
        },
        {"setting": "heads kept per layer", "paper": "not known here", "here": str(st.k), "same": "?"},
        {"setting": "map rank", "paper": "not known here", "here": str(st.rank), "same": "?"},
        {"setting": "learning rate", "paper": "not known here", "here": lrs, "same": "?"},
        {
            "setting": "training",
            "paper": "not known here",
            "here": f"{st.steps} steps of {st.batch} prompts, {len(st.seeds)} seeds",
            "same": "?",
        },
        {
            "setting": "baselines",
            "paper": "LoRA; random head selection; other locating strategies",
            "here": "LoRA r=1 and the zoo's r=8; random heads; heads outside the located set; a transferred circuit",
            "same": "partly",
        },
    ]


def edge_notes(lrs: tuple, chosen: dict[str, float]) -> list[str]:
    """A warning line (and a blank) for each method whose chosen rate lies at an end of the swept grid."""
    out = []
    for method, lr in chosen.items():
        if lrs and lr in (min(lrs), max(lrs)) and len(lrs) > 1:
            side = "largest" if lr == max(lrs) else "smallest"
            out += [
                f"{method}'s chosen rate {lr:g} is the {side} swept: rates beyond it were not tried, so "
                f"{method} may be under-tuned.",
                "",
            ]
    return out


def overlap_rows(located: dict[str, Circuit], path_patching: Sequence[str | Path], shape: Any) -> list[dict]:
    """Each located circuit against each group (and all heads) of each path-patching circuit file: the overlap
    row of `mechdiff.circuits.overlap.overlap_row` (hypergeometric p over every head of ``shape``)."""
    rows = []
    for path in path_patching:
        pp = Circuit.load(path)
        for name, c in located.items():
            for g, heads in [*pp.groups.items(), ("all", pp.heads())]:
                if heads:
                    row = overlap_row(g, heads, c.heads(), shape.n_layers * shape.n_heads, pp.names.get(g, "all heads"))
                    rows.append({"path_patching": f"{pp.model} ({Path(path).name})", "located_on": name, **row})
    return rows
