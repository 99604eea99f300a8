"""Discovery plans as data: which senders each path-patching step tests and what they send to.

A plan is a TOML file with one table per step, run in file order::

    [plan]
    name = "entity tracking A-D"

    [steps.A]                # senders -> logits
    group = "value fetcher"
    sender = "last"          # the position the senders are patched at
    k = 8                    # heads kept

    [steps.B]
    sender = "last"
    receiver = "A"           # an earlier step: its selected heads receive
    site = "q"               # q, k or v of the receivers
    position = "last"        # where the receivers read (default: the sender position)
    k = 3

The entity-tracking plan ships as ``mechdiff/tasks/plans/entity_tracking.toml``; a task names its
plan (`mechdiff.tasks.base.Task.plan`) and ``mechdiff circuit --plan FILE`` replaces it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import tomllib

SITES = ("q", "k", "v")
#: The plan discovery runs when none is given: entity tracking's A-D (data shipped with the package).
DEFAULT_PLAN = Path(__file__).resolve().parent.parent / "tasks" / "plans" / "entity_tracking.toml"
STEP_KEYS = {"group", "sender", "receiver", "site", "position", "k"}
PLAN_KEYS = {"name", "task", "description"}


@dataclass(frozen=True)
class PlanStep:
    """One path-patching step: senders at ``sender``; receivers (``None``: the logits) read ``site`` at ``position``."""

    name: str
    sender: str
    k: int
    receiver: Optional[str] = None
    site: Optional[str] = None
    position: Optional[str] = None
    group: str = ""

    @property
    def receiver_position(self) -> str:
        return self.position or self.sender

    def to_dict(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in (
                ("group", self.group),
                ("sender", self.sender),
                ("receiver", self.receiver),
                ("site", self.site),
                ("position", self.position),
                ("k", self.k),
            )
            if v not in (None, "")
        }


@dataclass(frozen=True)
class Plan:
    """Steps in the order they run."""

    name: str
    steps: tuple[PlanStep, ...]
    source: str = ""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for s in self.steps:
            where = f"{self.source or 'plan'}: step {s.name}"
            if s.name in seen:
                raise ValueError(f"{where} appears twice")
            if s.receiver is not None and s.receiver not in seen:
                raise ValueError(f"{where}: receiver {s.receiver!r} is not an earlier step (earlier: {sorted(seen)})")
            if (s.receiver is None) != (s.site is None):
                raise ValueError(
                    f"{where}: give receiver and site together (site one of {', '.join(SITES)}), "
                    "or neither for senders -> logits"
                )
            if s.site is not None and s.site not in SITES:
                raise ValueError(f"{where}: site {s.site!r} is not one of {', '.join(SITES)}")
            if s.position is not None and s.receiver is None:
                raise ValueError(f"{where}: position is the receivers' position; a step without receivers has none")
            if not isinstance(s.k, int) or isinstance(s.k, bool) or s.k < 0:
                raise ValueError(f"{where}: k must be a non-negative integer, got {s.k!r}")
            if not isinstance(s.sender, str) or not s.sender:
                raise ValueError(f"{where}: sender must name a position the task records")
            seen.add(s.name)
        if not self.steps:
            raise ValueError(f"{self.source or 'plan'} has no steps; add a [steps.NAME] table")

    @property
    def k(self) -> dict[str, int]:
        return {s.name: s.k for s in self.steps}

    @property
    def group_names(self) -> dict[str, str]:
        return {s.name: s.group for s in self.steps}

    def positions(self) -> set[str]:
        """Every position the plan reads (the task's records must name them all)."""
        return {s.sender for s in self.steps} | {s.receiver_position for s in self.steps if s.receiver}

    def with_k(self, k: Mapping[str, int]) -> "Plan":
        """The plan with some steps' ``k`` replaced."""
        unknown = set(k) - set(self.k)
        if unknown:
            raise ValueError(f"steps {sorted(unknown)} are not in plan {self.name!r} (steps: {list(self.k)})")
        steps = tuple(
            PlanStep(s.name, s.sender, k.get(s.name, s.k), s.receiver, s.site, s.position, s.group) for s in self.steps
        )
        return Plan(self.name, steps, self.source)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": {s.name: s.to_dict() for s in self.steps}}


def plan_from_dict(data: Mapping[str, Any], source: str = "plan") -> Plan:
    """A `Plan` from the TOML's tables (unknown keys rejected with the valid ones)."""
    unknown = set(data) - {"plan", "steps"}
    if unknown:
        raise ValueError(f"{source}: unknown tables {sorted(unknown)}; a plan has [plan] and [steps.NAME]")
    head = data.get("plan", {})
    bad = set(head) - PLAN_KEYS
    if bad:
        raise ValueError(f"{source}: unknown keys {sorted(bad)} in [plan]; valid: {sorted(PLAN_KEYS)}")
    steps = []
    for name, table in data.get("steps", {}).items():
        if not isinstance(table, dict):
            raise ValueError(f"{source}: steps.{name} must be a table")
        bad = set(table) - STEP_KEYS
        if bad:
            raise ValueError(f"{source}: unknown keys {sorted(bad)} in [steps.{name}]; valid: {sorted(STEP_KEYS)}")
        if "sender" not in table or "k" not in table:
            raise ValueError(f"{source}: [steps.{name}] needs sender and k")
        steps.append(
            PlanStep(
                name,
                table["sender"],
                table["k"],
                table.get("receiver"),
                table.get("site"),
                table.get("position"),
                table.get("group", ""),
            )
        )
    return Plan(head.get("name", Path(source).stem), tuple(steps), source)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and check a plan file (parsed once for each version of the file: a resource plan reads it for every
    count of every stage, thousands of times)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {path} does not exist")
    stat = path.stat()
    return _read_plan(str(path), str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _read_plan(path: str, resolved: str, mtime_ns: int, size: int) -> Plan:
    """The checked `Plan` of ``path`` as it is at ``mtime_ns`` and ``size`` (a `Plan` is frozen: shared safely).
    ``resolved`` keys the cache only: a relative ``path`` names another file after a change of directory."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    return plan_from_dict(data, path)


def default_plan() -> Plan:
    """The plan in `DEFAULT_PLAN`."""
    return load_plan(DEFAULT_PLAN)


def task_plan(task: Any) -> Plan:
    """The path-patching plan of ``task``: its own plan file (``task.plan``); a task without one is refused (it
    never gets entity tracking's)."""
    if not task.plan:
        raise ValueError(
            f"task {task.name} has no path-patching plan: discover its circuit by the curve ([discovery] method = "
            '"curve"), or import its rows again with --plan FILE (see mechdiff/tasks/plans/)'
        )
    return load_plan(task.plan)
