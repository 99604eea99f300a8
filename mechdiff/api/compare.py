"""One or more circuits scored in two or more models, in one call (`compare`): ``mechdiff compare`` from Python,
the same computation through the same function (`mechdiff.studies.circuits.scoring.compare_circuits`, which writes the
tables), read back as a `Comparison`: the circuit x model table as a DataFrame, each figure an `Estimate` with its
interval."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Sequence, Union

import pandas as pd

from ..circuits.circuit import Circuit, load_circuit_file
from ..common.inference import Interval
from ..common.io import check_writable
from ..models.memory import auto_batch_size
from ..models.modelset import ModelSet
from ..report.tables import read_table, to_markdown
from ..studies.circuits.scoring import COMPARE_N, COMPARE_OUT, ScoringPrompts, compare_circuits
from ..tasks.base import Task, get_task
from .results import Estimate, interval_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["compare", "Comparison"]

#: One circuit as `compare` takes it: a circuit file's path, or a `Circuit` (e.g. `Results.circuit`).
CircuitLike = Union[str, os.PathLike, Circuit]
#: What ``circuits=`` takes: one circuit, a list of them, or a dict label -> circuit.
CircuitsLike = Union[CircuitLike, Sequence[CircuitLike], Mapping[str, CircuitLike]]
#: What ``models=`` takes: a `pair` (or `ModelSet`) or the names (registry names, hub ids, directories, GGUF files).
ModelsLike = Union[ModelSet, Sequence[Union[str, os.PathLike]]]
#: The label of a `Circuit` given without one that names no model.
UNNAMED = "circuit"
#: The files `compare_circuits` writes that a `Comparison` reads back.
RESULT_FILE, TABLE, OVERLAP = "compare.json", "matrix.json", "overlap.json"


def compare(
    models: ModelsLike,
    circuits: CircuitsLike,
    task: Union[str, os.PathLike, Task],
    n: int = COMPARE_N,
    *,
    out: Union[str, os.PathLike] = COMPARE_OUT,
    labels: Optional[Sequence[str]] = None,
    n_random: int = 0,
    seed: int = ScoringPrompts.seed,
    reference: str = ScoringPrompts.reference,
    n_reference: Optional[int] = None,
    reference_seed: Optional[int] = None,
    batch_size: Union[int, Literal["auto"]] = ScoringPrompts.batch_size,
    store: Optional[str] = None,
    options: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
    **load: Any,
) -> "Comparison":
    """Score each circuit in each model by mean ablation, as ``mechdiff compare`` does, and return the result.

    Each model scores the same ``n`` prompts of ``task`` (prompt set ``command-scoring`` of ``seed``), each head
    outside the circuit replaced by its mean over the reference prompts: the full model's accuracy, the circuit's
    accuracy, answer probability and faithfulness (accuracy with only the circuit over the full model's, and the
    task's continuous metric's), each with its 95% interval over the prompts. Two or more circuits also get their
    overlap per group. The tables are written to ``out`` as the command writes them (``matrix.*``, ``overlap.*``,
    ``membership.png``, ``compare.json``), by the same function.

    Arguments:

    - ``models``: `pair` (or a `ModelSet`), or the models' names, base first; checked as one set (shapes,
      vocabularies) before any weights load.
    - ``circuits``: a circuit file, a `Circuit` (e.g. ``md.Results.load(d).circuit("smollm2-et")``), a list of
      them, or a dict label -> circuit. Each is checked against the models' shape before any weights load.
    - ``task``: a registered task name, a task directory, or a `Task` (`task`).
    - ``n``: prompts scored in each model.
    - ``out``: the directory the tables go to (``--out``).
    - ``labels``: one label per circuit of a list (default: a file's stem, a `Circuit`'s model).
    - ``n_random``: random circuits of the same group sizes drawn per cell, the baseline (``--n-random``).
    - ``seed``: the prompts' seed (``--seed``).
    - ``reference``: where the ablation means come from (``--reference``: ``path_patching`` or ``fresh``).
    - ``n_reference``: reference prompts (default: ``n``).
    - ``reference_seed``: the reference prompts' seed (default: set ``command-reference`` of ``seed``).
    - ``batch_size``: prompts per forward pass, or ``"auto"`` (from the first model's free memory).
    - ``store``: an HDF5 activation store caching the means (``--store``).
    - ``options``: the task's generator options (entity tracking: ``{"n_boxes": 3}``; default: the task's).
    - ``progress``: progress bars.
    - ``load``: how the models named by ``models`` load (`load_model`'s ``dtype``, ``device``, ``device_map``,
      ``remote``, ``cache_dir``); a `pair` carries its own.

    Returns the `Comparison` read back from ``out``:

    ```python
    pair = md.pair("smollm2-et-early", "smollm2-et")
    cmp = md.compare(pair, "results/entity-tracking-smollm2/circuits/smollm2-et.json", "entity-tracking", n=40)
    cmp.to_frame()[["circuit", "model", "faithfulness", "faithfulness_low", "faithfulness_high"]]
    print(cmp.estimate("smollm2-et-early"))  # the circuit's faithfulness there, with its 95% interval
    ```
    """
    models = _model_set(models, load)
    prompts_task = task if isinstance(task, Task) else get_task(task)
    chosen = _circuits(circuits, labels, models, prompts_task.positions)
    directory = check_writable(Path(out))
    if batch_size == "auto":
        batch_size = auto_batch_size(models[models.names[0]])
    prompts = ScoringPrompts(
        prompts_task,
        n,
        seed,
        reference,
        n_reference,
        reference_seed,
        batch_size,
        progress,
        store,
        dict(options or {}),
    )
    settings = {
        "via": "md.compare",
        "models": models.names,
        "circuits": {label: _source(c) for label, c in zip(chosen, _as_list(circuits))},
        "task": prompts_task.source or prompts_task.name,
        "n": n,
        "n_random": n_random,
        "seed": seed,
        "reference": reference,
        "n_reference": n_reference,
        "reference_seed": reference_seed,
        "batch_size": batch_size,
        "store": store,
        "options": dict(options or {}),
        "out": str(directory),
    }
    compare_circuits(models, chosen, prompts, directory, n_random, settings)
    return Comparison.load(directory)


@dataclass(frozen=True)
class Comparison:
    """What `compare` (or ``mechdiff compare``) wrote to ``out``, read back: ``rows``, one per circuit and model
    with every figure `mechdiff.circuits.measures.matrix_rows` makes (each estimate three keys, ``x``, ``x_low``,
    ``x_high``); ``overlap``, the overlap of each pair of circuits per group (empty for one circuit);
    ``settings``, what the run was asked; ``fingerprints``, each model's weights' digest."""

    out: Path
    rows: list[dict[str, Any]]
    overlap: list[dict[str, Any]]
    settings: dict[str, Any]
    fingerprints: dict[str, Any]

    @classmethod
    def load(cls, out: Union[str, os.PathLike]) -> "Comparison":
        """The comparison in ``out`` (a ``mechdiff compare --out`` or `compare` directory); refused where it
        holds none."""
        directory = Path(out)
        if not (directory / RESULT_FILE).is_file():
            raise FileNotFoundError(
                f"{directory} holds no {RESULT_FILE}: give the directory `mechdiff compare --out` or md.compare wrote"
            )
        data = json.loads((directory / RESULT_FILE).read_text())
        return cls(
            directory, data["matrix"], data.get("overlap", []), data.get("settings", {}), data.get("fingerprints", {})
        )

    def __repr__(self) -> str:
        return f"Comparison({str(self.out)!r}: circuits {self.circuits} x models {self.models})"

    def __str__(self) -> str:
        """The tables as the command prints them (markdown)."""
        return "\n\n".join(to_markdown(t) for t in (read_table(self.out / TABLE), self.overlap) if t)

    @property
    def models(self) -> list[str]:
        """The models, in the order scored."""
        return list(dict.fromkeys(r["model"] for r in self.rows))

    @property
    def circuits(self) -> list[str]:
        """The circuits' labels, in the order given."""
        return list(dict.fromkeys(r["circuit"] for r in self.rows))

    def to_frame(self, every: bool = False) -> pd.DataFrame:
        """The circuit x model table as written (``matrix.json``, the columns the command shows): ``circuit``,
        ``model``, ``n_pairs``, ``full_accuracy``, ``accuracy``, ``faithfulness`` and, where random circuits were
        drawn, theirs, each estimate with ``_low``/``_high``. ``every``: one row of `rows` a row instead, every
        figure (answer probability, the continuous metric's faithfulness, the empty circuit's accuracy...)."""
        if every:
            return pd.DataFrame([{k: v for k, v in r.items() if not isinstance(v, list)} for r in self.rows])
        return pd.DataFrame(read_table(self.out / TABLE))

    def overlap_frame(self) -> pd.DataFrame:
        """The overlap of each pair of circuits per group (intersection, fractions, Jaccard, hypergeometric p)."""
        return pd.DataFrame(self.overlap)

    def estimate(self, model: str, circuit: Optional[str] = None, figure: str = "faithfulness") -> Estimate:
        """One figure of ``circuit`` in ``model`` with its 95% interval (``circuit`` may be left out where there is
        one). ``figure``: a column of `rows` with an interval (``faithfulness``, ``accuracy``, ``full_accuracy``,
        ``answer_prob``, ``faithfulness_prob``, ``random_accuracy``...). Its ``rows`` and ``items`` are the
        prompts it was scored on (each prompt its own item); its ``method`` is empty, as the table keeps none
        (accuracy: exact binomial; the rest: a bootstrap over prompts; see
        `mechdiff.circuits.measures.faithfulness`)."""
        row = self._row(model, circuit)
        if f"{figure}_low" not in row:
            known = sorted(k[: -len("_low")] for k in row if k.endswith("_low"))
            raise KeyError(f"no figure {figure!r} with an interval; the figures: {', '.join(known)}")
        n = row["random_n_prompts"] if figure.startswith("random_") else row["n_prompts"]
        d = {"value": row[figure], "low": row[f"{figure}_low"], "high": row[f"{figure}_high"], "n": n}
        return Estimate.from_interval(Interval.from_dict(d), claim=f"{figure} of circuit {row['circuit']} in {model}")

    def figure(self, value: str = "faithfulness") -> "Figure":
        """Each circuit in each model as a point with its interval (`interval_figure`), labelled ``circuit in
        model``."""
        frame = self.to_frame()
        frame.insert(0, "cell", [f"{c} in {m}" for c, m in zip(frame["circuit"], frame["model"])])
        return interval_figure(frame, value, "cell", title=f"{self.out.name}: {value}")

    def _row(self, model: str, circuit: Optional[str]) -> dict[str, Any]:
        if circuit is None:
            if len(self.circuits) != 1:
                raise ValueError(f"give circuit=, one of {', '.join(self.circuits)}")
            circuit = self.circuits[0]
        found = [r for r in self.rows if r["model"] == model and r["circuit"] == circuit]
        if not found:
            raise KeyError(
                f"no row for circuit {circuit!r} in model {model!r}; circuits: {', '.join(self.circuits)}; "
                f"models: {', '.join(self.models)}"
            )
        return found[0]


