"""Cross-model activation patching (CMAP; Prakash et al. 2024, Sec. 5).

Base and fine-tune run on the same prompts (same positions); activations captured in the
fine-tune's run are written into the base's run, per circuit group at the group's position:

- ``z``: the heads' outputs, the input of the attention output projection. The BASE model's
  output projection then projects them (the receiving model's ``o_proj``).
- ``q``: the head's query at the group's position.
- ``k`` / ``v``: keys / values at every position up to and including the group's position
  (rule ``"base"``, mechdiff's extension) or strictly before it (rule ``"paper"``). Under grouped-query
  attention K and V belong to a KV group: patching a head's K or V patches its whole KV group, which
  every query head of that group reads.
- ``qk``, ``qkv``: combinations, to separate gains of the QK circuit from the OV circuit.

A group at a position class of several tokens (`scope_positions`, the mask completeness keeps) has z and Q
patched at every token of the class, K/V up to (rule ``"paper"``: strictly before) the class's last token, and its
isolation frees every token of the class; a prompt whose class is empty is not patched (mechdiff's extension: the
paper's groups sit at one position).

Two rules (``rule``):

- ``"base"`` (mechdiff's default): isolation (``isolate=True``) restores, for Q/K/V kinds, every head's
  output at positions other than the scope's positions and the read-out to the base's own value in every
  layer from the first patched one, so the patched K/V change only what the circuit heads read at their
  positions; the group's own position stays free, so Q/K/V rows exist for groups at any position (an
  extension of the paper). Under grouped-query attention the other query heads of a patched KV group are
  restored too, at every position: "V of group A" then patches exactly the heads of group A.
- ``"paper"`` (Prakash et al. 2024, ``Nix07/finetuning`` ``experiment_3/cmap_utils.py``: ``cmap_in``): K/V
  strictly before the group's position, Q at it, and for Q/K/V every head's output at every position except
  the last reset to the base's clean run, so only last-token groups have Q/K/V rows (`run_cmap` runs
  only ``z`` for the others). Under grouped-query attention (absent from the paper's LLaMA-7B) the other
  query heads of a patched KV group are restored at the last position as well. The study patches, under this
  rule, the fine-tune's pruned circuit cut per group to the heads its DCM selected (`dcm_cut`).

`run_cmap` reports accuracy of the patched base per group and for the whole circuit, beside
the base's and the fine-tune's accuracies, a layer-matched random-head control per kind, and keeps
each prompt's outcome so two kinds can be compared on the same prompts (`CMAPResult.paired`). What each kind
writes and each rule isolates (the scopes, the patches, `dcm_cut`, random scopes) is `mechdiff.methods.cmap_patches`.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..circuits.circuit import Circuit
from ..common import inference as inf
from ..common.metrics import answer_is_top1, answer_prob, logit_diff, sequence_is_greedy, sequence_logprob
from ..common.outcomes import bits
from ..common.progress import progress_bar
from ..common.stats import bootstrap, mean_estimate
from ..models.loading import LoadedModel
from ..models.modelset import check_shapes
from ..models.remote import keep
from ..patching.core import Resume, prompt_patch, run
from ..tasks.base import Record, batch_tensors, grouped_batches, record_order, take
from .cmap_patches import (
    CIRCUIT_SCOPE,
    CMAP_KINDS,
    Scope,
    capture_sites,
    cmap_patches,
    isolation_patches,
    paper_isolation_patches,
    paper_kinds,
    parse_kinds,
    random_scope,
    scope_positions,
    scopes,
)

CMAP_RULES: tuple[str, ...] = ("base", "paper")
CAPTION = (
    "CMAP: activations captured in the fine-tune's run are patched into the base's run on the same prompts, "
    "per group at the group's position. z = head outputs (o_proj input), projected by the BASE model's o_proj; "
    "q = the head's query at its position; k/v = keys/values at every position up to and including it. "
    "For q/k/v every head's output at positions other than the group's and the last is restored to the "
    "base's, and other query heads of a patched KV group are restored everywhere, so only the group's heads "
    "read the patched Q/K/V (per query head under grouped-query attention)."
)
CAPTION_PAPER = (
    "CMAP as the paper: activations captured in the fine-tune's run are patched into the base's run on "
    "the same prompts. z = head outputs at the group's position, projected by the BASE model's o_proj; "
    "q = the head's query at its position; k/v = keys/values at every position strictly before it. For "
    "q/k/v every head's output at every position except the last is reset to the base's clean run, so "
    "q/k/v are reported for last-token groups only."
)
CAPTION_UNISOLATED = (
    "CMAP without isolation: q/k/v patches write the KV group's keys/values at every position up to "
    "the group's, and every head reading them (the whole KV group, at every position) responds."
)


@dataclass
class CMAPRow:
    """Accuracy of the base with one scope's activations of one kind patched in from the fine-tune, the answer's
    probability and, on a ``logit_diff`` task, the logit difference (the task's continuous metric)."""

    scope: str
    kind: str
    accuracy: inf.Interval
    answer_prob: inf.Interval
    recovered: float  # (patched - base) / (fine-tune - base), NaN when the two models tie
    logit_diff: Optional[inf.Interval] = None

    def to_dict(self) -> dict:
        out = {
            "scope": self.scope,
            "kind": self.kind,
            "accuracy": self.accuracy.to_dict(),
            "answer_prob": self.answer_prob.to_dict(),
            "recovered": self.recovered,
        }
        return {**out, "logit_diff": self.logit_diff.to_dict()} if self.logit_diff is not None else out


@dataclass
class CMAPResult:
    """Base and fine-tune accuracies and one row per (scope, kind)."""

    base: str
    finetune: str
    base_accuracy: inf.Interval
    finetune_accuracy: inf.Interval
    rows: list[CMAPRow]
    base_answer_prob: Optional[inf.Interval] = None
    finetune_answer_prob: Optional[inf.Interval] = None
    positions: dict[str, str] = field(default_factory=dict)
    caption: str = CAPTION
    random_rows: list[CMAPRow] = field(default_factory=list)  # layer-matched random heads, pooled over draws
    outcomes: dict[str, list[float]] = field(default_factory=dict)  # "scope/kind" (or "base") -> per prompt
    settings: dict = field(default_factory=dict)
    #: "random:scope/kind" -> each draw's per-prompt outcomes (0/1 strings); "random:scope" -> each draw's heads
    random_outcomes: dict[str, list[str]] = field(default_factory=dict)
    random_heads: dict[str, list[list[str]]] = field(default_factory=dict)
    #: the prompts (indices) the random draws ran on, where not every one: a random key's outcomes are theirs
    random_prompts: list[int] = field(default_factory=list)
    base_logit_diff: Optional[inf.Interval] = None  # a logit_diff task's continuous metric, as the rows'
    finetune_logit_diff: Optional[inf.Interval] = None

    def paired(self, a: str, b: str) -> inf.Test:
        """Accuracy of ``a`` minus ``b`` ("scope/kind" keys, or "base"/"finetune") on the same prompts, by the
        inference layer's paired rule (`paired`: exact McNemar for two 0/1
        outcomes; against a random control, whose outcome is the per-prompt share of its draws, the sign-flip test):
        call one part larger than another only where the test rejects."""
        missing = [k for k in (a, b) if k not in self.outcomes]
        if missing:
            raise KeyError(f"no outcomes for {missing}; known: {sorted(self.outcomes)}")
        return inf.paired(*paired_outcomes(self.to_dict(), a, b), claim=f"{a} - {b}")

    def to_dict(self) -> dict:
        probs = {
            k: v.to_dict()
            for k, v in (
                ("base_answer_prob", self.base_answer_prob),
                ("finetune_answer_prob", self.finetune_answer_prob),
                ("base_logit_diff", self.base_logit_diff),
                ("finetune_logit_diff", self.finetune_logit_diff),
            )
            if v is not None
        }
        return {
            "base": self.base,
            "finetune": self.finetune,
            "caption": self.caption,
            "base_accuracy": self.base_accuracy.to_dict(),
            "finetune_accuracy": self.finetune_accuracy.to_dict(),
            **probs,
            "positions": self.positions,
            "rows": [r.to_dict() for r in self.rows],
            "random_rows": [r.to_dict() for r in self.random_rows],
            "outcomes": self.outcomes,
            "settings": self.settings,
            "random_outcomes": self.random_outcomes,
            "random_heads": self.random_heads,
            **({"random_prompts": self.random_prompts} if self.random_prompts else {}),
        }


def paired_outcomes(result: Mapping[str, Any], a: str, b: str) -> tuple[list, list]:
    """The per-prompt outcomes of ``a`` and ``b`` (keys of a `CMAPResult.to_dict`'s ``outcomes``) on the
    prompts both ran on: a random control's draws may run on ``random_prompts`` only, and the other key is then
    taken on those."""
    outcomes, on = result["outcomes"], result.get("random_prompts") or []
    x, y = list(outcomes[a]), list(outcomes[b])
    if len(x) != len(y) and on:
        x, y = ([x[i] for i in on] if len(x) > len(y) else x), ([y[i] for i in on] if len(y) > len(x) else y)
    return x, y


#: A batch's answers: ids ``"batch"`` (one token each) or tokens ``"batch a"`` and lengths ``"batch"`` (several).
Answer = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def teacher_forced(batch: dict) -> tuple[torch.Tensor, Optional[torch.Tensor], Answer]:
    """A batch's run inputs: the prompts (then each answer's tokens but its last, where an answer has several),
    the read-out positions (None: the last) and its `Answer`."""
    ids = batch["input_ids"]
    if "answer_tokens" not in batch:
        return ids, None, batch["answer_ids"]
    tokens, n = batch["answer_tokens"], ids.shape[1]
    readout = (n - 1 + torch.arange(tokens.shape[1]))[None].expand(ids.shape[0], -1)
    return torch.cat([ids, tokens[:, :-1]], 1), readout, (tokens, batch["answer_lengths"])


def _read(readout: Optional[torch.Tensor]) -> dict:
    """``run``'s read-out argument where answers are teacher-forced (none for one-token answers: their last)."""
    return {} if readout is None else {"readout": readout}


@dataclass(frozen=True)
class Target:
    """What one run of a batch scores: its `Answer`, the task's ``metric``, the alternatives' ids
    (``"batch k"``) where a one-token logit difference reads them from the same logits, and the run's weight in the
    logit difference (an alternative's teacher-forced run: ``-1/k``)."""

    answer: Answer
    metric: str = "prob"
    alternatives: Optional[torch.Tensor] = None
    weight: float = 1.0


#: A run's outcomes per prompt: (correct, answer probability, the logit difference's term or None).
Scores = tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]


