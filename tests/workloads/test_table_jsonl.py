"""JSON-lines traces without pandas: columns are made from the parsed rows
(`sim.workloads.table.from_rows`) as the arrays pandas' `DataFrame.from_records` typed them, so a
Mooncake run imports no pandas (about 0.45 s a process) and reads the values the DataFrame path
read. The expectations here are computed the old way, with pandas."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sim.workloads.fields import seconds, token_counts
from sim.workloads.table import JsonRows, TraceTable, from_rows
from tests.helpers import cli_code as cli
from tests.helpers import imported_by
from tests.workloads.test_table_csv import NOT_FOR_CSV_TRACES

FAST = "replica: {latency: {kind: constant, iteration_s: 0.01}}\n"


def _rows(seed: int, num_rows: int = 40) -> list[dict]:
    """Rows whose columns hold each kind of JSON value, keys in varying orders, some missing."""
    rng = np.random.default_rng(seed)
    big = [2**63 - 1, -(2**63)]
    columns = {
        "ints": lambda i: int(rng.integers(-(2**40), 2**40)),
        "int_edges": lambda i: big[i % 2] if i < 2 else int(rng.integers(0, 9)),
        "past_int64": lambda i: 2**63 if i == 3 else int(rng.integers(0, 9)),
        "floats": lambda i: float(rng.normal(0, 1e6)),
        "mixed_numbers": lambda i: float(rng.random()) if i % 3 else int(rng.integers(0, 99)),
        "bools": lambda i: bool(rng.integers(0, 2)),
        "bool_and_int": lambda i: True if i == 5 else int(rng.integers(1, 9)),
        "text": lambda i: f"x{i}",
        "number_and_text": lambda i: "100" if i == 7 else int(rng.integers(1, 9)),
        "lists": lambda i: [int(v) for v in rng.integers(0, 99, int(rng.integers(0, 4)))],
        "nulls": lambda i: None if i == 2 else int(rng.integers(1, 9)),
        "objects": lambda i: {"a": i},
        "sometimes": lambda i: int(rng.integers(1, 9)),
    }
    rows = []
    for i in range(num_rows):
        names = list(columns)
        rng.shuffle(names)
        rows.append({name: columns[name](i) for name in names
                     if name != "sometimes" or i % 4})
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_json_columns_are_what_from_records_gives(seed):
    rows = _rows(seed)
    table = from_rows(rows, list(range(1, len(rows) + 1)))
    expected = pd.DataFrame.from_records(rows)
    assert list(table.columns) == list(expected.columns)
    typed = set()
    for name, values in table.columns.items():
        old = expected[name]
        if isinstance(values, np.ndarray) and values.dtype != object:
            typed.add(name)
            assert values.dtype == old.dtype, name
            assert values.tobytes() == old.to_numpy().tobytes(), name
        elif isinstance(values, np.ndarray):  # objects: pandas' Series of them for checks
            assert list(values) == list(old), name
        # Every column reads as pandas' Series, values and index (errors show these).
        assert table.series(name).equals(old), name
        for row in (0, len(rows) - 1):
            assert repr(table.value(name, row)) == repr(old.iloc[row]), name
    assert typed == {"ints", "int_edges", "floats", "mixed_numbers", "bools"}


def _old_table(rows: list[dict]) -> TraceTable:
    """The table as the DataFrame path made it: every column pandas' Series."""
    df = pd.DataFrame.from_records(rows)
    return TraceTable({name: df[name] for name in df.columns}, np.arange(len(df)),
                      JsonRows(rows), lines=list(range(1, len(rows) + 1)))


def test_the_mooncake_trace_reads_as_the_dataframe_path_read_it(traces):
    path = traces / "mooncake_fast25" / "conversation_trace.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    new, old = from_rows(rows, list(range(1, len(rows) + 1))), _old_table(rows)
    assert new.columns["hash_ids"].dtype == object  # lists, as objects
    assert seconds(new, "timestamp", "ms", path).tobytes() == \
        seconds(old, "timestamp", "ms", path).tobytes()
    for name in ("input_length", "output_length"):
        assert np.array_equal(token_counts(new, name, path), token_counts(old, name, path))


@pytest.mark.parametrize("row", [
    {"timestamp": 5, "input_length": "100", "output_length": 2, "hash_ids": []},
    {"timestamp": 5, "input_length": True, "output_length": 2, "hash_ids": []},
    {"timestamp": 5, "input_length": 7, "output_length": None, "hash_ids": []},
    {"timestamp": 5, "input_length": 7, "hash_ids": []},
    {"timestamp": "5", "input_length": 7, "output_length": 2, "hash_ids": []},
    {"timestamp": 5, "input_length": 7.5, "output_length": 2, "hash_ids": []},
], ids=["text", "boolean", "null", "missing", "text_time", "fraction"])
def test_bad_values_are_refused_as_the_dataframe_path_refused_them(row, tmp_path):
    rows = [{"timestamp": 1, "input_length": 3, "output_length": 4, "hash_ids": [1]}, row]
    path = tmp_path / "t.jsonl"
    for read in (seconds, token_counts):
        names = ["timestamp"] if read is seconds else ["input_length", "output_length"]
        for name in names:
            args = (name, "ms", path) if read is seconds else (name, path)
            errors = []
            for table in (from_rows(rows, [1, 2]), _old_table(rows)):
                try:
                    read(table, *args)
                    errors.append(None)
                except Exception as exc:  # noqa: BLE001 - the two paths' outcomes compared
                    errors.append(f"{type(exc).__name__}: {exc}")
            assert errors[0] == errors[1], (name, errors)


def test_a_mooncake_run_imports_no_pandas(tmp_path):
    run = cli("simulate", "scenarios/mooncake_conversation.yaml", "--set", "horizon_s=5",
              "--out", str(tmp_path / "run"))
    assert imported_by(run, NOT_FOR_CSV_TRACES) == []
    assert (tmp_path / "run" / "requests.parquet").is_file()


@pytest.mark.parametrize(("where", "with_pandas"), [(None, False), ("p > 20", True)],
                         ids=["plain", "where"])
def test_a_generic_jsonl_run_imports_pandas_only_for_where(tmp_path, where, with_pandas):
    """A `where:` condition is evaluated by pandas: there the probe sees it (it can fail)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": 0.5 * i, "p": 10 + i, "o": 1 + i % 5}) + "\n"
                             for i in range(30)))
    condition = f", where: '{where}'" if where else ""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"workload: {{format: jsonl, path: {trace}, time_unit: s{condition}, "
                        f"columns: {{arrival: t, prompt_tokens: p, output_tokens: o}}}}\n{FAST}")
    run = cli("simulate", str(scenario), "--out", str(tmp_path / "run"))
    assert imported_by(run, NOT_FOR_CSV_TRACES) == (["pandas"] if with_pandas else [])
    assert (tmp_path / "run" / "requests.parquet").is_file()
