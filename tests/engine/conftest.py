"""Fixtures of the engine tests: a scheduler and a latency model written in the tests,
registered for one test."""

from __future__ import annotations

import pytest

from sim.latency.base import LATENCY_MODELS
from sim.schedulers.base import SCHEDULERS
from tests.engine.fastpath_helpers import NewLatency, NewPolicy


@pytest.fixture
def registered():
    SCHEDULERS.register("new_policy")(NewPolicy)
    LATENCY_MODELS.register("new_latency")(NewLatency)
    yield
    del SCHEDULERS._entries["new_policy"], LATENCY_MODELS._entries["new_latency"]
