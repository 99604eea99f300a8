"""Fault injection: damaged caches heal with a warning, bad inputs are refused naming the file and the fix
before any weights load, interrupted runs keep every finished stage, concurrent runs and unwritable
outputs are refused. Tiny saved llama models throughout (a whole study takes a few seconds)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from test_study import tiny_spec

from mechdiff.cli import main
from mechdiff.common.io import LOCK_NAME, OutputError, RunLockedError, atomic_open, run_lock, write_json
from mechdiff.patching.store import ActivationStore, capture_sites
from mechdiff.runs.stages import StageCache
from mechdiff.studies.circuits.study import CircuitsStudy as Study
from mechdiff.tasks.entity_tracking import generate

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def family(tiny_family) -> list[str]:
    """The two tiny saved models of the study tests (``conftest.tiny_family``)."""
    return tiny_family


@pytest.fixture(scope="module")
def finished(tiny_study) -> Path:
    """A whole tiny study run once, uninterrupted: ``<root>/run`` and ``<root>/store.h5`` (``conftest.tiny_study``,
    shared with the study tests; copied before any change)."""
    return tiny_study


def copy_of(finished: Path, family: list[str], dest: Path):
    shutil.copytree(finished, dest, dirs_exist_ok=True)
    return tiny_spec(family, dest)


def stage_files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "stages").glob("*.json"))}


def results(run: Path) -> dict[str, object]:
    """Every stage's result, wall-clock timings left out (they are all that may differ between runs)."""
    return {name: _untimed(json.loads(data)["result"]) for name, data in stage_files(run).items()}


def _untimed(value: object) -> object:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in ("timings_s", "seconds")}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def leftovers(run: Path) -> list[Path]:
    """Temporary or lock files an interrupted run must not leave behind."""
    return [p for p in run.rglob("*") if p.name.endswith(".tmp") or p.name == LOCK_NAME]


def set_aside_warnings(caplog, path: Path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and str(path) in r.getMessage() and "recompute" in r.getMessage()
    ]


# ----------------------------------------------------------------------------------- stage records
CORRUPTIONS = {
    "truncated": lambda data: data[:100],
    "garbled": lambda data: bytes(b ^ 0x5A for b in data[:200]) + data[200:],
    "not-a-record": lambda data: json.dumps({"name": "dcm", "key": "x"}).encode(),  # valid JSON, no result
    "empty": lambda data: b"",
}


