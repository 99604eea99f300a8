"""Task specs (``tasks/*.toml``): each section a pydantic dataclass (`section`), so a file's unknown keys and
values of the wrong type are refused with their line, and a section built in Python is checked the same way.

What every kind shares: the schema (`SCHEMA`, `section`, `load_sections`, `SpecError`, `line_of`), the sections more
than one kind reads (``[study]``, ``[task]``, ``[eval]``, ``[dcm]``, ``[output]``) and the checks of a task's name,
groups and desiderata. Each kind's own sections live with it: the circuits study's (`RunSpec`, `load_spec`) in
`mechdiff.studies.circuits.spec`."""

from __future__ import annotations

import difflib
import re
from dataclasses import field, fields
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

import tomllib
from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.dataclasses import is_pydantic_dataclass

from ..methods.dcm import DCMConfig
from ..tasks.base import is_registered, is_relation_file, known_tasks
from ..tasks.desiderata import desideratum_name


class SpecError(ValueError):
    """A task file that cannot be run; the message names the line and the valid keys."""


#: How a section is checked (docs/your-own-task.md, "The schema"): a key that no field names is refused, and each
#: value must have its field's type as TOML writes it, never converted (``"7"`` is no integer, ``1`` no boolean, a
#: value of a field that defaults to None is checked against the type it takes when set).
SCHEMA = ConfigDict(extra="forbid", strict=True)
#: The decorator of a task file's section: a dataclass (attribute access, `dataclasses.asdict`, `dataclasses.replace`
#: as before) that pydantic checks when built, from a file or in Python.
section = pydantic_dataclass(config=SCHEMA)
#: A number as the file writes it: an integer stays an integer (a ``float`` field would turn ``1`` into ``1.0``, and
#: a stage key that reads the section would move).
Real = Union[int, float]


@section
class StudySection:
    """A task file's ``[study]`` section: which kind of study the file is (``mechdiff.studies.base.KINDS``)."""

    kind: str = "circuits"


@section
class TaskSection:
    name: str = "entity-tracking"
    n_boxes: int = 7
    seed: int = 0


@section
class EvalSection:
    n: int = 300
    batch_size: int = 50


@section
class DcmSection:
    desiderata: list[str] = field(default_factory=list)  # empty: every desideratum the task declares
    n_train: int = 32
    n_val: int = 12
    n_test: int = 200
    # circuit groups to train masks for (those the circuit has; empty: every group at a position of the task's prompts)
    groups: list[str] = field(default_factory=list)
    # training: each default is DCMConfig's (defined once, in mechdiff.methods.dcm)
    epochs: int = DCMConfig.epochs
    batch_size: int = DCMConfig.batch_size  # pairs per optimiser step: 32 training pairs x 4 epochs = 16 mask updates
    lam: Real = DCMConfig.lam
    lam_scale: str = DCMConfig.lam_scale  # "loss": lam x the unpatched mean |logit(target)|; "absolute": the paper's
    lr: Real = DCMConfig.lr
    eval_every: int = (
        DCMConfig.eval_every
    )  # steps ("steps") or batches of an epoch ("epoch_batches") between validations
    schedule: str = DCMConfig.schedule  # "steps" (also before training and after the last step) or "epoch_batches"
    shuffle: bool = DCMConfig.shuffle  # shuffle the training pairs every epoch (the paper: in order)
    random_pool: str = (
        DCMConfig.random_pool
    )  # random baseline: heads of the selected count from each selected head's "layer", "all" heads or the "group"
    n_random: int = DCMConfig.n_random  # random head sets, in DCM's baseline and in semantic patching of each model
    circuit: str = "found"  # the circuit whose groups DCM masks: "found" (as discovered) or "pruned" (the paper)
    # how the pair cache holds what patched runs read (mechdiff.methods.dcm_cache.CACHE_MODES): "file" (a scratch
    # file under TMPDIR, suffix runs), "memory" (the sources' z in host memory, as the paper; full runs), "recompute"
    # (sources run again per batch), or "auto": the fastest that fits the machine, as `mechdiff run --plan` shows.
    # Not in the stage's key: the modes give the same results but for float rounding
    cache: str = "auto"


@section
class OutputSection:
    dir: str = "results/entity-tracking-smollm2"  # the embedded default study's; a task file without it: output_dir
    store: str = "cache/activations.h5"


#: The options that name groups of a circuit (a position class of the task, or a step of its plan).
GROUP_OPTIONS = (("dcm", "groups"), ("cmap", "groups"), ("scoring", "completeness_groups"), ("cmap", "selection"))


