"""`servesim fit` and `servesim profile`'s options: files that are not profiles, rows or
metadata it cannot fit, the host overhead taken from replays only, options checked before
anything is measured."""

from __future__ import annotations

import os
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sim import load_scenario, run_scenario
from sim.cli import main
from tests.helpers import REPO, assert_one_line_error, requires_torch, run_cli
from tests.latency.test_profile import scenario_with_profile

# `servesim fit` and `servesim profile` read and write profiles with `profiler.measure.timing`,
# which imports torch.
pytestmark = requires_torch

CPU_TINY = REPO / "profiles" / "cpu_tiny.json"


def test_fit_rejects_a_file_that_is_not_a_profile(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "x.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(bad)
    monkeypatch.setattr(sys, "argv", ["servesim", "fit", str(bad)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert "not a servesim profile" in capsys.readouterr().err


def tiny_profile_with(tmp_path, change, metadata=None):
    """The committed tiny profile's rows with `change(frame)` applied, its metadata kept
    (or replaced by `metadata`)."""
    table = pq.read_table(CPU_TINY.with_suffix(".parquet"))
    frame = table.to_pandas()
    frame = change(frame) if change is not None else frame
    out = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(
        table.schema.metadata if metadata is None else metadata)
    path = tmp_path / "p.parquet"
    pq.write_table(out, path)
    return path


def set_rows(column, value, rows=None):
    """`column` set to `value` in `rows` (every row if None)."""
    def change(frame):
        frame = frame.copy()
        if rows is None:
            frame[column] = value
        else:
            frame[column] = frame[column].astype(float)
            frame.loc[frame.index[rows], column] = value
        return frame
    return change


@pytest.mark.parametrize("change,needles", [
    (lambda f: f.iloc[0:0], ["split='0 train rows'", "two token counts"]),
    (lambda f: f[f["split"] == "holdout"], ["split='0 train rows'"]),
    (lambda f: pd.concat([f[f["split"] == "train"].head(1), f[f["split"] == "holdout"]]),
     ["split='1 train rows'"]),
    (set_rows("median_s", np.nan, slice(0, 5)), ["median_s=nan: row 0: must be a finite time"]),
    (set_rows("median_s", np.inf, 3), ["median_s=inf: row 3"]),
    (set_rows("median_s", -1.0, 3), ["median_s=-1.0: row 3"]),
    (set_rows("median_s", 0.0), ["median_s=0.0: row 0: must be a finite time > 0 s"]),
    (set_rows("num_tokens", np.nan, 3), ["num_tokens=nan: row 3: must be a whole number"]),
    (set_rows("median_s", "0.1"), ["median_s='0.1': row 0: must be a number"]),
    (set_rows("split", "nonsense"), ["split='nonsense': row 0: must be one of train, holdout"]),
    (lambda f: f.drop(columns=["decode_kv_tokens"]), ["<columns>=['decode_kv_tokens']"]),
    (lambda f: f.assign(samples_s=[[] for _ in range(len(f))]),
     ["samples_s=[]: row 0: must be a non-empty list"]),
])
def test_fit_refuses_rows_it_cannot_fit(tmp_path, monkeypatch, capsys, change, needles):
    """Each was a traceback (KeyError, numpy, scipy), a NaN error table or a hang (nnls on
    NaN), or a fit of negative times."""
    path = tiny_profile_with(tmp_path, change)
    code, err = run_cli(monkeypatch, capsys, "fit", str(path), "--out", str(tmp_path / "f.json"))
    assert_one_line_error(code, err, "p.parquet: ", *needles)
    assert not (tmp_path / "f.json").exists()


def test_fit_refuses_metadata_that_is_not_a_profiles(tmp_path, monkeypatch, capsys):
    key = b"servesim"
    for metadata, needle in (({key: b"[1, 2]"}, "metadata='list': must be a JSON object"),
                             ({key: b'{"model": 5}'}, "metadata.model=5"),
                             ({key: b'{"model": "tiny", "model": "x"}'}, "given twice"),
                             ({}, "metadata.model=None")):
        path = tiny_profile_with(tmp_path, None, metadata)
        code, err = run_cli(monkeypatch, capsys, "fit", str(path), "--out",
                            str(tmp_path / "f.json"))
        assert_one_line_error(code, err, "p.parquet: ", needle)


def test_host_overhead_comes_from_replays_only(tmp_path, monkeypatch, capsys):
    profile = tiny_profile_with(tmp_path, None)
    run = tmp_path / "run"
    run_scenario(load_scenario(scenario_with_profile(tmp_path, str(CPU_TINY))), out_dir=run)
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    # Was KeyError: 'host_s'.
    assert_one_line_error(code, err, "--host-overhead-from", "no host_s", "servesim replay")
    its = pd.read_parquet(run / "iterations.parquet")
    its.assign(host_s=np.nan).to_parquet(run / "iterations.parquet", index=False)
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    assert_one_line_error(code, err, "iterations.parquet: host_s=nan: row 0")
    (run / "iterations.parquet").write_bytes(b"garbage")
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    assert_one_line_error(code, err, "iterations.parquet", "cannot read it")  # was pyarrow's
    assert not (tmp_path / "f.json").exists()


def test_profile_options_are_checked_before_measuring(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("garbage")
    small = ["--max-tokens", "16", "--max-batch", "1", "--holdout", "1", "--reps", "1",
             "--warmup", "0"]
    for args, needles in (
            (["--out", str(tmp_path)], ["--out", "is a directory", "name a .parquet file"]),
            (["--out", str(fifo)], ["--out", "not a regular file"]),
            (["--out", str(garbage)], ["--out", "not a profile (not parquet"]),
            # Parquet under another name would be read as neither a profile nor a fit.
            (["--out", str(tmp_path / "p.json")], ["--out", "p.json", "a .parquet file"]),
            (["--max-context", "16"], ["--max-context=16: must be at least 32"]),  # low >= high
            (["--model", "nosuch"], ["<command line>: --model='nosuch': unknown"])):
        out = [] if "--out" in args else ["--out", str(tmp_path / "p.parquet")]
        code, err = run_cli(monkeypatch, capsys, "profile", *small, *out, *args)
        assert_one_line_error(code, err, *needles)
    assert garbage.read_text() == "garbage" and not (tmp_path / "p.parquet").exists()
    assert not (tmp_path / "p.json").exists()
