"""Activation-patching scans: the effect of patching each component alone, as a [layer, head] or
[layer, position] grid (TransformerLens's patching helpers, on suffix runs).

``scan(model, clean, source, answer_ids, site=..., positions=...)`` patches, one component at a
time, the source run's activation into the clean run and measures a named metric at the last
position. Sites:

- ``z`` / ``q``: one query head's slice, at one position per example (``positions``: ``"last"``,
  an int or a LongTensor ``[batch]``) or at every position (``positions=None``) -> ``[layer, head]``.
- ``k`` / ``v``: one KV group's slice (grouped-query attention: every head of the group reads it);
  each head's cell holds its group's effect -> ``[layer, head]``.
- ``resid``: the residual stream entering block ``layer`` (the embedding output at layer 0) at one
  position, every position in turn (or the ints in ``positions``) -> ``[layer, position]``.

Answers of several tokens are teacher-forced (``continuations=``, `Continuations`):
each prompt's answers (and, under ``logit_diff``, its alternatives) are stacked rows that run the prompt with the
answer's tokens but its last appended; components are patched at the prompt's positions only and the metric is the
answer's probability (the product of its tokens') or its summed log-probability minus the alternatives' mean.

Components are stacked along the batch (``per_pass`` copies of the prompts per forward pass); each
pass resumes at its lowest layer from the clean residual stream and runs only the positions from
its earliest patched one on, over the clean run's key/value cache. No per-component Python loop
runs inside a pass: each copy's component is selected by a 0/1 mask (exact: ``x*1 + y*0 = x``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from einops import repeat

from ..common.metrics import answer_logit, answer_prob, logit_diff, metric_name
from ..models.loading import LoadedModel
from ..models.remote import keep
from .core import EMB_LAYER, Continuations, Patch, Resume, continuations, run

HEAD_SITES = ("z", "q", "k", "v")
SITES = (*HEAD_SITES, "resid")
DEFAULT_PER_PASS = 32


def _logit_diff(logits: torch.Tensor, answer_ids: torch.Tensor, other_ids: Optional[torch.Tensor]) -> torch.Tensor:
    if other_ids is None:
        raise ValueError("metric logit_diff needs other_ids (the alternative answer of each prompt)")
    return logit_diff(logits, answer_ids, other_ids)


# metric name -> (per-example function of (logits, answer_ids, other_ids), what it measures)
METRICS: dict[str, tuple[Callable, str]] = {
    "prob": (lambda logits, a, o: answer_prob(logits, a), "probability of the answer"),
    "answer_logit": (lambda logits, a, o: answer_logit(logits, a), "logit of the answer"),
    "logit_diff": (_logit_diff, "logit of the answer minus logit of the alternative"),
}

# metric name -> what it measures where answers have several tokens (teacher-forced)
FORCED_LABELS = {
    "prob": "probability of the answer (the product of its tokens')",
    "logit_diff": "summed log-probability of the answer minus the alternatives'",
}

Positions = Union[str, int, torch.Tensor, Sequence[int], None]


@dataclass
class ScanResult:
    """Effects of patching each component alone: ``metric(patched) - metric(clean)``, batch means."""

    effects: torch.Tensor  # "layer head" or "layer position"
    site: str
    metric: str
    axes: tuple[str, str]
    clean: float  # the metric of the clean run
    source: float  # the metric of the source run
    positions: list = field(default_factory=list)  # the position axis (resid) or each example's position
    forced: bool = False  # answers of several tokens, teacher-forced

    @property
    def label(self) -> str:
        what = FORCED_LABELS[self.metric] if self.forced else METRICS[self.metric][1]
        return f"change in {what} ({self.metric})"

    def to_dict(self) -> dict:
        return {
            "site": self.site,
            "metric": self.metric,
            "label": self.label,
            "axes": list(self.axes),
            "clean": self.clean,
            "source": self.source,
            "positions": self.positions,
            "effects": self.effects.tolist(),
        }


def scan(
    model: LoadedModel,
    clean: torch.Tensor,
    source: torch.Tensor,
    answer_ids: torch.Tensor,
    site: str = "z",
    positions: Positions = "last",
    metric: str = "prob",
    other_ids: Optional[torch.Tensor] = None,
    per_pass: int = DEFAULT_PER_PASS,
    forced: Optional[Continuations] = None,
) -> ScanResult:
    """Patch each component of ``site`` from ``source`` into ``clean`` alone; effects on ``metric`` (module doc).
    ``forced``: the prompts' answers of several tokens, teacher-forced (``answer_ids`` and ``other_ids`` unread)."""
    metric = metric_name(metric)
    if forced is not None and forced.metric != metric:
        raise ValueError(f"the teacher-forced answers measure {forced.metric}, not {metric!r}")
    if site not in SITES:
        raise ValueError(f"unknown scan site {site!r}; expected one of {SITES}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {sorted(METRICS)}")
    if clean.shape != source.shape:
        raise ValueError(f"clean and source token ids differ in shape: {tuple(clean.shape)} vs {tuple(source.shape)}")
    if per_pass < 1:
        raise ValueError("per_pass must be at least 1")
    fn = METRICS[metric][0]
    score = lambda logits, copies: fn(logits, _stack(answer_ids, copies), _stack(other_ids, copies))  # noqa: E731
    reading = Reading(score)
    if forced is not None:
        reading = Reading(forced.measure, forced.readout(), forced.prompt_length)
    n_layers = model.shape.n_layers
    rows = (lambda t: t) if forced is None else forced.stack
    with model.session(), torch.no_grad():  # remote: every pass in one request
        if site == "resid":
            pos_axis = _resid_positions(positions, clean.shape[1])
            ids = clean if forced is None else forced.ids(clean)
            effects, base, src = _scan_resid(model, ids, rows(source), pos_axis, reading, per_pass)
            axes, pos_list = ("layer", "position"), pos_axis
        else:
            pos = _head_positions(positions, clean.shape)
            ids = clean if forced is None else forced.ids(clean)
            at = None if pos is None else rows(pos)
            effects, base, src = _scan_heads(model, ids, rows(source), site, at, reading, per_pass)
            axes, pos_list = ("layer", "head"), ([] if pos is None else pos.tolist())
        effects, base, src = keep(effects), keep(base), keep(src)
    assert effects.shape[0] == n_layers
    return ScanResult(effects, site, metric, axes, float(base), float(src), pos_list, forced is not None)


