"""When each component of a mechanism forms along a training run: on the change scale, with intervals over prompts
and every order a test in a Holm family.

A component's **level** at every step is a mean over one prompt set of its per-prompt outcomes, less a per-step
constant where one is known only as a figure (`Change`): the model's accuracy, a circuit's accuracy with it
alone kept, the first checkpoint's accuracy with a group patched in from the checkpoint (CMAP), a DCM selection's
patched target rate above its unpatched floor. Its **change** is the level less step 0's, and its **share** at a
step is that change over its own final change. A component forms (`change_curves`) where the change from
step 0 to the last step is shown (a paired test, Holm-adjusted across components); its step at ``q``
(`ChangeCurve.timing`) is the first step whose share reaches ``q``, and the step from which it stays there.
A decline (the final change below 0) is timed the same way on its loss: the first step where the loss reaches
``q`` of its final loss. Ratio measures (faithfulness over the checkpoint's own accuracy, a share of the
checkpoint's gain, `Measure`) are levels to show, never a formation timing: a component that tracks the
model sits near 1 at every step of a ratio and would "form" at the first step shown.

Censoring: a level first reached at the first checkpoint after step 0 was reached at or before that step
(left-censored); one not reached by the last step, after it (right-censored); `step_text` writes both.

Intervals are a bootstrap over prompts drawn jointly across steps (`resample`: the same indices serve every
step and every component reading a prompt set), so two components' steps in one draw are paired. At a step whose
0/1 outcomes are all 0 (or all 1) every resample gives the same mean, so there the draws are Jeffreys posterior
draws, Beta(k + 1/2, n - k + 1/2), and the step's own interval is exact (Clopper-Pearson). "A before B"
(`order_test`) is the paired bootstrap test of the difference of their steps (p twice the smaller share of
draws on either side, ties counted on both, +1 corrected), one test in the family "formation order" per pair and
level (`order_family`), Holm-adjusted: the smallest p of ``D`` draws is ``2 / (D + 1)``, so
`CHANGE_DRAWS` is set for a family of some hundred tests to be able to reject.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.stats import paired_difference

#: Bootstrap draws of the prompts for a ratio level (every prompt set, jointly across steps and components).
DRAWS = 1000
#: Bootstrap draws of the prompts on the change scale: enough that Holm over a family of ~200 order tests can reject.
CHANGE_DRAWS = 10000
#: The order tests' family (docs/inference.md) and the family of each component's change by the last step.
ORDER_FAMILY = "formation order"
CHANGE_FAMILY = "formation: change from step 0 to the last"
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


@dataclass(frozen=True)
class Curve:
    """A ratio measure's level at every step: the point estimate and ``"step draw"`` bootstrap values. A level
    only: formation is timed on the change scale (`ChangeCurve`), never on a ratio."""

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
        """Every step's `interval`."""
        return [self.interval(i, confidence) for i in range(len(self.steps))]


def curves(measures: dict[str, Measure], steps: Sequence[int], draws: int = DRAWS, seed: int = 0) -> dict[str, Curve]:
    """Every measure's `Curve` on one set of draws (`resample`): the same prompt indices at every
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


# --- the change scale --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """A component's level at every step, ``mean(x[s]) - offset[s]`` (``x``: "step prompt", the same prompts at
    every step; ``offset``: a per-step constant known only as a figure, e.g. an unpatched floor kept as a count),
    timed on its change from step 0."""

    x: np.ndarray
    prompts: str
    offset: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        x = _steps_by_prompts(self.x)
        if np.isnan(x).any():
            raise ValueError(f"{self.prompts}: a change needs an outcome at every step and prompt")
        if self.offset is not None and np.shape(self.offset) != (x.shape[0],):
            raise ValueError(
                f"{self.prompts}: an offset is one figure a step ({x.shape[0]}), got {np.shape(self.offset)}"
            )
        object.__setattr__(self, "x", x)

    def off(self) -> np.ndarray:
        """The per-step offset (zeros where none)."""
        return np.zeros(len(self.x)) if self.offset is None else np.asarray(self.offset, dtype=float)

    def levels(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The level at every step on the resampled prompts ``rows`` ("draw prompt"): ``"step draw"``; at a step
        whose 0/1 outcomes are all 0 or all 1, Jeffreys posterior draws instead (the resamples cannot vary)."""
        out = np.empty((len(self.x), len(rows)))
        for s, row in enumerate(self.x):
            k, n = float(row.sum()), row.size
            if _binary(row) and k in (0, n):
                out[s] = rng.beta(k + 0.5, n - k + 0.5, len(rows))
            else:
                out[s] = row[rows].mean(1)
        return out - self.off()[:, None]

    def level_interval(self, s: int) -> inf.Interval:
        """Step ``s``'s level with its interval over prompts (exact for 0/1 outcomes, bootstrap otherwise)."""
        iv = inf.mean(self.x[s])
        o = float(self.off()[s])
        return inf.Interval(iv.value - o, iv.low - o, iv.high - o, iv.n_rows, iv.n_items, iv.method)

    def final_test(self, claim: str) -> inf.Test:
        """The change from step 0 to the last step on the same prompts: exact McNemar for 0/1 outcomes with no
        offset to move, else the sign-flip test of the per-prompt change against the offset's change."""
        d_off = float(self.off()[-1] - self.off()[0])
        if d_off == 0:
            return inf.paired(self.x[-1], self.x[0], claim=claim)
        t = inf.sign_flip(self.x[-1] - self.x[0] - d_off, claim=claim)  # its mean: the change above the offset
        return inf.Test(claim, t.interval, t.p, t.method + " (the offset's change subtracted)")


