"""Fixtures for every test: the parsed-trace cache in a folder of this session, the real traces
in ../shared/traces, and the hypothesis profile CI uses. Helpers shared by several test files
are in `tests.helpers`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Shared assertion helpers report their operands as the tests' own asserts do.
pytest.register_assert_rewrite("tests.helpers", "tests.engine.fastpath_helpers")

from tests.helpers import TRACES  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _trace_cache_in_tmp(tmp_path_factory):
    """Parsed-trace cache entries go to a folder of this session, not the user's ~/.cache (a
    user's own SERVESIM_CACHE_DIR is kept)."""
    os.environ.setdefault("SERVESIM_CACHE_DIR", str(tmp_path_factory.mktemp("servesim-cache")))


@pytest.fixture
def traces() -> Path:
    """The shared trace folder. CI sets SERVESIM_REQUIRE_TRACES=1 so that a missing folder fails."""
    if not TRACES.is_dir():
        if os.environ.get("SERVESIM_REQUIRE_TRACES"):
            pytest.fail(f"trace folder {TRACES} is missing")
        pytest.skip(f"trace folder {TRACES} is missing (set SERVESIM_TRACES)")
    return TRACES


# CI runs the property tests on a fixed set of examples, so a pass or a failure repeats;
# locally, hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _full_checks_in_property_tests(request):
    """A property test (hypothesis) runs with every state invariant checked after every plan
    (`sim.schedulers.base.checks`)."""
    if not hasattr(request.function, "hypothesis"):
        yield
        return
    from sim.schedulers.base import checks

    before = checks(True)
    try:
        yield
    finally:
        checks(before)
