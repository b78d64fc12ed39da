"""A sweep file: one base scenario and axes of values for any of its fields (dotted paths),
expanded into its runs, each checked as a whole scenario before any starts::

    name: budgets
    base: chunked.yaml            # a scenario file (relative to this file) or a mapping
    seeds: [0, 1]                 # replications
    grid:                         # every combination
      replica.scheduler.token_budget: [256, 512, 1024]
    zip:                          # varied together, position by position
      workload.rate_scale: [1.0, 2.0]
      name: [slow, fast]

An axis sets its field by the rule `--set` uses (`sim.config.overrides.set_path`): naming another
scheduler (`replica.scheduler.name`) starts its parameters afresh. `--set` options change every
run, over the base and the axes; one that meets an axis is refused. Running the runs:
`sim.studies.sweep`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from sim.config.errors import InputError, Problem
from sim.config.overrides import (
    FIELD_PATH,
    Override,
    apply_overrides,
    named_by_overrides,
    problems_alone,
    related,
    resolved_defaults,
    set_path,
    split_base_problems,
)
from sim.config.scenario import (
    MAX_SEED,
    Scenario,
    parse_scenario,
    read_mapping,
    results_name,
)
from sim.config.yaml_input import read_base
from sim.results.fingerprint import input_files, scenario_key
from sim.studies.workers import SweepFailed


@dataclass(frozen=True)
class Run:
    """One point of a sweep: the values it varies, its seed, its resolved scenario and, by
    field, its input files' paths as the user wrote them (recorded beside its results)."""

    point: dict[str, Any]
    seed: int
    scenario: Scenario
    given_paths: dict[str, str] = field(default_factory=dict, compare=False)

    @cached_property
    def key(self) -> str:
        """Same key, same answer (`sim.results.fingerprint.scenario_key`): such a point runs
        once."""
        return scenario_key(self.scenario)


MAX_RUNS = 10_000  # runs in one sweep: each is loaded and checked before any starts


def load_sweep(path: str | Path, overrides: Sequence[Override] = ()) -> tuple[str, list[Run]]:
    """Expand a sweep file into its runs; one-line errors for bad files. `overrides` (`--set`)
    change every run, over the base and the axes; one that meets an axis (the same field, or
    one inside the other) is refused: which value was meant would be a guess."""
    path = Path(path)
    data = read_mapping(path, "sweep", {"name", "base", "seeds", "grid", "zip"})
    name = results_name(path, data)
    # A base scenario file's own problems are named by it, not by the sweep (below).
    base, base_dir, base_file = read_base(path, data)
    base_alone: list[Problem] | None = None
    raw_base = {"name": name, **base}
    _check_overrides(path, data, overrides)
    defaults = resolved_defaults(base, path, base_dir)
    base = apply_overrides(base, overrides, defaults)
    seeds = _seeds(path, data, base)
    grid, zipped = _axes(path, data)
    if not grid and not zipped and not seeds:
        raise InputError(path, "<top level>", sorted(data), "nothing to sweep: no grid, zip or "
                         "seeds (one run is `servesim simulate`)")
    run_seeds: list[int | None] = list(seeds) if seeds else [None]
    # Counted before the points are listed: ten axes of ten values are 10**10 of them.
    sizes = [*(len(v) for v in grid.values()), len(next(iter(zipped.values()), [None])),
             len(run_seeds)]
    if math.prod(sizes) > MAX_RUNS:
        raise InputError(path, "grid", f"{' x '.join(map(str, sizes))} = "
                         f"{math.prod(sizes):,} runs", f"at most {MAX_RUNS:,} runs in one "
                         "sweep (grid values x zip points x seeds): split it, or sweep fewer "
                         "values")
    grid_points = [dict(zip(grid, combo, strict=True))
                   for combo in itertools.product(*grid.values())] or [{}]
    zip_points = [dict(zip(zipped, combo, strict=True))
                  for combo in zip(*zipped.values(), strict=True)] or [{}]
    runs, errors = [], []
    for g, z, seed in itertools.product(grid_points, zip_points, run_seeds):
        point = {**g, **z}
        scenario_data = dict(base)
        for dotted, value in point.items():
            scenario_data = set_path(scenario_data, dotted, value, defaults)
        # Again over the axes: an axis naming another scheduler starts it afresh.
        scenario_data = apply_overrides(scenario_data, overrides, defaults)
        if seed is not None:
            scenario_data["seed"] = seed
        scenario_data.setdefault("name", name)
        try:
            scenario = parse_scenario(scenario_data, path, base_dir)
        except InputError as exc:  # named by the override or sweep axis that set the field
            problems = list(exc.problems)
            if base_file is not None:
                if base_alone is None:
                    base_alone = problems_alone(raw_base, base_file, base_dir)
                own, problems = split_base_problems(exc, base_alone, overrides)
                if own:
                    errors.append(InputError.many(base_file, own))
            if problems:
                errors.append(named_by_overrides(InputError.many(exc.source, problems),
                                                 overrides, path, partial(_axis_of, point)))
            if len(errors) == MAX_FAILED_POINTS:  # a bad base fails every point alike: enough
                break
            continue
        runs.append(Run(point, scenario.seed, scenario, _given_paths(scenario, scenario_data)))
    if errors:
        raise _every_problem(path, errors)
    return name, runs


