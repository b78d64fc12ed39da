"""Sweeps: the runs of a sweep file (`sim.studies.sweep_file`), run in parallel, cached under a key
of everything that changes each point's answer (`sim.results.fingerprint`: the resolved scenario,
the content of its input files, the servesim code), gathered into one table. Re-running a sweep
runs only new or changed points; an interrupted sweep resumes.

A sweep directory holds `sweep.json` (its marker), `runs/<key>/` (one run's result files and
`inputs.json`, each written whole or not at all) and, once every run is done, `results.parquet`
and `results.csv` (never written from a partial set). A sweep with more than one seed per point
also gets `results_ci.parquet` and `results_ci.csv`: one row per point, each numeric headline
metric's estimate over the seeds and its 95% interval (`sim.studies.replications`' rules, see
`interval_table`).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from sim.config.errors import InputError
from sim.results.fingerprint import inputs_record
from sim.results.formats import CI_TABLES, METRICS
from sim.results.outdir import check_only_results, check_writable_dir, is_run_dir, replace_file
from sim.studies.sweep_file import Run
from sim.studies.workers import Job, SweepFailed, run_jobs

SWEEP_MARKER = "sweep.json"
TABLES = ("results.parquet", "results.csv")


def is_sweep_dir(path: Path) -> bool:
    """A sweep's directory: its marker, or (written before there was one) a `runs/` folder."""
    from sim.results.read import PLAN_MARKER

    return (path / SWEEP_MARKER).is_file() or ((path / "runs").is_dir() and not is_run_dir(path)
                                               and not (path / PLAN_MARKER).is_file())


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
    from sim.results.read import read_json  # here: it imports pandas and pyarrow

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
    deleted (`sim.results.outdir.check_only_results`)."""
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
    from sim.results.read import read_json

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
    `<metric>_hi` (its 95% interval), by `sim.results.metrics.intervals.estimate`'s rules:
    percentiles (`_p50_`, `_p90_`, `_p99_` in the name) the expanded bootstrap (fixed seed) widened
    to at least the Student t interval, every other metric the t interval; clipped to the values the
    metric can take (attainment to [0, 1], the rest at 0); no interval (empty) where every seed
    gives the same value, or from fewer than two. The same table gives the same bytes."""
    from sim.results.metrics.intervals import estimate

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
