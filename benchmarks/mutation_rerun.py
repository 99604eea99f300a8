"""Run chosen mutmut mutants against chosen tests, without ``mutmut run``'s stats pass (see mutation.md).

``mutmut run`` resets every result and reruns its whole test selection once (its stats pass) whenever
``[tool.mutmut]``'s test selection changes, which costs more than the reruns themselves on 2 shared cores.
This driver uses mutmut's own mutants (the files under ``mutants/`` with their trampolines, written by
``mutmut run`` or by ``--generate``) and its way of running them: one parent process imports everything
once, then each mutant runs in a forked child with ``MUTANT_UNDER_TEST`` set, under ``pytest -x`` on the
tests this file lists for its module. Exit code 0: survived; 1: killed; -24: timed out.

    python benchmarks/mutation_rerun.py --fresh > all.txt   # mutants/ rebuilt from this checkout; every mutant's name
    python benchmarks/mutation_rerun.py --generate mechdiff/methods/knowledge/forward.py   # (re)write its mutants
    python benchmarks/mutation_rerun.py NAME ... | @FILE   # results go to mutants/rerun-results.json
    python benchmarks/mutation_rerun.py --seed 0 --jobs 2 @FILE   # seeded order: any prefix is a random sample
    python benchmarks/mutation_rerun.py --summary [--by-function] @FILE   # counts and exact 95% intervals
    python benchmarks/mutation_rerun.py --survivors @FILE   # the survivors, grouped by what their mutation touches

Run from the repository root with mutmut importable (``PYTHONPATH=/path/to/mutmut``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
RESULTS = MUTANTS / "rerun-results.json"
FAST = ["-m", "not slow", "-p", "no:anyio", "-p", "no:warnings", "-p", "no:cacheprovider", "-q", "-x"]
FAMILIES_EDGE = [
    "tests/unit/models/test_architectures.py::test_edge_forward_full_and_empty_circuits",
    "tests/unit/models/test_architectures.py::test_removing_one_edge_changes_only_its_receiver",
    "tests/unit/models/test_architectures.py::test_edge_gradients_match_finite_differences",
]
POST_NORM = [
    f"tests/unit/models/test_architectures.py::{t}[{f}]"
    for f in ("gemma2", "gemma3_text", "gemma3", "olmo2", "olmo3")
    for t in ("test_edge_forward_full_and_empty_circuits", "test_removing_one_edge_changes_only_its_receiver")
]
U = "tests/unit/"
# mutant-name prefix -> the fast tests that exercise it, quickest and most specific first (longest prefix wins)
TESTS = {
    "mechdiff.methods.cmap.": [U + "methods/test_cmap.py"],
    "mechdiff.methods.cmap_patches.": [U + "methods/test_cmap.py", U + "methods/test_class_patching.py"],
    "mechdiff.methods.knowledge.forward.": [
        U + "methods/knowledge/test_forward.py",
        *FAMILIES_EDGE,
        U + "methods/knowledge/test_acdc.py",
    ],
    # the RMS post-norm gain: only models with an attention post-norm reach it
    "mechdiff.methods.knowledge.forward.x__rms_gain__": [U + "methods/knowledge/test_forward.py", *POST_NORM],
    "mechdiff.patching.core.": [
        U + "patching/test_core.py",
        U + "patching/test_activation.py",
        U + "methods/knowledge/test_forward.py",
        *POST_NORM[:2],
        U + "patching/test_path.py",
    ],
    "mechdiff.patching.path.": [
        U + "patching/test_path.py",
        U + "patching/test_activation.py",
        U + "patching/test_core.py",
    ],
    "mechdiff.patching.path_pairs.": [
        U + "patching/test_path.py",
        U + "patching/test_path_stream.py",
        U + "patching/test_activation.py",
        U + "patching/test_core.py",
    ],
    "mechdiff.patching.scan.": [
        U + "patching/test_scan.py",
        U + "circuits/test_curve.py",
        U + "common/test_metrics.py",
    ],
    "mechdiff.patching.ablation.": [
        U + "patching/test_ablation.py",
        U + "circuits/test_scoring.py",
        U + "methods/knowledge/test_forward.py",
        U + "circuits/test_curve.py",
    ],
    "mechdiff.patching.activation.": [
        U + "patching/test_activation.py",
        U + "patching/test_scan.py",
        U + "patching/test_ablation.py",
        U + "patching/test_store.py",
    ],
    "mechdiff.patching.attribution.": [
        U + "patching/test_attribution.py",
        U + "patching/test_path.py",
        U + "circuits/test_curve.py",
    ],
    "mechdiff.methods.dcm.": [U + "methods/test_dcm.py", U + "common/test_metrics.py"],
    "mechdiff.methods.dcm_cache.": [U + "methods/test_dcm.py", U + "methods/test_dcm_modes.py"],
    "mechdiff.methods.semantic.": [U + "methods/test_dcm.py", U + "report/test_rows.py"],
    "mechdiff.circuits.scoring.": [
        U + "circuits/test_scoring.py",
        U + "patching/test_ablation.py",
        U + "circuits/test_curve.py",
        U + "circuits/test_positions.py",
    ],
    "mechdiff.circuits.measures.": [
        U + "circuits/test_scoring.py",
        U + "circuits/test_random_control.py",
        U + "patching/test_ablation.py",
        U + "circuits/test_curve.py",
        U + "circuits/test_positions.py",
    ],
    "mechdiff.circuits.pruning.": [U + "circuits/test_pruning.py", U + "circuits/test_scoring.py"],
    "mechdiff.tasks.desiderata.": [U + "tasks/test_desiderata.py"],
}
TIMEOUT_S = 180  # the slowest clean selection takes about 15 s; a mutant past this is counted as timed out (-24)


def generate(path: str) -> list[str]:
    """Write ``mutants/<path>`` from the source with mutmut's generator; return its mutant names."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    source = (ROOT / path).read_text()
    mutated = mutate_file_contents(path, source)
    (MUTANTS / path).write_text(mutated.code)
    module = path.removesuffix(".py").replace("/", ".")
    return [f"{module}.{name}" for name in mutated.mutant_names]


