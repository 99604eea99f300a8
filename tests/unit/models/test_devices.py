"""This machine's measured matrix-multiply throughput (`mechdiff.models.devices.matmul_throughput`) on a clock
the test controls: each multiply advances it by its FLOPs at a set rate."""

from __future__ import annotations

import inspect

import pytest
import torch

from mechdiff.models import devices


def _timed(monkeypatch, rate: float) -> list[int]:
    """``torch.mm`` and ``time.process_time`` replaced: a multiply takes its FLOPs / ``rate`` seconds of the clock.
    Returns the row count of each multiply, in order."""
    clock, rows = [0.0], []

    def mm(a, b):
        rows.append(a.shape[0])
        clock[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate
        return a.new_zeros(a.shape[0], b.shape[1])

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(devices.time, "process_time", lambda: clock[0])
    return rows


#: The measurement itself, not the cached one of tests/conftest.py (`measure_machine_once`).
measure = inspect.unwrap(devices.matmul_throughput)


@pytest.mark.parametrize(
    ("seconds", "timed"),
    [(1.0, [512]), (0.15, [512, 512, 512])],  # one multiply of 1 s; 0.4 s needs three of 0.15 s
)
def test_a_multiply_is_timed_after_a_short_warm_up_for_at_least_min_seconds(monkeypatch, seconds, timed):
    rate = 2 * 512 * 64 * 128 / seconds
    rows = _timed(monkeypatch, rate)
    assert measure(512, 64, 128, "float32") == pytest.approx(rate)
    assert rows == [devices.WARM_ROWS, *timed]


def test_a_dtype_this_cpu_multiplies_slowly_is_measured_on_fewer_rows_within_the_bound(monkeypatch):
    """A multiply of 512 rows that would take 84 s (as float16 does on a CPU without float16 kernels): the rows are
    cut so that one takes about `MEASURE_SECONDS`, and the rate is still the one measured."""
    rate = 2 * 512 * 64 * 128 / 84.0
    rows = _timed(monkeypatch, rate)
    assert measure(512, 64, 128, "float32") == pytest.approx(rate)
    warm, *timed = rows
    assert warm == devices.WARM_ROWS and timed == [int(512 * devices.MEASURE_SECONDS / 84.0)]
    spent = sum(2 * r * 64 * 128 / rate for r in rows)
    assert spent <= devices.MEASURE_SECONDS + 84.0 * devices.WARM_ROWS / 512
