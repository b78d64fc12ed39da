"""The BurstGPT format and `workload.where`, on a small BurstGPT-format file written here (the
real trace is a 1.4-million-row release asset, not in ../shared/traces)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import sim.workloads.burstgpt  # noqa: F401  # registers the format
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload
from tests.helpers import assert_one_line_error, run_cli, run_cli_out

HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
# (Timestamp, Model, Request tokens, Response tokens, Log Type); line = index + 2.
ROWS = [
    (5.0, "ChatGPT", 472, 18, "Conversation log"),
    (7.5, "GPT-4", 300, 0, "API log"),  # a failed request
    (45.0, "ChatGPT", 1087, 230, "Conversation log"),
    (118.25, "GPT-4", 417, 276, "Conversation log"),
    (120.0, "ChatGPT", 90, 0, "API log"),  # failed
    (121.0, "ChatGPT", 64, 12, "API log"),
]
CHATGPT_OK = "Model == 'ChatGPT' and `Response tokens` > 0"


def write_trace(tmp_path, rows=ROWS, name="burst.csv"):
    lines = [f"{t},{m},{p},{o},{p + o if isinstance(p, int) and isinstance(o, int) else ''},{k}"
             for t, m, p, o, k in rows]
    path = tmp_path / name
    path.write_text(HEADER + "".join(line + "\n" for line in lines))
    return path


def workload(spec: dict):
    return load_workload(parse_scenario({"workload": spec}, "test"))


def simulate(tmp_path, monkeypatch, capsys, path, extra: str = "", run=run_cli):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"workload: {{format: burstgpt, path: {path}{extra}}}\n"
                        "replica: {latency: {kind: constant, iteration_s: 0.01}}\n")
    return run(monkeypatch, capsys, "simulate", str(scenario), "--out", str(tmp_path / "o"))


def test_rows_chosen_by_where_with_times_from_the_first_kept_row(tmp_path):
    w = workload({"format": "burstgpt", "path": str(write_trace(tmp_path)), "where": CHATGPT_OK})
    assert w.arrival_s.tolist() == [0.0, 40.0, 116.0]
    assert w.num_prompt_tokens.tolist() == [472, 1087, 64]
    assert w.num_output_tokens.tolist() == [18, 230, 12]
    gpt4 = workload({"format": "burstgpt", "path": str(write_trace(tmp_path)),
                     "where": "Model == 'GPT-4' and `Response tokens` > 0"})
    assert gpt4.arrival_s.tolist() == [0.0] and gpt4.num_prompt_tokens.tolist() == [417]
    api = workload({"format": "burstgpt", "path": str(write_trace(tmp_path)),
                    "where": "`Log Type` == 'API log' and `Response tokens` > 0"})
    assert api.num_output_tokens.tolist() == [12]


def test_the_simulator_runs_the_chosen_rows(tmp_path, monkeypatch, capsys):
    path = write_trace(tmp_path)
    code, out = simulate(tmp_path, monkeypatch, capsys, path, f', where: "{CHATGPT_OK}"',
                         run=run_cli_out)
    assert code == 0, out
    requests = pd.read_parquet(tmp_path / "o" / "requests.parquet")
    assert len(requests) == 3
    assert sorted(requests["num_prompt_tokens"].tolist()) == [64, 472, 1087]


def test_failed_requests_without_a_filter_point_to_where(tmp_path, monkeypatch, capsys):
    path = write_trace(tmp_path)
    code, err = simulate(tmp_path, monkeypatch, capsys, path)
    assert_one_line_error(code, err, str(path), "Response tokens (line 3)=0", "failed request",
                          "`Response tokens` > 0")


@pytest.mark.parametrize("condition,needles", [
    ("Model ==", ["not a pandas expression"]),
    ("Modle == 'ChatGPT'", ["no column", "Modle", "the file's columns are", "'Log Type'"]),
    ("`Request tokens` + 1", ["must be a condition"]),
    ("Model == 'Claude'", ["selects none of the 6 rows"]),
])
def test_bad_conditions_are_one_line_naming_file_field_and_expression(
        tmp_path, monkeypatch, capsys, condition, needles):
    path = write_trace(tmp_path)
    code, err = simulate(tmp_path, monkeypatch, capsys, path, f', where: "{condition}"')
    assert_one_line_error(code, err, str(path), f"workload.where={condition!r}", *needles)


@pytest.mark.parametrize("bad,needles", [
    ((130.0, "ChatGPT", -5, 7, "API log"), ["Request tokens (line 8)=-5", "positive integer"]),
    ((130.0, "ChatGPT", "", 7, "API log"), ["Request tokens (line 8)=nan", "positive integer"]),
    ((130.0, "ChatGPT", "many", 7, "API log"), ["Request tokens (line 8)='many'"]),
    ((130.0, "ChatGPT", 5, 2.5, "API log"), ["Response tokens (line 8)=2.5"]),
    ((3.0, "ChatGPT", 5, 7, "API log"), ["Timestamp (line 8)=3", "must not decrease"]),
])
def test_bad_rows_kept_by_the_filter_name_their_line_and_column(tmp_path, monkeypatch, capsys,
                                                                bad, needles):
    path = write_trace(tmp_path, [*ROWS, bad])
    code, err = simulate(tmp_path, monkeypatch, capsys, path, f', where: "{CHATGPT_OK}"')
    assert_one_line_error(code, err, str(path), *needles)


def test_lines_are_counted_past_empty_lines(tmp_path, monkeypatch, capsys):
    # The CSV reader skips empty lines: the error still names the bad value's line in the file.
    path = write_trace(tmp_path, [*ROWS, (130.0, "ChatGPT", "many", 7, "API log")])
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3] + ["\n", "\r\n"] + lines[3:]))  # after data line 2
    code, err = simulate(tmp_path, monkeypatch, capsys, path, f', where: "{CHATGPT_OK}"')
    assert_one_line_error(code, err, str(path), "Request tokens (line 10)='many'")


def test_bad_rows_the_filter_drops_are_not_read(tmp_path):
    path = write_trace(tmp_path, [*ROWS, (130.0, "Llama", "many", -1, "API log")])
    w = workload({"format": "burstgpt", "path": str(path), "where": CHATGPT_OK})
    assert len(w) == 3


def test_a_file_missing_a_column(tmp_path, monkeypatch, capsys):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens\n1,ChatGPT,5\n")
    code, err = simulate(tmp_path, monkeypatch, capsys, path)
    assert_one_line_error(code, err, str(path), "column 'Response tokens'", "missing")


def test_where_works_alike_for_the_other_csv_formats(tmp_path):
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                     "2023-11-16 18:17:03.9799600,100,5\r\n"
                     "2023-11-16 18:17:04.0000000,9000,6\r\n"
                     "2023-11-16 18:17:05.5000000,200,7")
    w = workload({"format": "azure", "path": str(azure), "where": "ContextTokens < 8000"})
    assert w.num_prompt_tokens.tolist() == [100, 200]
    assert np.allclose(w.arrival_s, [0.0, 1.52004])
    lengths = tmp_path / "l.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens,pd_ratio\n10,2,5\n30,3,10\n")
    w = workload({"format": "lengths", "path": str(lengths), "arrivals": {"qps": 1},
                  "where": "pd_ratio > 6"})
    assert w.num_prompt_tokens.tolist() == [30]
    w = workload({"format": "csv", "path": str(lengths), "arrivals": {"qps": 1},
                  "columns": {"prompt_tokens": "num_prefill_tokens",
                              "output_tokens": "num_decode_tokens"},
                  "where": "num_decode_tokens == 2"})
    assert w.num_prompt_tokens.tolist() == [10]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 0, "p": 5, "o": 1, "kind": "chat"}\n'
                     '{"t": 2000, "p": 6, "o": 2, "kind": "code"}\n'
                     '{"t": 3500, "p": 7, "o": 3, "kind": "chat"}\n')
    w = workload({"format": "jsonl", "path": str(jsonl), "time_unit": "ms",
                  "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"},
                  "where": "kind == 'chat'"})
    assert w.arrival_s.tolist() == [0.0, 3.5] and w.num_prompt_tokens.tolist() == [5, 7]


def test_lines_are_counted_past_a_quoted_line_break(tmp_path, monkeypatch, capsys):
    # A quoted field holding a line break makes one row of two lines: the bad value's row
    # starts a line later than a row count says (issue 49: line 4 was named for the fifth).
    rows = [*ROWS, (130.0, "ChatGPT", "many", 7, "API log")]
    path = write_trace(tmp_path, rows)
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace("Conversation log", '"Conversation\nlog"')  # data row 0
    path.write_text("".join(lines))
    code, err = simulate(tmp_path, monkeypatch, capsys, path, f', where: "{CHATGPT_OK}"')
    assert_one_line_error(code, err, str(path), "Request tokens (line 9)='many'")
