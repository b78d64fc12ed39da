"""Bad trace files: one line naming the file and the field, never a hang on a named pipe, a
traceback, or a file read as something it does not say (a column named twice, hexadecimal
counts, JSON a strict reader refuses)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload
from tests.helpers import assert_one_line_error, run_cli, within

VIDUR_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


def workload(spec: dict):
    return load_workload(parse_scenario({"seed": 0, "workload": spec}, "test"))


def refused(spec: dict, *needles: str) -> InputError:
    """Loading `spec` raises one InputError whose line holds each needle."""
    with pytest.raises(InputError) as info:
        workload(spec)
    assert len(info.value.lines()) == 1, info.value.lines()
    for needle in needles:
        assert needle in info.value.one_line(), (needle, info.value.one_line())
    return info.value


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the file itself -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["vidur", "mooncake"])
def test_a_special_path_with_where_is_refused_before_it_is_opened(tmp_path, fmt):
    # `where:` reads the CSV header before the rows: the file must be checked before that too.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = {fifo: "not a regular file", tmp_path: "is a directory",
             Path("/dev/zero"): "not a regular file", tmp_path / "missing": "file not found"}
    for path, problem in cases.items():
        with within(5):
            refused({"format": fmt, "path": str(path), "where": "x > 0"},
                    "workload.path", problem)


def test_a_fifo_as_a_lengths_file_is_named_as_such(tmp_path):
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    with within(5):
        refused({"format": "synthetic", "num_requests": 3, "arrivals": {"qps": 1},
                 "lengths": {"file": str(fifo)}}, "workload.lengths.file", "not a regular file")


@pytest.mark.parametrize("header,spec", [
    ("arrived_at,num_prefill_tokens,num_decode_tokens,num_prefill_tokens",
     {"format": "vidur"}),
    ("num_prefill_tokens,arrived_at,num_prefill_tokens,num_decode_tokens",
     {"format": "vidur"}),
    ("arrived_at,num_prefill_tokens,num_decode_tokens,x,x",  # a column only `where` reads
     {"format": "vidur", "where": "x > 0"}),
    ("num_prefill_tokens,num_decode_tokens,num_decode_tokens",
     {"format": "synthetic", "num_requests": 3, "arrivals": {"qps": 1}}),
])
def test_a_column_named_twice_is_refused(tmp_path, header, spec):
    fields = header.split(",")
    trace = write(tmp_path, "t.csv", header + "\n" + ",".join("1" for _ in fields) + "\n")
    if spec["format"] == "synthetic":
        spec = {**spec, "lengths": {"file": str(trace)}}
    else:
        spec = {**spec, "path": str(trace)}
    repeated = next(name for name in fields if fields.count(name) > 1)
    refused(spec, str(trace), f"column {repeated!r}", "named 2 times on line 1")


def test_a_column_named_twice_that_is_not_read_is_no_matter(tmp_path):
    trace = write(tmp_path, "t.csv", VIDUR_HEADER.strip() + ",note,note\n0,5,2,a,b\n")
    assert len(workload({"format": "vidur", "path": str(trace)})) == 1


def test_a_hexadecimal_count_is_refused_not_read_as_16(tmp_path):
    # pyarrow reads 0x10 as the integer 16.
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "0,5,2\n1,0x10,2\n")
    refused({"format": "vidur", "path": str(trace)}, "num_prefill_tokens (line 3)", "'0x10'",
            "not a decimal number")
    # `0x` in a column of text is text: the counts are still read.
    trace = write(tmp_path, "n.csv", VIDUR_HEADER.strip() + ",id\n0,5,2,0xab\n1,16,2,0x01\n")
    assert workload({"format": "vidur", "path": str(trace)}).num_prompt_tokens.tolist() == [5, 16]


# -- JSON lines: strict JSON, numbers as numbers ----------------------------------------------

MOONCAKE = {"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}


@pytest.mark.parametrize("line,needles", [
    ('{"timestamp": 1, "input_length": 5, "input_length": 900, "output_length": 2, '
     '"hash_ids": [1]}', ["line 2=", "input_length=5, then 900: given twice"]),
    ('{"timestamp": ' + "1" * 400 + ', "input_length": 5, "output_length": 2, "hash_ids": []}',
     ["line 2=", "an integer of 400 digits"]),
    ('{"x": ' + "[" * 50_000 + "]" * 50_000 + "}", ["line 2=", "nested too deeply"]),
    ('{"timestamp": 1, "input_length": NaN, "output_length": 2, "hash_ids": []}',
     ["line 2=", "NaN is not a JSON number"]),
    ('{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": [}',
     ["line 2=", "not JSON (Expecting value at column"]),
])
def test_jsonl_values_that_would_mean_something_else_are_refused(tmp_path, line, needles):
    trace = write(tmp_path, "m.jsonl", json.dumps(MOONCAKE) + "\n" + line + "\n")
    refused({"format": "mooncake", "path": str(trace)}, str(trace), *needles)


def test_a_bad_trace_is_one_line_on_the_command_line(tmp_path, monkeypatch, capsys):
    trace = write(tmp_path, "t.csv", VIDUR_HEADER.strip() + ",num_decode_tokens\n0,5,2,3\n")
    scenario = write(tmp_path, "s.yaml", f"workload: {{format: vidur, path: {trace}}}\n"
                     "replica: {latency: {kind: constant, iteration_s: 0.01}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario),
                        "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, str(trace), "column 'num_decode_tokens'", "named 2 times")
