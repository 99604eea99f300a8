"""Cross-model activation patching (CMAP; Prakash et al. 2024, Sec. 5).

Base and fine-tune run on the same prompts (same positions); activations captured in the
fine-tune's run are written into the base's run, per circuit group at the group's position:

- ``z``: the heads' outputs, the input of the attention output projection. The BASE model's
  output projection then projects them (the receiving model's ``o_proj``).
- ``q``: the head's query at the group's position.
- ``k`` / ``v``: keys / values at every position up to and including the group's position
  (the paper patches K/V at all previous positions). Under grouped-query attention K and V
  belong to a KV group: patching a head's K or V patches its whole KV group, which every query
  head of that group reads.
- ``qk``, ``qkv``: combinations, to separate gains of the QK circuit from the OV circuit.

:func:`run_cmap` reports accuracy of the patched base per group and for the whole circuit,
beside the base's and the fine-tune's accuracies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .circuits.circuit import Circuit
from .components import Head
from .evaluate import batches
from .models.loading import LoadedModel
from .models.modelset import check_shapes
from .models.remote import keep
from .patching.core import Patch, Resume, run
from .stats import Estimate, bootstrap
from .tasks.entity_tracking import EntityTrackingExample, batch_tensors

CMAP_KINDS: tuple[str, ...] = ("z", "q", "k", "v", "qk", "qkv")
CIRCUIT_SCOPE = "circuit"
CAPTION = ("CMAP: activations captured in the fine-tune's run are patched into the base's run on the same prompts, "
           "per group at the group's position. z = head outputs (o_proj input), projected by the BASE model's o_proj; "
           "q = the head's query at its position; k/v = keys/values at every position up to and including it. "
           "Under grouped-query attention K and V belong to a KV group: patching a head's K or V patches its whole "
           "KV group.")

Scope = list[tuple[Head, str]]  # (head, position name) pairs


def parse_kinds(kinds: str | Iterable[str]) -> list[str]:
    """``"z,q,qkv"`` or a list -> validated CMAP kinds."""
    items = [k.strip().lower() for k in (kinds.split(",") if isinstance(kinds, str) else kinds) if k.strip()]
    bad = [k for k in items if k not in CMAP_KINDS]
    if bad or not items:
        raise ValueError(f"unknown CMAP kinds {bad or items}; choose from {', '.join(CMAP_KINDS)}")
    return items


def scopes(circuit: Circuit) -> dict[str, Scope]:
    """One scope per non-empty group (its heads at its position) and the whole circuit (every group at its own)."""
    out = {g: [(h, circuit.positions[g]) for h in hs] for g, hs in circuit.groups.items() if hs}
    out[CIRCUIT_SCOPE] = circuit.pairs()
    return out


def capture_sites(heads: Iterable[Head]) -> list[tuple[str, int]]:
    """The sites the fine-tune's run must capture to patch ``heads`` in any kind."""
    layers = sorted({h.layer for h in heads})
    return [(kind, layer) for layer in layers for kind in ("q", "k", "v", "z")]


def cmap_patches(model: LoadedModel, scope: Scope, kind: str, captured: dict, positions: dict[str, torch.Tensor],
                 seq_len: int) -> list[Patch]:
    """Patches that write the captured (fine-tune) activations of ``scope`` into the receiving model.

    ``captured``: ``(site kind, layer) -> "batch pos cols"`` from the donor's run on the same prompts;
    ``positions``: position name -> LongTensor ``[batch]``. ``kind`` is one of :data:`CMAP_KINDS`.
    """
    patches: list[Patch] = []
    done: set = set()
    for component in parse_kinds([kind])[0]:
        for head, pos_name in scope:
            pos = positions[pos_name]
            if (pos < 0).any():
                raise ValueError(f"position {pos_name!r} is absent from some prompts; CMAP needs it in every prompt")
            cols = model.arch.columns(component, head.head, model.shape)
            site = captured[(component, head.layer)]
            if component in ("z", "q"):
                rows = torch.arange(site.shape[0], device=site.device)
                value = site[rows, pos.to(site.device), cols]
                patches.append(Patch(component, head.layer, value, pos, cols))
                continue
            key = (component, head.layer, cols.start, pos_name)  # one patch per KV group and position
            if key in done:
                continue
            done.add(key)
            keep = (torch.arange(seq_len)[None, :] > pos[:, None]).float()[..., None]  # 1 after the position
            patches.append(Patch(component, head.layer, site[:, :, cols], None, cols, mask=keep))
    return patches


@dataclass
class CMAPRow:
    """Accuracy of the base with one scope's activations of one kind patched in from the fine-tune."""

    scope: str
    kind: str
    accuracy: Estimate
    answer_prob: Estimate
    recovered: float  # (patched - base) / (fine-tune - base), NaN when the two models tie

    def to_dict(self) -> dict:
        return {"scope": self.scope, "kind": self.kind, "accuracy": self.accuracy.to_dict(),
                "answer_prob": self.answer_prob.to_dict(), "recovered": self.recovered}