@pytest.mark.parametrize(
    "stage,damage",
    [
        ("dcm.json", "truncated"),
        ("accuracy__m0.json", "garbled"),
        ("matrix__m1.json", "not-a-record"),
        ("cmap__m1.json", "empty"),
    ],
)
def test_damaged_stage_record_is_set_aside_and_recomputed(finished, family, tmp_path, caplog, stage, damage):
    spec = copy_of(finished, family, tmp_path)
    run = tmp_path / "run"
    before = stage_files(run)
    path = run / "stages" / stage
    damaged = CORRUPTIONS[damage](path.read_bytes())
    path.write_bytes(damaged)
    with caplog.at_level(logging.WARNING):
        study = Study(spec, progress=False)
        study.run()
    assert set_aside_warnings(caplog, path), caplog.text
    aside = list(path.parent.glob(stage + ".unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == damaged  # kept as evidence, not deleted
    recomputed = {n for n, r in study.cache.records.items() if not r.cached}
    assert len(recomputed) == 1  # only the damaged stage; every other finished stage is reused
    after = stage_files(run)
    assert {n: b for n, b in after.items() if n != stage} == {n: b for n, b in before.items() if n != stage}
    assert _untimed(json.loads(after[stage])["result"]) == _untimed(json.loads(before[stage])["result"])


def test_damaged_headmap_stage_is_set_aside_and_recomputed(tmp_path, caplog):
    """HeadMap's stages go through the one stage cache: a damaged record is set aside and recomputed."""
    from mechdiff.runs.stages import StageCache

    calls = []
    stage = lambda fn: StageCache(tmp_path).run("locate-x", {"k": 1}, fn).result  # noqa: E731
    value = stage(lambda: calls.append(1) or {"heads": ["L0H1"]})
    path = tmp_path / "stages" / "locate-x.json"
    assert stage(lambda: calls.append(1)) == value and calls == [1]  # reused
    path.write_text(path.read_text()[:20])
    with caplog.at_level(logging.WARNING):
        again = stage(lambda: calls.append(1) or {"heads": ["L0H1"]})
    assert again == value and calls == [1, 1]
    assert set_aside_warnings(caplog, path) and len(list(path.parent.glob("locate-x.json.unreadable-*"))) == 1


# ----------------------------------------------------------------------------------- the activation store
@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, n=8, n_boxes=3, seed=1)


def _chunk_offset(path: Path, group: str) -> int:
    with h5py.File(path, "r") as f:
        return f[group]["L0"].id.get_chunk_info(0).byte_offset


def _truncate(path: Path, group: str) -> None:
    os.truncate(path, min(5000, path.stat().st_size // 2))


def _garble_header(path: Path, group: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"\x00" * 8)  # the HDF5 signature


def _garble_data(path: Path, group: str) -> None:
    offset = _chunk_offset(path, group)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(range(64)))


def _shorten(path: Path, group: str) -> None:
    """The key matches, the attributes say complete, but a layer's array holds fewer rows than recorded."""
    with h5py.File(path, "a") as f:
        g = f[group]
        data = g["L1"][()]
        del g["L1"]
        g.create_dataset("L1", data=data[: max(1, len(data) - 1)])


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _garble_data, _shorten])
def test_damaged_store_is_set_aside_and_rebuilt(tmp_path, tiny_llama, records, caplog, damage):
    store = ActivationStore(tmp_path / "acts.h5")
    means = store.means(tiny_llama, records, "z", batch_size=4, progress=False)
    direct = torch.stack([t.float().mean(0) for t in capture_sites(tiny_llama, records, "z").values()])
    torch.testing.assert_close(means, direct, atol=1e-5, rtol=1e-5)
    group = store.keys()[0].group
    damage(store.path, group)
    with caplog.at_level(logging.WARNING):
        again = store.means(tiny_llama, records, "z", batch_size=4, progress=False)
    torch.testing.assert_close(again, direct, atol=1e-5, rtol=1e-5)  # rebuilt, not read from the damage
    assert set_aside_warnings(caplog, store.path), caplog.text
    assert len(list(tmp_path.glob("acts.h5.unreadable-*"))) == 1
    assert [k.group for k in store.keys()] == [group]


def test_store_entry_shorter_than_recorded_is_rebuilt(tmp_path, tiny_llama, records, caplog):
    store = ActivationStore(tmp_path / "acts.h5")
    entry = store.get_or_compute(tiny_llama, records, "z", "last", batch_size=4, progress=False)
    _shorten(store.path, entry.key.group)
    with caplog.at_level(logging.WARNING):
        again = store.get_or_compute(tiny_llama, records, "z", "last", batch_size=4, progress=False)
    assert len(again) == len(records) and set_aside_warnings(caplog, store.path)
    torch.testing.assert_close(again.read(1), capture_sites(tiny_llama, records, "z", "last")[1].float())


def test_unreadable_partial_store_is_set_aside(tmp_path, tiny_llama, records, caplog):
    store = ActivationStore(tmp_path / "acts.h5")
    store.partial.write_bytes(b"not hdf5" * 100)
    with caplog.at_level(logging.WARNING):
        entry = store.get_or_compute(tiny_llama, records, "z", "last", batch_size=4, progress=False)
    assert set_aside_warnings(caplog, store.partial) and not store.partial.exists()
    torch.testing.assert_close(entry.read(0), capture_sites(tiny_llama, records, "z", "last")[0].float())


def test_truncated_store_in_a_run_is_rebuilt_and_results_match(finished, family, tmp_path, caplog):
    spec = copy_of(finished, family, tmp_path)
    store = Path(spec.output.store)
    os.truncate(store, 5000)
    (tmp_path / "run" / "stages" / "matrix__m0.json").unlink()  # the one stage that must read the store again
    with caplog.at_level(logging.WARNING):
        study = Study(spec, progress=False)
        study.run()
    assert set_aside_warnings(caplog, store)
    assert {n for n, r in study.cache.records.items() if not r.cached} == {f"matrix:{family[0]}"}
    assert results(tmp_path / "run") == results(finished / "run")


