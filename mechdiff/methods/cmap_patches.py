"""What CMAP (`mechdiff.methods.cmap`) writes into the base's run: the scopes of a circuit (each group at its position,
and the whole circuit), the sites the fine-tune's run captures, the patches of each kind (z, Q, K, V and their
combinations, at one position or at every token of a position class), the isolation of either rule, the paper's
DCM cut of a circuit and layer-matched random scopes.
"""

from __future__ import annotations

import random
from typing import Iterable, Sequence

import torch

from ..circuits.circuit import Circuit
from ..circuits.scoring import is_one_token, position_mask
from ..common.components import Head, layer_matched
from ..models.loading import LoadedModel
from ..patching.core import Patch

CMAP_KINDS: tuple[str, ...] = ("z", "q", "k", "v", "qk", "qkv")
LAST = "last"  # the read-out position
CIRCUIT_SCOPE = "circuit"

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


def cmap_patches(
    model: LoadedModel,
    scope: Scope,
    kind: str,
    captured: dict,
    positions: dict[str, torch.Tensor],
    seq_len: int,
    strict: bool = False,
) -> list[Patch]:
    """Patches that write the captured (fine-tune) activations of ``scope`` into the receiving model.

    ``captured``: ``(site kind, layer) -> "batch pos cols"`` from the donor's run on the same prompts;
    ``positions``: position name -> LongTensor ``[batch]`` (one token a prompt) or a boolean ``"batch pos"`` mask
    (a position class: `scope_positions`; every token of it is patched, and K/V up to its last token).
    ``kind`` is one of `CMAP_KINDS`.
    ``strict``: K/V at positions strictly before the group's (the paper's), else up to and including it.
    """
    patches: list[Patch] = []
    done: set = set()
    for component in parse_kinds([kind])[0]:
        for head, pos_name in scope:
            pos = positions[pos_name]
            if pos.dtype == torch.bool:
                patches += _class_patches(model, head, component, captured, pos, pos_name, strict, done)
                continue
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
            after = (
                torch.arange(seq_len)[None, :] >= pos[:, None]
                if strict
                else torch.arange(seq_len)[None, :] > pos[:, None]
            )
            keep = after.float()[..., None]  # 1 where the base keeps its own K/V
            patches.append(Patch(component, head.layer, site[:, :, cols], None, cols, mask=keep))
    return patches