def fresh() -> list[str]:
    """Rebuild ``mutants/`` from this checkout (the package, tests and task files, with every module of
    ``[tool.mutmut] only_mutate`` mutated); return every mutant's name, module by module."""
    import shutil

    import tomllib

    shutil.rmtree(MUTANTS, ignore_errors=True)
    for part in ("mechdiff", "tests", "tasks"):
        shutil.copytree(ROOT / part, MUTANTS / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", MUTANTS / "pyproject.toml")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return [name for path in config["only_mutate"] for name in generate(path)]


def _module(name: str) -> str:
    return next(m for m in sorted(TESTS, key=len, reverse=True) if name.startswith(m))


def _tests(module: str) -> list[str]:
    """The module's tests that exist (a test file not written yet would make pytest exit 4, read as killed)."""
    return [t for t in TESTS[module] if (MUTANTS / t.split("::")[0]).exists()]


def order(names: list[str], seed: int) -> list[str]:
    """Each module's mutants in a seeded random order, the modules interleaved in proportion to their sizes.

    Any prefix of the result is then a uniform random sample of each module's mutants, whenever a run stops.
    """
    rng = random.Random(seed)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.split(".x", 1)[0], []).append(n)
    for g in groups.values():
        rng.shuffle(g)
    keyed = [((i + 0.5) / len(g), n) for g in groups.values() for i, n in enumerate(g)]
    return [n for _, n in sorted(keyed)]


def _child(name: str, tests: list[str]) -> int:
    """Fork a pytest run of ``tests`` with ``name`` as the mutant under test ("" for none); return its pid."""
    import pytest
    from mutmut.mutation.trampoline import set_mutant_under_test

    pid = os.fork()
    if pid == 0:
        set_mutant_under_test(name)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1), os.dup2(devnull, 2)
        os._exit(int(pytest.main([*FAST, *tests])))
    return pid


