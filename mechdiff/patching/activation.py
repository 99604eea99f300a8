"""Activation patching (clean <- counterfactual) of any set of heads and the embeddings.

Components are `Head` (its ``z`` slice, the input of the
output projection) or ``"EMB"`` (the token-embedding output). Positions are a LongTensor
``[batch]`` (one position per example, from the dataset's position records) or ``None``
(every position).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Sequence

import torch

from ..common.components import Component, Head
from ..models.loading import LoadedModel
from ..models.remote import keep
from .core import EMB_LAYER, Patch, Prefix, run


def _sites(components: Iterable[Component]) -> list[tuple[str, int]]:
    sites = set()
    for c in components:
        if isinstance(c, Head):
            sites.add(("z", c.layer))
        elif c == "EMB":
            sites.add(("emb", EMB_LAYER))
        else:
            raise ValueError(f"cannot patch {c!r}: activation patching supports heads (L<l>H<h>) and EMB")
    return sorted(sites, key=lambda s: s[1])


def patches_from(
    model: LoadedModel, components: Iterable[Component], source: dict, positions: Optional[torch.Tensor] = None
) -> list[Patch]:
    """Patches writing ``source`` (captured ``{(kind, layer): "batch pos cols"}``) into ``components``.

    Heads of one layer are merged into one patch per layer (one write per site).
    """
    by_layer: dict[int, list[Head]] = defaultdict(list)
    patches = []
    for c in components:
        if isinstance(c, Head):
            by_layer[c.layer].append(c)
        elif c == "EMB":
            patches.append(_patch(source[("emb", EMB_LAYER)], "emb", EMB_LAYER, None, positions))
    d = model.shape.d_head
    for layer, heads in by_layer.items():
        value = source[("z", layer)]
        mask = torch.zeros(value.shape[-1], dtype=torch.bool)
        for h in heads:
            mask[h.head * d : (h.head + 1) * d] = True
        patches.append(_patch(value, "z", layer, mask, positions))
    return patches


def _patch(
    value: torch.Tensor, kind: str, layer: int, mask: Optional[torch.Tensor], positions: Optional[torch.Tensor]
) -> Patch:
    """One patch of the columns in ``mask`` (all if ``None``): untouched columns keep their clean value."""
    if positions is not None:
        value = value[torch.arange(value.shape[0]), positions.to(value.device)]
    if mask is None:
        return Patch(kind, layer, value, positions)
    cols = mask.nonzero()[:, 0]
    if (cols.diff() == 1).all():  # contiguous: a plain column slice
        return Patch(kind, layer, value[..., cols[0] : cols[-1] + 1], positions, slice(int(cols[0]), int(cols[-1]) + 1))
    # non-contiguous heads: write the whole site, clean values restored by the mask
    return Patch(kind, layer, value, positions, mask=(~mask).float())


def activation_patch(
    model: LoadedModel,
    clean_ids: torch.Tensor,
    source_ids: torch.Tensor,
    components: Sequence[Component],
    positions: Optional[torch.Tensor] = None,
    source: Optional[dict] = None,
    prefix: Optional[Prefix] = None,
) -> torch.Tensor:
    """Last-token logits (``"batch vocab"``) of the clean run with ``components`` patched from the source run.

    ``source``: the source run's captured sites, if already computed (``capture_sources``).
    ``prefix``: the clean run's keys and values (``run(model, clean_ids, keep_kv=True).kv``): with
    ``positions``, only the positions from the earliest patched one on are computed (a suffix run).
    """
    with model.session():  # remote: the source run and the patched run in one request
        if source is None:
            source = capture_sources(model, source_ids, components)
        with torch.no_grad():
            patches = patches_from(model, components, source, positions)
            logits = keep(run(model, clean_ids, patches, prefix=prefix).logits)
    return logits


def capture_sources(model: LoadedModel, input_ids: torch.Tensor, components: Sequence[Component]) -> dict:
    """The sites that ``components`` live in, captured from an unpatched run on ``input_ids``."""
    with torch.no_grad():
        return run(model, input_ids, capture=_sites(components)).captured