def task_group_names(task_name: str) -> Optional[set[str]]:
    """The names a circuit of the task may group heads by: its positions, the classes derived from them, an
    imported task's own classes and its plan's steps; None for a knowledge relation (no circuit groups)."""
    if is_relation_file(task_name):
        return None
    from ..tasks.base import derived_class_names, get_task
    from ..tasks.plan import load_plan

    task = get_task(task_name)
    names = {*task.positions, *derived_class_names(task.positions)}
    if Path(task_name).is_dir():
        from ..tasks.task_directory import load_task_meta

        names |= set(load_task_meta(task_name).get("classes", []))
    if task.plan is not None:
        names |= {step.name for step in load_plan(task.plan).steps}
    return names


def _check_groups(path: Path, text: str, raw: dict, task_name: str) -> None:
    """Groups a file names (``[dcm] groups``, ``[cmap] groups`` and ``selection``, ``[scoring]
    completeness_groups``) must be the task's (`task_group_names`); refused with the line before weights."""
    set_here = [(sec, key) for sec, key in GROUP_OPTIONS if key in (raw.get(sec) or {})]
    if not set_here:
        return
    known = task_group_names(task_name)
    for sec, key in set_here if known is not None else ():
        unknown = [g for g in raw[sec][key] if g not in known]
        if unknown:
            raise SpecError(
                f"{path}:{line_of(text, sec, key)}: [{sec}] {key} names {unknown}, which task {task_name} does not "
                f"have; its groups are {', '.join(sorted(known))} (leave {key} out: every group at a position "
                "of the task's prompts)"
            )


def _check_desiderata(path: Path, text: str, dcm: Optional[dict], task_name: str) -> None:
    """A file whose ``[dcm]`` asks for DCM needs a task that declares a desideratum, and the desiderata it names
    must be the task's own (an alias resolved); refused before any weights load. Without ``[dcm]`` a task with no
    desideratum runs every other stage and the report says DCM was not run. ``dcm``: the file's own ``[dcm]``."""
    if dcm is None or is_relation_file(task_name):
        return
    from ..tasks.base import get_task

    task = get_task(task_name)
    own = sorted(task.desiderata)
    if not own:
        raise SpecError(
            f"{path}:{line_of(text, None, 'dcm')}: [dcm] asks for DCM, but task {task.name} declares no "
            "desideratum; remove [dcm] (the report then says DCM was not run), or give every row a "
            "counterfactual_answer and import it again (its `counterfactual` desideratum)"
        )
    named = dcm.get("desiderata")
    unknown = [d for d in named or [] if desideratum_name(d) not in task.desiderata]
    if unknown:
        raise SpecError(
            f"{path}:{line_of(text, 'dcm', 'desiderata')}: [dcm] desiderata {unknown} are not task "
            f"{task.name}'s; it declares {', '.join(own)}"
        )


def read_task_file(path: str | Path, example: str = "tasks/entity_tracking.toml") -> tuple[str, dict[str, Any]]:
    """The text and parsed TOML of the task file ``path``; a missing, binary or malformed file is refused
    naming the file and what to do."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"task file {path} does not exist")
    try:
        text = path.read_text()
        return text, tomllib.loads(text)
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not a text file ({err}) — give a TOML task file (tasks/*.toml)") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(
            f"{path}: not valid TOML ({err}) — fix the syntax there ({example} is a complete example)"
        ) from None


def load_sections(
    path: str | Path,
    sections: dict[str, type],
    required: Optional[dict[str, tuple]] = None,
    choices: Optional[dict[tuple[str, str], tuple]] = None,
    example: str = "tasks/entity_tracking.toml",
) -> tuple[dict[str, Any], str]:
    """The one task-file loader: every ``[section]`` of the TOML file ``path`` built into its dataclass in
    ``sections`` (absent sections: defaults), and the file's text. Unknown sections and keys (with the nearest
    valid one), values of the wrong type (checked by pydantic, `SCHEMA`; lists where the default is a tuple become
    tuples) and values outside ``choices`` are refused with the file and line; ``required`` names fields a file
    must give."""
    path = Path(path)
    text, data = read_task_file(path, example)
    for section in data:
        if section not in sections:
            raise SpecError(
                f"{path}:{line_of(text, None, section)}: unknown section [{section}]; "
                f"{_nearest(section, sections, '[{}]')}valid sections: {', '.join(sections)}"
            )
    for section, keys in (required or {}).items():
        for key in keys:
            if key not in data.get(section, {}):
                raise SpecError(f"{path}: [{section}] is missing the required field {key!r}")
    return {
        name: _section(path, text, name, cls, data.get(name, {}), choices or {}) for name, cls in sections.items()
    }, text


def _nearest(word: str, valid: Any, form: str = "{!r}") -> str:
    """``"did you mean X? "`` for the valid name nearest ``word`` (difflib), or nothing where none is near."""
    near = difflib.get_close_matches(word, list(valid), n=1)
    return f"did you mean {form.format(near[0])}? " if near else ""


def _section(path: Path, text: str, name: str, cls: type, values: dict, choices: dict) -> Any:
    """One section's dataclass from its values, each checked (key, type, choices) with its line."""
    valid = [f.name for f in fields(cls)]
    for key in values:
        if key not in valid:
            raise SpecError(
                f"{path}:{line_of(text, name, key)}: unknown key {key!r} in [{name}]; "
                f"{_nearest(key, valid)}valid keys: {', '.join(valid)}"
            )
    defaults = cls()
    own = {
        k: tuple(v) if isinstance(getattr(defaults, k), tuple) and isinstance(v, list) else v for k, v in values.items()
    }
    try:
        built = checked(cls)(**own)
    except ValidationError as err:
        raise SpecError(_type_error(path, text, name, cls, values, defaults, err.errors()[0])) from None
    for key, value in values.items():
        allowed = choices.get((name, key))
        if allowed and any(item not in allowed for item in (value if isinstance(value, list) else [value])):
            raise SpecError(
                f"{path}:{line_of(text, name, key)}: {key} = {value!r} in [{name}]; "
                f"valid values: {', '.join(map(str, allowed))}"
            )
    return built if type(built) is cls else cls(**own)


