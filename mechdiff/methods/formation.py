"""When each component of a mechanism forms along a training run, with intervals over prompts.

A component's measure at every checkpoint is a ratio of prompt means, ``mean(num[s]) / mean(den[s])``
(:class:`Measure`): a circuit's faithfulness in the checkpoint (accuracy with the circuit alone kept over the
whole model's, :func:`faithfulness`), a patched component's gain as a share of the checkpoint's own gain over the
first checkpoint (:func:`share`), semantic patching over the checkpoint's own accuracy (:func:`over_accuracy`),
or the model's accuracy gain over the first checkpoint (:func:`gain`, no denominator). A ratio is shown only at
checkpoints whose own accuracy on its denominator's prompts is above the first checkpoint's (paired bootstrap
interval above 0, :func:`above_first`): elsewhere the denominator is noise.

A component forms (:meth:`Curve.formation`) where its final value's interval lies above 0; its formation step at
``q`` is the first step whose value reaches ``q`` times the final checkpoint's. The interval is a bootstrap over
prompts drawn jointly across steps: each draw resamples every prompt set once (:func:`resample`) and the same
indices serve every step and every component, so two components' formation steps in one draw are paired, and
"A forms before B" (:func:`order`) holds only where the percentile interval of the difference of their formation
steps lies below 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..common.stats import paired_difference

#: Bootstrap draws of the prompts (every prompt set, jointly across steps and components).
DRAWS = 1000
#: Fractions of the final value whose first crossing is a formation step.
LEVELS = (0.5, 0.9)
CONFIDENCE = 0.95

Indices = dict[str, Optional[np.ndarray]]  # prompt set -> "draw prompt" indices (None: the prompts themselves)


def _steps_by_prompts(x: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"per-prompt outcomes must be 'step prompt', got shape {arr.shape}")
    return arr


def above_first(outcomes: Sequence[Sequence[float]] | np.ndarray, confidence: float = CONFIDENCE) -> np.ndarray:
    """Per step (``outcomes``: "step prompt", the same prompts), whether its mean minus the first step's has a
    paired bootstrap interval above 0; False for the first step and a step not measured (nan)."""
    o = _steps_by_prompts(outcomes)
    keep = [
        i > 0 and not np.isnan(row).any() and paired_difference(row, o[0], confidence).low > 0
        for i, row in enumerate(o)
    ]
    return np.asarray(keep, dtype=bool)


@dataclass(frozen=True)
class Measure:
    """``mean(num[s]) / mean(den[s])`` at every step ``s`` (``"step prompt"`` arrays; ``den`` None: the mean of
    ``num``), on the named prompt sets; nan where ``shown`` is False or the denominator is not above 0."""

    num: np.ndarray
    prompts: str
    den: Optional[np.ndarray] = None
    den_prompts: str = ""
    shown: Optional[np.ndarray] = None

    def sets(self) -> dict[str, int]:
        """Prompt set -> number of prompts."""
        out = {self.prompts: self.num.shape[1]}
        if self.den is not None:
            out[self.den_prompts] = self.den.shape[1]
        return out

    def at(self, idx: Indices) -> np.ndarray:
        """The measure at every step on the prompts ``idx`` selects: ``"step draw"``."""
        value = _means(self.num, idx[self.prompts])
        if self.den is not None:
            den = _means(self.den, idx[self.den_prompts])
            with np.errstate(divide="ignore", invalid="ignore"):
                value = np.where(den > 0, value / den, np.nan)
        if self.shown is not None:
            value = np.where(self.shown[:, None], value, np.nan)
        return value


def _means(x: np.ndarray, rows: Optional[np.ndarray]) -> np.ndarray:
    return x.mean(1)[:, None] if rows is None else x[:, rows].mean(2)


def gain(outcomes: Sequence[Sequence[float]] | np.ndarray, prompts: str) -> Measure:
    """The model's accuracy gain over the first step, ``mean(o[s] - o[0])`` (``outcomes``: "step prompt")."""
    o = _steps_by_prompts(outcomes)
    return Measure(o - o[0], prompts)


