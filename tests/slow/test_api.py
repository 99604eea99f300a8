"""The Python door end to end (#52's "Done when"): in a fresh ``python -c``, with no task file and no CLI, a pair, a
task, a small study, its plan, its run, its accuracy and faithfulness as DataFrames and a figure; then ``mechdiff
run`` on the study's own task file (`Study.to_toml`) finds every stage the Python run computed under the same key
and writes byte-identical tables and JSON. Two tiny random llamas (`tiny_family`) at the sizes of the integration
tests' tiny study: what is checked is that the two doors are one study, not what the models do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mechdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import mechdiff as md
pair = md.pair({m0!r}, {m1!r})
task = md.task("entity_tracking")
study = md.Study(
    task={{"name": task.name, "n_boxes": 3}},
    models=pair,
    out={out!r},
    output={{"store": {store!r}}},
    eval={{"n": 12, "batch_size": 12, "floor": -1.0}},
    positions={{"n": 6, "max_steps": 2}},
    discovery={{"n": 6, "curve_n": 8, "sizes": [0.1, 0.5, 1.0], "stability_draws": 20}},
    scoring={{"n": 8, "random_draws": 2, "random_prompts": 0, "completeness_draws": 1, "reference_n": 12,
             "prune_n": 6}},
    dcm={{"desiderata": ["positional"], "groups": ["last"], "n_train": 6, "n_val": 3, "n_test": 3, "epochs": 1}},
    cmap={{"n": 8, "parts": ["z"], "groups": ["last"], "n_random": 1, "random_prompts": 0}},
    progress=False,
)
plan = study.plan()
print(plan)
frame = plan.to_frame()
assert not frame["cached"].any() and (frame["pflop"] > 0).all(), frame
results = study.run()
accuracy, faithfulness = results.accuracy(), results.faithfulness()
print(accuracy.to_string(), faithfulness.to_string(), sep="\\n")
assert list(accuracy["model"]) == pair.names and "accuracy_low" in accuracy
assert set(faithfulness["model"]) == set(pair.names) and "faithfulness_high" in faithfulness
fig = results.figure("accuracy")
fig.savefig({figure!r})
study.to_toml({toml!r})
print("DONE", len(frame))
"""


def _files(run: Path) -> dict[str, bytes]:
    """Every table, circuit, stage record and JSON result of a run directory (not the report, its timings)."""
    wanted = [*run.glob("tables/*"), *run.glob("circuits/*"), *run.glob("stages/*.json"), run / "outcomes.json"]
    return {str(p.relative_to(run)): p.read_bytes() for p in wanted}


def test_the_done_when_script_then_mechdiff_run_finds_the_same_study(tiny_family, tmp_path):
    out, toml, figure = tmp_path / "run", tmp_path / "study.toml", tmp_path / "accuracy.png"
    script = SCRIPT.format(
        m0=tiny_family[0],
        m1=tiny_family[1],
        out=str(out),
        store=str(tmp_path / "store.h5"),
        figure=str(figure),
        toml=str(toml),
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "circuits study into" in done.stdout and "stages to compute" in done.stdout and "DONE" in done.stdout
    assert figure.stat().st_size > 0
    computed = json.loads((out / "run.json").read_text())["stages"]
    assert len(computed) >= 8 and not any(s["cached"] for s in computed.values())
    before = _files(out)
    assert main(["run", str(toml), "--workers", "1", "--no-progress"]) == 0  # the CLI on the study's own file
    again = json.loads((out / "run.json").read_text())["stages"]
    assert {n: s["key"] for n, s in again.items()} == {n: s["key"] for n, s in computed.items()}
    assert all(s["cached"] for s in again.values())
    after = _files(out)
    assert after.keys() == before.keys() and len(after) > 20
    assert [name for name in after if after[name] != before[name]] == []