MAX_PROBLEMS = 20  # lines of a sweep's problems shown at once; a last line counts the rest
# Points checked at most once this many have failed (each check parses a whole scenario: a bad
# base in a sweep of 10,000 points would otherwise parse them all to say one thing).
MAX_FAILED_POINTS = 200


def _every_problem(path: Path, errors: list[InputError]) -> InputError:
    """The problems of every point, each once, in order: the first `MAX_PROBLEMS`, then a line
    of the sweep file `path` saying how many more. One `InputError` where every problem is of
    one file (the sweep's), else a line each."""
    problems: dict[str, tuple[str, Problem]] = {}
    for exc in errors:
        for problem, line in zip(exc.problems, exc.lines(), strict=True):
            problems.setdefault(line, (exc.source, problem))
    shown = list(problems.values())[:MAX_PROBLEMS]
    more = len(problems) - len(shown)
    rest: list[Problem] = [("<more>", more, f"problems not shown (the first {MAX_PROBLEMS} are "
                            "above): fix those and check again")] if more else []
    sources = {source for source, _ in problems.values()}
    if sources == {str(path)}:
        return InputError.many(path, [problem for _, problem in shown] + rest)
    return SweepFailed(list(problems)[:MAX_PROBLEMS]
                       + (InputError.many(path, rest).lines() if rest else []))


def _seeds(path: Path, data: dict[str, Any], base: dict[str, Any]) -> list[int] | None:
    """The file's `seeds`, each once; None where it lists none (each run keeps the base's
    seed, checked with the rest of the scenario)."""
    if "seeds" not in data:
        return None
    seeds = data["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED
            for s in seeds):
        raise InputError(path, "seeds", seeds, "must be a non-empty list of integers from 0 "
                         f"to {MAX_SEED} (2**63 - 1)")
    if (twice := _given_twice(seeds)) is not None:
        raise InputError(path, "seeds", twice, "listed twice: the same run again")
    return seeds


def _axes(path: Path, data: dict[str, Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """`grid` and `zip`: each axis a field's dotted path, once in the file and not inside
    another axis (which value was meant would be a guess), with a non-empty list of distinct
    values; zipped lists of one length."""
    for section in ("grid", "zip"):
        if section in data and not data[section]:
            raise InputError(path, section, data[section], "holds no axis: map field paths to "
                             "lists of values, or leave it out")
    sections = {section: data.get(section) or {} for section in ("grid", "zip")}
    seen: dict[str, str] = {}
    for section, axes in sections.items():
        if not isinstance(axes, dict):
            raise InputError(path, section, axes, "must map field paths to lists of values")
        for axis, values in axes.items():
            if not FIELD_PATH.fullmatch(axis):
                raise InputError(path, f"{section}.{axis}", axis, "must be a field's path: "
                                 "names joined by '.', e.g. workload.arrivals.qps")
            if axis == "seed":
                raise InputError(path, f"{section}.seed", values, "seeds are listed in "
                                 "`seeds:` (each run of every point), not swept as an axis")
            other = next((a for a in seen if related(a, axis)), None)
            if other is not None:
                what = "the same field" if other == axis else "a field inside the other"
                raise InputError(path, f"{section}.{axis}", values, f"{seen[other]}.{other} "
                                 f"sweeps {what}: which value was meant would be a guess")
            seen[axis] = section
            if not isinstance(values, list) or not values:
                raise InputError(path, f"{section}.{axis}", values, "must be a non-empty list")
            if (twice := _given_twice(values)) is not None:
                raise InputError(path, f"{section}.{axis}", twice, "listed twice: the same "
                                 "points would run again")
    grid, zipped = sections["grid"], sections["zip"]
    if len({len(v) for v in zipped.values()}) > 1:
        raise InputError(path, "zip", {k: len(v) for k, v in zipped.items()},
                         "zipped lists must have the same length")
    return grid, zipped


def _given_twice(values: list[Any]) -> Any:
    """The first value of `values` equal to an earlier one (2 and 2.0 alike, a boolean never
    equal to a number), or None."""
    seen = set()
    for value in values:
        try:
            key: Any = (type(value) is bool, value)
            hash(key)
        except TypeError:  # a mapping or list: by its content
            key = ("json", json.dumps(value, sort_keys=True, default=str))
        if key in seen:
            return value
        seen.add(key)
    return None


def _check_overrides(path: Path, data: dict[str, Any], overrides: Sequence[Override]) -> None:
    """Refuse an override of a swept field (`seed` too, where the file lists `seeds`)."""
    axes = [*(data.get("grid") or {}), *(data.get("zip") or {})]
    if "seeds" in data:
        axes.append("seed")
    for dotted, value in overrides:
        axis = next((a for a in axes if isinstance(a, str) and related(a, dotted)), None)
        if axis is not None:
            raise InputError(path, f"--set {dotted}", value, f"the sweep varies {axis}: "
                             "change its values in the sweep file, or sweep something else")


def _axis_of(point: dict[str, Any], field: str) -> str:
    return next((axis for axis in point if field.startswith(axis)), field)


def _given_paths(scenario: Scenario, data: dict[str, Any]) -> dict[str, str]:
    """Each input file's path as written in the sweep or its base (not resolved)."""
    given = {}
    for dotted in input_files(scenario):
        value: Any = data
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            given[dotted] = value
    return given
