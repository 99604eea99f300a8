"""The one stage cache (mechdiff.runs.stages), seeds derived by name (mechdiff.runs.seeds) and the progress
bars that give way to one line per stage off a terminal (mechdiff.common.progress)."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import pytest

from mechdiff.common import progress
from mechdiff.runs.seeds import derive
from mechdiff.runs.stages import StageCache, key_hash


def test_derive_is_the_documented_hash_and_separates_names():
    digest = hashlib.sha256(b"7\x00random-heads").digest()
    assert derive(7, "random-heads") == int.from_bytes(digest[:8], "big") % 2**31
    seeds = {derive(s, n) for s in range(3) for n in ("random-heads", "outside-heads", "random-0", "random-1")}
    assert len(seeds) == 12  # distinct for every (seed, name): no offset collides with another study seed
    assert derive(0, "a") == derive(0, "a") and 0 <= derive(123, "x") < 2**31
    with pytest.raises(ValueError):
        derive(0, "")
    with pytest.raises(TypeError):
        derive(1.5, "x")


def test_stage_cache_reuses_only_matching_keys(tmp_path):
    calls = []
    cache = StageCache(tmp_path)
    compute = lambda v: lambda: calls.append(v) or {"v": v}  # noqa: E731
    first = cache.run("score:org/model-a", {"x": 1}, compute(1))
    assert not first.cached and (tmp_path / "stages" / "score__model-a.json").is_file()
    again = StageCache(tmp_path).run("score:org/model-a", {"x": 1}, compute(2))
    assert again.cached and again.result == {"v": 1} and again.key == key_hash({"x": 1})
    changed = StageCache(tmp_path).run("score:org/model-a", {"x": 2}, compute(3))
    assert not changed.cached and changed.result == {"v": 3} and calls == [1, 3]


def test_a_stage_keeps_its_cpu_seconds_apart_from_its_wall_time(tmp_path):
    """A stage that waits costs wall time and no CPU; one that computes costs CPU: both are kept in the record
    with the time it was written, read back from the cache and listed in the manifest's summary."""

    def spin() -> dict:
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        return {}

    cache = StageCache(tmp_path)
    before = time.time()
    waited = cache.run("wait", {}, lambda: time.sleep(0.3) or {})
    spun = cache.run("spin", {}, spin)
    assert before + 0.3 <= waited.finished <= spun.finished <= time.time()  # when each record was written
    assert waited.seconds >= 0.3 and waited.cpu_seconds < 0.1
    assert spun.cpu_seconds >= 0.2
    again = StageCache(tmp_path).run("spin", {}, lambda: pytest.fail("recomputed"))
    assert again.cached and again.cpu_seconds == spun.cpu_seconds and again.finished == spun.finished
    assert cache.summary()["wait"]["cpu_seconds"] == waited.cpu_seconds
    (tmp_path / "stages" / "old.json").write_text(json.dumps({"key": key_hash({}), "seconds": 1, "result": {}}))
    assert StageCache(tmp_path).run("old", {}, lambda: pytest.fail("recomputed")).cpu_seconds is None


def test_key_hash_is_canonical_json():
    assert key_hash({"b": 1, "a": [1, 2]}) == key_hash({"a": [1, 2], "b": 1})
    want = hashlib.sha256(json.dumps({"a": 1}, sort_keys=True).encode()).hexdigest()[:16]
    assert key_hash({"a": 1}) == want


def test_first_headmap_records_are_read(tmp_path):
    """A record of the first HeadMap study ({"key": inputs, "value": result}) is reused for the same inputs."""
    inputs = {"model": "m", "n": 8}
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "train-base.json").write_text(json.dumps({"key": inputs, "value": [1, 2], "seconds": 3}))
    rec = StageCache(tmp_path).run("train-base", inputs, lambda: pytest.fail("recomputed a cached stage"))
    assert rec.cached and rec.result == [1, 2] and rec.seconds == 3
    other = StageCache(tmp_path).run("train-base", {**inputs, "n": 9}, lambda: [3])
    assert not other.cached and other.result == [3]


def test_a_record_without_result_is_set_aside(tmp_path):
    (tmp_path / "stages").mkdir()
    path = tmp_path / "stages" / "s.json"
    path.write_text(json.dumps({"key": key_hash({}), "seconds": 1}))
    rec = StageCache(tmp_path).run("s", {}, lambda: 5)
    assert not rec.cached and rec.result == 5
    assert list((tmp_path / "stages").glob("s.json.unreadable-*"))


def test_stages_say_one_plain_line_each_off_a_terminal(tmp_path, capsys, caplog, monkeypatch):
    """stderr not a terminal (capsys): one line per stage as it ends, computed or cached, and nothing else; on a
    terminal the same line is logged instead (the bars show the progress there)."""
    StageCache(tmp_path).run("a", {"x": 1}, lambda: 1)
    StageCache(tmp_path).run("a", {"x": 1}, lambda: 2)
    StageCache(tmp_path).run("b:org/m", {}, lambda: 3)
    k = key_hash({"x": 1})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[0].startswith("stage a: computed in ") and lines[0].endswith(f" s (key {k})")
    assert lines[1].startswith(f"stage a: cached (key {k}; computed in ") and lines[1].endswith(" s)")
    assert lines[2].startswith("stage b:org/m: computed in ") and lines[2].endswith(f" s (key {key_hash({})})")
    monkeypatch.setattr(progress, "interactive", lambda stream=None: True)
    with caplog.at_level(logging.INFO, logger="mechdiff.runs.stages"):
        StageCache(tmp_path).run("a", {"x": 1}, lambda: 2)
    assert capsys.readouterr().err == "" and caplog.messages[-1].startswith(f"stage a: cached (key {k}; ")


def test_a_stage_read_again_under_its_key_says_nothing_more(tmp_path, capsys):
    """A worker waiting on the other's stages reads them at every poll: one line per stage and key, not one a poll;
    a changed key says so again."""
    StageCache(tmp_path).run("accuracy:m", {"x": 1}, lambda: 1)
    capsys.readouterr()
    waiting = StageCache(tmp_path)
    for _ in range(5):
        assert waiting.run("accuracy:m", {"x": 1}, lambda: pytest.fail("recomputed a cached stage")).cached
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage accuracy:m: cached (key ")
    waiting.run("accuracy:m", {"x": 2}, lambda: 2)
    waiting.run("accuracy:m", {"x": 2}, lambda: pytest.fail("recomputed a cached stage"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stage accuracy:m: computed in ")
