"""A run's directory read back (`Results.load` in `sim.results.run_dir`): what `write` wrote, and
nothing that is not a whole run."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sim import run_scenario
from sim.config.errors import InputError
from sim.results.run_dir import Results
from tests.helpers import (
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
