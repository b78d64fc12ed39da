"""A run's results (`Results`): its tables and summary, written into a run directory beside
its resolved scenario, and read back from one. Importing it imports neither SimPy nor the
engine, the cluster or the runner (the scenario models it reads `scenario.yaml` with register
the policies): notebooks, plots and reports that only read result files need no more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.config.errors import InputError
from sim.config.scenario import Scenario, load_scenario, scenario_yaml
from sim.engine.iteration_log import COLUMNS
from sim.results.columns import Columns, plain, to_frame, write_parquet
from sim.results.outdir import write_dir

if TYPE_CHECKING:
    import pandas as pd


class Results:
    """What a run produced; `write` puts it next to its resolved scenario.

    Its tables (`requests`, `iterations`, `tokens`: one row per token, if the scenario records
    token times; `tbt_gaps`: every TBT gap of the run as distinct values with counts, `gap_s`
    and `count`, sorted, the population of the summary's TBT row, at most one row per
    iteration) are DataFrames when read, made from the run's columns on first use: a run that
    is only written never imports pandas. `tables` holds them as given (`Columns` from a run,
    DataFrames from `load`), and is what `write` writes: the files do not depend on which
    frames were read before."""

    def __init__(self, scenario: Scenario, requests: Columns | pd.DataFrame,
                 iterations: Columns | pd.DataFrame, tokens: Columns | pd.DataFrame | None,
                 summary: dict[str, Any], tbt_gaps: Columns | pd.DataFrame | None = None):
        self.scenario = scenario
        self.summary = summary
        self.path: Path | None = None  # the run directory it was read from (`load`)
        self.tables: dict[str, Columns | pd.DataFrame] = {
            name: table for name, table in (("requests", requests), ("iterations", iterations),
                                            ("tokens", tokens), ("tbt_gaps", tbt_gaps))
            if table is not None}
        self._frames: dict[str, pd.DataFrame] = {}

    def _frame(self, name: str) -> pd.DataFrame | None:
        if name not in self.tables:
            return None
        if name not in self._frames:
            self._frames[name] = to_frame(self.tables[name])
        return self._frames[name]

    def add_columns(self, name: str, columns: dict[str, np.ndarray]) -> None:
        """Add columns to table `name` (replay's measurements beside the iterations), written
        with it; a DataFrame already made of it is made again when next read."""
        table = self.tables[name]
        for column_name, values in columns.items():
            table[column_name] = values
        self._frames.pop(name, None)

    @property
    def requests(self) -> pd.DataFrame:
        frame = self._frame("requests")
        assert frame is not None
        return frame

    @property
    def iterations(self) -> pd.DataFrame:
        frame = self._frame("iterations")
        assert frame is not None
        return frame

    @property
    def tokens(self) -> pd.DataFrame | None:
        return self._frame("tokens")

    @property
    def tbt_gaps(self) -> pd.DataFrame | None:
        return self._frame("tbt_gaps")

    def write(self, out_dir: str | Path) -> Path:
        """Write the result files into `out_dir`, replacing an earlier run there whole: the
        directory holds this run's complete files or, if interrupted, the previous ones."""
        return write_dir(Path(out_dir), self.write_files)

    def write_files(self, out: Path, inputs: list[dict[str, Any]] | None = None) -> None:
        """The result files, into an existing directory (`write` makes it atomic), with
        `inputs.json`: versions and input-file hashes (`inputs`, if the caller hashed them
        already, as a sweep does to key the run)."""
        from sim.results.fingerprint import run_record

        (out / "scenario.yaml").write_text(scenario_yaml(self.scenario))
        (out / "inputs.json").write_text(json.dumps(run_record(self.scenario, inputs),
                                                    indent=2, sort_keys=True) + "\n")
        for name, table in self.tables.items():
            write_parquet(table, out / f"{name}.parquet", COUNTER_COLUMNS.get(name, ()))
        # Last: its presence marks a directory as a servesim run. Strict JSON, as it is read
        # back (`sim.results.read`): a NaN here is a bug to see now, not a file refused later.
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, sort_keys=True,
                                                     allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Results:
        """A run directory read back as `write` left it (frames equal to the written ones; the
        scenario through `load_scenario`). One-line `InputError`s for a path that is not a
        directory, a directory of another kind (a sweep's, say), or a file that is missing,
        corrupt or lacks a column; `tokens.parquet` is read when the scenario recorded token
        times (then it must be there) or when it is present."""
        # Here, not at the top: the readers import pyarrow, which a simulation does not need.
        from sim.results.read import directory_kind, read_json, read_parquet

        run = Path(path)
        kind = directory_kind(run)
        if kind != "run":
            raise InputError(run, "RESULTS", str(run), f"a {kind} directory, not one run's results "
                             "(give a run directory: one holding summary.json)")
        scenario = load_scenario(run / "scenario.yaml")
        requests = read_parquet(run / "requests.parquet", REQUEST_COLUMNS)
        iterations = read_parquet(run / "iterations.parquet", ITERATION_COLUMNS)
        tokens = None
        if scenario.record_token_times or (run / "tokens.parquet").exists():
            tokens = read_parquet(run / "tokens.parquet", TOKEN_COLUMNS,
                                  missing="missing, though the scenario records token times")
        gaps = (read_parquet(run / "tbt_gaps.parquet", GAP_COLUMNS)
                if (run / "tbt_gaps.parquet").exists() else None)
        check_claims(run, requests, iterations, tokens, gaps)
        results = cls(scenario, requests, iterations, tokens, read_json(run / "summary.json"),
                      gaps)
        results.path = run
        return results


def check_claims(run: Path, requests: pd.DataFrame, iterations: pd.DataFrame,
                 tokens: pd.DataFrame | None, gaps: pd.DataFrame | None) -> None:
    """What every run guarantees, checked on tables read back (edited by hand, or by another
    tool): ids unique and known, times ordered, counts not negative. A table that breaks one
    is refused in one line naming its file, column and first offending row, before an export
    or a plot draws from it."""
    def refuse(file: str, column: str, values: Any, bad: np.ndarray, problem: str) -> None:
        if bad.any():
            row = int(np.argmax(bad))
            raise InputError(run / file, column, plain(values[row]), f"row {row}: {problem}")

    def col(frame: pd.DataFrame, name: str) -> np.ndarray:
        return frame[name].to_numpy(dtype=np.float64, na_value=np.nan)

    ids = requests["request_id"].to_numpy()
    refuse("requests.parquet", "request_id", ids, _repeats(ids), "an id given twice")
    arrival = col(requests, "arrival_s")
    refuse("requests.parquet", "arrival_s", arrival, ~(np.isfinite(arrival) & (arrival >= 0)),
           "every request arrives at a finite time, from 0")
    for name, problem in (("ttft_s", "a first token before its arrival"),
                          ("e2e_s", "a finish before its arrival"),
                          ("max_tbt_s", "a negative gap between tokens")):
        values = col(requests, name)
        refuse("requests.parquet", name, values, values < 0, problem)
    for name in ("first_token_s", "finish_s", "failed_s"):
        if name not in requests:
            continue  # (failed_s: results written before client timeouts)
        values = col(requests, name)
        refuse("requests.parquet", name, values, values < arrival, "before its arrival")
    generated = col(requests, "num_generated_tokens")
    refuse("requests.parquet", "num_generated_tokens", generated, generated < 0,
           "a negative count")
    if "num_output_tokens" in requests:
        refuse("requests.parquet", "num_generated_tokens", generated,
               generated > col(requests, "num_output_tokens"),
               "more tokens than the request's output length (num_output_tokens)")
    duration = col(iterations, "duration_s")
    refuse("iterations.parquet", "duration_s", duration, ~(duration > 0),
           "every iteration takes some time")
    start = col(iterations, "start_s")
    refuse("iterations.parquet", "start_s", start, ~(np.isfinite(start) & (start >= 0)),
           "every iteration starts at a finite time, from 0")
    for name in COLUMNS:
        if name.startswith("num_"):
            values = col(iterations, name)
            refuse("iterations.parquet", name, values, values < 0, "a negative count")
    if tokens is not None:
        owner = tokens["request_id"].to_numpy()
        refuse("tokens.parquet", "request_id", owner, ~np.isin(owner, ids),
               "names a request that requests.parquet does not have")
        time_s = col(tokens, "time_s")
        refuse("tokens.parquet", "time_s", time_s, ~(np.isfinite(time_s) & (time_s >= 0)),
               "every token comes at a finite time, from 0")
    if gaps is not None:
        gap, count = col(gaps, "gap_s"), col(gaps, "count")
        refuse("tbt_gaps.parquet", "gap_s", gap, ~(gap >= 0), "a gap is never negative")
        refuse("tbt_gaps.parquet", "count", count, ~(count >= 1), "each gap counted once or more")


def _repeats(values: np.ndarray) -> np.ndarray:
    """True where a value came earlier in `values`."""
    _, first = np.unique(values, return_index=True)
    repeated = np.ones(len(values), dtype=bool)
    repeated[first] = False
    return repeated


# The columns a loaded run must have: what the readers of `Results.load` rely on.
REQUEST_COLUMNS = ("request_id", "replica_id", "decode_replica_id", "arrival_s",
                   "num_prompt_tokens", "num_generated_tokens", "first_token_s", "finish_s",
                   "status", "reason", "ttft_s", "e2e_s", "max_tbt_s", "transfer_start_s",
                   "transfer_end_s")
ITERATION_COLUMNS = ("replica_id", "pool", "iteration", *COLUMNS)
TOKEN_COLUMNS = ("request_id", "token_index", "time_s")
GAP_COLUMNS = ("gap_s", "count")
# Integer columns stored as differences (`write_parquet`): they mostly step by one or little.
COUNTER_COLUMNS = {"requests": ("request_id",), "tokens": ("token_index",),
                   "iterations": ("iteration", "num_kv_blocks_used")}