def _model_set(models: ModelsLike, load: Mapping[str, Any]) -> ModelSet:
    """``models`` as a checked `ModelSet` (a given one as it is: its load options are its own)."""
    if isinstance(models, ModelSet):
        if load:
            raise TypeError(f"{', '.join(load)}: a pair carries its own load options; give them to md.pair")
        return models
    if isinstance(models, (str, os.PathLike)) or not models:
        raise TypeError("models= takes md.pair(base, other) or a list of model names, base first")
    return ModelSet([os.fspath(m) for m in models], **load)


def _as_list(circuits: CircuitsLike) -> list[CircuitLike]:
    """The circuits given, one a label, in order."""
    if isinstance(circuits, Mapping):
        return list(circuits.values())
    if isinstance(circuits, (str, os.PathLike, Circuit)):
        return [circuits]
    return list(circuits)


def _circuits(
    circuits: CircuitsLike, labels: Optional[Sequence[str]], models: ModelSet, positions: Sequence[str]
) -> dict[str, Circuit]:
    """Each circuit by its label, read (a file) and checked against the models' shape (a `Circuit` also against
    the task's ``positions``, where it names them), before any weights load."""
    given = _as_list(circuits)
    if not given:
        raise ValueError("circuits= is empty: give a circuit file, a Circuit, or a list or dict of them")
    if isinstance(circuits, Mapping):
        if labels is not None:
            raise TypeError("labels= is for a list of circuits; a dict's keys are its labels")
        names = [str(k) for k in circuits]
    else:
        names = list(labels) if labels is not None else [_label(c) for c in given]
    if len(names) != len(given) or len(set(names)) != len(names):
        raise ValueError(
            f"need one unique label per circuit; got {names} for {len(given)} circuit(s): give labels=[...] one "
            "per circuit, or circuits={label: circuit}"
        )
    shape = models.shape
    return {name: _checked(c, shape.n_layers, shape.n_heads, positions) for name, c in zip(names, given)}


def _label(circuit: CircuitLike) -> str:
    if isinstance(circuit, Circuit):
        return circuit.model or UNNAMED
    return Path(circuit).stem


def _checked(circuit: CircuitLike, n_layers: int, n_heads: int, positions: Sequence[str]) -> Circuit:
    """A circuit file read and checked (`load_circuit_file`, as the command), or a `Circuit` checked."""
    if not isinstance(circuit, Circuit):
        return load_circuit_file(Path(circuit), n_layers, n_heads)
    name = circuit.model or UNNAMED
    try:
        circuit.validate(n_layers, n_heads)
    except ValueError as err:
        raise ValueError(f"circuit of {name}: {err}; use a model of the shape it was found on") from None
    unknown = {g: p for g, p in circuit.positions.items() if positions and p not in positions}
    if unknown:
        raise ValueError(
            f"circuit of {name}: positions {unknown} are not the task's ({', '.join(positions)}); score it on the "
            "task it was found on"
        )
    return circuit


def _source(circuit: CircuitLike) -> str:
    """What the settings record of a circuit: its file, or ``<memory>`` for a `Circuit`."""
    return "<memory>" if isinstance(circuit, Circuit) else os.fspath(circuit)