def teacher_runs(batch: dict, metric: str = "prob") -> list[tuple[torch.Tensor, Optional[torch.Tensor], Target]]:
    """The runs a batch needs (`teacher_forced` each): the answer's; on a ``logit_diff`` task with answers of
    several tokens, one more per alternative (its summed log-probability weighted ``-1/k``), as evaluation scores
    the logit difference (`evaluate`)."""
    ids, readout, answer = teacher_forced(batch)
    if metric != "logit_diff":
        return [(ids, readout, Target(answer))]
    if "alternative_ids" not in batch:
        raise ValueError("the task's metric is logit_diff, but these records have no alternative answers")
    if not isinstance(answer, tuple):  # one token: the alternatives' logits sit beside the answer's
        return [(ids, readout, Target(answer, metric, batch["alternative_ids"]))]
    alt, lengths = batch["alternative_tokens"], batch["alternative_lengths"]
    runs = [(ids, readout, Target(answer, metric))]
    for j in range(alt.shape[1]):
        forced = {"input_ids": batch["input_ids"], "answer_tokens": alt[:, j], "answer_lengths": lengths[:, j]}
        a_ids, a_readout, a_answer = teacher_forced(forced)
        runs.append((a_ids, a_readout, Target(a_answer, metric, weight=-1.0 / alt.shape[1])))
    return runs


