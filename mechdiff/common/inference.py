"""How a finding is decided: one rule per kind of claim, each defined here once (docs/inference.md).

Every interval over prompts resamples *items* (an item is a clean prompt by default, or a field a task names: all
rows of one item move together), never rows that repeat one prompt. The rules:

- a proportion: Clopper-Pearson where every item has one row; with several rows an item, the cluster bootstrap's
  percentile interval widened to the exact interval of the item count (so a zero count never collapses to a point);
- a mean or a ratio of means (faithfulness): the cluster bootstrap over items;
- a paired difference of 0/1 outcomes with one row an item: the exact McNemar test (conditional on the discordant
  pairs; Agresti 2013, 11.1) with the hull of Tango's score interval (Tango 1998) and the conditional exact interval,
  so the interval excludes 0 only where the exact test rejects;
- any other paired difference (continuous, or clustered): the sign-flip permutation test over items (exact where
  few items differ) with the interval that inverts it;
- a difference of two ratios on the same prompts: the paired cluster bootstrap with its percentile p;
- a statistic of the items that is no mean of rows (an overlap of top-n sets, `recentred`): the statistic
  recomputed on each cluster resample (`cluster_resamples`), its percentile interval moved to the estimate;
- an intervention against random draws of its kind: the rank among the draws with its +1-corrected empirical p,
  the draws' interval resampling draws and items both;
- a statistic of a few independent units (runs of one recipe, each another seed) that no unit's rows carry alone (a
  mean over every two runs): the leave-one-unit-out jackknife (Efron and Stein 1981) with Student's t on units - 1
  degrees of freedom (`jackknife`);
- sameness: two one-sided tests (Schuirmann 1987) against a stated margin;
- a family of claims: Holm's step-down (Holm 1979) within the family.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

ALPHA = 0.05
N_RESAMPLES = 2000
N_PERMUTATIONS = 9999
EXACT_FLIPS = 16  # enumerate every sign pattern up to 2**16 items that differ
POWER = 0.8


@dataclass(frozen=True)
class Interval:
    """A figure with its interval, over ``n_rows`` rows in ``n_items`` items, and how it was made."""

    value: float
    low: float
    high: float
    n_rows: int
    n_items: int
    method: str

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def excludes(self, null: float = 0.0) -> bool:
        """Whether the interval leaves ``null`` out."""
        return not (self.low <= null <= self.high)

    def to_dict(self, detail: bool = False) -> dict:
        """As a stage record or table keeps it: ``value``, ``low``, ``high`` and ``n`` (rows); with ``detail`` also
        ``items`` and ``method``."""
        out = {"value": self.value, "low": self.low, "high": self.high, "n": self.n_rows}
        return {**out, "items": self.n_items, "method": self.method} if detail else out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Interval":
        """An interval back from its `to_dict`; a record without ``items`` counts each row an item, one
        without ``method`` names none."""
        return cls(d["value"], d["low"], d["high"], d["n"], d.get("items", d["n"]), d.get("method", ""))


@dataclass(frozen=True)
class Test:
    """One claim as a test: its estimate and interval, its p, and (once its family is adjusted) Holm's p."""

    claim: str
    interval: Interval
    p: float
    method: str
    family: str = ""
    p_adjusted: Optional[float] = None
    discordant: Optional[tuple[int, int]] = None

    @property
    def rejects(self) -> bool:
        """Whether the claim survives its family's adjustment (its raw p where it was never adjusted)."""
        p = self.p if self.p_adjusted is None else self.p_adjusted
        return p <= ALPHA

    def row(self) -> dict:
        """A table row: claim, estimate, interval, p, adjusted p, method, rows and items."""
        iv = self.interval
        return {
            "family": self.family,
            "claim": self.claim,
            "estimate": iv.value,
            "low": iv.low,
            "high": iv.high,
            "p": self.p,
            "p_holm": self.p_adjusted,
            "shown": self.rejects,
            "method": self.method,
            "rows": iv.n_rows,
            "items": iv.n_items,
        }


