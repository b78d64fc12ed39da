"""CSV traces without pandas: their columns are read from pyarrow's buffers
(`sim.workloads.table`) into the values pandas' conversion gave, so a run of a CSV trace imports
no pandas (about 0.45 s a process) and its results are those of the DataFrame path it replaced.
The expectations here are computed the old way, with pandas."""

from __future__ import annotations

import datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pytest

import sim.workloads.azure as azure
from sim.config.scenario import parse_scenario
from sim.workloads import Workload
from sim.workloads.load import load_workload
from sim.workloads.table import numpy_column, seconds_since_first
from tests.helpers import cli_code as cli
from tests.helpers import imported_by, run_cli_out

NOT_FOR_CSV_TRACES = ("pandas", "matplotlib", "scipy")
FAST = "replica: {latency: {kind: constant, iteration_s: 0.01}}\n"


def _old_seconds(values: pd.Series) -> np.ndarray:
    """Arrival seconds as `base._datetimes` computed them from a DataFrame column."""
    times = pd.to_datetime(values, format="ISO8601", errors="coerce", utc=True)
    return (times - times.iloc[0]).dt.total_seconds().to_numpy()


def _bits(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=np.float64).tobytes()  # -0.0 differs from 0.0


def _write_zoned(path, num_rows: int = 300) -> None:
    """Azure 2024's layout: microseconds and `+00:00`; offsets change halfway (as at daylight
    saving), which must be no jump."""
    start = datetime.datetime(2024, 5, 10, 23, 59, 58, 999_999, tzinfo=datetime.UTC)
    rng = np.random.default_rng(3)
    rows = []
    for i, gap_us in enumerate(np.cumsum(rng.integers(1, 2_000_000, num_rows))):
        zone = datetime.timezone(datetime.timedelta(hours=2 if i > num_rows // 2 else 0))
        stamp = (start + datetime.timedelta(microseconds=int(gap_us))).astimezone(zone)
        rows.append(f"{stamp.isoformat(sep=' ')},{100 + i},{1 + i % 50}\n")
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(rows))


def _write_lengths(path, num_rows: int = 50) -> None:
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n" + "".join(
        f"{100 + 7 * i},{5 + i},{105 + 8 * i},{(100 + 7 * i) / (5 + i)}\n"
        for i in range(num_rows)))


def _scenarios(tmp_path) -> dict[str, str]:
    """Scenario files of each CSV format, without `where:`."""
    vidur = tmp_path / "vidur.csv"
    vidur.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{0.25 * i},{64 + i},{1 + i % 9}\n" for i in range(40)))
    lengths = tmp_path / "lengths.csv"
    _write_lengths(lengths)
    zoned = tmp_path / "azure_2024.csv"
    _write_zoned(zoned)
    burst = tmp_path / "burst.csv"
    # `0x` in the file: its integer columns are read again as text, for hexadecimal numbers.
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5.0,ChatGPT-0x1,472,18,490,Conversation log\n"
                     "45.5,GPT-4,1087,230,1317,API log\n")
    specs = {
        "vidur": f"{{format: vidur, path: {vidur}}}",
        "lengths_file": f"{{format: synthetic, num_requests: 30, arrivals: {{qps: 5}}, "
                        f"lengths: {{file: {lengths}}}}}",
        "lengths": f"{{format: lengths, path: {lengths}, arrivals: {{qps: 5}}}}",
        "azure_2024": f"{{format: azure, path: {zoned}}}",
        "burstgpt": f"{{format: burstgpt, path: {burst}}}",
        "csv_datetime": f"{{format: csv, path: {zoned}, time_unit: datetime, columns: "
                        "{arrival: TIMESTAMP, prompt_tokens: ContextTokens, "
                        "output_tokens: GeneratedTokens}}",
    }
    paths = {}
    for name, spec in specs.items():
        paths[name] = str(tmp_path / f"{name}.yaml")
        (tmp_path / f"{name}.yaml").write_text(f"workload: {spec}\n{FAST}")
    return paths