def _score(logits: torch.Tensor, target: Union[Target, Answer]) -> Scores:
    """(correct, prob, the logit difference's term) per prompt: the top-1, its probability and (``logit_diff``) the
    answer's logit minus its alternatives' mean; for answers of several tokens (teacher-forced ``logits``
    ``"batch a vocab"``) greedy decoding of the whole answer, ``exp`` of its summed log-probability and
    (``logit_diff``) that summed log-probability, the alternatives' runs subtracting theirs (`_combine`)."""
    target = target if isinstance(target, Target) else Target(target)
    answer, diff = target.answer, None
    if isinstance(answer, tuple):
        logp = sequence_logprob(logits, *answer).cpu().double().numpy()
        diff = logp if target.metric == "logit_diff" else None
        return sequence_is_greedy(logits, *answer).cpu().numpy(), np.exp(logp), diff
    if target.metric == "logit_diff":
        diff = logit_diff(logits, answer, target.alternatives).cpu().double().numpy()
    return answer_is_top1(logits, answer).cpu().numpy(), answer_prob(logits, answer).cpu().numpy(), diff


def _combine(runs: list[tuple[float, dict]]) -> dict:
    """One batch's outcomes per key from its runs (``(weight, key -> Scores)``, the answer's first): correctness
    and probability of the answer's run, the logit difference summed over the runs with their weights."""
    first = runs[0][1]
    if len(runs) == 1:
        return first
    return {key: (c, p, sum(w * scored[key][2] for w, scored in runs)) for key, (c, p, _) in first.items()}


