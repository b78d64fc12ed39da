"""The shared rules for reading a user's file: regular files only, bounded, strict JSON."""

import os

import pytest

from sim.errors import InputError
from sim.input_file import FileProblem, check_regular, loads, read_bytes, read_json_file


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


def test_only_a_regular_file_is_opened(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    cases = {fifo: "not a regular file", tmp_path: "is a directory",
             tmp_path / "missing": "file not found",
             tmp_path / ("x" * 300): "cannot read it: File name too long"}
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
