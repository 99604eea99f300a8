"""A pytest plugin: each test's CPU seconds (this process and the child processes it waited for; setup, call and
teardown together) beside its wall seconds; the 40 largest are printed at the end, and all are written to
``$CPUTIME_OUT`` (tab-separated) when it is set. On a shared, loaded machine wall times swell with the load, CPU
times of one-thread runs much less: compare two versions of a test by CPU time, run in the same period::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 CPUTIME_OUT=cpu.tsv \\
        python -m pytest -q -p benchmarks.cputime_plugin tests/integration
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_rows: dict[str, tuple[float, float]] = {}


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.perf_counter()
    yield
    _rows[item.nodeid] = (_cpu() - cpu, time.perf_counter() - wall)


def _largest() -> list[tuple[str, tuple[float, float]]]:
    return sorted(_rows.items(), key=lambda kv: -kv[1][0])


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("CPUTIME_OUT")
    if out:
        with open(out, "w") as f:
            f.writelines(f"{c:.2f}\t{w:.2f}\t{k}\n" for k, (c, w) in _largest())


def pytest_terminal_summary(terminalreporter) -> None:
    cpu, wall = sum(c for c, _ in _rows.values()), sum(w for _, w in _rows.values())
    terminalreporter.write_line(f"CPU time per test: {len(_rows)} tests, CPU {cpu:.1f} s, wall {wall:.1f} s")
    for k, (c, w) in _largest()[:40]:
        terminalreporter.write_line(f"  CPU {c:7.2f}  wall {w:7.2f}  {k}")
