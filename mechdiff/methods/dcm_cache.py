"""What every DCM run on one list of pairs reads (`mechdiff.methods.dcm`): the source runs' z at the heads a group
patches, the mixing patches that write it (at one position, or at every token of a position class), and `PairCache`,
which holds both with the base runs' residual streams, keys and values for training, validation and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch
from einops import rearrange, repeat

from ..circuits.scoring import class_indices, is_one_token
from ..common.components import Head
from ..common.metrics import answer_is_top1, answer_logit, sequence_is_greedy, sequence_logprob
from ..common.progress import progress_bar
from ..models.loading import LoadedModel
from ..patching.core import Patch, Prefix, Resume, run
from ..patching.evaluate import batches
from ..patching.store import MemoryRows, RowStore
from ..tasks.base import (
    PairRecord,
    group_batches,
    grouped_batches,
    pair_batch_tensors,
    record_order,
    take,
    target_tokens,
    token_tensors,
)

#: A batch's targets: ids ``"batch"`` (one token each), or tokens ``"batch a"`` and lengths ``"batch"`` (several).
Target = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def target_score(logits: torch.Tensor, target: Target) -> torch.Tensor:
    """Per pair, what DCM's loss raises: the target's logit (one token, the paper's loss) or, for targets of
    several tokens (teacher-forced ``logits`` ``"batch a vocab"``), its summed log-probability."""
    if isinstance(target, tuple):
        return sequence_logprob(logits, *target)
    return answer_logit(logits, target)


def target_correct(logits: torch.Tensor, target: Target) -> torch.Tensor:
    """Per pair, whether the run gives the target: its top-1 token, or greedy decoding of its every token."""
    if isinstance(target, tuple):
        return sequence_is_greedy(logits, *target)
    return answer_is_top1(logits, target)


# ---------------------------------------------------------------------------------------------
# The source runs' z and the mixing patches
# ---------------------------------------------------------------------------------------------


def _positions(batch: dict, name: str, which: str) -> torch.Tensor:
    pos = batch[which]["positions"][name]
    if (pos < 0).any():
        raise ValueError(
            f"position {name!r} is absent from some {which} prompts (e.g. path-patching sources); "
            "DCM needs the group's position in both prompts of every pair"
        )
    return pos


def source_run(model: LoadedModel, batch: dict, layers: Iterable[int]) -> dict[int, torch.Tensor]:
    """The source run's z (``"batch pos (head d_head)"``) at every layer of ``layers``, one forward for them all."""
    with torch.no_grad():
        out = run(model, batch["source"]["input_ids"], capture=[("z", layer) for layer in sorted(set(layers))])
    return {layer: z for (_, layer), z in out.captured.items()}


def z_at(z: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str) -> dict[int, torch.Tensor]:
    """The source run's z (`source_run`) at ``position``, per layer of ``layers`` (``"batch (head d_head)"``)."""
    pos = _positions(batch, position, "source")
    rows = torch.arange(pos.shape[0])
    return {layer: z[layer][rows, pos.to(z[layer].device)].detach() for layer in layers}


def source_z(model: LoadedModel, batch: dict, layers: Sequence[int], position: str) -> dict[int, torch.Tensor]:
    """The source run's z (``"batch (head d_head)"``) at ``position``, per layer."""
    return z_at(source_run(model, batch, layers), batch, layers, position)


def masked_z_patches(
    model: LoadedModel,
    heads: Sequence[Head],
    mask: torch.Tensor,
    values: dict[int, torch.Tensor],
    positions: torch.Tensor,
) -> list[Patch]:
    """One mixing patch per layer: ``z <- m * z + (1 - m) * value`` for ``heads`` (mask ``[len(heads)]``),
    other heads of the layer untouched (m = 1). Differentiable in ``mask``."""
    shape = model.shape
    index = torch.tensor([h.layer * shape.n_heads + h.head for h in heads], device=mask.device)
    full = torch.ones(shape.n_layers * shape.n_heads, dtype=mask.dtype, device=mask.device)
    full = full.index_put((index,), mask)  # out of place: keeps the graph to ``mask``
    per_layer = rearrange(full, "(layer head) -> layer head", head=shape.n_heads)
    return [
        Patch("z", layer, values[layer], positions, mask=repeat(per_layer[layer], "head -> (head d)", d=shape.d_head))
        for layer in sorted({h.layer for h in heads})
    ]


def class_z_at(
    z: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str, k: int
) -> dict[int, torch.Tensor]:
    """The source run's z (`source_run`) at every token of position class ``position``, in order
    (``"batch k (head d_head)"``, zero-filled past a prompt's own tokens), per layer of ``layers``."""
    index, real = class_indices(batch["source"], position)
    if index.shape[1] > k:
        raise ValueError(f"class {position!r} has {index.shape[1]} tokens in a source prompt; the cache holds {k}")
    rows = torch.arange(index.shape[0])[:, None]
    values = {}
    for layer in layers:
        at = z[layer][rows.to(z[layer].device), index.clamp(min=0).to(z[layer].device)]
        keep = real[..., None].to(at.device)
        values[layer] = _pad(torch.where(keep, at, torch.zeros_like(at)), 1, k).detach()
    return values


def source_class_z(
    model: LoadedModel, batch: dict, layers: Sequence[int], position: str, k: int
) -> dict[int, torch.Tensor]:
    """The source run's z at every token of position class ``position`` (`class_z_at`), per layer."""
    return class_z_at(source_run(model, batch, layers), batch, layers, position, k)


def class_z_patches(
    model: LoadedModel,
    heads: Sequence[Head],
    mask: torch.Tensor,
    values: dict[int, torch.Tensor],
    index: torch.Tensor,
    real: torch.Tensor,
    length: int,
) -> list[Patch]:
    """`masked_z_patches` at every token of a position class: the ``j``-th real token ``index[:, j]`` of each
    prompt mixes in ``values[layer][:, j]`` (``"batch k (head d_head)"``); a prompt whose class is empty is left as
    it is. Each patch covers positions from the batch's first class token to the prompt's end (``length``), its
    mask 1 (keep) outside the class, so suffix runs start at the class. Differentiable in ``mask``."""
    shape = model.shape
    slot = torch.tensor([h.layer * shape.n_heads + h.head for h in heads], device=mask.device)
    full = torch.ones(shape.n_layers * shape.n_heads, dtype=mask.dtype, device=mask.device).index_put((slot,), mask)
    per_layer = rearrange(full, "(layer head) -> layer head", head=shape.n_heads)
    rows, cols = real.nonzero(as_tuple=True)
    tokens = index[rows, cols]
    start = int(tokens.min()) if len(tokens) else length - 1
    cell = torch.zeros(index.shape[0], length, dtype=torch.bool)
    cell[rows, tokens] = True
    cell = cell[:, start:, None].to(mask.device)
    patches = []
    for layer in sorted({h.layer for h in heads}):
        value = values[layer].new_zeros(index.shape[0], length, values[layer].shape[-1])
        value[rows, tokens] = values[layer][rows, cols]
        keep = repeat(per_layer[layer], "head -> (head d)", d=shape.d_head)
        mix = torch.where(cell, keep[None, None], torch.ones_like(keep)[None, None])  # "batch pos cols"
        patches.append(Patch("z", layer, value[:, start:], slice(start, length), mask=mix))
    return patches


class UnequalClass(ValueError):
    """A pair whose base and source prompts hold different numbers of a position class's tokens."""


def class_widths(pairs: Sequence[PairRecord], positions: Iterable[str], batch_size: int) -> dict[str, int]:
    """For each of ``positions`` that is a class (not one named token a prompt), the most tokens it has in a
    prompt of ``pairs`` (at least 1). A pair whose base and source prompts hold different numbers of the class's
    tokens is refused: DCM writes the source's ``j``-th token of the class into the base's ``j``-th."""
    widths: dict[str, int] = {}
    for rows in grouped_batches(pairs, batch_size):
        batch = pair_batch_tensors(take(pairs, rows))
        for name in positions:
            if is_one_token(batch["base"], name):
                continue
            (_, base), (_, source) = class_indices(batch["base"], name), class_indices(batch["source"], name)
            counts = base.sum(1), source.sum(1)
            bad = (counts[0] != counts[1]).nonzero()
            if len(bad):
                i = int(bad[0])
                raise UnequalClass(
                    f"pair {rows[i]}: position class {name!r} has {int(counts[0][i])} tokens in the base prompt "
                    f"and {int(counts[1][i])} in the source prompt; DCM patches the class token for token"
                )
            widths[name] = max(widths.get(name, 1), base.shape[1])
    return widths


# ---------------------------------------------------------------------------------------------
# The pair cache
# ---------------------------------------------------------------------------------------------


#: How a `PairCache` holds what patched runs read (``[dcm] cache``; the plan's choice where "auto"):
#: ``"file"`` streams a scratch file of the base runs' keys, values and entering residual streams and the sources'
#: ``z`` (patched runs are suffix runs from the group's layer and position); ``"memory"`` holds only the sources'
#: ``z`` at the groups' heads and positions in host memory, as the paper does (patched runs are full runs);
#: ``"recompute"`` holds nothing but the floor and runs each batch's sources again (full runs). The three give the
#: same outcomes but for float rounding (a suffix run over a stored prefix and a full run sum in another order).
CACHE_MODES = ("file", "memory", "recompute")


@dataclass
class PairCache:
    """What every DCM run on one list of pairs shares, computed in one pass over them and streamed from disk.

    Per pair: the source run's z at each ``(layer, position)`` a group patches (at every token of a position
    class, zero-padded to the most tokens a prompt has: `classes`); the base run's
    residual stream entering each group's first layer, so that patched runs resume there and
    skip the blocks before (`Resume`; exact, since nothing
    before that layer is patched); the base run's keys and values, so that patched runs (and DCM's
    backward passes) compute only the positions from the patched one on (suffix runs); and whether
    the unpatched base already gives the target (the floor). Training, validation, test and the
    random baseline all read from it.

    The activations are written to a scratch HDF5 file (`RowStore`, under
    ``TMPDIR``) a batch at a time and read back by the rows each patched run needs, so memory holds one batch's
    activations whatever the number of pairs (the paper-form study's 2000 SmolLM2 pairs: about 17 GB on disk);
    the values read back are the ones computed, bit for bit. The file is deleted with the cache. Where that file
    does not fit (`CACHE_MODES`), ``mode="memory"`` holds only the sources' ``z`` in host memory and
    ``mode="recompute"`` runs the sources again for every batch; both run patched runs in full (no keys, values or
    residual streams stored).

    Pairs of several token lengths and templates are run group by group
    (`grouped_batches`); the residual streams and keys/values of shorter pairs
    are stored zero-filled to the longest pair's length and cut back to their own length when read, so
    no padding ever enters a run. Every per-pair result is in the pairs' order.
    """

    pairs: list[PairRecord]
    store: Union[RowStore, MemoryRows]  # "source/<position>", "resid/<layer>", "keys", "values": one row per pair
    sites: dict[str, list[int]]  # position -> the layers whose source z is stored there (in the row's order)
    starts: list[int]  # the layers whose entering residual stream is stored (patched runs resume there)
    floor: np.ndarray  # bool per pair: target is the unpatched base's top-1
    suffix: bool = True  # patched runs read the base's keys and values (suffix runs); False: full-length runs
    #: The most tokens a target has: runs append the first ``width - 1`` (right-padded) to every base prompt, and the
    #: stored residual streams, keys and values cover them (one teacher-forced base run per pair).
    width: int = 1
    #: Position classes of several tokens among the sites -> the most tokens a prompt has there: the source z of
    #: every token of the class is stored (``"row layer k (head d_head)"``) and patched (`class_z_patches`).
    classes: dict[str, int] = field(default_factory=dict)
    mode: str = "file"  # one of CACHE_MODES

    @classmethod
    def build(
        cls,
        model: LoadedModel,
        pairs: Sequence[PairRecord],
        groups: Iterable[tuple[Sequence[Head], str]],
        batch_size: int = 32,
        progress: bool = False,
        mode: str = "file",
    ) -> "PairCache":
        """Two forward passes per pair, one source run (the sites of every ``(heads, position)`` in ``groups``; none
        under ``mode="recompute"``) and one base run; a target of several tokens is appended to the base prompt
        (teacher forcing), and the base run covers it. ``mode``: one of `CACHE_MODES`."""
        if mode not in CACHE_MODES:
            raise ValueError(f"DCM's cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        pairs = list(pairs)
        groups = [(list(heads), pos) for heads, pos in groups]
        sites = {pos: sorted({h.layer for hs, p in groups if p == pos for h in hs}) for _, pos in groups}
        sites = {pos: layers for pos, layers in sorted(sites.items()) if layers}
        starts = sorted({min(h.layer for h in heads) for heads, _ in groups if heads} - {0})
        width = max((len(target_tokens(p)) for p in pairs), default=1)
        classes = class_widths(pairs, sites, batch_size)
        store = RowStore(len(pairs)) if mode == "file" else MemoryRows(len(pairs))
        floor = np.zeros(len(pairs), dtype=bool)
        suffix = mode == "file"
        starts = starts if suffix else []  # full runs: nothing to resume from
        cache = cls(pairs, store, sites, starts, floor, suffix, width=width, classes=classes, mode=mode)
        length = max((len(p.base.input_ids) for p in pairs), default=0) + width - 1
        batches = grouped_batches(pairs, batch_size)
        for rows in progress_bar(batches, desc="dcm cache", disable=not progress, leave=False):
            cache._write(model, rows, length)
        return cache

    def _write(self, model: LoadedModel, rows: list[int], length: int) -> None:
        """One batch's source z, base residual streams, keys and values and floor, stored at ``rows``."""
        batch = pair_batch_tensors(take(self.pairs, rows))
        if self.mode != "recompute":
            self._write_sources(model, batch, rows)  # its run freed before the base run
        ids, readout, target = self._teacher(batch, rows)
        with torch.no_grad():
            capture = [("resid", layer - 1) for layer in self.starts]
            out = run(model, ids, capture=capture, keep_kv=self.suffix, readout=readout)
        for layer in self.starts:
            self.store.write(f"resid/{layer}", rows, _pad(out.captured[("resid", layer - 1)], -2, length))
        self.floor[rows] = target_correct(out.logits, target).cpu().numpy()
        if self.suffix:
            for name, kv in (("keys", out.kv.keys), ("values", out.kv.values)):
                self.store.write(name, rows, _pad(torch.stack(kv, dim=1), -2, length))

    def _write_sources(self, model: LoadedModel, batch: dict, rows: list[int]) -> None:
        """One batch's source z at every site, from one source run, stored at ``rows``."""
        source = source_run(model, batch, [layer for layers in self.sites.values() for layer in layers])
        for position, layers in self.sites.items():
            self.store.write(f"source/{position}", rows, self._site_z(source, batch, layers, position))

    def _site_z(
        self, source: dict[int, torch.Tensor], batch: dict, layers: Sequence[int], position: str
    ) -> torch.Tensor:
        """The source run's z at ``position`` for ``layers``, stacked ``"batch layer ..."`` as a row stores it."""
        if position in self.classes:
            z = class_z_at(source, batch, layers, position, self.classes[position])
        else:
            z = z_at(source, batch, layers, position)
        return torch.stack([z[layer] for layer in layers], dim=1)

    def _source_values(
        self, model: LoadedModel, batch: dict, rows: Sequence[int], heads: Sequence[Head], position: str
    ) -> dict[int, torch.Tensor]:
        """The sources' z of pairs ``rows`` at ``position`` for each layer of ``heads``: read from the cache, or
        (``mode="recompute"``) from a source run of the batch now."""
        layers = sorted({h.layer for h in heads})
        if self.mode == "recompute":
            z = self._site_z(source_run(model, batch, layers), batch, layers, position)
            return {layer: z[:, i] for i, layer in enumerate(layers)}
        z = self.store.read(f"source/{position}", rows)
        return {layer: z[:, self.sites[position].index(layer)] for layer in layers}

    def _teacher(self, batch: dict, rows: Sequence[int]) -> tuple[torch.Tensor, Optional[torch.Tensor], Target]:
        """The base run's input ids (the prompts, then the first ``width - 1`` target tokens where a target has
        several), its read-out positions (None: the last) and the batch's `Target`."""
        ids = batch["base"]["input_ids"]
        if self.width == 1:
            return ids, None, batch["target_ids"]
        tokens, lengths = token_tensors([target_tokens(self.pairs[i]) for i in rows])
        tokens = _pad(tokens, 1, self.width)
        n = ids.shape[1]
        readout = (n - 1 + torch.arange(self.width))[None].expand(ids.shape[0], -1)
        return torch.cat([ids, tokens[:, :-1]], 1), readout, (tokens, lengths)

    def close(self) -> None:
        """Delete the cache's file now (it is deleted with the cache otherwise)."""
        self.store.close()

    def logits(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        heads: Sequence[Head],
        mask: torch.Tensor,
        position: str,
        grad: bool = False,
    ) -> tuple[torch.Tensor, Target]:
        """(logits at the last token, target ids) of pairs ``rows`` with ``heads`` mixed under ``mask``, in
        the order of ``rows`` (pairs of several lengths run group by group); for targets of several tokens, the
        teacher-forced logits ``"batch width vocab"`` and (tokens, lengths)."""
        rows = list(rows)
        groups = group_batches(take(self.pairs, rows))
        if len(groups) == 1:
            return self._logits(model, rows, heads, mask, position, grad)
        outs = [self._logits(model, take(rows, g), heads, mask, position, grad) for g in groups]
        back = torch.as_tensor(record_order(groups), dtype=torch.long)
        logits = torch.cat([o[0] for o in outs])[back.to(outs[0][0].device)]
        if self.width == 1:
            return logits, torch.cat([o[1] for o in outs])[back.to(outs[0][1].device)]
        tokens, lengths = (torch.cat([o[1][i] for o in outs])[back] for i in (0, 1))
        return logits, (tokens.to(logits.device), lengths.to(logits.device))

    def _logits(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        heads: Sequence[Head],
        mask: torch.Tensor,
        position: str,
        grad: bool = False,
    ) -> tuple[torch.Tensor, Target]:
        """`logits` of pairs of one length."""
        batch = pair_batch_tensors([self.pairs[i] for i in rows])
        ids, readout, target = self._teacher(batch, rows)
        n = ids.shape[1]
        values = self._source_values(model, batch, rows, heads, position)
        if position in self.classes:
            index, real = class_indices(batch["base"], position)
            patches = class_z_patches(model, heads, mask, values, index, real, batch["base"]["input_ids"].shape[1])
        else:
            patches = masked_z_patches(model, heads, mask, values, _positions(batch, position, "base"))
        first = min(h.layer for h in heads)
        start = max((layer for layer in self.starts if layer <= first), default=0)
        resume = Resume(start, self.store.read(f"resid/{start}", rows)[:, :n]) if start else None
        out = run(model, ids, patches, grad=grad, resume=resume, prefix=self._prefix(rows, n), readout=readout)
        if isinstance(target, tuple):
            return out.logits, (target[0].to(out.logits.device), target[1].to(out.logits.device))
        return out.logits, target.to(out.logits.device)

    def _prefix(self, rows: Sequence[int], n: int) -> Optional[Prefix]:
        """The base run's keys and values of pairs ``rows`` cut to their length ``n`` (None: full-length runs)."""
        if not self.suffix:
            return None
        keys, values = (self.store.read(name, rows)[..., :n, :] for name in ("keys", "values"))
        return Prefix(list(keys.unbind(1)), list(values.unbind(1)))

    def accuracy(
        self,
        model: LoadedModel,
        rows: Sequence[int],
        patched: Sequence[Head],
        position: str,
        batch_size: int = 32,
        progress: bool = False,
    ) -> np.ndarray:
        """Per-pair correctness (top-1 == target) of pairs ``rows`` with ``patched`` heads' z from the source."""
        rows, patched = list(rows), list(patched)
        if not patched:
            return self.floor[rows]
        mask = torch.zeros(len(patched), device=model.device)
        correct = []
        for chunk in progress_bar(batches(len(rows), batch_size), desc="dcm eval", disable=not progress, leave=False):
            with torch.no_grad():
                logits, target = self.logits(model, rows[chunk], patched, mask, position)
            correct.append(target_correct(logits, target).cpu().numpy())
        return np.concatenate(correct)


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` zero-filled along ``dim`` to ``length`` (a shorter pair's stored run; cut back when read)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def target_accuracy(
    model: LoadedModel,
    pairs: Sequence[PairRecord],
    patched: Sequence[Head],
    position: str,
    batch_size: int = 32,
    progress: bool = False,
    mode: str = "file",
) -> np.ndarray:
    """Per-pair correctness (top-1 == target) with ``patched`` heads' z taken from the source at ``position``
    (``mode``: the `PairCache`'s, one of `CACHE_MODES`)."""
    cache = PairCache.build(model, pairs, [(list(patched), position)], batch_size, progress, mode)
    try:
        return cache.accuracy(model, range(len(pairs)), patched, position, batch_size, progress)
    finally:
        cache.close()
