"""Sweeps: one base scenario, axes of values for any of its fields (dotted paths), run in
parallel, cached under a key of everything that changes each point's answer (`sim.fingerprint`:
the resolved scenario, the content of its input files, the servesim code), gathered into one
table. Re-running a sweep runs only new or changed points; an interrupted sweep resumes.

A sweep file::

    name: budgets
    base: chunked.yaml            # a scenario file (relative to this file) or a mapping
    seeds: [0, 1]                 # replications
    grid:                         # every combination
      replica.scheduler.token_budget: [256, 512, 1024]
    zip:                          # varied together, position by position
      workload.rate_scale: [1.0, 2.0]
      name: [slow, fast]

An axis sets its field by the rule `--set` uses (`sim.overrides.set_path`): naming another
scheduler (`replica.scheduler.name`) starts its parameters afresh. `--set` options change every
run, over the base and the axes; one that meets an axis is refused.

A sweep directory holds `sweep.json` (its marker), `runs/<key>/` (one run's result files and
`inputs.json`, each written whole or not at all) and, once every run is done, `results.parquet`
and `results.csv` (never written from a partial set). A sweep with more than one seed per point
also gets `results_ci.parquet` and `results_ci.csv`: one row per point, each numeric headline
metric's estimate over the seeds and its 95% interval (`sim.replications`' rules, see
`interval_table`).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import pandas as pd

from sim.config import (
    MAX_SEED,
    Scenario,
    parse_scenario,
    read_mapping,
    results_name,
)
from sim.errors import InputError, Problem
from sim.fingerprint import input_files, inputs_record, scenario_key
from sim.outdir import check_only_results, check_writable_dir, is_run_dir, replace_file
from sim.overrides import (
    FIELD_PATH,
    Override,
    apply_overrides,
    named_by_overrides,
    related,
    resolved_defaults,
    set_path,
)
from sim.sweep_workers import Job, SweepFailed, run_jobs
from sim.yaml_input import read_base

SWEEP_MARKER = "sweep.json"
TABLES = ("results.parquet", "results.csv")
CI_TABLES = ("results_ci.parquet", "results_ci.csv")


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
        """Same key, same answer (`sim.fingerprint.scenario_key`): such a point runs once."""
        return scenario_key(self.scenario)


MAX_RUNS = 10_000  # runs in one sweep: each is loaded and checked before any starts


def load_sweep(path: str | Path, overrides: Sequence[Override] = ()) -> tuple[str, list[Run]]:
    """Expand a sweep file into its runs; one-line errors for bad files. `overrides` (`--set`)
    change every run, over the base and the axes; one that meets an axis (the same field, or
    one inside the other) is refused: which value was meant would be a guess."""
    path = Path(path)
    data = read_mapping(path, "sweep", {"name", "base", "seeds", "grid", "zip"})
    name = results_name(path, data)
    base, base_dir = read_base(path, data)
    _check_overrides(path, data, overrides)
    defaults = resolved_defaults(base, path, base_dir)
    base = apply_overrides(base, overrides, defaults)
    seeds = _seeds(path, data, base)
    grid, zipped = _axes(path, data)
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
            errors.append(named_by_overrides(exc, overrides, path, partial(_axis_of, point)))
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


def is_sweep_dir(path: Path) -> bool:
    """A sweep's directory: its marker, or (written before there was one) a `runs/` folder."""
    return (path / SWEEP_MARKER).is_file() or ((path / "runs").is_dir() and not is_run_dir(path))


def check_sweep_dir(out: Path, field: str = "--out") -> None:
    """Fail before any run if `out` is a file or a non-empty directory of something else (a
    single run's results, say): a sweep never writes into it."""
    check_writable_dir(out, field)
    if out.is_dir() and any(out.iterdir()) and not is_sweep_dir(out):
        what = "a single run's results" if is_run_dir(out) else "not a sweep's directory"
        raise InputError(out, field, str(out), f"is {what} (no {SWEEP_MARKER}) and not empty; "
                         "refusing to write a sweep there: choose another directory")


CACHED_FILES = ("inputs.json", "requests.parquet", "iterations.parquet")


def is_cached(run_dir: Path) -> bool:
    """A point whose results and input record are all there and whose summary reads back as a
    complete run (written together, whole; anything else, e.g. a file deleted or damaged by
    hand, is run again)."""
    from sim.result_files import read_json  # here: it imports pandas and pyarrow

    if not is_run_dir(run_dir) or not all((run_dir / f).is_file() for f in CACHED_FILES):
        return False
    try:
        summary = read_json(run_dir / "summary.json")
    except InputError:  # damaged: run it again
        return False
    return summary.get("run", {}).get("complete") is True


