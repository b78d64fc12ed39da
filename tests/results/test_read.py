"""Result directories read back (`sim.results.read`): a file that is corrupt, edited or of
another version is one line naming it, the field and the value, from plot, report and export
alike (they share the readers), never a traceback and never output drawn from nonsense."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.results.read import check_table, read_csv, read_json, read_parquet
from sim.runner import run_scenario
from tests.helpers import assert_one_line_error, replica, run_cli, trace


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A colocated run of six requests, all finished, written whole."""
    tmp = tmp_path_factory.mktemp("results")
    rows = [(0.05 * i, 20 + 3 * i, 2 + i % 3) for i in range(6)]
    scenario = parse_scenario({"workload": {"format": "vidur", "path": trace(tmp, rows)},
                               "replica": replica()}, "test")
    run_scenario(scenario, out_dir=tmp / "run")
    return tmp / "run"


@pytest.fixture
def run_copy(good_run, tmp_path) -> Path:
    shutil.copytree(good_run, tmp_path / "run")
    return tmp_path / "run"


def test_written_files_do_not_depend_on_the_frames_read_first(tmp_path):
    """A run's tables are written from its columns whether or not their DataFrames were made
    (`Results.requests` and the others are made on first use), byte for byte."""
    rows = [(0.05 * i, 20 + 3 * i, 2 + i % 3) for i in range(6)]
    scenario = parse_scenario({"workload": {"format": "vidur", "path": trace(tmp_path, rows)},
                               "replica": replica(), "record_token_times": True}, "test")
    res = run_scenario(scenario)
    res.write(tmp_path / "unread")
    assert len(res.requests) == 6 and len(res.iterations) and res.tokens is not None
    assert res.tbt_gaps is not None
    res.write(tmp_path / "read")
    names = ["requests.parquet", "iterations.parquet", "tokens.parquet", "tbt_gaps.parquet"]
    for name in names:
        assert (tmp_path / "read" / name).read_bytes() == (tmp_path / "unread" / name
                                                            ).read_bytes(), name


def test_counters_are_stored_as_differences_and_times_split_by_byte(tmp_path):
    """The encodings that halve the files (`write_parquet`), and what reads them back: the
    columns as written, with their types."""
    import pyarrow.parquet as pq

    rows = [(0.05 * i, 20 + 3 * i, 2 + i % 3) for i in range(6)]
    scenario = parse_scenario({"workload": {"format": "vidur", "path": trace(tmp_path, rows)},
                               "replica": replica(), "record_token_times": True}, "test")
    res = run_scenario(scenario, out_dir=tmp_path / "run")
    expected = {"iterations.parquet": {"iteration": "DELTA_BINARY_PACKED",
                                       "num_kv_blocks_used": "DELTA_BINARY_PACKED",
                                       "start_s": "BYTE_STREAM_SPLIT",
                                       "num_seqs": "RLE_DICTIONARY"},
                "tokens.parquet": {"token_index": "DELTA_BINARY_PACKED",
                                   "time_s": "BYTE_STREAM_SPLIT"},
                "requests.parquet": {"request_id": "DELTA_BINARY_PACKED",
                                     "ttft_s": "BYTE_STREAM_SPLIT"}}
    for name, columns in expected.items():
        meta = pq.ParquetFile(tmp_path / "run" / name).metadata.row_group(0)
        found = {meta.column(i).path_in_schema: meta.column(i).encodings
                 for i in range(meta.num_columns)}
        for column_name, encoding in columns.items():
            assert encoding in found[column_name], (name, column_name, found[column_name])
    back = type(res).load(tmp_path / "run")
    for frame, again in ((res.requests, back.requests), (res.iterations, back.iterations),
                         (res.tokens, back.tokens)):
        pd.testing.assert_frame_equal(frame, again)


def edit_summary(run: Path, edit: Callable[[dict], object]) -> None:
    summary = json.loads((run / "summary.json").read_text())
    edit(summary)
    (run / "summary.json").write_text(json.dumps(summary))


def edit_requests(run: Path, edit: Callable[[pd.DataFrame], object]) -> None:
    frame = pd.read_parquet(run / "requests.parquet")
    edit(frame)
    frame.to_parquet(run / "requests.parquet", index=False)


