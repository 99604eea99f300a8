"""benchmarks/gpu.py, the Python part of benchmarks/gpu.sh, on a tiny LLaMA config on CPU: every stage it times
runs, and each row carries the planner's prediction beside its measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[3] / "benchmarks"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def test_gpu_benchmark_runs_every_stage_on_cpu_with_the_plan_beside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gpu", None)
    import gpu

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "rows.json"
    rows = gpu.main(["--device", "cpu", "--quick", "--layers", "2", "--config", str(config), "--json", str(out)])
    assert [r["stage"] for r in rows] == list(gpu.STAGES) and json.loads(out.read_text()) == rows
    for r in rows:
        assert r["case"] == "L2 bfloat16" and r["planned_on"] == "this machine"
        assert r["gflop"] > 0 and r["s_planned"] > 0 and r["s_measured"] > 0 and r["mem_planned_mib"] > 0
    # two models held for DCM and CMAP: the load is both, planned as twice one model's weights
    dcm = rows[gpu.STAGES.index("dcm-epoch")]
    assert dcm["weights_planned_gib"] == 2 * rows[0]["weights_planned_gib"]
    text = capsys.readouterr().out
    assert text.count("| L2 bfloat16 |") == len(gpu.STAGES) and "share of mm rate" in text


def test_gpu_bundle_carries_what_nnsight_requires_beyond_a_gpu_images_packages(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import importlib.metadata as md

    import gpu_bundle

    for python in gpu_bundle.PYTHONS:
        pins, machine = gpu_bundle.travelling(python), gpu_bundle.machine_names(python)
        # what the issue found missing on a GPU image travels; what the image has does not
        assert {"nnsight", "pydantic", "pydantic-core", "websocket-client", "zstandard", "greenlet"} <= set(pins)
        assert not {"torch", "transformers", "peft", "huggingface-hub", "tqdm", "pyyaml", "numpy"} & set(pins)
        assert all(pins[name] == md.version(name) for name in pins)
        # closed: every requirement of what travels travels too or is the image's
        for name in pins:
            assert set(gpu_bundle._requires(name, python)) <= set(pins) | machine, name


def test_gpu_benchmark_plan_only_runs_nothing_and_plans_every_stage_on_an_h100(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gpu", None)
    import gpu

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    rows = gpu.main(["--device", "cuda", "--plan-only", "--quick", "--layers", "2", "--config", str(config)])
    text = capsys.readouterr().out
    assert rows == [] and f"on h100-80gb for {len(gpu.STAGES)} stages at L2 bfloat16" in text
    per_stage = text.split("seconds a run: ")[1].splitlines()[0].split(", ")
    assert [s.split()[0] for s in per_stage] == list(gpu.STAGES) and all(float(s.split()[1]) > 0 for s in per_stage)