def scope_positions(batch: dict, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``batch["positions"]``, with each of ``names`` that is a position class (not one named token a prompt) as
    its boolean ``"batch pos"`` mask (`position_mask`: the mask completeness
    scoring keeps)."""
    out = dict(batch["positions"])
    for name in dict.fromkeys(names):
        if not is_one_token(batch, name):
            out[name] = position_mask(batch, name)
    return out


def _class_patches(
    model: LoadedModel,
    head: Head,
    component: str,
    captured: dict,
    cell: torch.Tensor,
    pos_name: str,
    strict: bool,
    done: set,
) -> list[Patch]:
    """One head's ``component`` patch at every token of a class (``cell``, ``"batch pos"``): Q or z at each of the
    tokens; K/V at every position up to and including the class's last token of each prompt (``strict``: strictly
    before it). A prompt where the class is empty is left as it is. Patches start at the batch's first token the
    patch writes (suffix runs start there)."""
    cols = model.arch.columns(component, head.head, model.shape)
    site = captured[(component, head.layer)]
    seq_len = cell.shape[1]
    if component in ("k", "v"):
        key = (component, head.layer, cols.start, pos_name)  # one patch per KV group and position
        if key in done:
            return []
        done.add(key)
        at = torch.arange(seq_len)[None, :]
        last = torch.where(cell.any(1), seq_len - 1 - cell.flip(1).int().argmax(1), -1)[:, None]
        cell = (at < last) if strict else (at <= last)
    written = cell.any(0).nonzero()
    start = int(written[0]) if len(written) else seq_len - 1
    keep = (~cell[:, start:]).float()[..., None]  # 1 where the base keeps its own value
    return [Patch(component, head.layer, site[:, start:, cols], slice(start, seq_len), cols, mask=keep)]


def isolation_patches(
    model: LoadedModel, scope: Scope, kind: str, base_z: dict, positions: dict[str, torch.Tensor], seq_len: int
) -> list[Patch]:
    """z patches that restore the base's own head outputs, so a Q/K/V patch of ``scope`` changes only
    what the scope's heads read at their positions (see the module docstring); none for ``z``.

    From the scope's first layer on, every head's output is restored except at the scope's positions
    and the read-out; in a layer whose K/V are patched, the heads of the patched KV groups are restored
    everywhere except each scope head at its own position. ``base_z``: layer -> the base's plain ``z``."""
    if kind == "z":
        return []
    shape = model.shape
    n = positions[LAST].shape[0]
    free = torch.zeros(n, seq_len, dtype=torch.bool)  # positions whose outputs may change
    _mark(free, positions[LAST])
    for _, pos_name in scope:
        _mark(free, positions[pos_name])
    kv_layers = {h.layer for h, _ in scope} if set(kind) & {"k", "v"} else set()
    patches = []
    for layer in range(min(h.layer for h, _ in scope), shape.n_layers):
        keep = free[:, :, None].expand(n, seq_len, shape.n_heads).clone()  # "batch pos head", True = keep patched
        if layer in kv_layers:
            ours = [(h.head, pos) for h, pos in scope if h.layer == layer]
            groups = {h // shape.group_size for h, _ in ours}
            for head in range(shape.n_heads):
                if head // shape.group_size in groups:
                    keep[:, :, head] = False
            for head, pos in ours:
                _mark(keep[:, :, head], positions[pos])
        mask = keep.repeat_interleave(shape.d_head, dim=2).float()
        patches.append(Patch("z", layer, base_z[layer], None, None, mask=mask))
    return patches


def _mark(cells: torch.Tensor, where: torch.Tensor) -> None:
    """Set ``cells`` (``"batch pos"``, in place) True at one position a prompt (``[batch]``) or at a class's tokens
    (a boolean ``"batch pos"`` mask)."""
    if where.dtype == torch.bool:
        cells |= where.to(cells.device)
    else:
        cells[torch.arange(cells.shape[0]), where] = True


def paper_isolation_patches(
    model: LoadedModel, scope: Scope, kind: str, base_z: dict, positions: dict[str, torch.Tensor], seq_len: int
) -> list[Patch]:
    """The paper's isolation for Q/K/V kinds (none for ``z``): from the scope's first layer on, every head's output
    at every position except the last is reset to the base's clean run (``cmap_in``'s ``o_proj`` branch).
    Under grouped-query attention, in a layer whose K/V are patched, the other query heads of the patched KV
    groups are reset at the last position too. ``base_z``: layer -> the base's plain ``z``."""
    if kind == "z":
        return []
    shape = model.shape
    n = positions[LAST].shape[0]
    free = torch.zeros(n, seq_len, dtype=torch.bool)
    _mark(free, positions[LAST])
    kv_layers = {h.layer for h, _ in scope} if set(kind) & {"k", "v"} else set()
    patches = []
    for layer in range(min(h.layer for h, _ in scope), shape.n_layers):
        keep = free[:, :, None].expand(n, seq_len, shape.n_heads).clone()  # "batch pos head", True = keep patched
        if layer in kv_layers and shape.group_size > 1:
            ours = {h.head for h, _ in scope if h.layer == layer}
            groups = {h // shape.group_size for h in ours}
            for head in range(shape.n_heads):
                if head // shape.group_size in groups and head not in ours:
                    keep[:, :, head] = False
        mask = keep.repeat_interleave(shape.d_head, dim=2).float()
        patches.append(Patch("z", layer, base_z[layer], None, None, mask=mask))
    return patches


def paper_kinds(scope: Scope, kinds: Sequence[str]) -> list[str]:
    """The kinds the paper's rule runs for a scope: every kind if all its pairs sit at the last position, else ``z``."""
    return list(kinds) if all(pos == LAST for _, pos in scope) else [k for k in kinds if k == "z"]


def dcm_cut(circuit: Circuit, dcm: Sequence[dict], selection: dict[str, str]) -> Circuit:
    """``circuit`` with each group named in ``selection`` cut to the heads DCM selected for it under the named
    desideratum (``dcm``: `mechdiff.methods.dcm.DCMResult.to_dict` records); other groups keep every head."""
    from ..common.components import parse_heads
    from ..tasks.desiderata import desideratum_name

    def same(a: str, b: str) -> bool:
        return desideratum_name(a) == desideratum_name(b)

    groups = {}
    for g, heads in circuit.groups.items():
        if g not in selection or not heads:
            groups[g] = list(heads)
            continue
        found = [r for r in dcm if r["group"] == g and same(r["desideratum"], selection[g])]
        if not found:
            raise ValueError(
                f"no DCM result for group {g!r} under desideratum {selection[g]!r}; run DCM on this "
                f"circuit with that desideratum (results: {sorted({(r['group'], r['desideratum']) for r in dcm})})"
            )
        groups[g] = parse_heads(found[0]["selected"])
    meta = {**circuit.meta, "dcm_cut": dict(selection)}
    return Circuit(circuit.model, circuit.task, groups, dict(circuit.positions), names=dict(circuit.names), meta=meta)


def random_scope(scope: Scope, n_heads: int, rng: random.Random) -> Scope:
    """The scope's layers and positions with random heads: as many per (layer, position) as it has."""
    by_position: dict[str, list[Head]] = {}
    for h, pos in scope:
        by_position.setdefault(pos, []).append(h)
    return [(h, pos) for pos, heads in by_position.items() for h in layer_matched(heads, n_heads, rng)]