def refused_everywhere(monkeypatch, capsys, run: Path, *needles: str) -> None:
    """Report, both exports and plot each refuse `run` with the same one line."""
    out = run.parent
    for args in (("report", str(run), "--out", str(out / "r.html")),
                 ("export", str(run), "--format", "vllm", "--out", str(out / "v.json")),
                 ("export", str(run), "--format", "chrome", "--out", str(out / "c.json")),
                 ("plot", str(run), "--out", str(out / "plots"))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, *needles)
    assert not (out / "v.json").exists() and not (out / "c.json").exists()


def test_the_readers_take_what_a_run_wrote(good_run):
    assert read_json(good_run / "summary.json")["requests"]["total"] == 6
    assert len(read_parquet(good_run / "requests.parquet", ["ttft_s"])) == 6
    assert len(read_parquet(good_run / "iterations.parquet")) > 0
    assert len(read_parquet(good_run / "tbt_gaps.parquet", ["gap_s", "count"])) > 0


@pytest.mark.parametrize(("edit", "needles"), [
    (lambda s: s.clear(), ("summary.json: run=<missing>: required", "edited?")),
    (lambda s: s.pop("run"), ("summary.json: run=<missing>",)),
    (lambda s: s.update(ttft_s="fast"), ("ttft_s='fast': must be a mapping",)),
    (lambda s: s["run"].update(end_s="9.7"), ("run.end_s='9.7'", "not text")),
    (lambda s: s["replicas"][0].update(replica_id=True), ("replicas.0.replica_id=True",)),
    (lambda s: s["requests"].pop("total"), ("requests.total=<missing>",)),
])
def test_a_summary_without_what_its_readers_need_is_refused(run_copy, monkeypatch, capsys,
                                                             edit, needles):
    edit_summary(run_copy, edit)
    refused_everywhere(monkeypatch, capsys, run_copy, "summary.json", *needles)


def test_summary_json_is_read_strictly(run_copy, monkeypatch, capsys):
    text = (run_copy / "summary.json").read_text()
    (run_copy / "summary.json").write_text(text.replace('"p99": ', '"p99": NaN, "x": ', 1))
    refused_everywhere(monkeypatch, capsys, run_copy, "summary.json", "NaN is not a JSON number")
    (run_copy / "summary.json").write_text(text[:-2] + ', "run": {}}')
    with pytest.raises(InputError, match="run=.*given twice"):
        read_json(run_copy / "summary.json")


def test_a_finished_request_without_its_ttft_is_refused(run_copy, monkeypatch, capsys):
    edit_requests(run_copy, lambda f: f.__setitem__("ttft_s", np.nan))
    # Export wrote NaN into JSON (a traceback), plot and report drew an empty CDF.
    refused_everywhere(monkeypatch, capsys, run_copy, "requests.parquet: ttft_s=nan",
                       "a finished request must have one (row 0)")


def test_text_in_a_time_column_is_refused(run_copy, monkeypatch, capsys):
    edit_requests(run_copy, lambda f: f.__setitem__("ttft_s", "x"))
    refused_everywhere(monkeypatch, capsys, run_copy, "requests.parquet: ttft_s='x'",
                       "must be a number")


def test_requests_fewer_than_the_summary_counts_are_refused(run_copy, monkeypatch, capsys):
    frame = pd.read_parquet(run_copy / "requests.parquet")
    frame.iloc[0:0].to_parquet(run_copy / "requests.parquet", index=False)
    refused_everywhere(monkeypatch, capsys, run_copy, "requests.parquet: <rows>=0",
                       "summary.json counts 6 requests (requests.total)")


def test_an_unknown_status_or_a_fractional_count_is_refused(run_copy):
    edit_requests(run_copy, lambda f: f.__setitem__("status", "done"))
    with pytest.raises(InputError, match="status='done': must be one of finished"):
        read_parquet(run_copy / "requests.parquet")
    iterations = pd.read_parquet(run_copy / "iterations.parquet")
    iterations["num_seqs"] = iterations["num_seqs"] + 0.5
    iterations.to_parquet(run_copy / "iterations.parquet", index=False)
    with pytest.raises(InputError, match=r"num_seqs=1.5: must be an integer \(row 0\)"):
        read_parquet(run_copy / "iterations.parquet")


def test_a_named_pipe_is_refused_not_read(tmp_path):
    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        read_json(fifo)
    with pytest.raises(InputError, match="file not found"):
        read_json(tmp_path / "absent.json")