def run_cmap(
    base: LoadedModel,
    finetune: LoadedModel,
    circuit: Circuit,
    records: Sequence[Record],
    kinds: Sequence[str] = CMAP_KINDS,
    batch_size: int = 32,
    groups: Optional[Iterable[str]] = None,
    progress: bool = True,
    isolate: bool = True,
    n_random: int = 0,
    seed: int = 0,
    rule: str = "base",
    random_prompts: Optional[Sequence[int]] = None,
    metric: str = "prob",
) -> CMAPResult:
    """CMAP from ``finetune`` into ``base`` for each group of ``circuit`` and the whole circuit.

    ``rule``: ``"base"`` or ``"paper"`` (see the module docstring); ``isolate`` (rule ``"base"`` only): restore
    the base's other head outputs for Q/K/V kinds (the paper's rule always isolates).
    ``n_random``: draws of layer-matched random heads per group (the control), each patched in every kind, on the
    prompts ``random_prompts`` (indices into ``records``; None: every one), each draw's outcomes kept.
    ``metric``: the task's; ``logit_diff`` adds the logit difference beside accuracy and the answer's probability
    (answers of several tokens: one more teacher-forced run per alternative, `teacher_runs`)."""
    if rule not in CMAP_RULES:
        raise ValueError(f"rule must be one of {CMAP_RULES}, got {rule!r}")
    if rule == "paper" and not isolate:
        raise ValueError(
            "the paper's CMAP always resets the other positions to the base (isolate); use rule 'base' "
            "for runs without isolation"
        )
    check_shapes({base.name: base.shape, finetune.name: finetune.shape})
    circuit.validate(base.shape.n_layers, base.shape.n_heads)
    kinds = parse_kinds(kinds)
    if not circuit.heads():
        raise ValueError("the circuit has no heads; nothing to patch")
    all_scopes = scopes(circuit)
    if groups is not None:
        wanted = list(groups)
        missing = [g for g in wanted if g not in all_scopes]
        if missing:
            raise ValueError(f"groups {missing} are not in the circuit or empty (groups: {sorted(circuit.groups)})")
        all_scopes = {g: all_scopes[g] for g in wanted}
    sites = capture_sites(circuit.heads())
    rng = random.Random(seed)
    randoms = (
        {
            f"random:{g}": [random_scope(sc, base.shape.n_heads, rng) for _ in range(n_random)]
            for g, sc in all_scopes.items()
            if g != CIRCUIT_SCOPE
        }
        if n_random > 0
        else {}
    )
    plan = {s: paper_kinds(sc, kinds) if rule == "paper" else list(kinds) for s, sc in all_scopes.items()}
    plan.update({r: plan[r.split(":", 1)[1]] for r in randoms})
    every = list(range(len(records)))
    drawn_on = every if random_prompts is None else sorted({int(i) for i in random_prompts})
    if not drawn_on or drawn_on[0] < 0 or drawn_on[-1] >= len(records):
        raise ValueError(f"random_prompts must be indices into the {len(records)} CMAP prompts")
    run_pass = functools.partial(
        _cmap_pass,
        base,
        finetune,
        sites,
        all_scopes,
        kinds,
        isolate,
        rule,
        batch_size=batch_size,
        progress=progress,
        metric=metric,
    )
    if drawn_on == every or not randoms:  # one pass: the draws (if any) on every prompt
        scores, drawn = run_pass(records, randoms, plan)
    else:  # the draws on their prompts only, in a pass of their own (plain runs, no group patched again)
        scores, _ = run_pass(records, {}, {s: plan[s] for s in all_scopes})
        quiet = {**{s: [] for s in all_scopes}, **{r: plan[r] for r in randoms}}
        sub, drawn = run_pass(take(records, drawn_on), randoms, quiet)
        scores.update({key: v for key, v in sub.items() if isinstance(key, tuple) and key[0] in randoms})
    result = _result(base, finetune, circuit, scores, all_scopes, kinds, plan)
    result.random_outcomes = {"/".join(key): [bits(row) for row in draws] for key, draws in drawn.items()}
    result.random_heads = {key: [[h.name for h, _ in sc] for sc in draws] for key, draws in randoms.items()}
    result.random_prompts = [] if drawn_on == every or not randoms else drawn_on
    result.caption = CAPTION_PAPER if rule == "paper" else CAPTION if isolate else CAPTION_UNISOLATED
    result.settings = {"isolate": isolate, "n_random": n_random, "seed": seed, "n_prompts": len(records)}
    if rule == "paper":
        result.settings.update(rule=rule, kinds={s: plan[s] for s in all_scopes})
    return result


