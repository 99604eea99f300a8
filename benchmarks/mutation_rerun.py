"""Run chosen mutmut mutants against chosen tests, without ``mutmut run``'s stats pass (see mutation.md).

``mutmut run`` resets every result and reruns its whole test selection once (its stats pass) whenever
``[tool.mutmut]``'s test selection changes, which costs more than the reruns themselves on 2 shared cores.
This driver uses mutmut's own mutants (the files under ``mutants/`` with their trampolines, written by
``mutmut run`` or by ``--generate``) and its way of running them: one parent process imports everything
once, then each mutant runs in a forked child with ``MUTANT_UNDER_TEST`` set, under ``pytest -x`` on the
tests this file lists for its module. Exit code 0: survived; 1: killed; -24: timed out.

    python benchmarks/mutation_rerun.py --generate mechdiff/knowledge/forward.py   # (re)write its mutants
    python benchmarks/mutation_rerun.py NAME ... | @FILE   # results go to mutants/rerun-results.json

Run from the repository root with mutmut importable (``PYTHONPATH=/path/to/mutmut``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
RESULTS = MUTANTS / "rerun-results.json"
FAST = ["-m", "not slow", "-p", "no:anyio", "-p", "no:warnings", "-p", "no:cacheprovider", "-q", "-x"]
FAMILIES_EDGE = ["tests/unit/test_families.py::test_edge_forward_full_and_empty_circuits",
                 "tests/unit/test_families.py::test_removing_one_edge_changes_only_its_receiver",
                 "tests/unit/test_families.py::test_edge_gradients_match_finite_differences"]
POST_NORM = [f"tests/unit/test_families.py::{t}[{f}]" for f in ("gemma2", "gemma3_text", "gemma3", "olmo2", "olmo3")
             for t in ("test_edge_forward_full_and_empty_circuits", "test_removing_one_edge_changes_only_its_receiver")]
TESTS = {  # mutant-name prefix -> the fast tests that exercise it, quickest and most specific first (longest prefix wins)
    "mechdiff.cmap.": ["tests/unit/test_mutants_cmap.py", "tests/unit/test_cmap.py"],
    "mechdiff.knowledge.forward.": ["tests/unit/test_mutants_forward.py", "tests/unit/test_mutants.py",
                                    "tests/unit/test_knowledge.py", *FAMILIES_EDGE, "tests/unit/test_knowledge_acdc.py"],
    # the RMS post-norm gain: only models with an attention post-norm reach it
    "mechdiff.knowledge.forward.x__rms_gain__": ["tests/unit/test_mutants_forward.py", *POST_NORM,
                                                 "tests/unit/test_knowledge.py::test_pipeline_on_other_families"],
}
TIMEOUT_S = 600


def generate(path: str) -> list[str]:
    """Write ``mutants/<path>`` from the source with mutmut's generator; return its mutant names."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    source = (ROOT / path).read_text()
    mutated = mutate_file_contents(path, source)
    (MUTANTS / path).write_text(mutated.code)
    module = path.removesuffix(".py").replace("/", ".")
    return [f"{module}.{name}" for name in mutated.mutant_names]


def _module(name: str) -> str:
    return next(m for m in sorted(TESTS, key=len, reverse=True) if name.startswith(m))


def run(names: list[str]) -> dict[str, int]:
    os.chdir(MUTANTS)
    sys.path[:0] = [str(MUTANTS), str(MUTANTS / "tests")]
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    import pytest  # noqa: F401  (imported once, before the forks)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import conftest  # the tests' conftest, as pytest imports it: its tokenizer cache is then shared by every fork
    from mutmut.mutation.trampoline import set_mutant_under_test

    conftest._smollm2_tokenizer()
    modules = {_module(n) for n in names}
    sys.path.insert(0, str(MUTANTS / "tests" / "unit"))
    for test in {t.split("::")[0] for m in modules for t in TESTS[m]}:  # as pytest imports them (prepend mode)
        __import__(Path(test).stem)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = [n for n in names if n not in results]  # already run: kept
    clean = list(dict.fromkeys(t for m in sorted(modules) for t in TESTS[m]))
    for name in ["", *names]:  # "": the clean run, which must pass
        start = time.time()
        pid = os.fork()
        if pid == 0:
            set_mutant_under_test(name)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1), os.dup2(devnull, 2)
            code = pytest.main([*FAST, *(TESTS[_module(name)] if name else clean)])
            os._exit(int(code))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.time() - start > TIMEOUT_S:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = -24
                break
            time.sleep(0.2)
        if not name:
            if code != 0:
                raise SystemExit(f"the clean tests failed (exit {code})")
            continue
        results[name] = code
        RESULTS.write_text(json.dumps(results, indent=0))
        print(f"{name}\t{code}\t{time.time() - start:.1f}s", flush=True)
    return results


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--generate"]:
        for p in args[1:]:
            print("\n".join(generate(p)))
    else:
        names = [n for a in args for n in (Path(a[1:]).read_text().split() if a.startswith("@") else [a])]
        run(names)
