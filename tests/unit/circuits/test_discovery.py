"""Path-patching discovery by plan (mechdiff.circuits.discovery) and the per-model settings a study hands it."""

from __future__ import annotations

import pytest

from mechdiff.circuits.discovery import DiscoverySettings, discover, select
from mechdiff.tasks.entity_tracking import path_patching_pairs


def test_the_circuit_is_cut_from_a_steps_scores_at_its_own_k(tiny_llama, smollm2_tokenizer):
    """As the paper: step A keeps k heads as step B's receivers and puts its top circuit_k heads, from the same
    exact scores, in the circuit; without circuit_k the circuit holds the receivers."""
    pairs = path_patching_pairs(smollm2_tokenizer, 5, n_boxes=3, seed=3)
    k = {"A": 2, "B": 1, "C": 0, "D": 0}
    wide, steps = discover(
        tiny_llama, pairs, DiscoverySettings(k=k, circuit_k={"A": 5}, n_prompts=5, n_boxes=3), progress=False
    )
    a = steps["A"]
    assert a.selected == select(a.exact, 2) and steps["B"].receivers.heads == tuple(a.selected)
    assert wide.groups["A"] == select(a.exact, 5) and len(wide.groups["A"]) == 5
    assert wide.scores["A"] == {h.name: a.exact[h] for h in wide.groups["A"]}
    assert wide.groups["B"] == steps["B"].selected  # no circuit_k for B: its receivers' count
    narrow, again = discover(tiny_llama, pairs, DiscoverySettings(k=k, n_prompts=5, n_boxes=3), progress=False)
    assert narrow.groups["A"] == a.selected and again["A"].exact == a.exact  # the same scores, another cut
    assert wide.meta["settings"]["circuit_k"] == {"A": 5}


def _spec_file(tmp_path, names, extra: str):
    path = tmp_path / "paper.toml"
    path.write_text(
        f'[models]\nbase = "{names[0]}"\nfinetunes = ["{names[1]}"]\n\n[task]\nname = "entity-tracking"\n'
        f'\n[discovery]\nmethod = "path"\ntop_k = {{ A = 3, B = 1, C = 1, D = 1 }}\n{extra}'
    )
    return path


def test_each_model_gets_its_own_k_and_seed(tiny_family, tmp_path):
    """[discovery.models.NAME] sets top_k, circuit_k and the seed of one model's path patching; a model not named
    takes the section's; a name outside [models] or another key is refused with its line."""
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.plan import default_plan

    base, ft = tiny_family
    extra = f'circuit_k = {{ A = 6 }}\n\n[discovery.models."{ft}"]\ntop_k = {{ A = 4 }}\nseed = 9\n'
    study = CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, extra), out=str(tmp_path / "run"))
    mine, theirs = study.path_settings(base, default_plan()), study.path_settings(ft, default_plan())
    assert (mine.k, mine.circuit_k, mine.seed) == ({"A": 3, "B": 1, "C": 1, "D": 1}, {"A": 6}, study.seed("discovery"))
    assert (theirs.k, theirs.circuit_k, theirs.seed) == ({"A": 4}, {"A": 6}, 9)
    with pytest.raises(SpecError, match=r"paper.toml:12: \[discovery.models.llama-7b\] names no model"):
        CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, "\n[discovery.models.llama-7b]\nseed = 1\n"))
    with pytest.raises(SpecError, match=r"may set top_k, circuit_k, seed"):
        CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, f'\n[discovery.models."{ft}"]\nscreen = true\n'))
    with pytest.raises(SpecError, match=r"give a step -> k table"):
        CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, f'\n[discovery.models."{ft}"]\ntop_k = 3\n'))


def test_step_d_reads_its_counterfactual_senders_where_the_settings_say(smollm2_tokenizer):
    """source_position {"D": "labels"} (the paper's random box label) changes step D's scores only: A-C read
    their senders at the clean index either way; the setting is recorded in the circuit's meta."""
    from conftest import make_tiny

    lm = make_tiny("llama", smollm2_tokenizer, n_layers=6)  # deep enough for all four steps
    pairs = path_patching_pairs(smollm2_tokenizer, 5, n_boxes=3, seed=3)
    k = {"A": 4, "B": 3, "C": 3, "D": 2}
    _, plain = discover(lm, pairs, DiscoverySettings(k=k, n_prompts=5, n_boxes=3), progress=False)
    settings = DiscoverySettings(k=k, n_prompts=5, n_boxes=3, source_position={"D": "labels"})
    circuit, paper = discover(lm, pairs, settings, progress=False)
    assert all(paper[s].exact == plain[s].exact for s in "ABC")
    assert paper["D"].exact.keys() == plain["D"].exact.keys() and paper["D"].exact != plain["D"].exact
    assert circuit.meta["settings"]["source_position"] == {"D": "labels"}


def test_a_study_hands_path_patching_its_source_position(tiny_family, tmp_path):
    """[discovery] source_position reaches each model's path-patching settings (cut to the plan's steps); a value
    that is not a position name is refused with its line."""
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.plan import default_plan

    base, _ = tiny_family
    extra = 'source_position = { D = "labels", Z = "labels" }\n'
    study = CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, extra), out=str(tmp_path / "run"))
    assert study.path_settings(base, default_plan()).source_position == {"D": "labels"}
    with pytest.raises(
        SpecError, match=r"paper.toml:11: source_position = .* in \[discovery\] — give a table of strings"
    ):
        CircuitsStudy.from_file(_spec_file(tmp_path, tiny_family, "source_position = { D = 3 }\n"))