def _binary(x: np.ndarray) -> bool:
    return bool(np.all((x == 0) | (x == 1)))


@dataclass(frozen=True)
class ChangeCurve:
    """One component's level at every step (point and ``"step draw"`` bootstrap values), read as its change from
    step 0 over its own final change; ``final``: the test of that final change."""

    steps: tuple[int, ...]
    level: np.ndarray
    draws: np.ndarray
    n: int
    final: inf.Test

    @property
    def direction(self) -> int:
        """+1 for a rise (the final change at or above 0), -1 for a decline."""
        return -1 if self.level[-1] < self.level[0] else 1

    def change(self) -> tuple[np.ndarray, np.ndarray]:
        """The change from step 0: point ("step") and draws ("step draw")."""
        return self.level - self.level[0], self.draws - self.draws[0]

    def share(self) -> tuple[np.ndarray, np.ndarray]:
        """The change as a share of the final change (point and draws; nan where the final change is 0)."""
        point, draws = self.change()
        with np.errstate(divide="ignore", invalid="ignore"):
            return point / point[-1] if point[-1] else point * np.nan, draws / draws[-1]

    def reached(self, q: float, change: np.ndarray) -> np.ndarray:
        """Per step and column of ``change`` ("step draw"), whether it reaches ``q`` of its own final change in this
        curve's direction (never, in a column whose final change is not in that direction)."""
        signed = change * self.direction
        return (signed >= q * signed[-1]) & (signed[-1] > 0)

    def timing(self, q: float) -> dict[str, tuple[float, np.ndarray]]:
        """``{"first": ..., "stays": ...}``: the first step reaching ``q`` of the final change, and the step from
        which every later step stays there; each as (point, draws), inf where never."""
        point, draws = self.change()
        out = {}
        for rule in ("first", "stays"):
            pick = _first if rule == "first" else _stays
            out[rule] = (pick(self.reached(q, point[:, None]), self.steps)[0], pick(self.reached(q, draws), self.steps))
        return out

    def share_interval(self, i: int, confidence: float = CONFIDENCE) -> Optional[dict]:
        """Step ``i``'s share of the final change with its bootstrap percentile interval (None: no final change)."""
        point, draws = self.share()
        if not np.isfinite(point[i]):
            return None
        d = draws[i][np.isfinite(draws[i])]
        low, high = np.quantile(d, [(1 - confidence) / 2, (1 + confidence) / 2]) if d.size else (point[i],) * 2
        return {"value": float(point[i]), "low": float(low), "high": float(high), "n": self.n}


def _first(reached: np.ndarray, steps: Sequence[int]) -> np.ndarray:
    """Per column, the first step reached (inf: none)."""
    first = np.argmax(reached, axis=0)
    return np.where(reached.any(0), np.asarray(steps, dtype=float)[first], np.inf)


def _stays(reached: np.ndarray, steps: Sequence[int]) -> np.ndarray:
    """Per column, the step from which every later step is reached (inf: the last is not)."""
    missed = ~reached
    last_missed = np.where(missed.any(0), len(steps) - 1 - np.argmax(missed[::-1], axis=0), -1)
    ok = last_missed + 1 < len(steps)
    return np.where(ok, np.asarray(steps, dtype=float)[np.minimum(last_missed + 1, len(steps) - 1)], np.inf)


