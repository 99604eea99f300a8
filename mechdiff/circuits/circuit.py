"""The Circuit: named groups of heads, each read at a named dataset position; JSON round-trip.

Positions are names of the task's position records (entity tracking: ``last``, ``query_label``,
``query_label_context``; IOI: ``last``, ``S2``...), never token offsets, so one circuit file scores
on any model of the same shape and any prompt length. Whether a name exists is checked against
the records a circuit is scored on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from ..common.components import Head, check_heads, parse_heads
from ..common.io import write_json

if TYPE_CHECKING:
    from ..models.architectures import ModelShape

# Files written before circuits recorded their group names are entity-tracking circuits: their names.
GROUP_NAMES = {"A": "value fetcher", "B": "position transmitter", "C": "position detector", "D": "structure reader"}
# The entity-tracking position names (the names old circuit files use).
POSITION_NAMES = ("last", "query_label", "query_label_context")
_LEGACY_TASKS = ("", "entity-tracking")
_PAPER_POSITIONS = {
    "last token": "last",
    "query box label (last - 2)": "query_label",
    "earlier occurrence of the query box label in the context": "query_label_context",
}


class CircuitFileError(ValueError):
    """A circuit file that cannot be used; the message is ``<file>: <what> — <fix>``."""


@dataclass
class Circuit:
    """Groups of heads (``{"A": [Head, ...]}``) with the dataset position each group acts at."""

    model: str
    task: str
    groups: dict[str, list[Head]]
    positions: dict[str, str]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(self.groups) - set(self.positions)
        if missing:
            raise ValueError(f"groups {sorted(missing)} have no position; give positions for every group")
        bad = {g: p for g, p in self.positions.items() if not isinstance(p, str) or not p.strip() or p == "*"}
        if bad:
            raise ValueError(f"positions {bad} are not names; give each group the name of a position the task records")

    def pairs(self) -> list[tuple[Head, str]]:
        """Every distinct (head, position) pair of the circuit, in group order."""
        seen: dict[tuple[Head, str], None] = {}
        for g, heads in self.groups.items():
            for h in heads:
                seen.setdefault((h, self.positions[g]), None)
        return list(seen)

    def heads(self) -> list[Head]:
        """Every distinct head of the circuit, sorted."""
        return sorted({h for hs in self.groups.values() for h in hs})

    def sizes(self) -> dict[str, int]:
        return {g: len(hs) for g, hs in self.groups.items()}

    def __iter__(self) -> Iterator[tuple[str, list[Head]]]:
        return iter(self.groups.items())

    def validate(self, n_layers: int, n_heads: int) -> None:
        """Raise if a head does not exist in a model of this shape."""
        for heads in self.groups.values():
            check_heads(heads, n_layers, n_heads)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "task": self.task,
            "groups": {g: [h.name for h in hs] for g, hs in self.groups.items()},
            "positions": dict(self.positions),
            "names": dict(self.names),
            "scores": self.scores,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Circuit":
        """Load the mechdiff format (``"L14H7"`` names) or the paper's (``[layer, head]`` pairs)."""
        positions = {g: _PAPER_POSITIONS.get(p, p) for g, p in data["positions"].items()}
        return cls(
            model=data.get("model", ""),
            task=data.get("task", ""),
            groups={g: parse_heads(hs) for g, hs in data["groups"].items()},
            positions=positions,
            scores=data.get("scores", {}),
            names=data.get("names", dict(GROUP_NAMES) if data.get("task", "entity-tracking") in _LEGACY_TASKS else {}),
            meta=data.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Circuit":
        """Read a circuit file; any problem raises `CircuitFileError` naming the file and the fix."""
        return load_circuit_file(path)


_FIX = "fix the file, or write it again with `mechdiff circuit` / `mechdiff prune`"


def load_circuit_file(
    path: str | Path,
    n_layers: Optional[int] = None,
    n_heads: Optional[int] = None,
    positions: Optional[Sequence[str]] = None,
) -> Circuit:
    """Read and check a circuit file before anything expensive: JSON, the fields, head names, the
    positions (``positions``: those the task knows; by default those of the registered task the circuit
    names, or entity tracking's for files that name none; unchecked for other tasks) and, given a
    model's shape, that every head exists.
    Raises `CircuitFileError` (``<file>: <what> — <fix>``)."""
    path = Path(path)
    if not path.is_file():
        raise CircuitFileError(
            f"{path}: no such circuit file — give the path of a circuit JSON "
            "(a run's circuits/<model>.json, or tasks/circuits/)"
        )
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CircuitFileError(f"{path}: not valid JSON ({err}) — {_FIX}") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("groups"), dict)
        or not isinstance(data.get("positions"), dict)
    ):
        raise CircuitFileError(
            f'{path}: a circuit is a JSON object with "groups" and "positions" objects, e.g. '
            '{"groups": {"A": ["L21H3"]}, "positions": {"A": "last"}} — ' + _FIX
        )
    try:
        circuit = Circuit.from_dict(data)
    except (ValueError, TypeError, KeyError) as err:
        raise CircuitFileError(f"{path}: {err} — {_FIX}") from None
    positions = _task_positions(circuit.task) if positions is None else positions
    unknown = {g: p for g, p in circuit.positions.items() if positions is not None and p not in positions}
    if unknown:
        raise CircuitFileError(
            f"{path}: positions {unknown} are not positions of the task (valid: "
            f"{', '.join(positions)}) — name each group's position by one of them"
        )
    if n_layers is not None and n_heads is not None:
        try:
            circuit.validate(n_layers, n_heads)
        except ValueError as err:
            raise CircuitFileError(
                f"{path}: {err} — remove those heads, or use the circuit with a model of the shape it was found on"
            ) from None
    return circuit


def load_circuits(
    paths: Sequence[str | Path], labels: Optional[Sequence[str]] = None, shape: Optional["ModelShape"] = None
) -> dict[str, Circuit]:
    """Circuit files by label (default: the file stems), checking the labels are unique and (given a model
    ``shape``) that every head exists."""
    labels = list(labels or [Path(p).stem for p in paths])
    if len(labels) != len(paths) or len(set(labels)) != len(labels):
        raise ValueError(
            f"need one unique label per circuit; got {labels} for {list(paths)} (give labels one unique label per path)"
        )
    n_layers, n_heads = (shape.n_layers, shape.n_heads) if shape else (None, None)
    return {label: load_circuit_file(path, n_layers, n_heads) for label, path in zip(labels, paths)}


def _task_positions(task: str) -> Optional[tuple[str, ...]]:
    """The positions the registered task ``task`` records (entity tracking's for ``""``); ``None`` when
    the task is not registered (a user's task directory), so that its names are checked at scoring."""
    from ..tasks.base import get_task, is_registered

    name = task or "entity-tracking"
    if not is_registered(name):
        return None
    return tuple(get_task(name).positions) or None
