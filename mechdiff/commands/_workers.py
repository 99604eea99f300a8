"""One process per model for a plain ``mechdiff run`` of a circuits study (``--workers``).

Each worker is ``mechdiff run ... --model NAME`` (`run_model`): its
model's stages, waiting on the others' through the stage cache. Every model runs at once (a model's matrix row
waits for every model's circuit, so fewer workers than models could wait forever), each with its share of the cores
as torch threads, when the machine has at least two cores and the memory the resource plan
(`mechdiff.studies.planner`) predicts for all of them. The parent then writes the report from the cache.
Each worker's output reaches the terminal line by line under its model's name; a worker that fails ends the others
and the run, with its last lines.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import IO, Any, Optional

#: The last lines of a worker's output a failure repeats.
TAIL_LINES = 30


class WorkerFailed(RuntimeError):
    """A model's worker process exited with an error; the message holds its last lines."""


@dataclass
class WorkerPlan:
    """How a plain run proceeds: ``workers`` processes (1: the serial run) of ``threads`` torch threads, and why."""

    workers: int
    threads: int
    reason: str


def default_workers() -> Optional[int]:
    """``--workers`` when not given: ``$MECHDIFF_WORKERS`` (e.g. 1 where runs must stay in one process, as the
    tests' in-process runs), else None (decide)."""
    value = os.environ.get("MECHDIFF_WORKERS")
    return int(value) if value else None


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_workers(study: Any, requested: Optional[int]) -> WorkerPlan:
    """One worker per model where the study allows it (a circuits study whose stages run, its models on this
    machine's CPU), the machine has at least two cores, and ``requested`` (None: decide) is not 1; without a request
    the predicted memory of every model's stages at once must also fit what the machine has free."""
    serial = _serial_reason(study, requested)
    if serial:
        return WorkerPlan(1, 0, serial)
    n = len(study.spec.model_names)
    if requested is not None and requested < n:
        raise ValueError(f"--workers {requested}: a run in parallel has one process per model ({n}); give 1 or {n}")
    threads = max(1, cores() // n)
    need, free = _memory(study)
    if requested is None and need > free:
        return WorkerPlan(1, 0, f"{n} models at once need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    return WorkerPlan(n, threads, f"{n} processes, one per model, {threads} torch thread{'s' * (threads > 1)} each")


def _serial_reason(study: Any, requested: Optional[int]) -> str:
    """Why the run stays in one process ('' where it need not)."""
    if requested == 1:
        return "--workers 1"
    if getattr(study, "kind", None) != "circuits":
        return f"a {study.kind} study runs in one process"
    spec = study.spec
    if spec.reproduce.circuit and spec.reproduce.only:
        return "the reproduction table only"
    if spec.models.remote or spec.models.device_map or spec.models.device not in (None, "cpu"):
        return "models on a GPU or NDIF run in one process"
    if len(spec.model_names) < 2:
        return "one model"
    if cores() < 2:
        return "one core"
    return ""


def _memory(study: Any) -> tuple[int, int]:
    """The predicted peak bytes of every model's worker at once (each: its heaviest stage) and the bytes free."""
    from ..models.devices import Device, available_memory, process_memory
    from ..studies.circuits.stages.plan import resource_plan

    free = available_memory()
    # each worker: a process of its own, holding what this one holds before its models load
    here = Device("this machine", free, {study.spec.models.dtype: 1.0}, False, baseline=process_memory())
    peaks: dict[str, int] = {}
    for placed in resource_plan(study.spec, here):
        stage = placed.cost.stage
        name = study.spec.models.base if stage == "dcm" else stage.split(":", 1)[-1]  # the base's DCM: "dcm"
        peaks[name] = max(peaks.get(name, 0), placed.cost.device_peak(here))
    return sum(peaks.get(n, 0) for n in study.spec.model_names), free


def worker_command(args: argparse.Namespace, study: Any, name: str, threads: int) -> list[str]:
    """``mechdiff run`` of one model's stages, with the parent's task file and options."""
    cmd = [sys.executable, "-m", "mechdiff.cli", "run", *([args.task_file] if args.task_file else [])]
    cmd += ["--model", name, "--out", str(study.dir), "--no-progress", "--threads", str(threads)]
    for option in ("task", "dtype", "device", "device_map"):
        value = getattr(args, option)
        if value is not None:
            cmd += [f"--{option.replace('_', '-')}", str(value)]
    return cmd + (["--remote"] if args.remote else []) + (["--force"] if args.force else [])


def run_workers(args: argparse.Namespace, study: Any, plan: WorkerPlan) -> None:
    """Start one worker per model, relay their output, and wait; raise `WorkerFailed` (after ending the
    others) where one fails."""
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads), "MKL_NUM_THREADS": str(plan.threads)}
    env["PYTHONUNBUFFERED"] = "1"
    procs, tails, relays = {}, {}, []
    for name in study.spec.model_names:
        procs[name] = subprocess.Popen(
            worker_command(args, study, name, plan.threads),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        tails[name] = deque(maxlen=TAIL_LINES)
        relay = threading.Thread(target=_relay, args=(name, procs[name].stdout, tails[name]), daemon=True)
        relay.start()
        relays.append(relay)
    try:
        failed = _wait_first_failure(procs)
    finally:
        for proc in procs.values():  # only the workers started here, each by its own handle
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            proc.wait()
        for relay in relays:
            relay.join()
    if failed:
        name, code = failed
        raise WorkerFailed(f"the process of {name} failed (exit {code}); its last lines:\n" + "".join(tails[name]))


def _wait_first_failure(procs: dict[str, subprocess.Popen]) -> Optional[tuple[str, int]]:
    """Wait until every worker ends or one fails; the failed one's name and exit code, or None."""
    running = dict(procs)
    while running:
        for name, proc in list(running.items()):
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            del running[name]
            if code != 0:
                return name, code
    return None


def _relay(name: str, stream: IO[str], tail: deque) -> None:
    """Print each line of a worker's output under its model's name, keeping the last ones."""
    for line in stream:
        tail.append(line)
        print(f"[{name}] {line}", end="", file=sys.stderr, flush=True)
    stream.close()