def change_curves(
    changes: dict[str, Change], steps: Sequence[int], draws: int = CHANGE_DRAWS, seed: int = 0
) -> dict[str, ChangeCurve]:
    """Every component's `ChangeCurve` on one set of draws (`resample`): the same prompt indices at
    every step and for every component reading a prompt set."""
    sizes: dict[str, int] = {}
    for name, c in changes.items():
        if len(c.x) != len(steps):
            raise ValueError(f"{name}: a change needs one row per step ({len(steps)}), got {len(c.x)}")
        if sizes.setdefault(c.prompts, c.x.shape[1]) != c.x.shape[1]:
            raise ValueError(
                f"prompt set {c.prompts!r} has {sizes[c.prompts]} prompts in one component and {c.x.shape[1]} in {name}"
            )
    if len(steps) < 2:
        raise ValueError("formation needs step 0 and at least one later step")
    idx = resample(sizes, draws, seed)
    out = {}
    for i, (name, c) in enumerate(changes.items()):
        rng = np.random.default_rng([seed, i])
        level = c.x.mean(1) - c.off()
        test = c.final_test(f"{name}: change from step {steps[0]} to step {steps[-1]}")
        out[name] = ChangeCurve(tuple(steps), level, c.levels(idx[c.prompts], rng), c.x.shape[1], test)
    return out


def change_family(curves: dict[str, ChangeCurve]) -> inf.Family:
    """Each component's change from step 0 to the last, one test each, in `CHANGE_FAMILY`."""
    fam = inf.Family(CHANGE_FAMILY)
    for c in curves.values():
        fam.add(c.final)
    return fam


def _bounds(x: np.ndarray, confidence: float) -> tuple[float, float]:
    """Percentile interval of a discrete quantity (values of ``x`` itself; inf kept)."""
    alpha = (1 - confidence) / 2
    low, high = np.quantile(x, [alpha, 1 - alpha], method="inverted_cdf")
    return float(low), float(high)


def _difference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x - y`` of two steps, a tie (0) where neither is reached."""
    with np.errstate(invalid="ignore"):
        d = x - y
    return np.where(np.isinf(x) & np.isinf(y), 0.0, d)


def order_test(
    names: tuple[str, str], a: ChangeCurve, b: ChangeCurve, q: float, confidence: float = CONFIDENCE
) -> inf.Test:
    """Whether ``a`` and ``b`` first reach ``q`` of their own final change at different steps: the paired bootstrap
    of ``step(a) - step(b)`` on the same draws, its percentile interval and p (twice the smaller share of draws
    at or below 0 and at or above 0, +1 corrected: a tie in every draw gives p = 1)."""
    if a.draws.shape != b.draws.shape or a.steps != b.steps:
        raise ValueError("two curves compared must share the steps and the draws")
    (pa, da), (pb, db) = a.timing(q)["first"], b.timing(q)["first"]
    diff = _difference(da, db)
    low, high = _bounds(diff, confidence)
    tail = min(int((diff <= 0).sum()), int((diff >= 0).sum()))
    p = min(1.0, 2 * (tail + 1) / (diff.size + 1))
    value = float(_difference(np.array([pa]), np.array([pb]))[0])
    n = min(a.n, b.n)
    iv = inf.Interval(value, low, high, n, n, f"paired bootstrap over prompts ({diff.size} draws, joint across steps)")
    return inf.Test(f"{names[0]} vs {names[1]} at {q:.0%}", iv, p, "paired bootstrap (percentile p)")


def first_of(test: inf.Test, names: tuple[str, str]) -> Optional[str]:
    """The component a shown order test puts first (the side of 0 its estimate lies on); None: not ordered."""
    if not test.rejects or test.interval.value == 0:
        return None
    return names[0] if test.interval.value < 0 else names[1]


def order_family(
    curves: dict[str, ChangeCurve], formed: Sequence[str], levels: Sequence[float] = LEVELS
) -> tuple[inf.Family, list[tuple[str, str, float]]]:
    """Every two formed components at every level, one test each in `ORDER_FAMILY`; with the (a, b, level)
    of each test in the family's order."""
    fam, keys = inf.Family(ORDER_FAMILY), []
    for q in levels:
        for i, a in enumerate(formed):
            for b in formed[i + 1 :]:
                fam.add(order_test((a, b), curves[a], curves[b], q))
                keys.append((a, b, q))
    return fam, keys


def step_text(x: float, steps: Sequence[int]) -> Any:
    """A formation step as written: ``"at or before step N"`` at the first checkpoint after step 0 (left-censored),
    ``"after step <last>"`` where never reached (right-censored), else the step."""
    if not np.isfinite(x):
        return f"after step {steps[-1]}"
    if len(steps) > 1 and int(x) == steps[1]:
        return f"at or before step {steps[1]}"
    return int(x)