def faithfulness(kept: np.ndarray, full: np.ndarray, prompts: str) -> Measure:
    """A circuit's faithfulness in each checkpoint: accuracy with it alone kept over the whole model's, shown
    where the whole model's accuracy is above the first checkpoint's."""
    full = _steps_by_prompts(full)
    return Measure(_steps_by_prompts(kept), prompts, full, prompts, above_first(full))


def share(patched: np.ndarray, own: np.ndarray, first: np.ndarray, prompts: str) -> Measure:
    """A component patched from each checkpoint into the first: its gain over the first's own accuracy as a share
    of the checkpoint's own gain, ``(patched - first) / (own - first)``, shown where that gain's interval is
    above 0 (all "step prompt"; ``first``: the first checkpoint's outcomes at every step)."""
    own, first = _steps_by_prompts(own), _steps_by_prompts(first)
    return Measure(_steps_by_prompts(patched) - first, prompts, own - first, prompts, above_first(own))


def over_accuracy(num: np.ndarray, prompts: str, accuracy: np.ndarray, accuracy_prompts: str) -> Measure:
    """A measure (e.g. semantic patching's target accuracy) over the checkpoint's own accuracy on other prompts,
    shown where that accuracy is above the first checkpoint's."""
    accuracy = _steps_by_prompts(accuracy)
    return Measure(_steps_by_prompts(num), prompts, accuracy, accuracy_prompts, above_first(accuracy))