# ----------------------------------------------------------------------------------- inputs
def _no_weights(monkeypatch) -> None:
    """Any weight load fails the test: every refusal below must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr("mechdiff.models.loading._load_weights", refuse)


CIRCUITS = {
    "not-json": ('{"groups": {"A": ["L0H1"]},\n  positions: {}}', "not valid JSON"),
    "no-groups": ('{"model": "x"}', '"groups" and "positions"'),
    "bad-name": ('{"groups": {"A": ["head7"]}, "positions": {"A": "last"}}', "head7"),
    "outside-model": ('{"groups": {"A": ["L99H0", "L1H2"]}, "positions": {"A": "last"}}', "L99H0"),
    "unknown-position": ('{"groups": {"A": ["L0H1"]}, "positions": {"A": "first_token"}}', "first_token"),
    "missing-position": ('{"groups": {"A": ["L0H1"], "B": ["L1H0"]}, "positions": {"A": "last"}}', "no position"),
}


# every fault through `score`; the two kinds every command must catch itself (parse, shape) through the others
CASES = [("score", kind) for kind in CIRCUITS] + [
    (command, kind) for command in ("prune", "dcm", "cmap", "compare") for kind in ("not-json", "outside-model")
]


@pytest.mark.parametrize("command,kind", CASES)
def test_bad_circuit_file_refused_naming_file_before_weights_load(family, tmp_path, capsys, monkeypatch, kind, command):
    _no_weights(monkeypatch)
    text, what = CIRCUITS[kind]
    path = tmp_path / f"{kind}.json"
    path.write_text(text)
    out = str(tmp_path / "out")
    argv = {
        "score": ["score", "--model", family[0], "--circuit", str(path), "--out", out],
        "prune": ["prune", "--model", family[0], "--circuit", str(path), "--out", out + "/p.json"],
        "dcm": ["dcm", "--model", family[0], "--circuit", str(path), "--out", out],
        "cmap": ["cmap", "--base", family[0], "--finetune", family[1], "--circuit", str(path), "--out", out],
        "compare": ["compare", "--models", ",".join(family), "--circuits", str(path), "--out", out],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: " in err and what in err and " — " in err, err
    assert "Traceback" not in err
    assert path.read_text() == text  # a user's file is never moved or rewritten
    if kind == "outside-model":
        assert "2 layers x 4 heads" in err  # the shape read from the model's config


def test_missing_circuit_file_named(family, tmp_path, capsys, monkeypatch):
    _no_weights(monkeypatch)
    path = tmp_path / "nowhere.json"
    assert main(["score", "--model", family[0], "--circuit", str(path), "--out", str(tmp_path / "o")]) == 2
    assert f"error: {path}: no such circuit file — " in capsys.readouterr().err


TASK_FILES = {
    "syntax": ('[task]\nname = "entity-tracking"\n[models]\nbase = "m0\n', "not valid TOML"),
    "type": ('[task]\nname = "entity-tracking"\nn_boxes = "seven"\n[models]\nbase = "m0"\n', ":3: n_boxes"),
    "binary": ("\udcff", "not a text file"),
}


@pytest.mark.parametrize("kind", list(TASK_FILES))
def test_bad_task_file_refused_naming_file(tmp_path, capsys, monkeypatch, kind):
    _no_weights(monkeypatch)
    text, what = TASK_FILES[kind]
    path = tmp_path / "task.toml"
    path.write_bytes(b"\xff\xfe\x00garbage" if kind == "binary" else text.encode())
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}" in err and what in err and " — " in err, err


def test_bad_reproduction_circuit_refused_before_work(family, tmp_path, monkeypatch):
    _no_weights(monkeypatch)
    spec = tiny_spec(family, tmp_path)
    bad = tmp_path / "released.json"
    bad.write_text('{"groups": {"A": [[40, 0]]}, "positions": {"A": "last token"}}')  # the paper's format
    spec.reproduce.circuit = str(bad)
    with pytest.raises(ValueError, match=f"{bad}: .*L40H0"):
        Study(spec, progress=False)


# ----------------------------------------------------------------------------------- interruption
def test_killed_at_every_stage_boundary_keeps_finished_stages(finished, family, tmp_path, monkeypatch):
    """Each run finishes the stages of one kind (accuracy, positions, circuit, prune, matrix, DCM, CMAP: one per
    model or one) and is killed as the next kind begins; every earlier record stays intact, byte for byte (a
    stage recomputed would differ in its timings), nothing half-written is left, and the resumed runs end with
    the uninterrupted run's results. One kill per change of kind, not per stage: a kill before the second
    model's stage of a kind exercises nothing a kill before the first does not."""
    spec = tiny_spec(family, tmp_path)
    run = tmp_path / "run"
    original = StageCache.run
    kind = lambda name: name.split(":", 1)[0]  # noqa: E731
    kinds = []

    def one_kind_then_kill(self, name, inputs, compute):
        def guarded():
            done = {kind(n) for n, r in self.records.items() if not r.cached}
            if done and kind(name) not in done:
                raise KeyboardInterrupt(f"killed before {name}")
            return compute()

        return original(self, name, inputs, guarded)

    monkeypatch.setattr(StageCache, "run", one_kind_then_kill)
    while True:
        before = stage_files(run) if (run / "stages").exists() else {}
        try:
            Study(spec, progress=False).run()
            break
        except KeyboardInterrupt as e:
            kinds.append(kind(str(e).removeprefix("killed before ")))
        after = stage_files(run)
        assert {n: after[n] for n in before} == before  # nothing finished was touched
        new = {n.split("__")[0].removesuffix(".json") for n in set(after) - set(before)}
        assert len(new) == 1 and len(after) > len(before)  # the one kind that ran is on disk, complete
        assert all(json.loads(b)["result"] is not None for b in after.values())
        assert not leftovers(run), leftovers(run)
    # killed once before each kind but the first, in the order the uninterrupted run ran them
    order = list(dict.fromkeys(kind(n) for n in json.loads((finished / "run" / "run.json").read_text())["stages"]))
    assert kinds == order[1:] and {"positions", "circuit", "prune", "matrix", "dcm", "cmap"} <= set(kinds)
    assert results(run) == results(finished / "run")


