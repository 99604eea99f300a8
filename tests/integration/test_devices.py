"""Placement and remote execution: --device / --device-map / --remote on every stage, accelerate's
device map, and the NDIF code path with nnsight's local simulation (``remote="local"``) standing in
for the server: the same numbers as a local run, in the designed number of requests."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny

from mechdiff.cli import build_parser
from mechdiff.cli import main as cli_main
from mechdiff.common.components import Head
from mechdiff.models.loading import load_model, resolve_device_map
from mechdiff.models.memory import DEFAULT_BATCH, auto_batch_size
from mechdiff.models.registry import get_spec
from mechdiff.models.remote import RemoteSetupError, check_remote, hub_repo
from mechdiff.patching.core import Patch, run

MODEL_COMMANDS = {"eval", "circuit", "score", "prune", "compare", "dcm", "cmap", "finetune", "run"}
PLACEMENT = {"--dtype", "--device", "--device-map", "--remote"}


# ------------------------------------------------------------------------------------ options


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_model_loading_command_takes_the_placement_options():
    commands = _subcommands()
    assert MODEL_COMMANDS <= set(commands)
    loading = set()
    for name, p in commands.items():
        options = {o for a in p._actions for o in a.option_strings}
        if "--dtype" in options or name in MODEL_COMMANDS:
            loading.add(name)
            assert PLACEMENT <= options, f"mechdiff {name} lacks {sorted(PLACEMENT - options)}"
    assert MODEL_COMMANDS <= loading


def test_batch_size_auto_is_accepted_and_the_given_size_kept():
    args = build_parser().parse_args(["eval", "--models", "x", "--batch-size", "auto"])
    assert args.batch_size == "auto"
    assert build_parser().parse_args(["eval", "--models", "x", "--batch-size", "7"]).batch_size == 7
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--models", "x", "--batch-size", "0"])


def test_auto_batch_size_on_cpu_is_the_default(tiny_llama):
    assert auto_batch_size(tiny_llama) == DEFAULT_BATCH
    assert auto_batch_size(tiny_llama, default=7) == 7
    from mechdiff.commands._options import resolve_batch_size

    given = SimpleNamespace(batch_size=12)
    resolve_batch_size(given, tiny_llama)
    assert given.batch_size == 12
    auto = SimpleNamespace(batch_size="auto")
    resolve_batch_size(auto, tiny_llama)
    assert auto.batch_size == DEFAULT_BATCH


def test_device_and_device_map_resolve_to_one_placement():
    assert resolve_device_map(None, "auto") == "auto"
    assert resolve_device_map("cpu", None) == "cpu"
    with pytest.raises(ValueError, match="disagree"):
        resolve_device_map("cpu", "auto")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device_map("cuda", None)


# ------------------------------------------------------------------------------ device_map


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny llama saved as a local checkpoint directory (config, weights, tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    lm = make_tiny("llama", smollm2_tokenizer, seed=3)
    lm.model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


def test_device_map_loads_and_gives_the_plain_logits(tiny_dir, smollm2_tokenizer):
    from mechdiff.patching.path import path_patch
    from mechdiff.patching.path_pairs import prepare
    from mechdiff.tasks.entity_tracking import path_patching_pairs

    ids = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = load_model(str(tiny_dir))
    auto = load_model(str(tiny_dir), device_map="auto")  # all on CPU here; over the GPUs on a GPU machine
    on_cpu = load_model(str(tiny_dir), device="cpu")
    # a split map with accelerate's hooks (the layer on "disk" is loaded on the fly), as when sharding
    split = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    sharded = load_model(str(tiny_dir), device_map=split)
    assert auto.provenance["device_map"] == "auto" and sharded.model.hf_device_map["model.layers.2"] == "disk"
    assert sharded.device.type == "cpu"
    ref = run(plain, ids, capture=[("z", 2)])
    for other in (auto, on_cpu, sharded):
        out = run(other, ids, capture=[("z", 2)])
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.captured[("z", 2)], ref.captured[("z", 2)], rtol=0, atol=1e-5)
    # patching through the hooks: a path-patching step gives the plain model's scores
    pairs = path_patching_pairs(smollm2_tokenizer, 2, n_boxes=3, seed=0)
    senders = [Head(0, 1), Head(1, 2)]
    want = path_patch(plain, prepare(plain, pairs), senders, "last", None, progress=False)
    got = path_patch(sharded, prepare(sharded, pairs), senders, "last", None, progress=False)
    assert got.keys() == want.keys()
    assert max(abs(got[h] - want[h]) for h in want) < 1e-4


# ----------------------------------------------------------------------------------- remote


class Requests:
    """Counts what would go to NDIF: one call of the (local simulation) backend per request."""

    def __init__(self, monkeypatch):
        from nnsight.intervention.backends.local import LocalSimulationBackend

        self.kinds: list[str] = []
        original = LocalSimulationBackend.__call__

        def counted(backend, tracer):
            self.kinds.append("session" if type(tracer).__name__ == "Tracer" else "trace")
            return original(backend, tracer)

        monkeypatch.setattr(LocalSimulationBackend, "__call__", counted)

    def take(self) -> list[str]:
        kinds, self.kinds = self.kinds, []
        return kinds


@pytest.fixture
def pair(smollm2_tokenizer):
    """The same tiny llama twice: run locally, and through the remote path (nnsight's local simulation)."""
    local = make_tiny("llama", smollm2_tokenizer, seed=1)
    remote = make_tiny("llama", smollm2_tokenizer, seed=1)
    remote.remote = "local"
    return local, remote


def test_remote_path_gives_the_local_logits_for_an_activation_patch(pair, monkeypatch, smollm2_tokenizer):
    from mechdiff.patching.activation import activation_patch

    local, remote = pair
    requests = Requests(monkeypatch)
    g = torch.Generator().manual_seed(1)
    clean, source = torch.randint(0, 2000, (3, 10), generator=g), torch.randint(0, 2000, (3, 10), generator=g)
    patch = [Patch("z", 1, torch.randn(3, 10, 32, generator=g))]
    # one traced forward: one request, the same logits and captures
    a, b = run(local, clean, patch, capture=[("z", 2)]), run(remote, clean, patch, capture=[("z", 2)])
    assert requests.take() == ["trace"]
    assert torch.equal(a.logits, b.logits) and torch.equal(a.captured[("z", 2)], b.captured[("z", 2)])
    # activation patching (source run + patched run): one session
    heads = [Head(1, 0), Head(2, 3)]
    want = activation_patch(local, clean, source, heads)
    got = activation_patch(remote, clean, source, heads)
    assert requests.take() == ["session"]
    assert torch.equal(want, got)
    assert not torch.equal(want, run(local, clean).logits)  # the patch did something


def test_remote_path_patching_step_is_one_request_with_the_local_scores(pair, monkeypatch, smollm2_tokenizer):
    from mechdiff.patching.attribution import attribution_scores
    from mechdiff.patching.path import Receivers, path_patch
    from mechdiff.patching.path_pairs import prepare
    from mechdiff.tasks.entity_tracking import path_patching_pairs

    local, remote = pair
    requests = Requests(monkeypatch)
    pairs = path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=0)
    lb, rb = prepare(local, pairs), prepare(remote, pairs)
    assert requests.take() == ["session"]  # clean + counterfactual runs in one request
    assert all(torch.equal(lb.clean_z[l], rb.clean_z[l]) for l in lb.clean_z)
    senders = [Head(l, h) for l in range(2) for h in range(4)]
    receivers = Receivers((Head(2, 0), Head(2, 1)), "q", "last")
    # 8 senders, 3 per pass: locally 3 chunks x (frozen + receiver run) = 6 forwards; remotely 1 request
    want = path_patch(local, lb, senders, "last", receivers, senders_per_pass=3, progress=False)
    got = path_patch(remote, rb, senders, "last", receivers, senders_per_pass=3, progress=False)
    assert requests.take() == ["session"]
    assert got == want and any(v != 0 for v in want.values())
    step_a = path_patch(remote, rb, senders, "last", None, senders_per_pass=3, progress=False)
    assert requests.take() == ["session"]
    assert step_a == path_patch(local, lb, senders, "last", None, senders_per_pass=3, progress=False)
    # the attribution screen's forward and backward passes: one request
    want_attr = attribution_scores(local, lb, "last", receivers)
    got_attr = attribution_scores(remote, rb, "last", receivers)
    assert requests.take() == ["session"]
    assert got_attr.keys() == want_attr.keys()
    assert max(abs(got_attr[h] - want_attr[h]) for h in want_attr) <= 1e-6 * max(1.0, *map(abs, want_attr.values()))
    # in parts of two: a request to read each part's clean run, then one a part (both runs, then the step's passes)
    streamed = prepare(remote, pairs, part_size=2)
    assert requests.take() == ["session"] * 2
    parted = path_patch(remote, streamed, senders, "last", receivers, senders_per_pass=3, progress=False)
    assert max(abs(parted[h] - want[h]) for h in want) <= 1e-6 * max(1.0, *map(abs, want.values()))
    assert requests.take() == ["session"] * 4


