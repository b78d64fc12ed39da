"""servesim: a discrete-event simulator of LLM serving."""

from sim.config import Scenario, load_scenario
from sim.runner import Results, run_scenario

__all__ = ["Results", "Scenario", "load_scenario", "run_scenario"]