def test_killed_inside_a_store_write(finished, family, tmp_path, monkeypatch):
    spec = copy_of(finished, family, tmp_path)
    store, run = Path(spec.output.store), tmp_path / "run"
    store.unlink()
    for name in ("prune__m0.json", "matrix__m0.json", "matrix__m1.json"):
        (run / "stages" / name).unlink()
    kept = stage_files(run)
    calls = []
    real = ActivationStore._dataset

    def dies_on_second_layer(self, *args, **kwargs):  # the first layer's array is written, the second not
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-write")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ActivationStore, "_dataset", dies_on_second_layer)
    with pytest.raises(KeyboardInterrupt):
        Study(spec, progress=False).run()
    monkeypatch.undo()
    assert not store.exists() and Path(str(store) + ".partial").exists()  # never a half-written store
    assert stage_files(run) == kept and not leftovers(run)
    study = Study(spec, progress=False)
    study.run()
    m0, m1 = family
    assert {n for n, r in study.cache.records.items() if not r.cached} == {
        f"prune:{m0}",
        f"matrix:{m0}",
        f"matrix:{m1}",
    }
    assert results(run) == results(finished / "run")


def _task_file(family: list[str], tmp_path: Path) -> Path:
    spec = tiny_spec(family, tmp_path)
    lines = []
    for section, values in spec.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {json.dumps(value) if not isinstance(value, dict) else _inline(value)}")
    path = tmp_path / "task.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _inline(table: dict) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + " }"


def test_sigterm_during_a_run_keeps_finished_stages(family, tmp_path):
    """A real ``mechdiff run`` process is sent SIGTERM once its first stage is on disk."""
    task = _task_file(family, tmp_path)
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mechdiff.cli", "run", str(task), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not list((run / "stages").glob("*.json")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    assert (run / LOCK_NAME).read_text().split()[0] == str(proc.pid)  # the lock names its holder
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "interrupted" in err, err
    assert "Traceback" not in err
    finished = stage_files(run)
    assert finished and all(json.loads(b)["result"] is not None for b in finished.values())
    assert not leftovers(run), leftovers(run)  # lock released, no temporary file