@dataclass
class CMAPResult:
    """Base and fine-tune accuracies and one row per (scope, kind)."""

    base: str
    finetune: str
    base_accuracy: Estimate
    finetune_accuracy: Estimate
    rows: list[CMAPRow]
    base_answer_prob: Optional[Estimate] = None
    finetune_answer_prob: Optional[Estimate] = None
    positions: dict[str, str] = field(default_factory=dict)
    caption: str = CAPTION

    def to_dict(self) -> dict:
        probs = {k: v.to_dict() for k, v in (("base_answer_prob", self.base_answer_prob),
                                              ("finetune_answer_prob", self.finetune_answer_prob)) if v is not None}
        return {"base": self.base, "finetune": self.finetune, "caption": self.caption,
                "base_accuracy": self.base_accuracy.to_dict(), "finetune_accuracy": self.finetune_accuracy.to_dict(),
                **probs, "positions": self.positions, "rows": [r.to_dict() for r in self.rows]}


def _score(logits: torch.Tensor, answer: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    logits = logits.float()
    answer = answer.to(logits.device)
    correct = (logits.argmax(-1) == answer).cpu().numpy()
    prob = logits.softmax(-1).gather(1, answer[:, None])[:, 0].cpu().numpy()
    return correct, prob


def run_cmap(base: LoadedModel, finetune: LoadedModel, circuit: Circuit, records: Sequence[EntityTrackingExample],
             kinds: Sequence[str] = CMAP_KINDS, batch_size: int = 32, groups: Optional[Iterable[str]] = None,
             progress: bool = True) -> CMAPResult:
    """CMAP from ``finetune`` into ``base`` for each group of ``circuit`` and the whole circuit."""
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
    scores: dict = {key: ([], []) for key in ["base", "finetune", *((s, k) for s in all_scopes for k in kinds)]}
    for rows in tqdm(batches(len(records), batch_size), desc="cmap", disable=not progress):
        batch = batch_tensors(records[rows])
        ids, answer = batch["input_ids"], batch["answer_ids"]
        with torch.no_grad():
            donor = run(finetune, ids, capture=sites)
            captured = {key: t.to(base.device) for key, t in donor.captured.items()}
            _append(scores["finetune"], _score(donor.logits, answer))
        with base.session():  # remote: the base's plain and patched runs of this batch in one request
            scored = keep(_base_scores(base, ids, answer, captured, all_scopes, kinds, batch["positions"]))
        for key, value in scored.items():
            _append(scores[key], value)
    return _result(base, finetune, circuit, scores, all_scopes, kinds)


def _base_scores(base: LoadedModel, ids: torch.Tensor, answer: torch.Tensor, captured: dict, all_scopes: dict,
                 kinds: list[str], positions: dict) -> dict:
    """``(correct, prob)`` of the base, plain and with each (scope, kind) patched from the donor's ``captured``."""
    out = {}
    # Patched runs resume at their scope's first layer from the plain run's residual (exact: nothing
    # earlier is patched), skipping the blocks before it, and compute only the positions from the first
    # patched one on, reading earlier keys and values from the plain run (suffix runs).
    first = {scope: min(h.layer for h, _ in pairs) for scope, pairs in all_scopes.items()}
    with torch.no_grad():
        plain = run(base, ids, capture=[("resid", layer - 1) for layer in sorted(set(first.values()) - {0})],
                    keep_kv=True)
        out["base"] = _score(plain.logits, answer)
        for scope, pairs in all_scopes.items():
            resume = Resume(first[scope], plain.captured[("resid", first[scope] - 1)]) if first[scope] else None
            for kind in kinds:
                patches = cmap_patches(base, pairs, kind, captured, positions, ids.shape[1])
                out[(scope, kind)] = _score(run(base, ids, patches, resume=resume, prefix=plain.kv).logits, answer)
    return out


def _append(store: tuple[list, list], scored: tuple[np.ndarray, np.ndarray]) -> None:
    store[0].append(scored[0])
    store[1].append(scored[1])


def _result(base: LoadedModel, finetune: LoadedModel, circuit: Circuit, scores: dict, all_scopes: dict,
            kinds: list[str]) -> CMAPResult:
    acc = {key: bootstrap(np.concatenate(c).astype(float)) for key, (c, _) in scores.items()}
    prob = {key: bootstrap(np.concatenate(p)) for key, (_, p) in scores.items()}
    b, f = acc["base"].value, acc["finetune"].value
    rows = [CMAPRow(s, k, acc[(s, k)], prob[(s, k)], (acc[(s, k)].value - b) / (f - b) if f != b else float("nan"))
            for s in all_scopes for k in kinds]
    positions = {g: circuit.positions[g] for g in circuit.groups}
    return CMAPResult(base.name, finetune.name, acc["base"], acc["finetune"], rows, prob["base"], prob["finetune"],
                      positions)
