"""A fake clock for the tuners: a slow run without sleeping.

Tests that need it import the fixture: ``from tuning_clock import clock``.
"""

from __future__ import annotations

import time
import types

import pytest

from ejlabel.execution import tuning


class FakeClock:
    """``time.perf_counter`` plus an offset a test moves forward: a slow run without sleeping."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The clock of the tuning modules (and only theirs) made a :class:`FakeClock`."""
    fake = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=fake.perf_counter)
    for module in (tuning.measure, tuning.candidates, tuning.halving, tuning.isolated, tuning.paired, tuning.search, tuning.in_context):
        monkeypatch.setattr(module, "time", fake_time)
    return fake