# ----------------------------------------------------------------------------------- concurrency, outputs
def test_second_run_on_a_held_directory_is_refused_with_the_pid(finished, family, tmp_path, capsys):
    spec = copy_of(finished, family, tmp_path)
    task = _task_file(family, tmp_path)
    run = tmp_path / "run"
    before = stage_files(run)
    with run_lock(run) as lock:
        with pytest.raises(RunLockedError, match=f"PID {os.getpid()}"):
            Study(spec, progress=False).run()
        assert main(["run", str(task)]) == 2
        err = capsys.readouterr().err
        assert f"error: {lock}: another mechdiff run (PID {os.getpid()})" in err and " — " in err
    assert stage_files(run) == before and not (run / LOCK_NAME).exists()


def test_stale_lock_of_a_dead_process_is_taken_over(finished, family, tmp_path, caplog):
    spec = copy_of(finished, family, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run" / LOCK_NAME).write_text(f"{dead.pid}\n")  # left by a run killed with SIGKILL
    with caplog.at_level(logging.WARNING):
        Study(spec, progress=False).run()
    assert f"PID {dead.pid}" in caplog.text and "no longer running" in caplog.text
    assert not (tmp_path / "run" / LOCK_NAME).exists()


@pytest.mark.parametrize("which", ["run", "store"])
def test_unwritable_output_named_before_any_work(family, tmp_path, capsys, monkeypatch, which):
    """As root chmod does not stop writes, so the directory lies under a regular file (always unwritable)."""
    _no_weights(monkeypatch)
    monkeypatch.setattr(
        "mechdiff.models.weights.check_weights",
        lambda *a, **k: pytest.fail("work began before the output was checked"),
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    spec = tiny_spec(family, tmp_path)
    target = blocker / "results"
    if which == "run":
        spec.output.dir = str(target)
    else:
        spec.output.store = str(target / "acts.h5")
    with pytest.raises(OutputError, match=f"{target}: the .* cannot be written .* — choose another directory"):
        Study(spec, progress=False)
    if which == "run":
        assert main(["run", str(_task_file(family, tmp_path)), "--out", str(target)]) == 2
        assert f"error: {target}: the run directory cannot be written" in capsys.readouterr().err


def test_atomic_write_interrupted_leaves_the_old_file(tmp_path):
    path = write_json(tmp_path / "result.json", {"value": 1})
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path) as handle:
            handle.write('{"value": ')
            raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"value": 1} and list(tmp_path.iterdir()) == [path]


def test_figure_save_failure_leaves_no_file(tmp_path):
    import matplotlib.pyplot as plt

    from mechdiff.common.io import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    fig.savefig = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())  # dies while writing
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, tmp_path / "fig.png")
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_swallowed_in_a_destructor_still_stops_the_run(family, tmp_path, capsys, monkeypatch):
    """Python ignores an exception raised inside ``__del__``: a SIGTERM landing there must still end the run,
    at the next stage boundary, with the finished stages kept and no traceback printed."""
    import gc

    from mechdiff.cli import main
    from mechdiff.common import io as mio
    from mechdiff.studies.circuits.study import CircuitsStudy as RealStudy

    task = _task_file(family, tmp_path)
    seen = []

    class Swallowing:
        def __del__(self):
            mio.terminate(signal.SIGTERM, None)  # the handler, run where Python swallows its exception

    def accuracy(self, name):
        rec = real(self, name)
        if not seen and not self.cache.planning:  # the run's first computed stage, not the plan's walk
            seen.append(name)
            Swallowing()
            gc.collect()
        return rec

    real = RealStudy.accuracy
    monkeypatch.setattr(RealStudy, "accuracy", accuracy)
    assert main(["run", str(task), "--no-progress"]) == 143
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    finished = stage_files(tmp_path / "run")
    assert list(finished) == [f"accuracy__{Path(family[0]).name}.json"]  # stopped at the next boundary
    assert not leftovers(tmp_path / "run")
    mio.clear_terminated()