# --- items -------------------------------------------------------------------------------------------------------


def item_index(items: Optional[Sequence] = None, n: Optional[int] = None) -> np.ndarray:
    """Items as integers 0..k-1 aligned with rows; each row its own item where ``items`` is None."""
    if items is None:
        if n is None:
            raise ValueError("item_index needs the items or the row count")
        return np.arange(n)
    _, idx = np.unique(np.asarray(items, dtype=object).astype(str), return_inverse=True)
    if n is not None and idx.size != n:
        raise ValueError(f"{idx.size} item ids for {n} rows: give one item id per row")
    return idx.ravel()


def item_sums(values: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-item sums of ``values`` and per-item row counts."""
    k = int(idx.max()) + 1 if idx.size else 0
    return np.bincount(idx, weights=values, minlength=k), np.bincount(idx, minlength=k).astype(float)


def _binary(x: np.ndarray) -> bool:
    return bool(np.all((x == 0) | (x == 1)))


def _cluster_draws(idx: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Counts of each item in each resample (``resample item``): the cluster bootstrap's weights."""
    k = int(idx.max()) + 1
    picks = np.random.default_rng(seed).integers(0, k, size=(n_resamples, k))
    flat = (np.arange(n_resamples)[:, None] * k + picks).ravel()
    return np.bincount(flat, minlength=n_resamples * k).reshape(n_resamples, k).astype(float)


def cluster_resamples(n_items: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """The cluster bootstrap's resamples of ``n_items`` items as counts (``resample item``): how often each item is
    drawn, for a statistic recomputed on each resample rather than read off weighted sums."""
    if n_items < 1 or n_resamples < 1:
        raise ValueError(f"resampling needs at least one item and one resample; got {n_items} and {n_resamples}")
    return _cluster_draws(np.arange(n_items), n_resamples, seed)


def recentred(draws: np.ndarray, value: float, confidence: float = 0.95) -> tuple[float, float]:
    """The percentile interval of a statistic's resampled ``draws``, moved so that their median sits at ``value``.

    For a statistic whose resamples are biased by the items they repeat: two top-n sets found on halves of a
    resample that repeats items overlap less than on as many distinct items, a shift of the whole distribution
    that the percentile interval would carry (the draws' spread is kept, their location taken from the
    estimate)."""
    d = np.asarray(draws, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return float("nan"), float("nan")
    return _percentile(d - float(np.median(d)) + value, confidence)


def jackknife(stat: Any, units: Sequence[Any], confidence: float = 0.95, min_units: int = 3) -> dict[str, Any]:
    """``stat(units)`` with its interval over the units: the leave-one-out jackknife's standard error
    (``sqrt((k - 1) / k * sum((stat_-i - mean)^2))``) and Student's t on k - 1 degrees of freedom, with a two-sided
    t test of 0 (``p``). For a statistic of several independent units, such as a mean overlap over every two runs
    of a recipe, where resampling units with replacement would pair a run with itself. With fewer than
    ``min_units`` units (a statistic of two runs has no leave-one-out value) the interval and p are None."""
    units = list(units)
    k, value = len(units), float(stat(units))
    out: dict[str, Any] = {"value": value, "low": None, "high": None, "se": None, "p": None, "units": k}
    if k < min_units:
        return out
    loo = np.array([float(stat(units[:i] + units[i + 1 :])) for i in range(k)])
    se = float(np.sqrt((k - 1) / k * np.sum((loo - loo.mean()) ** 2)))
    t = float(sps.t.ppf(0.5 + confidence / 2, k - 1))
    p = float(2 * sps.t.sf(abs(value) / se, k - 1)) if se > 0 else float(value == 0)
    return out | {"low": value - t * se, "high": value + t * se, "se": se, "p": p}


def _percentile(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    draws = draws[np.isfinite(draws)]
    a = (1 - confidence) / 2
    return (float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))) if draws.size else (np.nan, np.nan)


# --- one quantity ------------------------------------------------------------------------------------------------


def beta_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson's Beta quantiles, for a (possibly effective, non-integer) count of ``successes`` in ``n``."""
    a = (1 - confidence) / 2
    low = 0.0 if successes <= 0 else float(sps.beta.ppf(a, successes, n - successes + 1))
    high = 1.0 if successes >= n else float(sps.beta.ppf(1 - a, successes + 1, n - successes))
    return low, high


def proportion(
    outcomes: Sequence[float], items: Optional[Sequence] = None, confidence: float = 0.95, seed: int = 0
) -> Interval:
    """A proportion of 0/1 outcomes over items: exact where each item has one row; else the cluster bootstrap
    widened to the exact interval of as many items (0 of 24 rows in 12 items: [0, 0.265])."""
    x = np.asarray(outcomes, dtype=float).ravel()
    if x.size == 0 or not _binary(x):
        raise ValueError("proportion() takes at least one 0/1 outcome; use mean() for other values")
    idx = item_index(items, x.size)
    k, value = int(idx.max()) + 1, float(x.mean())
    if k == x.size:
        low, high = beta_interval(x.sum(), x.size, confidence)
        return Interval(value, low, high, x.size, k, "exact (Clopper-Pearson)")
    sums, counts = item_sums(x, idx)
    w = _cluster_draws(idx, N_RESAMPLES, seed)
    lo_b, hi_b = _percentile((w @ sums) / (w @ counts), confidence)
    lo_e, hi_e = beta_interval(value * k, k, confidence)
    return Interval(value, min(lo_b, lo_e), max(hi_b, hi_e), x.size, k, "cluster bootstrap over items, exact hull")


def mean(
    values: Sequence[float], items: Optional[Sequence] = None, confidence: float = 0.95, seed: int = 0
) -> Interval:
    """A mean over rows, its interval from the cluster bootstrap over items (a proportion goes to
    `proportion`)."""
    x = np.asarray(values, dtype=float).ravel()
    if x.size and _binary(x):
        return proportion(x, items, confidence, seed)
    return ratio(x, np.ones_like(x), items, confidence, seed, method="cluster bootstrap over items")


def ratio(
    num: Sequence[float],
    den: Sequence[float],
    items: Optional[Sequence] = None,
    confidence: float = 0.95,
    seed: int = 0,
    method: str = "cluster bootstrap over items (ratio of means)",
) -> Interval:
    """mean(num) / mean(den) over the same rows (e.g. faithfulness), resampling items jointly."""
    a, b = np.asarray(num, dtype=float).ravel(), np.asarray(den, dtype=float).ravel()
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"a ratio needs the same non-empty rows; got {a.shape} and {b.shape}")
    idx = item_index(items, a.size)
    k = int(idx.max()) + 1
    value = float(a.sum() / b.sum()) if b.sum() else float("nan")
    if k < 2 or (np.all(a == a[0]) and np.all(b == b[0])):
        return Interval(value, value, value, a.size, k, method)
    sa, sb = item_sums(a, idx)[0], item_sums(b, idx)[0]
    w = _cluster_draws(idx, N_RESAMPLES, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        low, high = _percentile((w @ sa) / (w @ sb), confidence)
    return Interval(value, low, high, a.size, k, method)


# --- paired differences ------------------------------------------------------------------------------------------


def mcnemar(a: Sequence[float], b: Sequence[float]) -> tuple[float, int, int]:
    """The exact McNemar test of two 0/1 outcomes on the same rows: ``(p, a only, b only)``, two-sided,
    conditional on the discordant pairs."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n10, n01 = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    p = 1.0 if n10 + n01 == 0 else float(sps.binomtest(n10, n10 + n01, 0.5).pvalue)
    return p, n10, n01


def tango_interval(n10: int, n01: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Tango's (1998) score interval for p10 - p01, the difference of two paired proportions."""
    z = sps.norm.ppf(1 - (1 - confidence) / 2)

    def score(d0: float) -> float:
        a_, b_ = 2 * n, -n10 - n01 + (2 * n - n10 + n01) * d0
        c_ = -n01 * d0 * (1 - d0)
        q21 = (np.sqrt(max(b_ * b_ - 4 * a_ * c_, 0.0)) - b_) / (2 * a_)
        var, num = n * (2 * q21 + d0 * (1 - d0)), n10 - n01 - n * d0
        return num / np.sqrt(var) if var > 0 else (0.0 if num == 0 else np.inf * np.sign(num))

    est, eps = (n10 - n01) / n, 1e-12
    low = -1.0 if score(-1 + eps) <= z else optimize.brentq(lambda d: score(d) - z, -1 + eps, est)
    high = 1.0 if score(1 - eps) >= -z else optimize.brentq(lambda d: score(d) + z, est, 1 - eps)
    return float(low), float(high)


def _exact_paired(x: np.ndarray, y: np.ndarray, claim: str, confidence: float) -> Test:
    p, n10, n01 = mcnemar(x, y)
    n = x.size
    t_low, t_high = tango_interval(n10, n01, n, confidence)
    d = n10 + n01
    c_low, c_high = beta_interval(n10, d, confidence) if d else (0.5, 0.5)
    low, high = min(t_low, d / n * (2 * c_low - 1)), max(t_high, d / n * (2 * c_high - 1))
    iv = Interval((n10 - n01) / n, low, high, n, n, "exact McNemar; Tango score interval hulled with the exact one")
    return Test(claim, iv, p, "exact McNemar", discordant=(n10, n01))


def _flip_matrix(k: int, seed: int) -> tuple[np.ndarray, bool]:
    """Sign patterns over ``k`` items: all of them where ``k <= EXACT_FLIPS`` (exact), else random ones."""
    if k <= EXACT_FLIPS:
        return np.array(list(itertools.product((1.0, -1.0), repeat=k))).reshape(-1, k), True
    rng = np.random.default_rng(seed)
    return rng.choice((1.0, -1.0), size=(N_PERMUTATIONS, k)), False


def _flip_p(stat: np.ndarray, observed: float, exact: bool) -> float:
    hits = int((np.abs(stat) >= abs(observed) - 1e-12 * max(1.0, abs(observed))).sum())
    return hits / stat.size if exact else (hits + 1) / (stat.size + 1)


def sign_flip(
    diff: Sequence[float], items: Optional[Sequence] = None, claim: str = "", confidence: float = 0.95, seed: int = 0
) -> Test:
    """The sign-flip permutation test of mean(diff) = 0, flipping whole items, and the interval that inverts it
    (the shifts it does not reject, sharing one set of sign patterns)."""
    d = np.asarray(diff, dtype=float).ravel()
    idx = item_index(items, d.size)
    sums, counts = item_sums(d, idx)
    value = float(d.mean())
    nz = sums != 0
    flips, exact = _flip_matrix(int(nz.sum()), seed) if nz.any() else (np.ones((1, 0)), True)
    p = _flip_p(flips @ sums[nz], sums.sum(), exact) if nz.any() else 1.0
    low, high = _inverted(sums, counts, value, confidence, seed)
    if p > 1 - confidence:  # the interval never excludes 0 where the test does not reject
        low, high = min(low, 0.0), max(high, 0.0)
    method = "sign-flip permutation over items" + (" (exact)" if exact else f" ({N_PERMUTATIONS} flips)")
    iv = Interval(value, low, high, d.size, int(counts.size), method + ", inverted for the interval")
    return Test(claim, iv, p, method)


def _inverted(sums: np.ndarray, counts: np.ndarray, value: float, confidence: float, seed: int) -> tuple[float, ...]:
    """The shifts delta whose test of items' ``sums - delta * counts`` does not reject."""
    k = counts.size
    means = sums / counts
    if k < 2 or np.all(means == means[0]):
        return value, value
    flips, exact = _flip_matrix(k, seed + 1)
    fs, fc = flips @ sums, flips @ counts
    alpha = 1 - confidence

    def p_at(delta: float) -> float:
        return _flip_p(fs - delta * fc, sums.sum() - delta * counts.sum(), exact)

    def bound(inside: float, outside: float) -> float:
        if p_at(outside) > alpha:
            return outside
        for _ in range(50):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if p_at(mid) > alpha else (inside, mid)
        return inside

    span = float(means.max() - means.min())
    return bound(value, float(means.min()) - span), bound(value, float(means.max()) + span)


def paired(
    a: Sequence[float],
    b: Sequence[float],
    items: Optional[Sequence] = None,
    claim: str = "",
    confidence: float = 0.95,
    seed: int = 0,
) -> Test:
    """The test of mean(a - b) = 0 on the same rows, by the rule that fits the data: exact McNemar for 0/1
    outcomes with one row an item, the clustered sign-flip test otherwise."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired values need the same non-empty rows; got {x.shape} and {y.shape}")
    idx = item_index(items, x.size)
    if _binary(x) and _binary(y) and int(idx.max()) + 1 == x.size:
        return _exact_paired(x, y, claim, confidence)
    return sign_flip(x - y, idx, claim, confidence, seed)


def paired_ratio(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    items: Optional[Sequence] = None,
    claim: str = "",
    confidence: float = 0.95,
    seed: int = 0,
) -> Test:
    """mean(num_a)/mean(den_a) - mean(num_b)/mean(den_b) on the same rows: the paired cluster bootstrap, its
    percentile interval and the p that agrees with it (twice the smaller share of resamples beyond 0)."""
    arrs = [np.asarray(v, dtype=float).ravel() for v in (num_a, den_a, num_b, den_b)]
    if len({v.shape for v in arrs}) != 1:
        raise ValueError(f"paired ratios need the same rows; got shapes {[v.shape for v in arrs]}")
    idx = item_index(items, arrs[0].size)
    sums = [item_sums(v, idx)[0] for v in arrs]
    with np.errstate(divide="ignore", invalid="ignore"):
        value = float(sums[0].sum() / sums[1].sum() - sums[2].sum() / sums[3].sum())
        w = _cluster_draws(idx, N_RESAMPLES, seed)
        draws = (w @ sums[0]) / (w @ sums[1]) - (w @ sums[2]) / (w @ sums[3])
    draws = draws[np.isfinite(draws)]
    low, high = _percentile(draws, confidence)
    tail = min(int((draws <= 0).sum()), int((draws >= 0).sum()))
    p = min(1.0, 2 * (tail + 1) / (draws.size + 1)) if draws.size else 1.0
    iv = Interval(value, low, high, arrs[0].size, int(idx.max()) + 1, "paired cluster bootstrap over items")
    return Test(claim, iv, float(p), "paired cluster bootstrap (percentile p)")


# --- sameness ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests of |mean(a - b)| < margin: ``p`` is the larger one-sided p; ``shown`` where it is at
    most alpha, i.e. the (1 - 2 alpha) interval lies inside (-margin, margin)."""

    claim: str
    margin: float
    value: float
    low: float
    high: float
    p: float

    @property
    def shown(self) -> bool:
        """Whether sameness within the margin is shown."""
        return self.p <= ALPHA


MARGINS: dict[str, float] = {"accuracy": 0.05, "probability": 0.05, "faithfulness": 0.05, "logit difference": 0.5}
"""The default equivalence margin of each kind of measure, the one definition; a task file's ``[inference]
margins`` sets others (`margins_of`), read by the report and ``mechdiff restate``, never by a stage key."""


def margins_of(given: Optional[Mapping[str, Any]] = None) -> dict[str, float]:
    """The equivalence margins: `MARGINS` with ``given`` (measure -> margin, ``_`` read as a space:
    ``logit_difference``) over them; an unknown measure or a margin that is not a number above 0 is refused, naming
    the measures."""
    out = dict(MARGINS)
    for name, value in (given or {}).items():
        measure = str(name).replace("_", " ")
        if measure not in MARGINS:
            known = ", ".join(m.replace(" ", "_") for m in MARGINS)
            raise ValueError(f"unknown measure {name!r} in margins; the measures are {known}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"margins: {name} = {value!r}; give a number above 0 (the default is {MARGINS[measure]})")
        out[measure] = float(value)
    return out


def equivalence(
    a: Sequence[float], b: Sequence[float], margin: float, items: Optional[Sequence] = None, claim: str = ""
) -> Equivalence:
    """Sameness within ``margin``: for 0/1 outcomes one row an item, the interval inclusion principle on the exact
    paired interval (shown where its 1 - 2 alpha interval lies inside the margin; ``p`` the smallest such alpha);
    otherwise Schuirmann's two one-sided t tests on the per-item mean difference (items weighted by their rows:
    the ratio estimator's linearised standard error, ``k - 1`` degrees of freedom)."""
    if margin <= 0:
        raise ValueError("an equivalence margin must be above 0")
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    idx = item_index(items, x.size)
    k = int(idx.max()) + 1 if idx.size else 0
    if k < 2:
        raise ValueError("an equivalence test needs at least two items")
    if _binary(x) and _binary(y) and k == x.size:
        return _exact_equivalence(x, y, margin, claim)
    sums, counts = item_sums(x - y, idx)
    value = float((x - y).mean())
    resid = sums - value * counts
    se = float(np.sqrt(k / (k - 1) * (resid**2).sum()) / counts.sum())
    t = sps.t(k - 1)
    if se == 0:
        p = 0.0 if abs(value) < margin else 1.0
    else:
        p = float(max(t.sf((value + margin) / se), t.cdf((value - margin) / se)))
    q = t.ppf(1 - ALPHA)
    return Equivalence(claim, margin, value, float(value - q * se), float(value + q * se), p)


def _exact_equivalence(x: np.ndarray, y: np.ndarray, margin: float, claim: str) -> Equivalence:
    def inside(alpha: float) -> bool:
        iv = _exact_paired(x, y, claim, 1 - 2 * alpha).interval
        return -margin < iv.low and iv.high < margin

    iv = _exact_paired(x, y, claim, 1 - 2 * ALPHA).interval
    if not inside(0.5 - 1e-9):
        return Equivalence(claim, margin, iv.value, iv.low, iv.high, 1.0)
    lo, hi = 1e-9, 0.5 - 1e-9  # the smallest alpha whose interval lies inside the margin
    if inside(lo):
        return Equivalence(claim, margin, iv.value, iv.low, iv.high, lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if inside(mid) else (mid, hi)
    return Equivalence(claim, margin, iv.value, iv.low, iv.high, hi)


# --- controls ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlRank:
    """An intervention against random draws of its kind on the same rows."""

    value: float
    draws: Interval
    rank: int  # draws scoring at least ``value``
    n_draws: int
    p: float  # (1 + rank) / (1 + n_draws)
    quantiles: tuple[float, float, float]  # the draws' 5th, 50th and 95th percentiles


def control_rank(
    value_rows: Sequence[float],
    draw_rows: Sequence[Sequence[float]],
    items: Optional[Sequence] = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> ControlRank:
    """The circuit's rank among random draws (``draw row``) on the same rows, its empirical p with the +1
    correction, and the draws' mean with an interval resampling draws and items both."""
    v = np.asarray(value_rows, dtype=float).ravel()
    d = np.asarray(draw_rows, dtype=float)
    if d.ndim != 2 or d.shape[1] != v.size or d.shape[0] == 0:
        raise ValueError(f"draws must be (draws, {v.size}) rows; got {d.shape}")
    idx = item_index(items, v.size)
    per_draw = d.mean(1)
    rank = int((per_draw >= v.mean() - 1e-12).sum())
    sums = np.stack([item_sums(row, idx)[0] for row in d])  # "draw item"
    counts = item_sums(v, idx)[1]
    rng = np.random.default_rng(seed)
    w = _cluster_draws(idx, N_RESAMPLES, seed)
    picks = rng.integers(0, d.shape[0], size=(N_RESAMPLES, d.shape[0]))
    means = np.einsum("ri,ri->r", w, sums[picks].mean(1)) / (w @ counts)
    low, high = _percentile(means, confidence)
    iv = Interval(float(d.mean()), low, high, v.size, counts.size, "bootstrap over draws and items")
    q = tuple(float(x) for x in np.quantile(per_draw, [0.05, 0.5, 0.95]))
    return ControlRank(float(v.mean()), iv, rank, d.shape[0], (1 + rank) / (1 + d.shape[0]), q)


def control_ratio(
    draw_rows: Sequence[Sequence[float]],
    den_rows: Optional[Sequence[float]] = None,
    items: Optional[Sequence] = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The random draws' mean over draws and rows divided by mean(``den_rows``) (None: no denominator), e.g. the
    draws' faithfulness against the model's outcomes on the same rows, its interval resampling draws and items
    both (the resamples of `control_rank` with the same seed, so without a denominator its interval)."""
    d = np.asarray(draw_rows, dtype=float)
    den = np.ones(d.shape[-1]) if den_rows is None else np.asarray(den_rows, dtype=float).ravel()
    if d.ndim != 2 or d.shape[1] != den.size or d.shape[0] == 0:
        raise ValueError(f"draws must be (draws, {den.size}) rows; got {d.shape}")
    idx = item_index(items, den.size)
    sums = np.stack([item_sums(row, idx)[0] for row in d])  # "draw item"
    den_sums = item_sums(den, idx)[0]
    rng = np.random.default_rng(seed)
    w = _cluster_draws(idx, N_RESAMPLES, seed)
    picks = rng.integers(0, d.shape[0], size=(N_RESAMPLES, d.shape[0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        value = float(d.mean() / den.mean()) if den.mean() else float("nan")
        low, high = _percentile(np.einsum("ri,ri->r", w, sums[picks].mean(1)) / (w @ den_sums), confidence)
    return Interval(value, low, high, den.size, den_sums.size, "bootstrap over draws and items")


# --- families ----------------------------------------------------------------------------------------------------


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    adj = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out


@dataclass
class Family:
    """A named family of claims, adjusted together by Holm's step-down."""

    name: str
    tests: list[Test] = field(default_factory=list)

    def add(self, test: Test) -> Test:
        """Add a test to the family (its adjusted p is set by `adjusted`)."""
        self.tests.append(replace(test, family=self.name))
        return self.tests[-1]

    def adjusted(self) -> list[Test]:
        """The family's tests with Holm's adjusted p."""
        adj = holm([t.p for t in self.tests]) if self.tests else []
        return [replace(t, p_adjusted=float(a)) for t, a in zip(self.tests, adj)]

    def rows(self) -> list[dict]:
        """One table row a test, adjusted."""
        return [t.row() for t in self.adjusted()]


def verdict(test: Test, higher: str = "higher", lower: str = "lower") -> str:
    """A sentence fragment that says only what the adjusted test carries."""
    iv = test.interval
    ci = f"{iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"
    p = test.p if test.p_adjusted is None else test.p_adjusted
    pname = "p" if test.p_adjusted is None else "Holm p"
    if test.rejects:
        return f"{ci}, {higher if iv.value > 0 else lower} ({pname} = {p:.2g})"
    return f"{ci}, not shown ({pname} = {p:.2g})"


# --- planning ----------------------------------------------------------------------------------------------------


def detectable_difference(n_items: int, kind: str = "paired", discordance: float = 0.2) -> float:
    """The smallest true difference a two-sided test at ALPHA detects with POWER on ``n_items`` items (normal
    approximation): ``"paired"`` for a paired proportion difference with the stated discordance rate
    (Connor 1987), ``"proportion"`` for one proportion against a fixed value at 0.5."""
    if n_items < 1:
        raise ValueError("a detectable difference needs at least one item")
    z = sps.norm.ppf(1 - ALPHA / 2) + sps.norm.ppf(POWER)
    if kind == "paired":
        return float(z * np.sqrt(discordance / n_items))
    if kind == "proportion":
        return float(z * 0.5 / np.sqrt(n_items))
    raise ValueError(f"kind must be 'paired' or 'proportion', not {kind!r}")