def test_the_shipped_azure_scenario_imports_no_pandas(traces, tmp_path):
    run = cli("simulate", "scenarios/azure_conv_chunked_prefill.yaml", "--set", "horizon_s=5",
              "--out", str(tmp_path / "run"))
    assert imported_by(run, NOT_FOR_CSV_TRACES) == []
    assert (tmp_path / "run" / "requests.parquet").is_file()


@pytest.mark.parametrize("name", ["vidur", "lengths_file", "lengths", "azure_2024", "burstgpt",
                                  "csv_datetime"])
def test_csv_trace_formats_import_no_pandas(name, tmp_path):
    scenario = _scenarios(tmp_path)[name]
    run = cli("simulate", scenario, "--out", str(tmp_path / "run"))
    assert imported_by(run, NOT_FOR_CSV_TRACES) == []
    assert (tmp_path / "run" / "requests.parquet").is_file()


def test_a_cached_trace_is_read_back_without_pandas(tmp_path):
    """The parsed-trace cache writes and reads parquet (timestamp[ns, tz=UTC] here)."""
    scenario = _scenarios(tmp_path)["azure_2024"]
    every_size = "import sim.workloads.cache as cache\ncache.MIN_CACHED_BYTES = 0\n"
    for out in ("miss", "hit"):
        run = every_size + cli("simulate", scenario, "--out", str(tmp_path / out))
        assert imported_by(run, NOT_FOR_CSV_TRACES) == []
    assert (tmp_path / "miss" / "requests.parquet").read_bytes() == \
        (tmp_path / "hit" / "requests.parquet").read_bytes()