def run(names: list[str], jobs: int = 1) -> dict[str, int]:
    os.chdir(MUTANTS)
    sys.path[:0] = [str(MUTANTS), str(MUTANTS / "tests")]
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    import conftest  # the tests' conftest, as pytest imports it: its tokenizer cache is then shared by every fork
    import pytest  # noqa: F401  (imported once, before the forks)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    conftest._smollm2_tokenizer()
    modules = {_module(n) for n in names}
    sys.path.insert(0, str(MUTANTS / "tests" / "unit"))
    for test in {t.split("::")[0] for m in modules for t in _tests(m)}:  # as pytest imports them (prepend mode)
        __import__(Path(test).stem)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = [n for n in names if n not in results]  # already run: kept
    clean = list(dict.fromkeys(t for m in sorted(modules) for t in _tests(m)))
    pid = _child("", clean)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise SystemExit("the clean tests failed")
    running: dict[int, tuple[str, float]] = {}
    queue = list(names)
    while queue or running:
        while queue and len(running) < jobs:
            name = queue.pop(0)
            running[_child(name, _tests(_module(name)))] = (name, time.time())
        time.sleep(0.05)
        for pid, (name, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.time() - start <= TIMEOUT_S:
                continue
            if done:
                code = os.waitstatus_to_exitcode(status)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = -24
            del running[pid]
            results[name] = code
            RESULTS.write_text(json.dumps(results, indent=0))
            print(f"{name}\t{code}\t{time.time() - start:.1f}s", flush=True)
    return results


def show(name: str) -> str:
    """A mutant's diff against the original function, from the generated file under ``mutants/``."""
    import ast
    import difflib

    module, function = name.split(".x", 1)
    function = "x" + function
    tree = ast.parse((MUTANTS / (module.replace(".", "/") + ".py")).read_text())
    bodies = {n.name: ast.unparse(n).splitlines() for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    short = function
    original = bodies[short.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"]
    mutant = bodies[short]
    return "\n".join(difflib.unified_diff(original, mutant, name, name, n=1, lineterm=""))


# survivor kinds, by the mutated line (the first rule that matches); each is then checked by reading the diff
KINDS = [
    ("display", r"tqdm|desc=|leave=|disable=|progress|bar\b"),
    ("device", r"device"),
    ("dtype default", r"dtype="),
    ("message", r"raise ValueError"),
]


def survivors(names: list[str]) -> None:
    """The survivors among ``names``, grouped by kind (:data:`KINDS`; "other" is read one by one), each with
    its mutated line."""
    import re

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    groups: dict[str, list[str]] = {}
    for name in names:
        if results.get(name) not in (0, -24):
            continue
        lines = [l[1:].strip() for l in show(name).splitlines() if l.startswith("+") and not l.startswith("+++")]
        line = next((l for l in lines if not l.startswith("def ")), lines[0] if lines else "")
        kind = next((k for k, rule in KINDS if re.search(rule, line)), "other")
        groups.setdefault(kind, []).append(f"- `{name.removeprefix('mechdiff.')}`: `{line[:160]}`")
    for kind, rows in groups.items():
        print(f"\n### {kind} ({len(rows)})\n" + "\n".join(rows))


def summary(names: list[str]) -> None:
    """Per module (and per function with --by-function): run, killed, survived, and the score's exact 95% interval."""
    from scipy.stats import binomtest

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    by_function = "--by-function" in sys.argv
    groups: dict[str, list[str]] = {}
    for n in names:
        key = n.rsplit("__mutmut_", 1)[0] if by_function else n.split(".x", 1)[0]
        groups.setdefault(key, []).append(n)
    print(
        "| scope | mutants | run | killed | survived | timed out | score [exact 95%] |\n|---|---|---|---|---|---|---|"
    )
    for key, group in groups.items():
        codes = [results[n] for n in group if n in results]
        killed = sum(c not in (0, -24) for c in codes)
        survived, timeouts = codes.count(0), codes.count(-24)
        run_ = len(codes)
        score = "" if not run_ else f"{killed / run_:.3f}"
        if run_:
            ci = binomtest(killed, run_).proportion_ci(method="exact")
            score += f" [{ci.low:.3f}, {ci.high:.3f}]"
        print(f"| `{key}` | {len(group)} | {run_} | {killed} | {survived} | {timeouts} | {score} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--fresh"]:
        print("\n".join(fresh()))
        raise SystemExit
    if args[:1] == ["--generate"]:
        for p in args[1:]:
            print("\n".join(generate(p)))
        raise SystemExit
    options = {"--jobs": "1", "--seed": ""}
    for key in options:
        if key in args:
            i = args.index(key)
            options[key] = args[i + 1]
            del args[i : i + 2]
    report = [a for a in args if a.startswith("--")]
    args = [a for a in args if not a.startswith("--")]
    names = [n for a in args for n in (Path(a[1:]).read_text().split() if a.startswith("@") else [a])]
    if "--show" in report:
        print("\n\n".join(show(n) for n in names))
        raise SystemExit
    if options["--seed"]:
        names = order(names, int(options["--seed"]))
    if "--survivors" in report:
        survivors(names)
    elif "--summary" in report:
        summary(names)
    else:
        run(names, int(options["--jobs"]))
