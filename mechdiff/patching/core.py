"""The one intervention driver: a forward pass with patches written and sites captured, on nnsight.

Sites are ``(kind, layer)`` with kind ``z``/``q``/``k``/``v`` (see
:mod:`mechdiff.models.architectures`); a site tensor is ``"batch pos columns"``.
A :class:`Patch` overwrites some columns of one site, at one position per example
or at every position. Patches and captures are visited in execution order
(per layer: q, k, v, then z), as nnsight requires.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from ..components import Head
from ..models.loading import LoadedModel

SITE_ORDER = {"emb": -1, "q": 0, "k": 1, "v": 2, "z": 3, "pattern": 4, "resid": 5}
EMB_LAYER = -1  # the ("emb", -1) site: the token embedding output "batch pos d_model", before every layer
# ("resid", L): the residual stream after block L ("batch pos d_model"), what :class:`Resume` starts from.


@dataclass
class Patch:
    """Write ``value`` into ``columns`` of site ``(kind, layer)``.

    ``positions``: LongTensor ``[batch]`` (one position per example; value ``"batch d"``),
    a ``slice`` of positions (value ``"batch sliced_pos d"``) or ``None`` (every position;
    value ``"batch pos d"``). ``columns=None`` means all columns.
    ``value`` may have batch 1 to broadcast over the batch.

    ``mask`` (optional) MIXES instead of overwriting: ``site <- site * mask + value * (1 - mask)``,
    with ``mask`` broadcastable to the patched slice (``"batch pos cols"``, or ``"batch cols"``
    with ``positions``). It may require grad: under ``run(..., grad=True)`` the mix stays in the
    autograd graph, so gradients reach the mask (DCM, learned circuit masks).
    """

    kind: str
    layer: int
    value: torch.Tensor
    positions: Optional[torch.Tensor] = None
    columns: Optional[slice] = None
    mask: Optional[torch.Tensor] = None

    def apply(self, site: torch.Tensor) -> None:
        cols = self.columns if self.columns is not None else slice(None)
        value = self.value.to(device=site.device, dtype=site.dtype)
        if self.positions is None:
            site[:, :, cols] = self._mix(site[:, :, cols], value)
        elif isinstance(self.positions, slice):
            site[:, self.positions, cols] = self._mix(site[:, self.positions, cols], value)
        else:
            rows = torch.arange(site.shape[0], device=site.device)
            positions = self.positions.to(site.device)
            value = value.expand(site.shape[0], -1) if value.shape[0] == 1 else value
            site[rows, positions, cols] = self._mix(site[rows, positions, cols], value)

    def _mix(self, current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return value
        mask = self.mask.to(device=current.device, dtype=current.dtype)
        # ``current`` may be a view of the site, which is written in place next: clone it so that
        # autograd keeps the pre-write values it needs for the mask's gradient.
        return current.clone() * mask + value * (1 - mask)


@dataclass
class Resume:
    """Start a run at block ``layer``: blocks ``0 .. layer-1`` are skipped (nnsight ``skip``) and the
    residual stream entering ``layer`` is ``hidden`` (``"batch pos d_model"``, e.g. a captured
    ``("resid", layer - 1)`` of the same prompts). Exact when nothing before ``layer`` is patched;
    it saves the cost of the skipped blocks (DCM and CMAP patch only late layers, many times)."""

    layer: int
    hidden: torch.Tensor


@dataclass
class Run:
    """What one patched forward pass returned: logits at the read-out positions and captured sites."""

    logits: torch.Tensor  # "batch vocab" at each example's read-out position
    captured: dict = field(default_factory=dict)  # (kind, layer) -> "batch pos columns"


def head_patch(model: LoadedModel, kind: str, head: Head, value: torch.Tensor,
               positions: Optional[torch.Tensor] = None) -> Patch:
    """A patch of one head's slice (its KV group's slice for ``k``/``v``)."""
    return Patch(kind, head.layer, value, positions, model.arch.columns(kind, head.head, model.shape))


def run(
    model: LoadedModel,
    input_ids: torch.Tensor,
    patches: Iterable[Patch] = (),
    capture: Sequence[tuple[str, int]] = (),
    readout: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    grad: bool = False,
    stop: bool = False,
    resume: Optional[Resume] = None,
) -> Run:
    """One forward pass of ``model`` on ``input_ids`` with ``patches`` written and ``capture`` saved.

    ``readout``: LongTensor ``[batch]`` of positions whose logits are returned (default: last).
    Captured tensors are cloned after this run's patches at that site. With ``grad=True``
    the captured tensors stay in the autograd graph (see the attribution screen).
    ``stop=True`` halts the model after the last patched/captured site (``logits`` is then ``None``).
    ``resume`` skips the blocks before ``resume.layer`` (see :class:`Resume`).
    """
    by_site: dict[tuple[str, int], list[Patch]] = defaultdict(list)
    for p in patches:
        by_site[(p.kind, p.layer)].append(p)
    sites = sorted(set(by_site) | set(capture), key=lambda s: (s[1], SITE_ORDER[s[0]]))
    if resume is not None and sites and sites[0][1] < resume.layer:
        raise ValueError(f"site {sites[0]} lies before the resumed layer {resume.layer}; resume at or before "
                         "the first patched or captured layer")
    arch, nn = model.arch, model.nn
    device = model.device
    input_ids = input_ids.to(device)
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if readout is None:
        kwargs["logits_to_keep"] = 1
    captured: dict = {}
    with torch.set_grad_enabled(grad):
        out = None
        with model.trace(**kwargs) as tracer:  # on NDIF when the model is remote (see models.remote)
            fused_seen: dict[int, torch.Tensor] = {}
            if resume is not None:
                hidden = resume.hidden.to(device)
                for layer in range(resume.layer):
                    arch.block(nn, layer).skip(hidden)
            for kind, layer in sites:
                site = _site(arch, nn, kind, layer, fused_seen)
                for p in by_site.get((kind, layer), ()):
                    p.apply(site)
                if (kind, layer) in capture:
                    captured[(kind, layer)] = site if grad else site.clone()
            if stop:
                captured = captured.save() if hasattr(captured, "save") else captured
                tracer.stop()
            logits = nn.output.logits
            if readout is None:
                out = logits[:, -1]
            else:
                out = logits[torch.arange(logits.shape[0], device=logits.device), readout.to(logits.device)]
            out = out.save()
            captured = captured.save() if hasattr(captured, "save") else captured
    return Run(out, captured)


def _site(arch, nn, kind: str, layer: int, fused_seen: dict) -> torch.Tensor:
    """A site's tensor; fused Q/K/V projections are fetched once per layer; ``emb`` is the embedding output."""
    if kind == "emb":
        from ..models.architectures import _get

        return _get(nn, arch.embed).output
    if kind == "resid":
        return arch.block(nn, layer).output
    if kind in ("q", "k", "v") and arch.qkv_layout != "separate":
        if layer not in fused_seen:
            fused_seen[layer] = arch.site(nn, kind, layer)
        return fused_seen[layer]
    return arch.site(nn, kind, layer)
