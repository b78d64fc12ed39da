"""The shipped scenarios, run whole: none is overloaded unless its file says it studies overload
(a user copying one must not start from a run whose latencies only grow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import load_scenario, run_scenario
from tests.helpers import REPO

SCENARIOS = sorted(p for p in (REPO / "scenarios").glob("*.yaml")
                   if not p.name.startswith(("sweep_", "compare_", "plan_")))


def studies_overload(path: Path) -> bool:
    return "studies overload" in path.read_text()


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_shipped_scenario_is_stable_or_says_why_not(path: Path, traces):
    results = run_scenario(load_scenario(path))
    verdict = results.summary["overload"]
    if not studies_overload(path):
        assert verdict["verdict"] != "overloaded", verdict["detail"]
    requests = results.summary["requests"]
    assert requests["finished"] + requests["rejected"] + requests["unfinished"] == len(
        results.requests)


def test_embedded_default_scenario_is_stable():
    assert run_scenario().summary["overload"]["verdict"] == "stable"
