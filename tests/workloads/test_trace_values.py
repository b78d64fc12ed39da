"""Bad trace values: one line naming the file, the field with the row's line and the value,
never a traceback or a run on values that mean something else (a quoted JSON number, times with
and without a zone, dates read as numbers); and `where:` conditions nested too deeply, or that
would hang, write files or crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.workloads.test_trace_files import VIDUR_HEADER, refused, workload

GENERIC = {"format": "csv", "columns": {"arrival": "t", "prompt_tokens": "p",
                                        "output_tokens": "o"}}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


MOONCAKE = {"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}


@pytest.mark.parametrize("row,needles", [
    ({"input_length": "100"}, ["input_length (line 2)='100'", "a JSON number, not a string"]),
    ({"timestamp": "1"}, ["timestamp (line 2)='1'", "a JSON number, not a string"]),
    ({"output_length": True}, ["output_length (line 2)=True", "a number, not a boolean"]),
])
def test_jsonl_numbers_must_be_json_numbers(tmp_path, row, needles):
    # json reads "100" as text: pandas would have turned it into the number 100.
    lines = [MOONCAKE, {**MOONCAKE, **row}]
    trace = write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in lines))
    refused({"format": "mooncake", "path": str(trace)}, str(trace), *needles)


@pytest.mark.parametrize("fmt", ["mooncake", "jsonl"])
def test_a_column_quoted_on_every_line_is_refused_too(tmp_path, fmt):
    """pandas 3 types a column whose every value is quoted as text, not as an object column
    of mixed values: it was read as numbers (found by hand, 2026-11-23)."""
    lines = [{**MOONCAKE, "output_length": "5"}, {**MOONCAKE, "output_length": "7"}]
    trace = write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in lines))
    spec = {"format": fmt, "path": str(trace)}
    if fmt == "jsonl":
        spec |= {"columns": {"arrival": "timestamp", "prompt_tokens": "input_length",
                             "output_tokens": "output_length"}, "time_unit": "ms"}
    refused(spec, str(trace), "output_length (line 1)='5'", "a JSON number, not a string")


# -- where: ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["-" * 5000, "not " * 1500])
def test_a_where_nested_too_deeply_is_one_line(tmp_path, prefix):
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "0,5,2\n")
    refused({"format": "vidur", "path": str(trace), "where": prefix + "num_prefill_tokens > 0"},
            "workload.where", "nested too deeply")


@pytest.mark.parametrize("condition,problem", [
    # Python computes powers of literals exactly: each of these never returned (fuzzing,
    # 2026-11-24), or took 10 GB.
    ("9**9**9**9 > 1", "'**' takes a number of at most 64 as its exponent"),
    ("10**10**8 > 1", "'**' takes a number of at most 64 as its exponent"),
    ("num_prefill_tokens > 2**10000000", "'**' takes a number of at most 64"),
    ("num_prefill_tokens < 2 ** num_decode_tokens", "'**' takes a number of at most 64"),
    ("(2**64)**64 > 1", "'**' inside the operand of another '**'"),
    ("'a' * 10**10 == 'b'", "arithmetic on a string or list literal"),
    ("('a' + 'b') * 10**10 == 'b'", "arithmetic on a string or list literal"),
    ("'%0999999999d' % 1 == 'b'", "arithmetic on a string or list literal"),
    ("num_prefill_tokens in [5] * 10**9", "arithmetic on a string or list literal"),
    ("1 << 10**10 > 1", "'LShift' is not allowed in a row filter"),
    # Methods and `@` variables ran on the data or in servesim: they wrote files.
    ("num_prefill_tokens.repeat(10**9).sum() > 1", "only a named function can be called"),
    ("num_prefill_tokens.to_csv('written.csv') is None", "only a named function"),
    ("num_prefill_tokens.size > 0", "an attribute or method ('.name') is not allowed"),
    ("@path > 0", "'@path' is a Python variable, not a column"),
    ("num_prefill_tokens[0] > 0", "indexing ('[]') is not allowed"),
    ("lambda x: x", "a lambda is not allowed"),
    # Arithmetic errors and an unclosed bracket were tracebacks.
    ("num_prefill_tokens > 1e308**2", "cannot evaluate: (34, 'Numerical result out of range')"),
    ("num_prefill_tokens > 1/0", "cannot evaluate: division by zero"),
    ("num_prefill_tokens > 1 % 0", "cannot evaluate: integer modulo by zero"),
    ("(num_prefill_tokens > 0", "not a pandas expression: EOF in multi-line statement"),
])
def test_a_where_that_would_hang_write_or_crash_is_one_line(tmp_path, monkeypatch, condition,
                                                            problem):
    from tests.helpers import within

    monkeypatch.chdir(tmp_path)
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "0,5,2\n1,6,3\n")
    with within(60):  # a hang guard: a condition that hangs fails here
        refused({"format": "vidur", "path": str(trace), "where": condition},
                str(trace), f"workload.where={condition!r}", problem)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]  # nothing written


@pytest.mark.parametrize("condition,kept", [
    ("num_prefill_tokens > 2**2", [5, 6]),
    ("num_prefill_tokens ** 2 > 30", [6]),
    ("num_prefill_tokens ** -0.5 < 0.42", [6]),
    ("num_prefill_tokens < 2**64 and abs(num_decode_tokens) == 3", [6]),
    ("num_prefill_tokens in [5, 7] | `num_decode_tokens` > 5 * 0.5 + 1", [5]),
])
def test_a_where_of_columns_numbers_powers_and_functions_still_works(tmp_path, condition, kept):
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "0,5,2\n1,6,3\n")
    rows = workload({"format": "vidur", "path": str(trace), "where": condition})
    assert rows.num_prompt_tokens.tolist() == kept


def test_the_where_check_holds_without_pandas_private_preparser(tmp_path, monkeypatch):
    """The check reads an expression with pandas' own (private) preparser; a pandas that moved
    it still gets the check, with backticked names read as plain ones and '@' refused."""
    import pandas.core.computation.expr as expr

    monkeypatch.delattr(expr, "_preparse")
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "0,5,2\n1,6,3\n")
    for condition, problem in [("num_prefill_tokens > @x", "'@' (a Python variable)"),
                               ("9**9**9**9 > 1", "'**' takes a number"),
                               ("num_prefill_tokens.to_csv('f') is None", "only a named function")]:
        refused({"format": "vidur", "path": str(trace), "where": condition},
                str(trace), f"workload.where={condition!r}", problem)
    rows = workload({"format": "vidur", "path": str(trace),
                     "where": "`num_prefill_tokens` ** 2 > 30"})
    assert rows.num_prompt_tokens.tolist() == [6]


# -- times ------------------------------------------------------------------------------------

def dated(tmp_path, times: list[str], unit: str = "datetime") -> dict:
    rows = "".join(f"{t},5,2\n" for t in times)
    return {**GENERIC, "path": str(write(tmp_path, "g.csv", "t,p,o\n" + rows)),
            "time_unit": unit}


def test_times_with_and_without_a_zone_are_refused(tmp_path):
    spec = dated(tmp_path, ["2024-01-01T00:00:00", "2024-01-01T00:00:01",
                            "2024-01-01T00:00:02+01:00"])
    refused(spec, "t (line 4)='2024-01-01T00:00:02+01:00'",
            "a time zone on some times and not on others (line 2 has none)")


def test_times_whose_offset_changes_are_compared_in_utc(tmp_path):
    # Clocks go forward an hour: 01:59:59+00:00 and 03:00:01+01:00 are two seconds apart.
    spec = dated(tmp_path, ["2024-03-31T01:59:59+00:00", "2024-03-31T03:00:01+01:00"])
    assert workload(spec).arrival_s.tolist() == [0.0, 2.0]
    jsonl = write(tmp_path, "g.jsonl", '{"t": "2024-03-31T01:59:59+00:00", "p": 5, "o": 2}\n'
                                       '{"t": "2024-03-31T03:00:01+01:00", "p": 5, "o": 2}\n')
    spec = {**GENERIC, "format": "jsonl", "path": str(jsonl), "time_unit": "datetime"}
    assert workload(spec).arrival_s.tolist() == [0.0, 2.0]


def test_time_unit_must_match_the_column(tmp_path):
    # Dates read as numbers would count in pyarrow's unit for the column, not in seconds.
    refused(dated(tmp_path, ["2024-01-01T00:00:00", "2024-01-01T00:00:01"], unit="s"),
            "t (line 2)='2024-01-01 00:00:00'", "give time_unit: datetime")
    refused(dated(tmp_path, ["1700000000", "1700000001"]), "t (line 2)=1700000000",
            "not a date and time: give time_unit s, ms or us")
    jsonl = write(tmp_path, "g.jsonl", '{"t": "2024-01-01T00:00:00", "p": 5, "o": 2}\n'
                                       '{"t": 1700000000, "p": 5, "o": 2}\n')
    refused({**GENERIC, "format": "jsonl", "path": str(jsonl), "time_unit": "datetime"},
            "t (line 2)=1700000000", "not a time")


def test_equal_arrival_times_are_a_burst_not_an_error(tmp_path):
    trace = write(tmp_path, "t.csv", VIDUR_HEADER + "3,5,2\n3,6,2\n3,7,2\n")
    assert workload({"format": "vidur", "path": str(trace)}).arrival_s.tolist() == [0, 0, 0]