def runs_kept(runs: list[Run], out_dir: Path) -> int:
    """How many of `runs` have their results in `out_dir` (e.g. after an interrupt)."""
    return sum(is_cached(out_dir / "runs" / run.key) for run in runs)


def run_sweep(runs: list[Run], out_dir: str | Path, *, workers: int | None = None,
              backend: str = "local",
              address: str | None = None, force: bool = False,
              on_progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Run every run not already done under `out_dir/runs/<key>` (every run with `force`);
    return the results table, also written as `out_dir/results.parquet` and `.csv`. `workers`:
    local processes (None: one, in this process) or Ray tasks at once (None: no cap).

    Input problems met by the runs end the sweep as one `InputError` (a line each); queued runs
    are cancelled and running ones stopped, as on an interrupt; finished runs are kept."""
    out_dir = Path(out_dir)
    check_sweep_dir(out_dir)
    keys = _keys(runs)
    todo = {key: run for key, run in zip(keys, runs, strict=True)
            if force or not is_cached(out_dir / "runs" / key)}
    for key in todo:  # before any run: an earlier run there is replaced whole
        check_point_dir(out_dir / "runs" / key)
    _mark(out_dir, len(runs))
    if todo:
        for name in (*TABLES, *CI_TABLES):  # a table of earlier runs would look current
            (out_dir / name).unlink(missing_ok=True)
        for key in todo:
            run_dir = out_dir / "runs" / key
            if run_dir.is_dir() and not is_run_dir(run_dir):
                # Damaged by hand (summary gone), holding only servesim's files (checked
                # above): cleared for the new run, which refuses a directory that is not a
                # run's. A whole earlier run stays until the new one replaces it atomically.
                shutil.rmtree(run_dir, ignore_errors=True)
    runs_per_key = {key: keys.count(key) for key in todo}
    done = len(runs) - sum(runs_per_key.values())

    def finished(job: Job) -> None:
        nonlocal done
        done += runs_per_key[Path(job.out_dir).name]
        if on_progress is not None:
            on_progress(done, len(runs))

    if on_progress is not None:
        on_progress(done, len(runs))
    jobs = [Job(run.scenario, str(out_dir / "runs" / key),
                inputs_record(run.scenario, run.given_paths)) for key, run in todo.items()]
    try:
        run_jobs(jobs, workers=workers, backend=backend, address=address, on_done=finished)
    except BaseException:
        _remove_partial(out_dir / "runs", set(todo))
        raise
    table = results_table(runs, out_dir)
    _write_tables(table, out_dir)
    intervals = interval_table(table)
    if intervals is None:  # one seed a point: no intervals (none left from an earlier sweep)
        for name in CI_TABLES:
            (out_dir / name).unlink(missing_ok=True)
    else:
        _write_tables(intervals, out_dir, CI_TABLES)
    return table


def check_point_dir(run_dir: Path) -> None:
    """A point's directory `runs/<key>` may be replaced by a new run: absent, or a directory
    (an earlier run, or one damaged by hand) holding nothing but servesim's own files; a file
    or a link there, or a user's entry inside, is refused naming it, before anything is
    deleted (`sim.outdir.check_only_results`)."""
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        what = "a symbolic link" if run_dir.is_symlink() else "not a directory"
        raise InputError(run_dir, "--out", str(run_dir), f"is {what}, which no sweep "
                         "writes: replacing this point's run would delete it; move it, or "
                         "choose another directory")
    check_only_results(run_dir)


def _keys(runs: list[Run]) -> list[str]:
    """Every run's key; the input files that cannot be read, all reported at once."""
    keys, problems = [], []
    for run in runs:
        try:
            keys.append(run.key)
        except InputError as exc:
            problems += exc.lines()
    if problems:
        raise SweepFailed(problems)
    return keys


def _remove_partial(runs_dir: Path, keys: set[str]) -> None:
    """The temporary directories of runs stopped part-way (`.<key>.tmp-...`): a worker killed
    mid-write cannot remove its own."""
    for entry in runs_dir.iterdir():
        if entry.name.startswith(".") and entry.name[1:].split(".")[0] in keys:
            shutil.rmtree(entry, ignore_errors=True)


def _mark(out_dir: Path, num_runs: int) -> None:
    """Create the sweep directory with its marker: also the check that it can be written."""
    try:
        (out_dir / "runs").mkdir(parents=True, exist_ok=True)
        (out_dir / SWEEP_MARKER).write_text(json.dumps({"kind": "servesim sweep",
                                                        "runs": num_runs}) + "\n")
    except OSError as exc:
        raise InputError(out_dir, "--out", str(out_dir),
                         f"cannot write there: {exc.strerror}") from None


def _write_tables(table: pd.DataFrame, out_dir: Path,
                  names: tuple[str, ...] = TABLES) -> None:
    """Each table written aside, then renamed into place: present means complete."""
    for name in names:
        if name.endswith(".parquet"):
            replace_file(out_dir / name, lambda tmp: table.to_parquet(tmp, index=False))
        else:
            replace_file(out_dir / name, lambda tmp: table.to_csv(tmp, index=False))


METRICS = {  # column -> path in summary.json
    "overload": ("overload", "verdict"),
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
    "num_gpus": ("cost", "num_gpus"),
    "requests_per_s_per_gpu": ("cost", "requests_per_s_per_gpu"),
    "usd_per_million_tokens": ("cost", "usd_per_million_tokens"),
}


def short_value(value: Any) -> str:
    """A varied value for a narrow column or a legend: a mapping (JSON text in the table) by
    its values, e.g. `chunked_prefill 256`."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            mapping = json.loads(value)
        except ValueError:
            mapping = None
        if isinstance(mapping, dict) and ("peak_bf16_flops" in mapping or "base" in mapping):
            # A GPU described in the scenario: its figures would fill the column; its name.
            return str(mapping.get("name") or f"{mapping.get('base')}-custom")
        if isinstance(mapping, dict):
            return " ".join(str(v) for v in mapping.values())
    return f"{value:g}" if isinstance(value, float) else str(value)


def results_table(runs: list[Run], out_dir: Path) -> pd.DataFrame:
    """One row per run: the varied fields, the seed, the run's key, its overload verdict
    (`stable`, `overloaded` or `unknown`) and its headline metrics."""
    from sim.result_files import read_json

    rows = []
    for run in runs:
        summary = read_json(out_dir / "runs" / run.key / "summary.json")
        # Mappings (a whole scheduler, say) become JSON text, so the column can be grouped on.
        point = {k: v if isinstance(v, int | float | str | bool) or v is None
                 else json.dumps(v, sort_keys=True) for k, v in run.point.items()}
        row: dict[str, Any] = {**point, "seed": run.seed, "key": run.key}
        for column, (section, name) in METRICS.items():
            row[column] = (summary.get(section) or {}).get(name)
        rows.append(row)
    return pd.DataFrame(rows)


PERCENTILE_MARKS = ("_p50_", "_p90_", "_p99_")


def interval_metrics(table: pd.DataFrame) -> list[str]:
    """The headline metrics of `table` that are numbers (every value given is one)."""
    def numeric(column: str) -> bool:
        return all(isinstance(v, int | float) and not isinstance(v, bool)
                   for v in table[column].dropna())

    return [c for c in METRICS if c in table and numeric(c)]


def interval_table(table: pd.DataFrame) -> pd.DataFrame | None:
    """One row per point of a sweep with more than one seed a point (None otherwise): the
    varied fields, `num_seeds`, `num_overloaded` (runs whose verdict is overloaded) and, for
    each numeric headline metric, `<metric>` (the mean over the seeds), `<metric>_lo` and
    `<metric>_hi` (its 95% interval), by `sim.intervals.estimate`'s rules: percentiles
    (`_p50_`, `_p90_`, `_p99_` in the name) the expanded bootstrap (fixed seed) widened to at
    least the Student t interval, every other metric the t interval; clipped to the values the
    metric can take (attainment to [0, 1], the rest at 0); no interval (empty) where every seed
    gives the same value, or from fewer than two. The same table gives the same bytes."""
    from sim.intervals import estimate

    if table.empty or "seed" not in table:
        return None
    varied = [c for c in table.columns if c not in {"seed", "key", *METRICS}]
    if varied:
        parts = [part for _, part in table.groupby(varied, sort=False, dropna=False)]
    else:
        parts = [table]
    parts = [part.drop_duplicates("key") if "key" in part else part for part in parts]
    if max(part["seed"].nunique() for part in parts) < 2:
        return None
    metrics = interval_metrics(table)
    rows = []
    for part in parts:
        first = part.iloc[0]
        row: dict[str, Any] = {c: first[c] for c in varied}
        row["num_seeds"] = len(part)
        row["num_overloaded"] = (int((part["overload"] == "overloaded").sum())
                                 if "overload" in part else 0)
        for column in metrics:
            values = [None if pd.isna(v) else float(v) for v in part[column]]
            method = "bootstrap" if any(m in column for m in PERCENTILE_MARKS) else "t"
            clip = (0.0, 1.0) if column.endswith("attainment") else (0.0, math.inf)
            got = estimate(values, method, clip)
            lo, hi = got["ci95"] or (None, None)
            row[column], row[f"{column}_lo"], row[f"{column}_hi"] = got["estimate"], lo, hi
        rows.append(row)
    out = pd.DataFrame(rows)
    numbers = [c for m in metrics for c in (m, f"{m}_lo", f"{m}_hi")]
    out[numbers] = out[numbers].astype("float64")
    return out
