"""servesim: a discrete-event simulator of LLM serving.

The public API, for scripts and notebooks (`from sim import ...`); everything else under `sim`
may change without notice:

- `Scenario`: a validated scenario (frozen pydantic model).
- `load_scenario(path)`: a scenario file, or the embedded default with no path.
- `parse_scenario(mapping, source, base_dir)`: a scenario from a mapping, as a file would give.
- `run_scenario(scenario)`: simulate; a `Results` (written when given `out_dir`).
- `Results`: a run's requests, iterations, token times and summary; `write(out_dir)`, and
  `Results.load(run_dir)` to read a run directory back.
- `Run(point, seed, scenario)`: one point of a sweep; `run.key` names its cached directory.
- `load_sweep(path)`: a sweep file expanded into its name and its `Run`s.
- `run_sweep(runs, out_dir)`: run the points not yet cached under `out_dir/runs/<key>`; the
  results table (also `out_dir/results.parquet`).
- `load_comparison(path)`: a comparison file's variants of one scenario, by name.
- `run_comparison(variants, out_dir)`: run them; one table (`sim.studies.compare.compare`).
- `SLOTargets`: SLO upper bounds in seconds (P99 TBT, P90 TTFT, P50 scheduling delay).
- `search_capacity(scenario, targets)`: the largest rate at which the SLOs hold, as an interval
  (`interval_qps`, `capacity_qps_per_gpu`, every probed rate; `sim.studies.capacity.capacity`).
- `CapacityLog(out_dir)`: a capacity search on disk (`on_trial=log.add`, then `log.finish`),
  as `servesim capacity` writes it: `trials.csv` and `capacity.json`.
- `scenario_key(scenario)`: the cache key of a scenario (its fields, its input files'
  contents, the servesim code): same key, same results.
- `traces_dir()`: the shared trace folder, found from this package, not the working directory.
- `InputError`: bad input, as one line naming file, field and value.
- `plots`: the figure module; the names in its `__all__` (`p99_tbt_vs_load`, `cdfs`,
  `capacity_bars`, `plot_results`, ...) draw result files as PNG and SVG.

Names are imported lazily, on first use, so that the command line starts fast and a Ctrl-C
during start-up is handled like any other.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from sim import plots
    from sim.config.errors import InputError
    from sim.config.scenario import Scenario, load_scenario, parse_scenario
    from sim.results.fingerprint import scenario_key
    from sim.results.run_dir import Results
    from sim.runner import run_scenario
    from sim.studies.capacity import capacity as search_capacity
    from sim.studies.capacity_log import CapacityLog
    from sim.studies.compare import compare as run_comparison
    from sim.studies.compare import load_comparison
    from sim.studies.rate_decision import SLOTargets
    from sim.studies.sweep import run_sweep
    from sim.studies.sweep_file import Run, load_sweep

# public name -> the module that defines it
_HOMES = {
    "Scenario": "sim.config.scenario", "load_scenario": "sim.config.scenario",
    "parse_scenario": "sim.config.scenario", "Results": "sim.results.run_dir",
    "run_scenario": "sim.runner", "Run": "sim.studies.sweep_file",
    "load_sweep": "sim.studies.sweep_file", "run_sweep": "sim.studies.sweep",
    "run_comparison": "sim.studies.compare", "load_comparison": "sim.studies.compare",
    "SLOTargets": "sim.studies.rate_decision", "search_capacity": "sim.studies.capacity",
    "CapacityLog": "sim.studies.capacity_log", "scenario_key": "sim.results.fingerprint",
    "InputError": "sim.config.errors",
}
# A function named like its module is exported under another name: importing the module sets
# `sim.<module>`, which would hide the function.
_RENAMED = {"run_comparison": "compare", "search_capacity": "capacity"}

__all__ = [
    "CapacityLog", "InputError", "Results", "Run", "SLOTargets", "Scenario", "load_comparison",
    "load_scenario", "load_sweep", "parse_scenario", "plots", "run_comparison", "run_scenario",
    "run_sweep", "scenario_key", "search_capacity", "traces_dir",
]

TRACES_ENV = "SERVESIM_TRACES"


def traces_dir() -> Path:
    """The shared trace folder: `$SERVESIM_TRACES` if set, else `shared/traces` beside the
    checkout (`<repo>/../shared/traces`, where the tests and shipped scenarios look), located
    from this package's files so that the working directory does not matter."""
    import os
    from pathlib import Path

    given = os.environ.get(TRACES_ENV)
    if given:
        return Path(given).expanduser().resolve()
    return (Path(__file__).resolve().parents[2] / "shared" / "traces").resolve()


def __getattr__(name: str) -> Any:
    if name == "plots":  # a module, imported on first use (it brings matplotlib)
        return import_module("sim.plots")
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