def scan_pairs(
    model: LoadedModel,
    pairs: Sequence,
    site: str = "z",
    position: Optional[str] = "last",
    metric: str = "prob",
    per_pass: int = DEFAULT_PER_PASS,
) -> ScanResult:
    """`scan` over counterfactual pairs of any token lengths and templates: each group
    (`grouped_batches`) is scanned alone at its prompts' named ``position``
    (``None``: every position) and the effects are averaged over every prompt (each group weighted by its
    size), as one scan of all the prompts would. A residual-stream scan's axis is token positions, so it
    needs prompts of one length. Targets (or, under ``logit_diff``, alternatives) of several tokens are
    teacher-forced (module doc); ``answer_logit`` is refused for them."""
    from ..tasks.base import (
        alternative_tokens,
        group_batches,
        max_answer_length,
        pair_batch_tensors,
        take,
        target_tokens,
    )

    metric = metric_name(metric)
    several = max(len(target_tokens(p)) for p in pairs) > 1 or (
        metric == "logit_diff" and max_answer_length([p.base for p in pairs]) > 1
    )
    if several and metric not in ("prob", "logit_diff"):
        raise ValueError(f"answers of several tokens are scanned under prob or logit_diff, not {metric!r}")
    batches = [take(pairs, rows) for rows in group_batches(pairs)]
    groups = [pair_batch_tensors(b) for b in batches]
    if site == "resid" and len({t["base"]["input_ids"].shape[1] for t in groups}) > 1:
        lengths = sorted({t["base"]["input_ids"].shape[1] for t in groups})
        raise ValueError(
            f"a resid scan's axis is token positions, and these prompts have lengths {lengths}; "
            "scan heads (site z/q/k/v), or give prompts of one length"
        )
    results, sizes = [], []
    for group, t in zip(batches, groups):
        forced = None
        if several:
            alternatives = [alternative_tokens(p.base) for p in group] if metric == "logit_diff" else None
            answers = [target_tokens(p) for p in group]
            forced = continuations(answers, alternatives, metric, t["base"]["input_ids"].shape[1])
        where = None if position is None else t["base"]["positions"][position]
        if site == "resid" and where is not None:
            where = where.unique().tolist()
        other = t["base"].get("alternative_ids")
        results.append(
            scan(
                model,
                t["base"]["input_ids"],
                t["source"]["input_ids"],
                t["target_ids"],
                site=site,
                positions=where,
                metric=metric,
                per_pass=per_pass,
                other_ids=other,
                forced=forced,
            )
        )
        sizes.append(t["base"]["input_ids"].shape[0])
    if len(results) == 1:
        return results[0]
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    effects = sum(r.effects.double() * wi for r, wi in zip(results, w)).to(results[0].effects.dtype)
    return ScanResult(
        effects,
        site,
        metric,
        results[0].axes,
        float(sum(r.clean * wi for r, wi in zip(results, w))),
        float(sum(r.source * wi for r, wi in zip(results, w))),
        [p for r in results for p in r.positions],
        any(r.forced for r in results),
    )