def _cmap_pass(
    base: LoadedModel,
    finetune: LoadedModel,
    sites: list,
    all_scopes: dict,
    kinds: list[str],
    isolate: bool,
    rule: str,
    records: Sequence[Record],
    randoms: dict,
    plan: dict,
    batch_size: int = 32,
    progress: bool = True,
    metric: str = "prob",
) -> tuple[dict, dict]:
    """One pass of CMAP over ``records``: ``(correct, prob, logit difference)`` per key (``"base"``,
    ``"finetune"``, each (scope, kind) ``plan`` names) in the records' order (the logit difference None unless
    ``metric`` is ``logit_diff``), and each random (scope, kind)'s draws' correctness ``"draw prompt"``."""
    keys = ["base", "finetune", *((s, k) for s in [*all_scopes, *randoms] for k in plan[s])]
    scores: dict = {key: ([], [], []) for key in keys}
    drawn: dict[tuple, list[np.ndarray]] = {}  # (random scope, kind) -> per batch, each draw's outcomes
    batches = grouped_batches(records, batch_size)
    for rows in progress_bar(batches, desc="cmap", disable=not progress):
        batch = batch_tensors(take(records, rows))  # one template and length: any length per batch
        n = batch["input_ids"].shape[1]
        positions = scope_positions(batch, {pos for sc in all_scopes.values() for _, pos in sc})
        runs = []
        # an answer of several tokens: appended, never patched (each alternative's too, under logit_diff)
        for j, (ids, readout, target) in enumerate(teacher_runs(batch, metric)):
            with torch.no_grad():
                donor = run(finetune, ids, capture=sites if j == 0 else (), **_read(readout))
                if j == 0:  # the prompt's activations: the same in every run of the batch
                    captured = {key: t[:, :n].to(base.device) for key, t in donor.captured.items()}
            scored = {"finetune": _score(donor.logits, target)}
            with base.session():  # remote: the base's plain and patched runs of this batch in one request
                scored.update(
                    keep(
                        _base_scores(
                            base,
                            ids,
                            target,
                            captured,
                            all_scopes,
                            kinds,
                            positions,
                            isolate,
                            randoms,
                            rule,
                            plan,
                            (n, readout),
                        )
                    )
                )
            runs.append((target.weight, scored))
        # each draw's correctness: the answer's run decides it (the alternatives' runs add to the logit difference)
        draws = runs[0][1].pop("draws", {})
        for _, other in runs[1:]:
            other.pop("draws", None)
        for key, value in draws.items():
            drawn.setdefault(key, []).append(value)
        for key, value in _combine(runs).items():
            _append(scores[key], value)
    perm = record_order(batches)  # per-prompt outcomes back in the records' order
    scores = {key: tuple([_ordered(part, perm)] for part in parts) for key, parts in scores.items()}
    return scores, {key: np.concatenate(parts, axis=1)[:, perm] for key, parts in drawn.items()}


