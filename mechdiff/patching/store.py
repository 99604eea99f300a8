"""HDF5 activation store: cached activations and position-wise means, keyed by model and dataset.

One file holds many entries. An entry is addressed by a `StoreKey`
``(model_fingerprint, dataset_hash, kind, positions)``: ``kind`` is a site kind
(``z``, ``q``, ``k``, ``v``) or ``z_mean`` etc. for position-wise means, ``positions``
is ``"all"`` or the name of a dataset position record (``last``, ``query_label``...).

Layout: group ``/<kind>/<positions>/<fingerprint[:16]>-<dataset[:16]>`` with one chunked,
gzip-compressed dataset per layer (``L0``, ``L1``...), a ``done`` mask of completed
batches, and attributes (full fingerprint, dataset hash, mechdiff version, shapes,
``complete``). Reads check the attributes against the asking model and dataset and
refuse a mismatch (`StoreMismatchError`); nothing is ever silently reused.

Writes are atomic and resumable: a write goes to ``<path>.partial`` (a copy of the
current file plus the new entry), every finished batch is flushed and marked in
``done``, and only a complete entry is renamed over ``<path>``. A crash leaves
``<path>`` as it was; the next run reopens ``<path>.partial`` and computes only the
batches not marked done.

The store is a cache, so it heals: a file HDF5 cannot open (truncated, garbled), an entry whose
arrays are shorter than its recorded shape, or a chunk whose checksum fails on read is moved
aside under a timestamped name (``<path>.unreadable-<time>``) with a warning, and the entry is
computed again (`mechdiff.common.io.set_aside`). An unreadable ``.partial`` is set aside the same way.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import h5py
import numpy as np
import torch

from ..common.io import atomic_open, set_aside
from ..common.progress import progress_bar
from ..models.loading import LoadedModel
from ..tasks.base import batch_tensors, dataset_hash, group_key, group_name, grouped_batches, take
from ..version import __version__
from .evaluate import batches

log = logging.getLogger(__name__)

# compute_fn(model, batch_records) -> {layer: tensor "batch ... cols"} for one batch
ComputeFn = Callable[[LoadedModel, Sequence], dict[int, torch.Tensor]]


class StoreMismatchError(ValueError):
    """An entry was written for another model, dataset or shape than the one asking."""


class StoreCorruptError(OSError):
    """The store file or one of its entries cannot be read back as written."""


@dataclass(frozen=True)
class StoreKey:
    """What an entry holds: whose activations (model, dataset), which site kind, which positions."""

    model_fingerprint: str
    dataset_hash: str
    kind: str
    positions: str = "all"

    @property
    def group(self) -> str:
        return f"{self.kind}/{self.positions}/{self.model_fingerprint[:16]}-{self.dataset_hash[:16]}"

    def attrs(self) -> dict[str, str]:
        return {
            "model_fingerprint": self.model_fingerprint,
            "dataset_hash": self.dataset_hash,
            "kind": self.kind,
            "positions": self.positions,
        }


class Entry:
    """A read-only view of one complete entry; every read opens the file and streams a slice."""

    def __init__(self, path: Path, key: StoreKey) -> None:
        self.path, self.key = path, key
        with h5py.File(path, "r") as f:
            g = f[key.group]
            self.layers: list[int] = sorted(int(name[1:]) for name in g if name.startswith("L"))
            self.shape: tuple[int, ...] = tuple(g[f"L{self.layers[0]}"].shape)
            self.attrs = dict(g.attrs)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, layer: int, rows: slice | Sequence[int] = slice(None)) -> torch.Tensor:
        """Rows of one layer (``"row ... cols"``), read without loading the rest of the file.
        Raises `StoreCorruptError` naming the file when the data cannot be read back."""
        try:
            with h5py.File(self.path, "r") as f:
                return torch.from_numpy(np.asarray(f[self.key.group][f"L{layer}"][rows]))
        except (OSError, KeyError) as err:
            raise StoreCorruptError(
                f"{self.path}: entry {self.key.group} layer {layer} cannot be read ({err}) — "
                "delete the file (it is a cache) and it will be recomputed"
            ) from err

    def stack(self, rows: slice | Sequence[int] = slice(None)) -> torch.Tensor:
        """Every layer: ``"layer row ... cols"``."""
        return torch.stack([self.read(layer, rows) for layer in self.layers])


class ActivationStore:
    """Cached activations in one HDF5 file (see the module docstring for layout and guarantees)."""

    def __init__(self, path: str | Path, compression: str = "gzip", compression_opts: int = 4) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.compression, self.compression_opts = compression, compression_opts

    # ----------------------------------------------------------------------------- reading
    def _heal(self) -> None:
        """Set the committed file aside if HDF5 cannot open it (truncated, garbled)."""
        if not self.path.exists():
            return
        try:
            with h5py.File(self.path, "r") as f:
                f.visit(lambda name: None)  # walks every group header
        except (OSError, RuntimeError, KeyError) as err:
            set_aside(self.path, "activation store", err)

    def _short_arrays(self, g: h5py.Group) -> Optional[str]:
        """Why a complete-looking entry is not what was recorded (arrays shorter than ``n_rows`` or
        than the recorded shape, a batch not marked done), or ``None``."""
        n_rows, shape = g.attrs.get("n_rows"), g.attrs.get("shape")
        layers = [name for name in g if name.startswith("L")]
        if not layers:
            return "no layer arrays"
        for name in layers:
            got = g[name].shape
            if n_rows is not None and got[0] != n_rows:
                return f"{name} has {got[0]} rows, {n_rows} recorded"
            if shape is not None and tuple(got) != tuple(int(x) for x in shape):
                return f"{name} has shape {tuple(got)}, {tuple(int(x) for x in shape)} recorded"
        if "done" in g and not np.all(g["done"][()]):
            return "some batches are not marked done"
        return None

    def keys(self) -> list[StoreKey]:
        """Complete entries in the committed file."""
        self._heal()
        if not self.path.exists():
            return []
        found: list[StoreKey] = []
        with h5py.File(self.path, "r") as f:

            def visit(name: str, obj) -> None:
                if isinstance(obj, h5py.Group) and "model_fingerprint" in obj.attrs and obj.attrs.get("complete"):
                    a = obj.attrs
                    found.append(StoreKey(a["model_fingerprint"], a["dataset_hash"], a["kind"], a["positions"]))

            f.visititems(visit)
        return found

    def get(self, key: StoreKey) -> Entry:
        """The complete entry for ``key``; raises `StoreMismatchError` or ``KeyError`` otherwise."""
        self._heal()
        if not self.path.exists():
            raise KeyError(f"{self.path} does not exist; compute the activations with get_or_compute first")
        short: Optional[str] = None
        with h5py.File(self.path, "r") as f:
            if key.group in f:
                _check_attrs(f[key.group].attrs, key, self.path)
                if not f[key.group].attrs.get("complete"):
                    raise KeyError(f"entry {key.group} in {self.path} is incomplete; rerun get_or_compute to finish it")
                short = self._short_arrays(f[key.group])
                if short is None:
                    return Entry(self.path, key)
        if short is not None:  # moved only once the file is closed
            set_aside(self.path, "activation store", f"entry {key.group}: {short}")
            raise KeyError(f"{self.path} had a damaged entry {key.group}; compute it with get_or_compute")
        others = [k for k in self.keys() if (k.kind, k.positions) == (key.kind, key.positions)]
        if others:
            raise StoreMismatchError(
                f"{self.path} holds {key.kind}/{key.positions} only for "
                + ", ".join(f"model {k.model_fingerprint[:12]} dataset {k.dataset_hash[:12]}" for k in others)
                + f", not for model {key.model_fingerprint[:12]} dataset {key.dataset_hash[:12]}; "
                "compute them for this model and dataset (get_or_compute) or use another store"
            )
        raise KeyError(f"{self.path} has no entry {key.group}; compute it with get_or_compute")

    def read(self, model: LoadedModel, records: Sequence, kind: str, positions: str = "all") -> Entry:
        """The entry for this model and dataset, refusing entries written for others."""
        return self.get(StoreKey(model.fingerprint, dataset_hash(records), kind, positions))

    # ----------------------------------------------------------------------------- writing
    def get_or_compute(
        self,
        model: LoadedModel,
        records: Sequence,
        kind: str,
        positions: str = "all",
        compute_fn: Optional[ComputeFn] = None,
        batch_size: int = 32,
        progress: bool = True,
    ) -> Entry:
        """The cached entry, computing (or resuming) the missing batches first.

        ``compute_fn(model, batch_records)`` returns ``{layer: "batch ... cols"}``; by default
        the site ``kind`` of every layer at ``positions`` (see `capture_sites`).
        """
        key = StoreKey(model.fingerprint, dataset_hash(records), kind, positions)
        if positions == "all" and len({len(r.input_ids) for r in records}) > 1:
            raise ValueError(
                f"records of token lengths {sorted({len(r.input_ids) for r in records})} cannot share "
                "one array of every position; store each length apart, or a named position"
            )
        fn = compute_fn or (lambda m, recs: capture_sites(m, recs, kind, positions))
        # batches of one template and length each (any length per batch), written back at their rows
        units = [_unit(rows) for rows in grouped_batches(records, batch_size)]
        return self._ensure(key, len(records), units, lambda u: fn(model, take(records, _rows(u))), progress)

    def means(
        self, model: LoadedModel, records: Sequence, kind: str = "z", batch_size: int = 32, progress: bool = True
    ) -> torch.Tensor:
        """Position-wise means of a site over ``records``: ``"layer pos cols"`` (for z: ``"layer pos (head d_head)"``).

        Stored as per-batch sums (entry kind ``<kind>_mean``) so an interrupted run resumes.
        """
        # Means are of one group (template, token length): position_means takes each group's apart.
        groups = list(dict.fromkeys(group_key(r) for r in records))
        if len(groups) > 1:
            raise ValueError(
                f"position-wise means of one group (template, length) at a time; these records are of "
                f"{'; '.join(group_name(g) for g in groups)}"
            )
        # Per-batch sums: the batch size is part of the key, so a resume never mixes batchings.
        key = StoreKey(model.fingerprint, dataset_hash(records), f"{kind}_mean", f"all-batch{batch_size}")
        rows = batches(len(records), batch_size)

        from .ablation import every_position, position_sums

        def unit(unit_rows: slice) -> dict[int, torch.Tensor]:  # unit i = batch i: its float64 sums
            acts = capture_sites(model, records[rows[unit_rows.start]], kind, "all")
            return {layer: position_sums(t, every_position(t.shape[1]), t.shape[1])[None] for layer, t in acts.items()}

        units = [slice(i, i + 1) for i in range(len(rows))]
        try:
            sums = self._ensure(key, len(rows), units, unit, progress).stack()
        except StoreCorruptError as err:  # a chunk failed its checksum: set the file aside, compute again
            set_aside(self.path, "activation store", err.__cause__ or err)
            sums = self._ensure(key, len(rows), units, unit, progress).stack()
        return sums.sum(1).div(len(records)).float()

    def _ensure(
        self,
        key: StoreKey,
        n_rows: int,
        units: list[Unit],
        unit_fn: Callable[[Unit], dict[int, torch.Tensor]],
        progress: bool,
    ) -> Entry:
        """The entry for ``key``, filled first if it is missing (other models' entries are kept)."""
        try:
            return self.get(key)
        except (KeyError, StoreMismatchError):
            self._fill(key, n_rows, units, unit_fn, progress)
            return self.get(key)

    def _fill(
        self,
        key: StoreKey,
        n_rows: int,
        units: list[Unit],
        unit_fn: Callable[[Unit], dict[int, torch.Tensor]],
        progress: bool,
    ) -> None:
        """Compute the units not yet marked done into ``<path>.partial``, then commit it."""
        with self._lock():
            self._fill_locked(key, n_rows, units, unit_fn, progress)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """An exclusive lock on ``<path>.lock``: one writer at a time; others wait."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _fill_locked(
        self,
        key: StoreKey,
        n_rows: int,
        units: list[Unit],
        unit_fn: Callable[[Unit], dict[int, torch.Tensor]],
        progress: bool,
    ) -> None:
        units_attr = _units_attr(units, n_rows)
        f = self._open_partial()
        try:
            g = f.require_group(key.group)
            if "done" in g:
                _check_attrs(g.attrs, key, self.partial)
                same = len(g["done"]) == len(units) and ("units" not in g or np.array_equal(g["units"][()], units_attr))
                if not same:  # started with other batches: this entry starts again, the rest stays
                    log.warning(
                        "%s: %s was started with another batch size; computing it again", self.partial, key.group
                    )
                    del f[key.group]
                    g = f.require_group(key.group)
            if "done" not in g:
                g.attrs.update(key.attrs())
                g.attrs.update(mechdiff_version=__version__, complete=False, n_rows=n_rows)
                g.create_dataset("done", data=np.zeros(len(units), dtype=bool))
                g.create_dataset("units", data=units_attr)
            todo = [i for i in range(len(units)) if not g["done"][i]]
            if len(todo) < len(units):
                log.info("resuming %s: %d of %d batches already written", key.group, len(units) - len(todo), len(units))
            for i in progress_bar(todo, desc=f"store {key.kind}/{key.positions}", disable=not progress, leave=False):
                out = unit_fn(units[i])
                for layer, t in out.items():
                    ds = self._dataset(g, layer, n_rows, t)
                    ds[units[i]] = t.detach().float().cpu().numpy() if t.dtype != torch.float64 else t.cpu().numpy()
                g["done"][i] = True
                f.flush()
            g.attrs["complete"] = True
            g.attrs["shape"] = list(g[next(n for n in g if n.startswith("L"))].shape)
        finally:
            f.close()
        self.partial.replace(self.path)

    def _dataset(self, g: h5py.Group, layer: int, n_rows: int, t: torch.Tensor) -> h5py.Dataset:
        name = f"L{layer}"
        shape = (n_rows, *t.shape[1:])
        if name in g:
            if g[name].shape != shape:
                raise StoreMismatchError(f"{g.name}/{name} has shape {g[name].shape}, the model produced {shape}")
            return g[name]
        dtype = np.float64 if t.dtype == torch.float64 else np.float32
        chunks = (min(n_rows, max(1, t.shape[0])), *t.shape[1:])
        return g.create_dataset(
            name,
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            fletcher32=True,
            compression=self.compression,
            compression_opts=self.compression_opts,
        )

    def _open_partial(self) -> h5py.File:
        """Open ``<path>.partial`` (resume), else start it from a copy of ``<path>`` (or empty).
        The copy is itself atomic, so an interrupted copy never passes for a partial file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.partial.exists():
            try:
                return h5py.File(self.partial, "a")
            except OSError as err:
                set_aside(self.partial, "unfinished activation store", err)
        self._heal()
        if self.path.exists():
            with open(self.path, "rb") as src, atomic_open(self.partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            return h5py.File(self.partial, "a")
        return h5py.File(self.partial, "w")


class RowStore:
    """Per-row tensors of ``n_rows`` rows in a scratch HDF5 file: written a batch at a time, read back by rows, so
    that only the rows asked for are ever in memory. Uncompressed and contiguous (no chunk index to grow); values are
    read back bit for bit in their dtype (bfloat16 too). The file lives in a temporary directory under
    ``directory`` (default: ``TMPDIR``) and is deleted with the store or by `close`."""

    def __init__(self, n_rows: int, directory: Optional[str | Path] = None) -> None:
        self.n_rows = n_rows
        scratch = tempfile.mkdtemp(prefix="mechdiff-rows-", dir=directory)
        self.path = Path(scratch) / "rows.h5"
        self._file = h5py.File(self.path, "w", rdcc_nbytes=0)
        self._dtypes: dict[str, torch.dtype] = {}
        self._finalizer = weakref.finalize(self, _remove_scratch, self._file, scratch)

    def __contains__(self, name: str) -> bool:
        return name in self._dtypes

    def write(self, name: str, rows: Sequence[int], t: torch.Tensor) -> None:
        """Rows ``rows`` (distinct) of array ``name`` are ``t`` (``"row ..."``); the first write creates the array
        with ``t``'s row shape and dtype."""
        order = np.argsort(np.asarray(rows), kind="stable")
        data = _as_numpy(t.detach().cpu())[order]
        if name not in self._dtypes:
            self._file.create_dataset(name, (self.n_rows, *data.shape[1:]), data.dtype)  # contiguous: no chunk index
            self._dtypes[name] = t.dtype
        self._file[name][np.asarray(rows)[order]] = data

    def read(self, name: str, rows: Sequence[int]) -> torch.Tensor:
        """Rows ``rows`` (distinct) of array ``name``, in the order asked."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        data = self._file[name][rows[order]] if len(rows) else self._file[name][:0]
        if not np.array_equal(order, np.arange(len(rows))):
            data[order] = data.copy()
        t = torch.from_numpy(data)
        return t.view(self._dtypes[name]) if t.dtype != self._dtypes[name] else t

    def close(self) -> None:
        """Close and delete the file."""
        self._finalizer()


class MemoryRows:
    """`RowStore`'s interface over host memory: each array is allocated whole at its first write (``n_rows``
    rows of its row shape and dtype) and read back by rows, bit for bit. For what is small enough to hold (DCM's
    source ``z`` at a group's heads and positions, as the paper holds it)."""

    def __init__(self, n_rows: int) -> None:
        self.n_rows = n_rows
        self._arrays: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._arrays

    def write(self, name: str, rows: Sequence[int], t: torch.Tensor) -> None:
        """Rows ``rows`` (distinct) of array ``name`` are ``t`` (``"row ..."``)."""
        t = t.detach().cpu()
        if name not in self._arrays:
            self._arrays[name] = t.new_zeros((self.n_rows, *t.shape[1:]))
        self._arrays[name][torch.as_tensor(list(rows), dtype=torch.long)] = t

    def read(self, name: str, rows: Sequence[int]) -> torch.Tensor:
        """Rows ``rows`` of array ``name``, in the order asked (a copy)."""
        return self._arrays[name][torch.as_tensor(list(rows), dtype=torch.long)]

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(a.numel() * a.element_size() for a in self._arrays.values())

    def close(self) -> None:
        """Drop the arrays."""
        self._arrays.clear()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as numpy holds them; bfloat16 (which numpy lacks) as its bits, in int16."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _remove_scratch(file: h5py.File, directory: str) -> None:
    file.close()
    shutil.rmtree(directory, ignore_errors=True)


Unit = slice | list[int]
"""The rows of an entry one batch writes: a range, or the (increasing) rows of one group's batch."""


def _unit(rows: list[int]) -> Unit:
    """A batch's rows as a slice where they are consecutive (every batch of records of one group)."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else list(rows)


def _rows(unit: Unit) -> list[int]:
    return list(range(unit.start, unit.stop)) if isinstance(unit, slice) else list(unit)


def _units_attr(units: list[Unit], n_rows: int) -> np.ndarray:
    """How the entry is batched, recorded so a resume never mixes batchings: ``[[start, stop], ...]`` for
    ranges; otherwise each row's batch number."""
    if all(isinstance(u, slice) for u in units):
        return np.array([[u.start, u.stop] for u in units], dtype=np.int64)
    out = np.full(n_rows, -1, dtype=np.int64)
    for i, u in enumerate(units):
        out[_rows(u)] = i
    return out


def _check_attrs(attrs, key: StoreKey, path: Path) -> None:
    for name, want in key.attrs().items():
        got = attrs.get(name)
        if got != want:
            raise StoreMismatchError(
                f"{path}: entry {key.group} has {name}={got!r} but the request is for {want!r}; "
                "it was written by another model or dataset and will not be used. Use another store path "
                "or delete the entry."
            )


def capture_sites(
    model: LoadedModel, records: Sequence, kind: str, positions: str = "all", layers: Optional[Sequence[int]] = None
) -> dict[int, torch.Tensor]:
    """Site ``kind`` of every layer for one batch: ``"batch pos cols"`` (``positions="all"``)
    or ``"batch cols"`` at the named position record."""
    from .core import run

    layers = range(model.shape.n_layers) if layers is None else layers
    batch = batch_tensors(list(records))
    with torch.no_grad():
        out = run(model, batch["input_ids"], capture=[(kind, layer) for layer in layers])
    acts = {layer: out.captured[(kind, layer)] for layer in layers}
    if positions == "all":
        return acts
    if positions not in batch["positions"]:
        raise ValueError(f"unknown position {positions!r}; records have {sorted(batch['positions'])}")
    pos = batch["positions"][positions]
    if (pos < 0).any():
        raise ValueError(f"some records have no {positions!r} position (-1); select records that have it")
    rows = torch.arange(len(pos))
    return {layer: t[rows, pos.to(t.device)] for layer, t in acts.items()}