def test_remote_scoring_matches_and_batches_share_a_request(pair, monkeypatch, smollm2_tokenizer):
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.circuits.scoring import Scorer
    from mechdiff.tasks.entity_tracking import generate, reference_records

    local, remote = pair
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    reference = reference_records(smollm2_tokenizer, 6, 3, 1)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 1)]}, {"A": "last"})
    want = Scorer.build(local, records, reference, 4, progress=False).keep(circuit.pairs())
    requests = Requests(monkeypatch)
    scorer = Scorer.build(remote, records, reference, 4, progress=False)
    assert requests.take() == ["trace", "trace"]  # the means: one request per batch, each written to the store
    got = scorer.keep(circuit.pairs())
    assert requests.take() == ["session"]  # both batches of the evaluation in one request
    assert (got.correct == want.correct).all() and (got.prob == want.prob).all()


def test_remote_forward_with_grad_outside_a_session_is_refused(pair):
    _, remote = pair
    with pytest.raises(RemoteSetupError, match="session"):
        run(remote, torch.zeros(1, 4, dtype=torch.long), grad=True)


def test_remote_without_api_key_fails_before_loading(monkeypatch):
    from nnsight import CONFIG

    import mechdiff.models.loading as loading

    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)

    def no_load(*a, **k):
        raise AssertionError("weights or tokenizer loaded before the API key was checked")

    monkeypatch.setattr(loading, "_load_weights", no_load)
    monkeypatch.setattr(loading, "load_tokenizer", no_load)
    with pytest.raises(RemoteSetupError, match="NDIF_API_KEY"):
        load_model("llama-7b", remote=True)
    with pytest.raises(RemoteSetupError, match="NDIF_API_KEY"):
        check_remote(True)
    check_remote("local")  # the local stand-in needs no key