def _base_scores(
    base: LoadedModel,
    ids: torch.Tensor,
    answer: Union[Target, Answer],
    captured: dict,
    all_scopes: dict,
    kinds: list[str],
    positions: dict,
    isolate: bool = True,
    randoms: Optional[dict] = None,
    rule: str = "base",
    plan: Optional[dict] = None,
    prompt: Optional[tuple[int, Optional[torch.Tensor]]] = None,
) -> dict:
    """`Scores` of the base on ``answer`` (a `Target`, or an `Answer` scored by probability),
    plain and with each (scope, kind) patched from the donor's ``captured``; for each random scope key, the outcomes
    of its draws averaged per prompt (and under ``"draws"``, each draw's correctness, ``"draw batch"``). ``prompt``:
    the prompts' length and the read-out positions where ``ids`` carry answer tokens after them (patches then write
    the prompt only)."""
    n, readout = prompt or (ids.shape[1], None)
    out = {}
    randoms = randoms or {}
    # Patched runs resume at their scope's first layer from the plain run's residual (exact: nothing
    # earlier is patched), skipping the blocks before it, and compute only the positions from the first
    # patched one on, reading earlier keys and values from the plain run (suffix runs).
    first = {scope: min(h.layer for h, _ in pairs) for scope, pairs in all_scopes.items()}
    start = min(first.values())
    z_sites = [("z", layer) for layer in range(start, base.shape.n_layers)] if isolate else []
    with torch.no_grad():
        plain = run(
            base,
            ids,
            capture=[("resid", layer - 1) for layer in sorted(set(first.values()) - {0})] + z_sites,
            keep_kv=True,
            **_read(readout),
        )
        base_z = {layer: plain.captured[("z", layer)][:, :n] for _, layer in z_sites}
        out["base"] = _score(plain.logits, answer)

        def patched(pairs: Scope, kind: str) -> Scores:
            layer = min(h.layer for h, _ in pairs)
            resume = Resume(layer, plain.captured[("resid", layer - 1)]) if layer else None
            patches = cmap_patches(base, pairs, kind, captured, positions, n, strict=rule == "paper")
            if rule == "paper":
                patches += paper_isolation_patches(base, pairs, kind, base_z, positions, n)
            elif isolate:
                patches += isolation_patches(base, pairs, kind, base_z, positions, n)
            if readout is not None:
                patches = [prompt_patch(p, n) for p in patches]
            return _score(run(base, ids, patches, resume=resume, prefix=plain.kv, **_read(readout)).logits, answer)

        plan = plan or {}
        for scope, pairs in all_scopes.items():
            for kind in plan.get(scope, kinds):
                out[(scope, kind)] = patched(pairs, kind)
        for key, draws in randoms.items():
            for kind in plan.get(key, kinds):
                runs = [patched(pairs, kind) for pairs in draws]
                out[(key, kind)] = tuple(None if r[0] is None else np.mean(r, 0) for r in zip(*runs))
                out.setdefault("draws", {})[(key, kind)] = np.stack([r[0] for r in runs])
    return out


def _append(store: tuple[list, list, list], scored: Scores) -> None:
    for part, value in zip(store, scored):
        part.append(value)


def _kept(parts: tuple) -> bool:
    """Whether a key's optional outcome (the logit difference) was kept by its runs."""
    return bool(parts) and bool(parts[0]) and parts[0][0] is not None


def _ordered(parts: list, perm: np.ndarray) -> Optional[np.ndarray]:
    """A key's batches of one outcome concatenated in the records' order (None where no run kept it)."""
    return None if not parts or parts[0] is None else np.concatenate(parts)[perm]


def _result(
    base: LoadedModel,
    finetune: LoadedModel,
    circuit: Circuit,
    scores: dict,
    all_scopes: dict,
    kinds: list[str],
    plan: Optional[dict] = None,
) -> CMAPResult:
    correct = {key: np.concatenate(parts[0]).astype(float) for key, parts in scores.items()}
    acc = {key: mean_estimate(v) for key, v in correct.items()}
    prob = {key: bootstrap(np.concatenate(parts[1])) for key, parts in scores.items()}
    diff = {  # a logit_diff task's: (correct, prob, logit difference) parts per key
        key: bootstrap(np.concatenate(parts[2])) for key, parts in scores.items() if _kept(parts[2:])
    }
    b, f = acc["base"].value, acc["finetune"].value

    def row(s: str, k: str) -> CMAPRow:
        recovered = (acc[(s, k)].value - b) / (f - b) if f != b else float("nan")
        return CMAPRow(s, k, acc[(s, k)], prob[(s, k)], recovered, diff.get((s, k)))

    rows = [row(s, k) for s in all_scopes for k in (plan or {}).get(s, kinds)]
    random_rows = [
        row(s, k)
        for s, k in dict.fromkeys(key for key in scores if isinstance(key, tuple) and key[0].startswith("random:"))
    ]
    positions = {g: circuit.positions[g] for g in circuit.groups}
    # per prompt: 0/1, or for a random scope the share of its draws that were right (paired with the group's)
    outcomes = {
        ("/".join(k) if isinstance(k, tuple) else k): [x if k[0].startswith("random:") else int(x) for x in v.tolist()]
        if isinstance(k, tuple)
        else [int(x) for x in v.tolist()]
        for k, v in correct.items()
    }
    return CMAPResult(
        base.name,
        finetune.name,
        acc["base"],
        acc["finetune"],
        rows,
        prob["base"],
        prob["finetune"],
        positions,
        random_rows=random_rows,
        outcomes=outcomes,
        base_logit_diff=diff.get("base"),
        finetune_logit_diff=diff.get("finetune"),
    )