def test_aggregated_tables_hold_numbers_where_they_hold_metrics(tmp_path):
    path = tmp_path / "results.parquet"
    table = pd.DataFrame({"workload.arrivals.qps": ["2", "4"], "seed": [0, 0],
                          "tbt_p99_s": [0.01, np.nan], "slo_attainment": [None, None],
                          "tbt_p99_s_lo": [None, None]})
    check_table(table, path)  # a varied field may be anything; a metric may be missing
    with pytest.raises(InputError, match="tbt_p99_s='x': must be a number"):
        check_table(table.assign(tbt_p99_s="x"), path)
    with pytest.raises(InputError, match="requests_per_s=inf: must be a finite number"):
        check_table(table.assign(requests_per_s=[1.0, np.inf]), path)
    with pytest.raises(InputError, match="results.parquet: <rows>=0: no rows"):
        check_table(table.iloc[0:0], path)  # the sweep plot drew nothing, silently
    trials = tmp_path / "trials.csv"
    trials.write_text("seed,rate,qps,ok\n0,1.0,nan,True\n")
    with pytest.raises(InputError, match="trials.csv: qps=nan: must be a finite number"):
        read_csv(trials, ["qps", "ok"])


def test_a_capacity_result_with_nan_is_refused(tmp_path, monkeypatch, capsys):
    cap = tmp_path / "cap"
    cap.mkdir()
    (cap / "capacity.json").write_text('{"scenario": "s", "capacity_qps": NaN}')
    # Was "Axis limits cannot be NaN or Inf" from matplotlib.
    for args in (("plot", str(cap), "--out", str(tmp_path / "p")),
                 ("report", str(cap), "--out", str(tmp_path / "r.html"))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, "capacity.json", "NaN is not a JSON number")


def test_names_pyarrow_cannot_take_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A trace or an output directory whose name holds bytes that are not UTF-8 (pyarrow
    reads and writes only UTF-8 names): one line naming it, before anything is written."""
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/dir\xff"))
    folder.mkdir()
    (folder / "t.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                                  "0.0,100,5\n0.5,120,6\n")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nworkload: {format: vidur, path: t.csv}\n"
                        "replica: {model: tiny}\n")
    shutil.copy(scenario, folder / "s.yaml")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(folder / "s.yaml"), "--out",
                        str(tmp_path / "r"))
    assert_one_line_error(code, err, "workload.path=", "not a UTF-8 file name")
    out = Path(os.fsdecode(bytes(tmp_path) + b"/out\xff"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario), "--out", str(out))
    assert_one_line_error(code, err, "--out=", "not a UTF-8 name")
    assert not out.exists()


def test_a_full_disk_while_writing_keeps_the_earlier_results(good_run, tmp_path):
    """Writing fails after the output directory was checked (the disk filled up): a one-line
    error naming it, and the earlier run there untouched."""
    import errno

    from sim.results.outdir import write_dir

    out = tmp_path / "r"
    shutil.copytree(good_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def fill_up(tmp: Path) -> None:
        (tmp / "requests.parquet").write_bytes(b"part")
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space "
                                    "left on device")

    with pytest.raises(InputError) as caught:
        write_dir(out, fill_up)
    assert caught.value.lines() == [f"{out}: --out='{out}': cannot write the results there: "
                                    "No space left on device; nothing was replaced"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["r"]  # no temporary left

    def bug(tmp: Path) -> None:
        raise OSError(errno.EBADF, "a fault of ours, not the place's")

    with pytest.raises(OSError, match="a fault of ours"):
        write_dir(out, bug)


def _with_file_size_limit(limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    """`python -m sim ARGS` where no file may grow past `limit_bytes` (the system's own limit,
    RLIMIT_FSIZE: a write past it fails with EFBIG, as one past a full disk fails with
    ENOSPC)."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "sim", *args], preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_write_the_system_refuses_is_one_line_and_keeps_what_was_there(good_run, tmp_path):
    """Files that cannot be written in full (here the system's file-size limit) while a run's
    results, plots or report are written: one line, exit 2, the earlier run unchanged."""
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    proc = _with_file_size_limit(300, "simulate", str(out / "scenario.yaml"), "--out", str(out))
    assert_one_line_error(proc.returncode, proc.stderr, "--out=",
                          "cannot write the results there: File too large; nothing was "
                          "replaced")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    for command in ("plot", "report"):
        proc = _with_file_size_limit(300, command, str(out))
        assert_one_line_error(proc.returncode, proc.stderr, "cannot write it: File too large")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
