"""The shared rules for reading a user's file (`sim.config.input_file`): regular files only,
bounded, strict JSON; and the other readers that share them: a communication table, a model's
config.json and the GEMM calibration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.latency.comm
from sim.config.errors import InputError
from sim.config.input_file import (
    FileProblem,
    _loads_checking_each_number,
    check_regular,
    loads,
    read_bytes,
    read_json_file,
)
from sim.hardware.hf_config import read_config
from sim.latency.comm import read_table
from sim.latency.gemm import load_calibration
from tests.hardware.test_models import _config


@pytest.mark.parametrize(("text", "problem"), [
    ('{"a": 1, "a": 2}', "a=1, then 2: given twice"),
    ("[1e400]", "too large for a float"),
    ('{"x": NaN}', "NaN is not a JSON number"),
    ("-" + "1" * 31, "an integer of 31 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("{", "not JSON (Expecting property name"),
])
def test_json_that_would_mean_something_else_is_refused(text, problem):
    with pytest.raises(FileProblem, match=problem.replace("(", r"\(")):
        loads(text)


def test_plain_json_is_read_as_json_reads_it():
    text = '{"a": [1, 2.5, -3e-7, "x", null, true], "b": {"c": 123456789012345678901234567890}}'
    assert loads(text) == {"a": [1, 2.5, -3e-7, "x", None, True],
                           "b": {"c": 123456789012345678901234567890}}


# Numbers on both sides of every bound the strict reader keeps: 30 and 31 digits, floats near
# 1e30 and past the largest double, as literals (the text is what is parsed).
NUMBER_TEXT = st.one_of(
    st.integers(-(10**32), 10**32).map(str),
    st.sampled_from(["9" * 30, "-" + "9" * 30, "1" + "0" * 30, "-1" + "0" * 30, "1e29",
                     "9.99e29", "1e30", "-1e30", "1e308", "2e308", "-1e999", "1e-400", "-0.0",
                     "0", "5e-324"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr))
JSON_TEXT = st.recursive(
    st.one_of(NUMBER_TEXT, st.sampled_from(['"x"', "true", "null", '"7"'])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(st.tuples(st.sampled_from("abc"), inner), max_size=4).map(
            lambda pairs: "{" + ", ".join(f'"{k}": {v}' for k, v in pairs) + "}")),
    max_leaves=12)


@settings(max_examples=600, deadline=None)
@given(JSON_TEXT)
def test_numbers_checked_in_bulk_read_as_when_checked_one_by_one(text):
    """`loads` parses numbers in C and checks them after; whatever it returns or refuses is
    what the parse that checks each number returns or refuses (keys given twice included)."""
    def outcome(parse):
        try:
            return "value", parse(text)
        except FileProblem as exc:
            return "problem", str(exc)

    assert outcome(loads) == outcome(_loads_checking_each_number)


def test_only_a_regular_file_is_opened(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    cases = {fifo: "not a regular file", tmp_path: "is a directory",
             tmp_path / "missing": "file not found",
             tmp_path / ("x" * 300): "cannot read it: File name too long",
             tmp_path / "a\0b": "not a file name: it holds a NUL character"}
    for path, problem in cases.items():
        with pytest.raises(FileProblem, match=problem):
            read_bytes(path, 100)
        with pytest.raises(InputError, match=f"trace.yaml: workload.trace=.*: {problem}"):
            check_regular(path, "trace.yaml", "workload.trace")


def test_a_file_past_its_bound_is_refused_and_the_error_names_it(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"a": 1}')
    assert read_json_file(path, None, "<file>", max_bytes=8) == {"a": 1}
    with pytest.raises(InputError, match=r"p.json: <file>=.*too large \(more than 7 bytes"):
        read_json_file(path, None, "<file>", max_bytes=7)


def test_an_error_naming_a_path_with_a_newline_stays_one_line():
    error = InputError("/tmp/new\nline.yaml", "seed", 1, "a problem")
    assert error.lines() == ["'/tmp/new\\nline.yaml': seed=1: a problem"]
    assert InputError("plain.yaml", "seed", 1, "p").lines() == ["plain.yaml: seed=1: p"]


TABLE = ("time_stats.all_reduce.median,num_workers,size,devices_per_node\n"
         "0.02,2,2048,8\n0.03,2,1048576,8\n")


def test_a_communication_table_is_read_bounded(tmp_path, monkeypatch):
    table = tmp_path / "ar.csv"
    table.write_text(TABLE)
    assert read_table(table, "all_reduce", 2, "f").sizes_bytes.tolist() == [2048, 1048576]
    monkeypatch.setattr(sim.latency.comm, "MAX_TABLE_BYTES", len(TABLE) - 1)
    with pytest.raises(InputError, match=r"ar.csv: f=.*: too large \(more than"):
        read_table(table, "all_reduce", 2, "f")
    with pytest.raises(InputError, match=r"nothing.csv: f=.*: file not found"):
        read_table(tmp_path / "nothing.csv", "all_reduce", 2, "f")


@pytest.mark.parametrize("text,problem", [
    (json.dumps(_config(rms_norm_eps=1.0))[:-1] + ', "rope_theta": NaN}',
     "not JSON (NaN is not a JSON number)"),
    (json.dumps(_config(rms_norm_eps=1.0))[:-1] + ', "rope_theta": 1e999}',
     "the number 1e999 is too large for a float"),
])
def test_a_config_json_is_read_strictly(tmp_path, text, problem):
    # json.loads took NaN and 1e999 (inf) for numbers: a model read with them ran.
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_config(path)
    assert str(info.value) == f"{path.resolve()}: {problem}"


def test_a_calibration_with_nan_is_not_usable(tmp_path: Path) -> None:
    from sim.latency.gemm import CALIBRATION_PATH

    text = CALIBRATION_PATH.read_text()
    launch = json.loads(text)["gpus"]["h100-sxm"]["params"]["launch_s"]
    bad = tmp_path / "gemm.json"
    bad.write_text(text.replace(f'"launch_s": {json.dumps(launch)}', '"launch_s": NaN', 1))
    assert bad.read_text() != text
    with pytest.raises(RuntimeError, match="gemm.json: not a usable GEMM calibration.*NaN"):
        load_calibration(bad)