@dataclass
class Reading:
    """How a scan's runs are read: ``score(logits, copies)`` gives each prompt's metric ``"(copy b)"``; with answers
    of several tokens, ``readout`` (``"rows w"``) the positions predicting each answer token and ``prompt_length``
    the prompts' positions (the only ones patched)."""

    score: Callable
    readout: Optional[torch.Tensor] = None
    prompt_length: Optional[int] = None

    def read(self, copies: int = 1) -> dict:
        """``run``'s read-out argument for ``copies`` stacked copies (none: the last position)."""
        return {} if self.readout is None else {"readout": self.readout.repeat(copies, 1)}

    def effect(self, logits: torch.Tensor, copies: int, base: torch.Tensor) -> torch.Tensor:
        """Each copy's mean metric minus the clean one's, ``"copy"``."""
        return self.score(logits, copies).reshape(copies, -1).mean(1) - base


def _stack(t: Optional[torch.Tensor], copies: int) -> Optional[torch.Tensor]:
    return None if t is None else repeat(t, "b ... -> (s b) ...", s=copies)


def _head_positions(positions: Positions, shape: torch.Size) -> Optional[torch.Tensor]:
    if positions is None:
        return None
    if isinstance(positions, str):
        if positions != "last":
            raise ValueError(f"positions must be 'last', an int, a LongTensor [batch] or None, not {positions!r}")
        return torch.full((shape[0],), shape[1] - 1, dtype=torch.long)
    pos = torch.as_tensor(positions, dtype=torch.long)
    pos = pos.expand(shape[0]) if pos.ndim == 0 else pos
    if pos.shape != (shape[0],) or (pos < 0).any() or (pos >= shape[1]).any():
        raise ValueError(f"positions must give one position in [0, {shape[1]}) per example")
    return pos.clone()


def _resid_positions(positions: Positions, length: int) -> list[int]:
    if positions is None or positions == "all":
        return list(range(length))
    if positions == "last":
        return [length - 1]
    out = [
        int(p)
        for p in (positions if isinstance(positions, (list, tuple, range)) else torch.as_tensor(positions).flatten())
    ]
    if any(not 0 <= p < length for p in out):
        raise ValueError(f"resid scan positions must lie in [0, {length})")
    return out


def _clean_and_source(model: LoadedModel, clean: torch.Tensor, source: torch.Tensor, sites: list, reading: Reading):
    """The clean run (keys/values, residual stream, metric) and the source run's sites and metric (teacher-forced:
    the source prompt with the clean answers appended)."""
    resid = [("resid", l) for l in range(model.shape.n_layers - 1)]
    c = run(model, clean, capture=resid + [("emb", EMB_LAYER)], keep_kv=True, **reading.read())
    if reading.prompt_length is not None:
        source = torch.cat([source, clean[:, reading.prompt_length :]], 1)
    s = run(model, source, capture=sites, **reading.read())
    return c, s, reading.score(c.logits, 1).mean(), reading.score(s.logits, 1).mean()


