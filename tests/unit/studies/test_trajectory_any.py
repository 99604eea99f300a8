"""The trajectory study on any task over any checkpoints: groups and desiderata the task lacks refused with their
line when the file loads; full-weight checkpoints as a directory per step and as hub revisions, each checkpoint
served with its own weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny

from mechdiff.methods.checkpoints import Checkpoints, TrajectoryError, trajectory_specs
from mechdiff.models.resolve import trajectory_steps
from mechdiff.studies.spec import SpecError
from mechdiff.studies.trajectory.settings import load_settings, step_of

ROOT = Path(__file__).resolve().parents[3]


def _file(tmp_path: Path, task: str, extra: str) -> str:
    path = tmp_path / "t.toml"
    path.write_text(
        f'[study]\nkind = "trajectory"\n[task]\nname = "{task}"\n[models]\n'
        f'checkpoints = ["smollm2-et@0", "smollm2-et@5"]\n{extra}'
    )
    return str(path)


def test_another_tasks_groups_and_desiderata_load_and_names_it_lacks_are_refused_with_their_line(tmp_path) -> None:
    ok = load_settings(
        _file(tmp_path, "ioi", '[dcm]\ndesiderata = ["io_name"]\ngroups = ["S2"]\n[cmap]\ngroups = ["IO"]\n')
    )
    assert ok.dcm.desiderata == ["io_name"] and ok.cmap.groups == ["IO"]
    assert load_settings(_file(tmp_path, "ioi", "")).cmap.groups == []  # default: the task's own groups
    with pytest.raises(SpecError, match=r"t.toml:10: \[cmap\] groups names \['query_label'\], which task ioi"):
        load_settings(_file(tmp_path, "ioi", '[dcm]\ngroups = ["S2"]\n[cmap]\ngroups = ["query_label"]\n'))
    with pytest.raises(SpecError, match=r"t.toml:8: \[dcm\] groups names \['query_label'\]"):
        load_settings(_file(tmp_path, "ioi", '[dcm]\ngroups = ["query_label"]\n'))
    with pytest.raises(SpecError, match=r"t.toml:8: \[dcm\] desiderata \['positional'\] are not task ioi's"):
        load_settings(_file(tmp_path, "ioi", '[dcm]\ndesiderata = ["positional"]\n'))
    # entity tracking's own names still load, from the committed file
    committed = load_settings(ROOT / "tasks" / "entity_tracking_trajectory.toml")
    assert committed.cmap.groups == ["last", "query_label"] and committed.dcm.desiderata[0] == "positional"


def test_steps_read_from_names_and_hub_revisions() -> None:
    assert step_of("smollm2-et@45", 3) == 45
    assert step_of("hub:EleutherAI/pythia-70m@step1000", 0) == 1000
    assert step_of("hub:org/m@step-20", 0) == 20 and step_of("hub:org/m@step_7", 0) == 7
    assert step_of("hub:org/m@main", 4) == 4 and step_of("hub:org/m@abc123", 2) == 2  # a commit is no step
    assert step_of("runs/full/step-0005", 1) == 1


def _save(model, tokenizer, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def full_run(smollm2_tokenizer, tmp_path_factory) -> Path:
    """A run directory of full-weight checkpoints ``step-0000``, ``step-0005``, ``step-0010`` (tiny llamas of
    seeds 0, 1, 2: different weights, one architecture)."""
    run = tmp_path_factory.mktemp("full") / "run"
    for seed, step in ((0, 0), (1, 5), (2, 10)):
        _save(
            make_tiny("llama", smollm2_tokenizer, seed=seed, n_layers=2).model,
            smollm2_tokenizer,
            run / f"step-{step:04d}",
        )
    return run


def _weights(model) -> torch.Tensor:
    return model.model.lm_head.weight.detach().clone()


def test_full_weight_directories_per_step_are_one_trajectory_each_served_with_its_own_weights(full_run) -> None:
    from mechdiff.models.loading import load_model

    assert trajectory_steps(str(full_run)) == (0, 5, 10)
    names = [f"{full_run}@{s}" for s in (0, 5, 10)]
    base, specs = trajectory_specs(names)
    assert base == specs[0] and [s.kind for s in specs] == ["local"] * 3
    assert [step_of(n, i) for i, n in enumerate(names)] == [0, 5, 10]
    cp = Checkpoints(names)
    want = {n: _weights(load_model(str(full_run / f"step-{s:04d}"))) for n, s in zip(names, (0, 5, 10))}
    for n in (names[2], names[1], names[0], names[2]):  # out of order, and back
        assert torch.equal(_weights(cp.model(n)), want[n]), n
    assert torch.equal(_weights(cp.first()), want[names[0]]) and cp.model(names[0]) is cp.first()
    assert not torch.equal(want[names[1]], want[names[2]])  # the check above can tell checkpoints apart


def test_full_weight_checkpoints_of_another_architecture_are_refused(full_run, smollm2_tokenizer, tmp_path) -> None:
    other = _save(make_tiny("llama", smollm2_tokenizer, n_layers=3).model, smollm2_tokenizer, tmp_path / "deep")
    with pytest.raises(TrajectoryError, match=r"deep is not the architecture of .*step-0000"):
        trajectory_specs([str(full_run / "step-0000"), other])


def test_hub_revisions_of_one_repository_are_a_trajectory(full_run, tmp_path, monkeypatch) -> None:
    """A hub cache holding one repository at two revisions (refs ``step0`` and ``step5``, offline): each revision
    loads its own weights. The cache is this test's directory (``HF_HUB_CACHE``, and the location huggingface_hub
    read from it at import, which its cache lookups and transformers' read on every call), in this process: no
    other process to import torch for two tiny checkpoints."""
    from huggingface_hub import constants

    from mechdiff.models.loading import load_model

    repo = tmp_path / "hub" / "models--org--tiny"
    for step, sha in ((0, "a" * 40), (5, "b" * 40)):
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        for f in (full_run / f"step-{step:04d}").iterdir():
            (snap / f.name).write_bytes(f.read_bytes())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / f"step{step}").write_text(sha)
    names = ["hub:org/tiny@step0", "hub:org/tiny@step5"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert constants.HF_HUB_OFFLINE
    cp = Checkpoints(names)
    got = {n: cp.model(n).model.lm_head.weight[0, :4].tolist() for n in names[::-1]}
    for name, step in zip(names, (0, 5)):
        want = load_model(str(full_run / f"step-{step:04d}")).model.lm_head.weight[0, :4].tolist()
        assert got[name] == pytest.approx(want, abs=0), name
    assert got[names[0]] != got[names[1]]  # the check above can tell the revisions apart
    assert [step_of(n, 0) for n in names] == [0, 5]


def test_the_steps_the_between_run_null_reads_take_their_own_ranking_prompts(tmp_path) -> None:
    """``[discovery] runs_n`` ranking prompts at the ``[runs]`` steps (this run's checkpoint and the other runs'),
    ``n`` elsewhere, the plan's sizes counting the larger; fewer than ``n`` is refused with its line."""
    from mechdiff.studies.trajectory.stages.circuit import CircuitStage
    from mechdiff.studies.trajectory.study import TrajectoryStudy

    text = (ROOT / "tasks" / "entity_tracking_trajectory.toml").read_text()
    committed = load_settings(ROOT / "tasks" / "entity_tracking_trajectory.toml")
    assert (committed.discovery.n, committed.discovery.runs_n) == (32, 256)
    study = TrajectoryStudy(committed, out=tmp_path / "out", progress=False)
    read = {f"smollm2-et@{s}" for s in (2, 5, 15, 45, 100)}
    assert {n: study.ranking_n(n) for n in study.names} == {n: 256 if n in read else 32 for n in study.names}
    assert {study.ranking_n(o) for o in study.others} == {256} and len(study.others) == 4 * 5  # 4 runs, 5 steps
    assert study.prompt_set_sizes()["ranking"] == 256
    # a step ranked on n keeps the key it had before runs_n existed
    assert CircuitStage(study).inputs("smollm2-et@3")["discovery"] == {
        k: v for k, v in asdict_discovery(committed).items() if k != "runs_n"
    }
    assert CircuitStage(study).inputs("smollm2-et@5")["discovery"]["n"] == 256
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("runs_n = 256 ", "runs_n = 16  "))
    line = next(i for i, x in enumerate(bad.read_text().splitlines(), 1) if x.startswith("runs_n = 16"))
    with pytest.raises(SpecError, match=rf"bad.toml:{line}: \[discovery\] runs_n \(16\) must be at least n \(32\)"):
        load_settings(bad)


def asdict_discovery(settings) -> dict:
    from dataclasses import asdict

    return asdict(settings.discovery)
