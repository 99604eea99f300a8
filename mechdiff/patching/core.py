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


# ---- a forward whose body reads and writes the adapter's sites (the knowledge edge forward) ----------------


class Sites:
    """The sites of one traced forward, handed to a :func:`trace_sites` body; read and write them in
    execution order (per layer: Q/K/V, z, the attention's residual contribution, the MLP input, the
    MLP's contribution; then the final norm and the logits). Tensors are ``"batch pos columns"``."""

    def __init__(self, model: LoadedModel, nn) -> None:
        self.arch, self.nn, self.shape = model.arch, nn, model.shape

    def resid_in(self, layer: int) -> torch.Tensor:
        """The residual stream entering block ``layer`` (block 0: embeddings, position embeddings included)."""
        return self.arch.block(self.nn, layer).input

    def write_qkv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the Q/K/V projection outputs of ``layer`` (before any Q/K norm or rotary embedding) with
        ``q`` ``"batch pos (head d_head)"`` and ``k``, ``v`` ``"batch pos (group d_head)"``."""
        arch = self.arch
        if arch.qkv_layout == "separate":
            for kind, value in (("q", q), ("k", k), ("v", v)):
                arch.projection(self.nn, kind, layer).output[:] = value
            return
        fused = torch.cat([q, k, v], -1)[..., fused_order(arch, self.shape).to(q.device)]
        arch.projection(self.nn, "q", layer).output[:] = fused

    def z(self, layer: int) -> torch.Tensor:
        """The input of the attention output projection, ``"batch pos (head d_head)"``."""
        return self.arch.site(self.nn, "z", layer)

    def attn_post_norm(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and output of the norm applied to the attention output (Gemma 2/3, OLMo 2)."""
        norm = _path(self.arch.block(self.nn, layer), self.arch.attn_post_norm)
        return norm.input, norm.output

    def write_mlp_in(self, layer: int, value: torch.Tensor) -> None:
        """Replace what the MLP of ``layer`` reads (the output of the norm before it)."""
        _path(self.arch.block(self.nn, layer), self.arch.mlp).input = value

    def mlp_out(self, layer: int) -> torch.Tensor:
        """The MLP's contribution to the residual stream (after its post-norm, if the block has one)."""
        block = self.arch.block(self.nn, layer)
        out = _path(block, self.arch.mlp_post_norm or self.arch.mlp).output
        return out[0] if isinstance(out, tuple) else out

    def write_final_norm(self, value: torch.Tensor) -> None:
        self.arch.final_norm_module(self.nn).output[:] = value

    def logits(self) -> torch.Tensor:
        """``"batch vocab"`` at the last position."""
        return self.nn.output.logits[:, -1]


def _path(root, path: str):
    from ..models.architectures import _get

    return _get(root, path)


def fused_order(arch, shape) -> torch.Tensor:
    """Column ``c`` of a fused Q/K/V output is column ``order[c]`` of ``cat([q "(head d)", k "(group d)",
    v "(group d)"])`` (the identity for the ``fused`` layout, a permutation for ``interleaved``)."""
    d, H, G = shape.d_head, shape.n_heads, shape.n_kv_heads
    order = torch.empty((H + 2 * G) * d, dtype=torch.long)
    for kind, base, units in (("q", 0, range(H)), ("k", H * d, range(0, H, H // G)), ("v", (H + G) * d,
                                                                                     range(0, H, H // G))):
        for i, head in enumerate(units):
            cols = arch.columns(kind, head, shape)
            order[cols] = torch.arange(base + i * d, base + (i + 1) * d)
    return order


def trace_sites(model: LoadedModel, input_ids: torch.Tensor, body, grad: bool = False):
    """Run ``model`` on ``input_ids`` (logits at the last position only) with ``body(Sites)`` reading and
    writing sites inside the trace; returns what ``body`` returns. ``grad``: keep the autograd graph."""
    kwargs = {"input_ids": input_ids.to(model.device), "use_cache": False, "logits_to_keep": 1}
    box: dict = {}
    with torch.set_grad_enabled(grad), model.trace(**kwargs):
        box["out"] = body(Sites(model, model.nn))
    return box["out"]
