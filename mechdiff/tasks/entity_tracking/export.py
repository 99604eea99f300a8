"""Entity-tracking records to and from JSONL and ``datasets``; a dataset directory (`write_dataset`);
hashing and batching (the task protocol's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .. import base
from .building import generate
from .pairs import counterfactual_pairs
from .records import CounterfactualPair, EntityTrackingExample, Record, Vocabulary
from .vocabulary import vocabulary_report

if TYPE_CHECKING:  # heavy imports only for type checkers
    import datasets


# --------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------


def _record_dict(r: Record) -> dict[str, Any]:
    if isinstance(r, EntityTrackingExample):
        return {"type": "example", **r.to_dict()}
    if isinstance(r, CounterfactualPair):
        return {"type": "pair", **r.to_dict()}
    raise TypeError(f"expected EntityTrackingExample or CounterfactualPair, got {type(r).__name__}")


def _record_from_dict(d: Mapping[str, Any]) -> Record:
    d = dict(d)
    kind = d.pop("type", None)
    if kind == "example":
        return EntityTrackingExample.from_dict(d)
    if kind == "pair":
        return CounterfactualPair.from_dict(d)
    raise ValueError(f"unknown record type {kind!r} (expected 'example' or 'pair')")


def write_jsonl(records: Sequence[Record], path: str | os.PathLike) -> None:
    """Write examples and/or pairs, one JSON object per line (with a ``"type"`` field)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(base.canonical_json(_record_dict(r)) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read what `write_jsonl` wrote; equal to the records written."""
    with Path(path).open(encoding="utf-8") as f:
        return [_record_from_dict(json.loads(line)) for line in f if line.strip()]


def dataset_hash(records: Sequence[Record]) -> str:
    """sha256 hex digest of a canonical JSON of the records (order matters). Includes the
    input ids, so the same prompts under another tokenizer hash differently."""
    for r in records:
        _record_dict(r)  # entity-tracking records only
    return base.dataset_hash(records)


def _flat_example(e: EntityTrackingExample, prefix: str = "") -> dict[str, Any]:
    p = e.positions
    return {
        f"{prefix}prompt": e.prompt,
        f"{prefix}answer": e.answer,
        f"{prefix}answer_id": e.answer_id,
        f"{prefix}objects": list(e.objects),
        f"{prefix}labels": list(e.labels),
        f"{prefix}query_index": e.query_index,
        f"{prefix}query_label": e.query_label,
        f"{prefix}input_ids": list(e.input_ids),
        f"{prefix}pos_last": p["last"],
        f"{prefix}pos_query_label": p["query_label"],
        f"{prefix}pos_query_label_context": p["query_label_context"],
        f"{prefix}pos_objects": list(p["objects"]),
        f"{prefix}pos_labels": list(p["labels"]),
    }


def to_hf_dataset(records: Sequence[Record]) -> "datasets.Dataset":
    """A ``datasets.Dataset`` with one row per record. Examples give columns prompt, answer,
    answer_id, objects, labels, query_index, query_label, input_ids, pos_last,
    pos_query_label, pos_query_label_context (null when absent), pos_objects, pos_labels.
    Pairs give the same columns prefixed ``base_`` and ``source_`` plus target, target_id,
    kind. All records must be of one type."""
    import datasets

    records = list(records)
    if not records:
        raise ValueError("no records to export")
    if all(isinstance(r, EntityTrackingExample) for r in records):
        rows = [_flat_example(r) for r in records]
    elif all(isinstance(r, CounterfactualPair) for r in records):
        rows = [
            {
                **_flat_example(r.base, "base_"),
                **_flat_example(r.source, "source_"),
                "target": r.target,
                "target_id": r.target_id,
                "kind": r.kind,
            }
            for r in records
        ]
    else:
        raise TypeError("records must be all EntityTrackingExample or all CounterfactualPair")
    features = _hf_features(records[0])
    return datasets.Dataset.from_list(rows, features=features)


def _hf_features(first: Record) -> "datasets.Features":
    import datasets

    def ex(prefix: str) -> dict[str, Any]:
        i64, s = datasets.Value("int64"), datasets.Value("string")
        return {
            f"{prefix}prompt": s,
            f"{prefix}answer": s,
            f"{prefix}answer_id": i64,
            f"{prefix}objects": datasets.List(s),
            f"{prefix}labels": datasets.List(s),
            f"{prefix}query_index": i64,
            f"{prefix}query_label": s,
            f"{prefix}input_ids": datasets.List(i64),
            f"{prefix}pos_last": i64,
            f"{prefix}pos_query_label": i64,
            f"{prefix}pos_query_label_context": i64,
            f"{prefix}pos_objects": datasets.List(i64),
            f"{prefix}pos_labels": datasets.List(i64),
        }

    if isinstance(first, EntityTrackingExample):
        return datasets.Features(ex(""))
    return datasets.Features(
        {
            **ex("base_"),
            **ex("source_"),
            "target": datasets.Value("string"),
            "target_id": datasets.Value("int64"),
            "kind": datasets.Value("string"),
        }
    )


def batch_tensors(records: Sequence[EntityTrackingExample]) -> dict[str, Any]:
    """`mechdiff.tasks.base.batch_tensors`: ``input_ids``, ``attention_mask``, ``answer_ids`` and
    ``positions`` (``last``, ``query_label``, ``query_label_context`` as ``[batch]`` with ``-1`` where the
    query label is absent from the context; ``objects`` and ``labels`` as ``[batch, n_boxes]``)."""
    records = list(records)
    if records and not all(isinstance(r, EntityTrackingExample) for r in records):
        raise TypeError("batch_tensors takes EntityTrackingExample records; for pairs use pair_batch_tensors")
    return base.batch_tensors(records)


def pair_batch_tensors(pairs: Sequence[CounterfactualPair]) -> dict[str, Any]:
    """`mechdiff.tasks.base.pair_batch_tensors` (bases and sources share one token length)."""
    return base.pair_batch_tensors(pairs)


def write_dataset(
    tokenizer: Any,
    out: str | os.PathLike,
    n: int,
    n_boxes: int,
    seed: int,
    kinds: Sequence[str] = (),
    vocabulary: Vocabulary = None,
    hf: bool = False,
    echo: Callable[[str], None] = print,
) -> None:
    """``n`` prompts (``examples``) and ``n`` pairs of each counterfactual kind in ``kinds``, each written to
    ``out/<name>.jsonl`` (and, with ``hf``, a ``datasets.Dataset`` folder ``out/<name>``); hands ``echo`` the
    vocabulary report (the words dropped) before anything is generated, then one line per set as it is written
    (records, file, hash)."""
    echo(vocabulary_report(tokenizer, vocabulary).summary())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sets = {"examples": generate(tokenizer, n, n_boxes, seed, vocabulary)}
    for kind in kinds:
        sets[kind] = counterfactual_pairs(kind, tokenizer, n, n_boxes, seed, vocabulary)
    for name, records in sets.items():
        write_jsonl(records, out / f"{name}.jsonl")
        if hf:
            to_hf_dataset(records).save_to_disk(str(out / name))
        echo(f"{name}: {len(records)} records -> {out / (name + '.jsonl')} (hash {dataset_hash(records)[:12]})")