def test_remote_cli_error_names_the_api_key(monkeypatch, capsys):
    from nnsight import CONFIG

    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)
    assert cli_main(["eval", "--models", "llama-7b", "--remote", "--n", "2"]) == 2
    assert "NDIF_API_KEY" in capsys.readouterr().err


def test_remote_names_hub_checkpoints_and_refuses_local_ones(monkeypatch):
    assert hub_repo(get_spec("llama-7b")) == ("huggyllama/llama-7b", None, None)
    assert hub_repo(get_spec("goat-7b")) == ("huggyllama/llama-7b", None, "tiedong/goat-lora-7b")
    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    with pytest.raises(RemoteSetupError, match="NDIF runs only models it hosts"):
        check_remote(True, [get_spec("smollm2-et")])


# ---------------------------------------------------------------------------- reproduction


def test_llama7b_task_file_fails_early_naming_missing_weights(monkeypatch, tmp_path):
    from mechdiff.models.weights import WeightsMissingError
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.circuits.study import CircuitsStudy as Study

    spec = load_spec("tasks/entity_tracking_llama7b.toml")
    assert spec.reproduce.circuit.endswith("llama-7b-entity-tracking.json") and spec.reproduce.only
    assert spec.model_names == ["llama-7b", "vicuna-7b", "goat-7b", "float-7b"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing is there
    import mechdiff.models.weights as weights

    monkeypatch.setattr(weights, "_hub_cached", lambda repo, rev, cache_dir: (False, False))
    with pytest.raises(WeightsMissingError) as err:
        Study(spec, progress=False, out_dir=str(tmp_path / "out"))
    text = str(err.value)
    for name in ("llama-7b", "vicuna-7b", "goat-7b", "float-7b", "huggyllama/llama-7b", "tiedong/goat-lora-7b"):
        assert name in text
    assert "local directory" in text and "HF_HUB_OFFLINE" in text


def test_reproduction_rows_sit_beside_the_published_figures(tiny_llama, smollm2_tokenizer, tmp_path):
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.studies.circuits.reproduce import published_figures, reproduction_rows
    from mechdiff.studies.circuits.spec import default_spec

    paper = published_figures()
    assert paper["reported"]["accuracy_full"]["goat-7b"] == 0.82
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0)], "B": [Head(1, 1)]}, {"A": "last", "B": "last"})
    circuit.save(tmp_path / "c.json")
    spec = default_spec()
    spec.models.base, spec.models.finetunes = tiny_llama.name, []
    spec.task.n_boxes = 3
    study = SimpleNamespace(
        spec=spec, tokenizer=smollm2_tokenizer, progress=False, store=None, model=lambda name: tiny_llama
    )
    published = {
        "reported": {"accuracy_full": {tiny_llama.name: 0.5}, "accuracy_llama_circuit": {tiny_llama.name: 0.25}}
    }
    rows = reproduction_rows(study, str(tmp_path / "c.json"), published, n=4)
    assert [r["model"] for r in rows] == [tiny_llama.name]
    row = rows[0]
    assert row["published_full_accuracy"] == 0.5 and row["published_circuit_accuracy"] == 0.25
    assert row["published_faithfulness"] == 0.5
    assert 0 <= row["full_accuracy"] <= 1 and row["n_prompts"] == 4
    assert json.loads(json.dumps(row, default=str))  # a plain row for the tables
    missing = reproduction_rows(study, str(tmp_path / "c.json"), {}, n=4)[0]
    assert math.isnan(missing["published_full_accuracy"])


