"""A run's directory read back (`Results.load` in `sim.results.run_dir`): what `write` wrote, and
nothing that is not a whole run."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sim import run_scenario
from sim.config.errors import InputError
from sim.plots import plot_run
from sim.results.run_dir import Results
from tests.helpers import (
    colocated_run,
    disaggregated,
    disaggregated_run,
)

# --- Results.load ---------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [True, False])
def test_load_reads_back_what_write_wrote(tmp_path, tokens):
    rows = [(0.0, 100, 3), (0.125, 40, 2), (0.3, 50, 5)]
    res = run_scenario(disaggregated(tmp_path, rows, record_token_times=tokens),
                       out_dir=tmp_path / "r")
    back = Results.load(tmp_path / "r")
    assert back.scenario.model_dump() == res.scenario.model_dump()
    pd.testing.assert_frame_equal(back.requests, res.requests)
    pd.testing.assert_frame_equal(back.iterations, res.iterations)
    if tokens:
        assert back.tokens is not None and res.tokens is not None
        pd.testing.assert_frame_equal(back.tokens, res.tokens)
    else:
        assert back.tokens is None and res.tokens is None
    assert json.dumps(back.summary, sort_keys=True) == json.dumps(res.summary, sort_keys=True)


def test_load_refuses_what_is_not_a_whole_run(tmp_path):
    run = disaggregated_run(tmp_path)
    with pytest.raises(InputError, match="directory not found"):
        Results.load(tmp_path / "nowhere")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    with pytest.raises(InputError) as exc:
        Results.load(sweep)
    assert "a sweep directory" in exc.value.one_line() and "run directory" in exc.value.one_line()
    (run / "tokens.parquet").unlink()
    with pytest.raises(InputError, match="tokens.parquet.*records token times"):
        Results.load(run)
    (run / "iterations.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="iterations.parquet.*cannot read it"):
        Results.load(run)


def _edit(run, file, change):
    frame = pd.read_parquet(run / file)
    change(frame)
    frame.to_parquet(run / file, index=False)


def _set(column, row, value):
    def change(frame):
        frame.loc[row, column] = value
    return change


# (file, the edit, the column the error names, what it says): a run's guarantees broken by
# hand (issue 49), each refused on load, before an export or plot reads the tables.
BROKEN = {
    "negative TTFT": ("requests.parquet", _set("ttft_s", 0, -1.0), "ttft_s",
                      "first token before its arrival"),
    "finish before arrival": ("requests.parquet", _set("e2e_s", 1, -5.0), "e2e_s",
                              "finish before its arrival"),
    "100x its output": ("requests.parquet",
                        lambda f: f.__setitem__("num_generated_tokens",
                                                f["num_output_tokens"] * 100),
                        "num_generated_tokens", "more tokens than"),
    "duplicate ids": ("requests.parquet", _set("request_id", 1, 0), "request_id",
                      "an id given twice"),
    "negative iteration": ("iterations.parquet", _set("duration_s", 2, -1.0), "duration_s",
                           "takes some time"),
    "unknown token owner": ("tokens.parquet", _set("request_id", 0, 10**6), "request_id",
                            "does not have"),
    "negative gap count": ("tbt_gaps.parquet", _set("count", 0, -5), "count",
                           "counted once or more"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_tables_that_break_what_a_run_guarantees_are_refused_on_load(tmp_path, case):
    file, change, column, problem = BROKEN[case]
    run = colocated_run(tmp_path)
    Results.load(run)  # as written: whole
    _edit(run, file, change)
    with pytest.raises(InputError) as info:
        Results.load(run)
    (line,) = info.value.lines()
    assert file in line and f"{column}=" in line and "row " in line and problem in line
    with pytest.raises(InputError):  # nor drawn
        plot_run(run, tmp_path / "plots")
    assert not (tmp_path / "plots").exists()