def _arrow_columns() -> dict[str, pa.ChunkedArray]:
    """Columns of each type read from buffers: several chunks, some sliced (a non-zero
    offset), with values at the edges of their types."""
    rng = np.random.default_rng(0)
    ints = rng.integers(-(2**62), 2**62, 37).tolist() + [2**63 - 1, -(2**63), 0]
    floats = rng.normal(0, 1e6, 37).tolist() + [np.inf, -np.inf, -0.0, np.nan, 5e-324]
    bools = rng.integers(0, 2, 45).astype(bool).tolist()

    def chunked(values: list, kind: pa.DataType) -> pa.ChunkedArray:
        whole = pa.array(values, kind)
        return pa.chunked_array([whole.slice(0, 11), whole.slice(11, 2), whole.slice(13)])

    columns = {"int64": chunked(ints, pa.int64()), "double": chunked(floats, pa.float64()),
               "bool": chunked(bools, pa.bool_()), "bool_sliced": pa.chunked_array(
                   [pa.array(bools, pa.bool_()).slice(5, 30)])}
    ticks = np.cumsum(rng.integers(0, 10**12, 40)) + 1_700_000_000 * 10**9
    for unit, per_s in (("s", 1), ("ms", 10**3), ("us", 10**6), ("ns", 10**9)):
        for tz in (None, "UTC"):
            values = (ticks // (10**9 // per_s)).tolist()
            columns[f"{unit}_{tz}"] = chunked(values, pa.timestamp(unit, tz))
    return columns


def test_numpy_columns_are_what_to_pandas_gives():
    for name, arrow in _arrow_columns().items():
        values = numpy_column(arrow)
        expected = pa.table({name: arrow}).to_pandas()[name]  # as the DataFrame path had it
        assert values is not None, name
        if values.dtype.kind == "M":
            assert np.datetime_data(values.dtype)[0] == expected.dt.unit, name
            assert np.array_equal(values.view(np.int64), expected.astype("int64").to_numpy())
        else:
            assert values.dtype == expected.dtype, name
            assert values.tobytes() == expected.to_numpy().tobytes(), name


@pytest.mark.parametrize("column", [
    pa.chunked_array([pa.array([1, None, 3], pa.int64())]),
    pa.chunked_array([pa.array([1.5, None], pa.float64())]),
    pa.chunked_array([pa.array([True, None], pa.bool_())]),
    pa.chunked_array([pa.array([0, None], pa.timestamp("ns"))]),
    pa.chunked_array([pa.array(["7", "x"])]),
    pa.chunked_array([pa.array([7, 8], pa.int32())]),
    pa.chunked_array([pa.array([0, 1], pa.date32())]),
], ids=["int_null", "float_null", "bool_null", "time_null", "text", "int32", "date"])
def test_other_columns_are_left_to_pandas(column):
    """Missing values and other types keep pandas' own conversion (NaN, objects, text)."""
    assert numpy_column(column) is None


def _check_seconds(values: pd.Series, times: np.ndarray) -> None:
    assert _bits(seconds_since_first(times)) == _bits(_old_seconds(values))


def test_seconds_are_pandas_total_seconds_bit_for_bit_on_the_azure_traces(traces):
    for name in ("code", "conv"):
        table = pcsv.read_csv(traces / "azure_llm_2023" / f"AzureLLMInferenceTrace_{name}.csv")
        assert str(table.schema.field("TIMESTAMP").type) == "timestamp[ns]"
        times = numpy_column(table.column("TIMESTAMP"))
        assert times is not None
        _check_seconds(table.column("TIMESTAMP").to_pandas(), times)


def test_seconds_of_zoned_times_and_long_spans_are_pandas_bit_for_bit(tmp_path):
    zoned = tmp_path / "zoned.csv"
    _write_zoned(zoned)
    table = pcsv.read_csv(zoned)
    assert table.schema.field("TIMESTAMP").type.tz == "UTC"
    _check_seconds(table.to_pandas()["TIMESTAMP"], numpy_column(table.column("TIMESTAMP")))
    # Spans past 2**53 ticks, where pandas nudges a sum that rounded onto a whole second.
    rng = np.random.default_rng(1)
    for unit in ("s", "ms", "us", "ns"):
        for tz in (None, "UTC"):
            ticks = np.sort(rng.integers(0, 2**62, 2000)) - 2**61
            ticks[1:50] = ticks[0] + 2**53 + rng.integers(-(10**9), 10**9, 49)
            arrow = pa.chunked_array([pa.array(np.sort(ticks), pa.timestamp(unit, tz))])
            _check_seconds(arrow.to_pandas(), numpy_column(arrow))


def test_a_span_past_int64_ticks_is_left_to_pandas():
    times = np.array([-(2**62), 2**62], dtype=np.int64).view("datetime64[ns]")
    assert seconds_since_first(times) is None


def _old_workload(path) -> Workload:
    """The Azure format's columns as the DataFrame path made them."""
    df = pcsv.read_csv(path).to_pandas()
    return Workload(_old_seconds(df["TIMESTAMP"]),
                    *(pd.to_numeric(df[name]).to_numpy(dtype=np.float64).astype(np.int64)
                      for name in ("ContextTokens", "GeneratedTokens")))


def test_a_trace_run_is_the_dataframe_path_run(traces, tmp_path, monkeypatch, capsys):
    path = traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    workload = load_workload(parse_scenario({"workload": {"format": "azure", "path": str(path)}},
                                            "test"))
    old = _old_workload(path)
    assert _bits(workload.arrival_s) == _bits(old.arrival_s)
    assert workload.num_prompt_tokens.dtype == old.num_prompt_tokens.dtype == np.int64
    assert np.array_equal(workload.num_prompt_tokens, old.num_prompt_tokens)
    assert np.array_equal(workload.num_output_tokens, old.num_output_tokens)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"workload: {{format: azure, path: {path}}}\n")
    for out in ("new", "old"):
        if out == "old":
            monkeypatch.setattr(azure.Azure, "load", lambda self, *_: _old_workload(path))
        code, _ = run_cli_out(monkeypatch, capsys, "simulate", str(scenario), "--set",
                              "horizon_s=60", "--out", str(tmp_path / out))
        assert code == 0
    for name in ("requests.parquet", "iterations.parquet", "summary.json"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes()