def test_mechdiff_run_prints_the_reproduction_table(tiny_dir, tmp_path, smollm2_tokenizer, capsys):
    """The command path of tasks/entity_tracking_llama7b.toml, on two tiny local checkpoints."""
    import shutil

    from mechdiff.circuits.circuit import Circuit
    from mechdiff.studies.circuits.reproduce import published_figures

    other = tmp_path / "tiny-ft"
    shutil.copytree(tiny_dir, other)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0)], "B": [Head(1, 1)]}, {"A": "last", "B": "last"})
    circuit.save(tmp_path / "circuit.json")
    published = published_figures()
    published["reported"]["accuracy_full"][str(other)] = 0.5
    (tmp_path / "published.json").write_text(json.dumps(published))
    (tmp_path / "task.toml").write_text(f"""
[task]
name = "entity-tracking"
n_boxes = 3
[models]
base = "{tiny_dir}"
finetunes = ["{other}"]
device = "cpu"
[eval]
batch_size = 4
[reproduce]
circuit = "{tmp_path / "circuit.json"}"
published = "{tmp_path / "published.json"}"
n = 4
only = true
[output]
dir = "{tmp_path / "out"}"
store = "{tmp_path / "activations.h5"}"
""")
    assert cli_main(["run", str(tmp_path / "task.toml"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "published_full_accuracy" in out and "0.500" in out and "reproduction" in out
    rows = json.loads((tmp_path / "out" / "reproduction.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert [r["model"] for r in rows] == [str(tiny_dir), str(other)]
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["spec"]["reproduce"]["only"] is True
    assert sorted(manifest["stages"]) == sorted(f"reproduction:{m}" for m in (tiny_dir, other))  # one stage per model
    # a rerun reuses the stage
    assert cli_main(["run", str(tmp_path / "task.toml"), "--no-progress"]) == 0
    assert "cached" in capsys.readouterr().out


def test_remote_cmap_matches_with_one_request_per_model_and_batch(monkeypatch, smollm2_tokenizer):
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.methods.cmap import run_cmap
    from mechdiff.tasks.entity_tracking import generate

    base, ft = make_tiny("llama", smollm2_tokenizer, seed=1), make_tiny("llama", smollm2_tokenizer, seed=2)
    rbase, rft = make_tiny("llama", smollm2_tokenizer, seed=1), make_tiny("llama", smollm2_tokenizer, seed=2)
    rbase.remote = rft.remote = "local"
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0)], "B": [Head(1, 1)]}, {"A": "last", "B": "last"})
    want = run_cmap(base, ft, circuit, records, ["z", "v"], batch_size=3, progress=False)
    requests = Requests(monkeypatch)
    got = run_cmap(rbase, rft, circuit, records, ["z", "v"], batch_size=3, progress=False)
    # per batch: the donor's run (fine-tune) and one session of the base's 1 + 3 scopes x 2 kinds runs
    assert requests.take() == ["trace", "session"] * 2
    assert [r.accuracy.value for r in got.rows] == [r.accuracy.value for r in want.rows]
    assert [r.answer_prob.value for r in got.rows] == [r.answer_prob.value for r in want.rows]
    assert got.base_accuracy.value == want.base_accuracy.value


def test_remote_true_loads_no_weights_and_ships_small_requests(tiny_dir, monkeypatch):
    """``remote=True`` as for NDIF, with the server replaced by a backend that only serialises the request."""
    from nnsight.modeling.mixins.remotable import Remotable
    from nnsight.schema.request import RequestModel

    from mechdiff.models.registry import ModelSpec
    from mechdiff.patching.path_pairs import prepare
    from mechdiff.tasks.entity_tracking import path_patching_pairs

    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    sent: list[int] = []

    class Shipped(Exception):
        pass

    def backend(self, remote, blocking, job_id, verbose):
        def ship(tracer):
            sent.append(len(RequestModel.serialize(tracer)))
            raise Shipped

        return ship

    monkeypatch.setattr(Remotable, "_remote_backend", backend)
    spec = ModelSpec("tiny-on-ndif", "hub", str(tiny_dir))  # a "hub id" the config and tokenizer load from
    lm = load_model(spec, remote=True)
    assert lm.remote is True and lm.provenance["kind"] == "remote"
    assert {p.device.type for p in lm.model.parameters()} == {"meta"}  # no weights here
    assert lm.fingerprint.startswith("remote-") and lm.device.type == "cpu" and lm.shape.n_layers == 3
    weights = sum(p.numel() * 4 for p in load_model(str(tiny_dir)).model.parameters())
    with pytest.raises(Shipped):
        run(lm, torch.zeros(2, 8, dtype=torch.long), [Patch("z", 1, torch.zeros(2, 8, 32))])
    with pytest.raises(Shipped):
        prepare(lm, path_patching_pairs(lm.tokenizer, 2, n_boxes=3, seed=0))  # a session
    assert len(sent) == 2 and max(sent) < weights / 4, (sent, weights)