#: Plain dataclasses read from a file (a kind whose settings are also built from command-line flags) -> the pydantic
#: dataclass that checks them (`checked`).
_CHECKED: dict[type, type] = {}


def checked(cls: type) -> type:
    """The class pydantic checks ``cls`` with: itself where it is a `section`, else a pydantic subclass of the plain
    dataclass ``cls`` under `SCHEMA` (`load_sections` then builds ``cls`` itself from the values it checked, as the
    file gives them)."""
    if is_pydantic_dataclass(cls):
        return cls
    if cls not in _CHECKED:
        _CHECKED[cls] = pydantic_dataclass(cls, config=SCHEMA)
    return _CHECKED[cls]


def _type_error(path: Path, text: str, section: str, cls: type, values: dict, defaults: Any, error: dict) -> str:
    """The message of pydantic's first ``error`` on a section: the file's line, the value, the type its field
    takes, and the default (or, for a field that defaults to None, that it may be left out)."""
    key, *inner = error["loc"]
    default = getattr(defaults, key)
    value = values[key]
    at = inner[0] if inner else None  # an item of a list or table (else a tag of pydantic's, e.g. Real's "int")
    if isinstance(value, list) and isinstance(at, int):
        where = f"; item {at} is {value[at]!r}"
    else:
        where = f"; {at} is {value[at]!r}" if isinstance(value, dict) and at in value else ""
    unset = "or leave it out" if default is None else f"the default is {default!r}"
    return (
        f"{path}:{line_of(text, section, key)}: {key} = {value!r} in [{section}] — "
        f"give {type_name(checked(cls).__pydantic_fields__[key].annotation)} ({unset}){where}"
    )


#: How an error names a type: (one, several).
TYPE_NAMES = {
    bool: ("a bool", "bools"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    Real: ("a number", "numbers"),
    str: ("a string", "strings"),
    list: ("a list", "lists"),
    tuple: ("a list", "lists"),
    dict: ("a table", "tables"),
}


def type_name(annotation: Any, several: bool = False) -> str:
    """A field's type as a task file's author reads it: ``a list of numbers``, ``a table of integers``,
    ``an integer`` (for ``Optional[int]``: the type it takes when set)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in TYPE_NAMES:
        return TYPE_NAMES[annotation][several]
    if origin is Union:  # Optional[X]: X; Optional[Real]: Real
        rest = tuple(a for a in args if a is not type(None))
        return type_name(Union[rest] if len(rest) > 1 else rest[0], several)
    if origin in (list, tuple, dict) and args:
        outer = TYPE_NAMES[origin][several]
        return f"{outer} of {type_name(args[-1] if origin is dict else args[0], True)}"
    return TYPE_NAMES.get(origin, ("a value", "values"))[several]


def line_of(text: str, section: Optional[str], key: str) -> int:
    """1-based line where ``key`` (or ``[section]`` when section is None) appears."""
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            current = header[1].strip()
            if section is None and current == key:
                return i
        elif section is not None and current == section and re.match(rf"\s*{re.escape(key)}\s*=", line):
            return i
    return 0


def _check_task(path: Path, text: str, name: str) -> None:
    """The ``[task]`` name must be a registered task or a directory written by ``mechdiff dataset import``
    (relative to the working directory); checked before any model loads."""
    check_task(name, f"{path}:{line_of(text, 'task', 'name')}: ")


def check_task(name: str, where: str = "") -> None:
    """Refuse a task name that is neither registered (a task, an alias, a knowledge relation) nor a task
    directory, naming the known ones and saying how to make a directory."""
    if is_registered(name) or Path(name).is_dir() or is_relation_file(name):
        return
    raise SpecError(
        f"{where}task {name!r} is neither a registered task nor a task directory; {known_tasks(name)} "
        "(import your pairs with `mechdiff dataset import PAIRS.jsonl --model M --out DIR` and name DIR)"
    )
