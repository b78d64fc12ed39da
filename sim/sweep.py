"""Sweeps: one base scenario, axes of values for any of its fields (dotted paths), run in
parallel, cached by a hash of each resolved scenario (re-running a sweep runs only what changed;
an interrupted sweep resumes), gathered into one table.

A sweep file::

    name: budgets
    base: chunked.yaml            # a scenario file (relative to this file) or a mapping
    seeds: [0, 1]                 # replications
    grid:                         # every combination
      replica.scheduler.token_budget: [256, 512, 1024]
    zip:                          # varied together, position by position
      workload.rate_scale: [1.0, 2.0]
      name: [slow, fast]
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from sim.config import Scenario, parse_scenario, read_mapping, read_yaml, scenario_yaml
from sim.errors import InputError


@dataclass(frozen=True)
class Run:
    """One point of a sweep: the values it varies, its seed and its resolved scenario."""

    point: dict[str, Any]
    seed: int
    scenario: Scenario

    @property
    def key(self) -> str:
        """Hash of the resolved scenario: same scenario, same results, so run once."""
        return hashlib.sha256(scenario_yaml(self.scenario).encode()).hexdigest()[:16]


def set_path(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `data` with the field at `dotted` (e.g. replica.scheduler.token_budget) set."""
    head, _, rest = dotted.partition(".")
    out = dict(data)
    if rest:
        inner = out.get(head)
        out[head] = set_path(inner if isinstance(inner, dict) else {}, rest, value)
    else:
        out[head] = value
    return out


def load_sweep(path: str | Path) -> tuple[str, list[Run]]:
    """Expand a sweep file into its runs; one-line errors for bad files."""
    path = Path(path)
    data = read_mapping(path, "sweep", {"name", "base", "seeds", "grid", "zip"})
    base = data.get("base")
    base_dir = path.parent
    if isinstance(base, str):
        base_path = base_dir / base
        base, base_dir = read_yaml(base_path), base_path.parent
    if not isinstance(base, dict):
        raise InputError(path, "base", base, "must be a scenario file or mapping")
    seeds = data.get("seeds", [base.get("seed", 0)])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise InputError(path, "seeds", seeds, "must be a non-empty list of integers")
    grid, zipped = data.get("grid") or {}, data.get("zip") or {}
    for section, axes in (("grid", grid), ("zip", zipped)):
        if not isinstance(axes, dict):
            raise InputError(path, section, axes, "must map field paths to lists of values")
        for field, values in axes.items():
            if not isinstance(values, list) or not values:
                raise InputError(path, f"{section}.{field}", values, "must be a non-empty list")
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        raise InputError(path, "zip", {k: len(v) for k, v in zipped.items()},
                         "zipped lists must have the same length")
    grid_points = [dict(zip(grid, combo, strict=True))
                   for combo in itertools.product(*grid.values())] or [{}]
    zip_points = [dict(zip(zipped, combo, strict=True))
                  for combo in zip(*zipped.values(), strict=True)] or [{}]
    name = str(data.get("name", path.stem))
    runs = []
    for g, z, seed in itertools.product(grid_points, zip_points, seeds):
        point = {**g, **z}
        scenario_data = dict(base)
        for field, value in point.items():
            scenario_data = set_path(scenario_data, field, value)
        scenario_data["seed"] = seed
        scenario_data.setdefault("name", name)
        try:
            scenario = parse_scenario(scenario_data, path, base_dir)
        except InputError as exc:
            where = next((f for f in point if exc.field.startswith(f)), exc.field)
            raise InputError(path, where, exc.value, exc.problem) from None
        runs.append(Run(point, seed, scenario))
    return name, runs


def _run_one(scenario_yaml_text: str, out_dir: str) -> dict[str, Any]:
    """Run one scenario in a worker process and write its results; return its summary."""
    from sim.runner import run_scenario

    scenario = parse_scenario(yaml.safe_load(scenario_yaml_text), "sweep")
    return run_scenario(scenario, out_dir=out_dir).summary


def run_sweep(runs: list[Run], out_dir: Path, *, workers: int = 1, backend: str = "local",
              address: str | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Run every run not already cached under `out_dir/runs/<key>`; return the results table
    (also written as `out_dir/results.parquet` and `.csv`)."""
    todo = [r for r in runs if not (out_dir / "runs" / r.key / "summary.json").is_file()]
    done = len(runs) - len(todo)

    def one_more() -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, len(runs))

    if on_progress is not None:
        on_progress(done, len(runs))
    # Identical runs (same key) are run once.
    jobs = list({r.key: (scenario_yaml(r.scenario), str(out_dir / "runs" / r.key))
                 for r in todo}.values())
    if backend == "ray":
        _run_ray(jobs, address, one_more)
    elif workers <= 1:
        for job in jobs:
            _run_one(*job)
            one_more()
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for future in as_completed([pool.submit(_run_one, *job) for job in jobs]):
                future.result()
                one_more()
    table = results_table(runs, out_dir)
    table.to_parquet(out_dir / "results.parquet", index=False)
    table.to_csv(out_dir / "results.csv", index=False)
    return table


def _run_ray(jobs: list[tuple[str, str]], address: str | None, tick: Callable[[], None]) -> None:
    """The same runs as Ray tasks, on an existing cluster (`address`) or a local one."""
    try:
        import ray
    except ImportError:
        raise InputError(None, "--backend", "ray", "Ray is not installed: pip install "
                         "'servesim[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    remote = ray.remote(_run_one)
    pending = [remote.remote(*job) for job in jobs]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
        tick()


METRICS = {  # column -> path in summary.json
    "finished": ("requests", "finished"), "rejected": ("requests", "rejected"),
    "unfinished": ("requests", "unfinished"),
    "ttft_p50_s": ("ttft_s", "p50"), "ttft_p90_s": ("ttft_s", "p90"),
    "ttft_p99_s": ("ttft_s", "p99"), "tbt_p50_s": ("tbt_s", "p50"),
    "tbt_p99_s": ("tbt_s", "p99"), "tpot_p50_s": ("tpot_s", "p50"),
    "e2e_p50_s": ("e2e_s", "p50"), "e2e_p99_s": ("e2e_s", "p99"),
    "sched_delay_p50_s": ("scheduling_delay_s", "p50"),
    "requests_per_s": ("throughput", "requests_per_s"),
    "output_tokens_per_s": ("throughput", "output_tokens_per_s"),
    "slo_attainment": ("slo", "all_attainment"),
}


def results_table(runs: list[Run], out_dir: Path) -> pd.DataFrame:
    """One row per run: the varied fields, the seed, the run's key and its headline metrics."""
    rows = []
    for run in runs:
        summary = json.loads((out_dir / "runs" / run.key / "summary.json").read_text())
        # Mappings (a whole scheduler, say) become JSON text, so the column can be grouped on.
        point = {k: v if isinstance(v, int | float | str | bool) or v is None
                 else json.dumps(v, sort_keys=True) for k, v in run.point.items()}
        row: dict[str, Any] = {**point, "seed": run.seed, "key": run.key}
        for column, (section, field) in METRICS.items():
            row[column] = summary.get(section, {}).get(field)
        rows.append(row)
    return pd.DataFrame(rows)