def _scan_heads(
    model: LoadedModel,
    clean: torch.Tensor,
    source: torch.Tensor,
    site: str,
    pos: Optional[torch.Tensor],
    reading: Reading,
    per_pass: int,
):
    shape, arch = model.shape, model.arch
    n = clean.shape[0]
    units = shape.n_heads if site in ("z", "q") else shape.n_kv_heads
    rep = shape.n_heads if site in ("z", "q") else shape.group_size  # a query head that reads each unit
    layers = range(shape.n_layers)
    c, s, base, src = _clean_and_source(model, clean, source, [(site, l) for l in layers], reading)
    prompt = slice(0, reading.prompt_length)  # teacher-forced: the prompts' positions only (all of them otherwise)
    comps = [(l, u) for l in layers for u in range(units)]
    grid = torch.zeros(shape.n_layers, units)
    for i in range(0, len(comps), per_pass):
        chunk = comps[i : i + per_pass]
        k = len(chunk)
        first = chunk[0][0]
        patches = []
        for layer in sorted({l for l, _ in chunk}):
            value = s.captured[(site, layer)]
            value = value[:, prompt] if pos is None else value[torch.arange(n), pos]  # "b (pos) cols"
            mask = torch.ones((k * n,) + ((1,) if pos is None else ()) + (value.shape[-1],))
            for j, (l, u) in enumerate(chunk):  # building the masks: one row block per copy, outside the pass
                if l == layer:
                    cols = arch.columns(site, u * rep if site in ("k", "v") else u, shape)
                    mask[j * n : (j + 1) * n, ..., cols] = 0
            every = None if reading.prompt_length is None else prompt
            patches.append(Patch(site, layer, _stack(value, k), every if pos is None else _stack(pos, k), mask=mask))
        resume = Resume(first, c.captured[("resid", first - 1)]) if first > 0 else None
        prefix = c.kv if pos is not None else None
        out = run(model, _stack(clean, k), patches, resume=resume, prefix=prefix, **reading.read(k))
        effect = reading.effect(out.logits, k, base)
        for j, (l, u) in enumerate(chunk):
            grid[l, u] = effect[j]
    if units != shape.n_heads:  # each head's cell holds its KV group's effect
        grid = repeat(grid, "l g -> l (g r)", r=shape.group_size)
    return grid, base, src


def _scan_resid(
    model: LoadedModel, clean: torch.Tensor, source: torch.Tensor, pos_axis: list[int], reading: Reading, per_pass: int
):
    """Residual stream entering each block, at each position: layer 0 patches the embedding output;
    layer ``l > 0`` resumes at ``l`` from the clean stream with the copy's position taken from the source."""
    n_layers = model.shape.n_layers
    sites = [("resid", l) for l in range(n_layers - 1)] + [("emb", EMB_LAYER)]
    c, s, base, src = _clean_and_source(model, clean, source, sites, reading)
    n = clean.shape[0]
    rows = torch.arange(n)
    grid = torch.zeros(n_layers, len(pos_axis))
    for layer in range(n_layers):
        for i in range(0, len(pos_axis), per_pass):
            chunk = pos_axis[i : i + per_pass]
            k = len(chunk)
            at = torch.tensor(chunk, dtype=torch.long).repeat_interleave(n)  # "(copy b)": each copy's position
            start = min(chunk)
            if layer == 0:
                value = s.captured[("emb", EMB_LAYER)][rows.repeat(k), at]
                out = run(model, _stack(clean, k), [Patch("emb", EMB_LAYER, value, at)], prefix=c.kv, **reading.read(k))
            else:
                key = ("resid", layer - 1)
                hidden = _stack(c.captured[key][:, start:], k).clone()
                hidden[torch.arange(k * n), at - start] = s.captured[key][rows.repeat(k), at]
                read = reading.read(k)
                out = run(model, _stack(clean, k), resume=Resume(layer, hidden), prefix=c.kv, start=start, **read)
            effect = reading.effect(out.logits, k, base)
            grid[layer, i : i + k] = effect
    return grid, base, src