def resample(sizes: dict[str, int], draws: int = DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """Per prompt set, ``draws`` resamples of its prompts with replacement (``"draw prompt"``), sets drawn
    independently in name order; every step and component reads the same draws."""
    rng = np.random.default_rng(seed)
    return {name: rng.integers(0, n, (draws, n)) for name, n in sorted(sizes.items())}


def _bounds(x: np.ndarray, confidence: float) -> tuple[float, float]:
    """Percentile interval of a discrete quantity (values of ``x`` itself; inf kept)."""
    alpha = (1 - confidence) / 2
    low, high = np.quantile(x, [alpha, 1 - alpha], method="inverted_cdf")
    return float(low), float(high)


def _step(x: float) -> Optional[int]:
    """A step as JSON: None where it is not reached by the last step (inf)."""
    return int(x) if np.isfinite(x) else None


def first_reaching(values: np.ndarray, steps: Sequence[int], q: float) -> np.ndarray:
    """Per column of ``values`` (``"step draw"``), the first step whose value reaches ``q`` times the last step's;
    inf where the last is not above 0 or not measured. A step not measured (nan) never reaches."""
    final = values[-1]
    with np.errstate(invalid="ignore"):
        reached = (values >= q * final) & (final > 0)
    first = np.argmax(reached, axis=0)
    return np.where(reached.any(0), np.asarray(steps, dtype=float)[first], np.inf)


@dataclass(frozen=True)
class Curve:
    """One component's measure at every step: the point estimate and ``"step draw"`` bootstrap values."""

    steps: tuple[int, ...]
    point: np.ndarray
    draws: np.ndarray
    n: int  # prompts of the numerator's set

    def interval(self, i: int, confidence: float = CONFIDENCE) -> Optional[dict]:
        """Step ``i``'s value with its percentile interval; None where it is not shown."""
        if np.isnan(self.point[i]):
            return None
        d = self.draws[i][np.isfinite(self.draws[i])]
        alpha = (1 - confidence) / 2
        low, high = np.quantile(d, [alpha, 1 - alpha]) if d.size else (self.point[i], self.point[i])
        return {"value": float(self.point[i]), "low": float(low), "high": float(high), "n": self.n}

    def per_step(self, confidence: float = CONFIDENCE) -> list[Optional[dict]]:
        """Every step's :meth:`interval`."""
        return [self.interval(i, confidence) for i in range(len(self.steps))]

    def formed(self, confidence: float = CONFIDENCE) -> bool:
        """Whether the final value's interval lies above 0."""
        final = self.interval(len(self.steps) - 1, confidence)
        return final is not None and final["low"] > 0

    def crossing(self, q: float) -> tuple[float, np.ndarray]:
        """The formation step at ``q`` (:func:`first_reaching`) of the point estimate and of each draw."""
        return first_reaching(self.point[:, None], self.steps, q)[0], first_reaching(self.draws, self.steps, q)

    def formation(self, q: float, confidence: float = CONFIDENCE) -> dict:
        """``{"q", "formed", "step", "low", "high", "unreached", "n"}``: the first step reaching ``q`` of the final
        value with its bootstrap interval (None: not by the last step), and the share of draws never reaching it.
        A component not formed (its final interval not above 0) has no step."""
        point, draws = self.crossing(q)
        low, high = _bounds(draws, confidence)
        formed = self.formed(confidence)
        return {
            "q": q,
            "formed": formed,
            "step": _step(point) if formed else None,
            "low": _step(low) if formed else None,
            "high": _step(high) if formed else None,
            "unreached": float(np.mean(~np.isfinite(draws))),
            "n": int(draws.size),
        }

    def of_final(self) -> "Curve":
        """The measure as a share of its final value (point and each draw by its own final)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return Curve(self.steps, self.point / self.point[-1], self.draws / self.draws[-1], self.n)


def curves(measures: dict[str, Measure], steps: Sequence[int], draws: int = DRAWS, seed: int = 0) -> dict[str, Curve]:
    """Every measure's :class:`Curve` on one set of draws (:func:`resample`): the same prompt indices at every
    step and for every component reading a prompt set."""
    sizes: dict[str, int] = {}
    for name, m in measures.items():
        if len(m.num) != len(steps) or (m.den is not None and len(m.den) != len(steps)):
            raise ValueError(f"{name}: a measure needs one row per step ({len(steps)})")
        for s, n in m.sets().items():
            if sizes.setdefault(s, n) != n:
                raise ValueError(f"prompt set {s!r} has {sizes[s]} prompts in one measure and {n} in {name}")
    idx = resample(sizes, draws, seed)
    plain: Indices = dict.fromkeys(sizes)
    return {name: Curve(tuple(steps), m.at(plain)[:, 0], m.at(idx), m.num.shape[1]) for name, m in measures.items()}


def order(a: Curve, b: Curve, q: float, confidence: float = CONFIDENCE) -> dict:
    """Paired comparison of two components' formation steps at ``q`` on the same draws: the difference
    ``step(a) - step(b)`` (inf where one does not reach ``q`` by the last step; a tie where neither does) with its
    percentile interval, the shares of draws where each comes first, and ``before``: ``"a"`` where the interval lies
    below 0, ``"b"`` above, None where it holds 0 or either component has not formed."""
    if a.draws.shape != b.draws.shape or a.steps != b.steps:
        raise ValueError("two curves compared must share the steps and the draws")
    (pa, da), (pb, db) = a.crossing(q), b.crossing(q)
    diff = _difference(da, db)
    low, high = _bounds(diff, confidence)
    point = float(_difference(np.array([pa]), np.array([pb]))[0])
    both = a.formed(confidence) and b.formed(confidence)
    return {
        "q": q,
        "difference": point,
        "low": low,
        "high": high,
        "a_first": float(np.mean(diff < 0)),
        "b_first": float(np.mean(diff > 0)),
        "before": ("a" if high < 0 else "b" if low > 0 else None) if both else None,
        "n": int(diff.size),
    }


def _difference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        d = x - y
    return np.where(np.isinf(x) & np.isinf(y), 0.0, d)
