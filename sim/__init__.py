"""servesim: a discrete-event simulator of LLM serving.

`from sim import run_scenario, Results, Scenario, load_scenario`. Imported lazily, so that the
command line starts fast and a Ctrl-C during start-up is handled like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.config import Scenario, load_scenario
    from sim.runner import Results, run_scenario

__all__ = ["Results", "Scenario", "load_scenario", "run_scenario"]


def __getattr__(name: str) -> Any:
    if name in ("Scenario", "load_scenario"):
        from sim import config

        return getattr(config, name)
    if name in ("Results", "run_scenario"):
        from sim import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
