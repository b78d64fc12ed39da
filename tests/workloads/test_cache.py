"""The parsed-trace cache: a CSV is parsed once per content, entries are whole or absent."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import sim.workloads.cache as cache
from sim.config.errors import InputError
from sim.config.file_hash import _sha256
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure_2024(num_rows: int) -> str:
    """An Azure-2024-format trace (microseconds, `+00:00`), one request every 0.25 s."""
    rows = []
    for i in range(num_rows):
        minutes, seconds = divmod(i / 4, 60)
        rows.append(f"2024-05-10 {int(minutes // 60):02d}:{int(minutes % 60):02d}:{seconds:09.6f}"
                    f"+00:00,{100 + i % 900},{1 + i % 50}")
    return HEADER + "\n".join(rows) + "\n"


def load(path, **extra):
    return load_workload(parse_scenario(
        {"workload": {"format": "azure", "path": str(path), **extra}}, "test"))


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """Cache every file in tmp_path/cache; count the CSV parses."""
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "MIN_CACHED_BYTES", 0)
    parses = []
    parse = cache._parse_csv

    def counted(*args):
        parses.append(args[0])
        return parse(*args)

    monkeypatch.setattr(cache, "_parse_csv", counted)
    return parses


def entries(tmp_path) -> list[str]:
    folder = tmp_path / "cache" / "traces"
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_a_second_load_reads_the_cache(tmp_path, cached):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(500))
    first = load(path)
    assert len(cached) == 1 and len(entries(tmp_path)) == 1
    again = load(path)
    assert len(cached) == 1  # not parsed again
    assert np.array_equal(first.arrival_s, again.arrival_s)
    assert np.array_equal(first.num_prompt_tokens, again.num_prompt_tokens)
    assert first.arrival_s[-1] == pytest.approx(499 * 0.25)
    table = pq.read_table(tmp_path / "cache" / "traces" / entries(tmp_path)[0])
    assert str(table.schema.field("TIMESTAMP").type) == "timestamp[ns, tz=UTC]"


def test_an_edited_trace_is_parsed_again(tmp_path, cached):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(50))
    assert load(path).num_prompt_tokens[3] == 103
    stat = path.stat()
    path.write_text(azure_2024(50).replace(",103,", ",777,"))  # same size
    assert load(path).num_prompt_tokens[3] == 777
    assert len(cached) == 2 and len(entries(tmp_path)) == 2
    # Content decides, not the modification time: an edit that puts the old time back (`cp -p`,
    # `rsync -t`), seen by a new process (no per-process memo), is parsed again too.
    path.write_text(azure_2024(50).replace(",103,", ",555,"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _sha256.cache_clear()
    assert load(path).num_prompt_tokens[3] == 555


def test_columns_named_by_where_are_cached_with_the_rest(tmp_path, cached):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(100))
    kept = load(path, where="GeneratedTokens > 40")
    assert len(kept) == 20 and kept.arrival_s[:2].tolist() == [0.0, 0.25]
    load(path, where="GeneratedTokens > 40")
    load(path, where="GeneratedTokens > 10")  # the same columns: the same entry
    assert len(cached) == 1 and len(entries(tmp_path)) == 1


def test_an_interrupted_write_leaves_nothing_behind(tmp_path, cached, monkeypatch):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(200))

    def interrupted(table, where, **kwargs):
        with open(where, "wb") as file:
            file.write(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load(path)
    assert entries(tmp_path) == []
    monkeypatch.undo()  # a later run, with a working disk
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "MIN_CACHED_BYTES", 0)
    assert len(load(path)) == 200 and len(entries(tmp_path)) == 1


def test_an_unreadable_entry_is_parsed_again_and_replaced(tmp_path, cached):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(100))
    expected = load(path)
    entry = tmp_path / "cache" / "traces" / entries(tmp_path)[0]
    entry.write_bytes(b"not parquet")
    assert np.array_equal(load(path).arrival_s, expected.arrival_s)
    assert len(cached) == 2 and pq.read_table(entry).num_rows == 100


def test_a_cache_that_cannot_be_written_costs_speed_only(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(not_a_dir))
    monkeypatch.setattr(cache, "MIN_CACHED_BYTES", 0)
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(20))
    assert len(load(path)) == 20 and len(load(path)) == 20


def test_small_files_are_not_cached(tmp_path, monkeypatch, traces):
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(tmp_path / "cache"))
    assert len(load(traces / "azure_llm_2023/AzureLLMInferenceTrace_conv.csv")) == 19366
    assert not (tmp_path / "cache").exists()


def test_pyarrow_reads_the_azure_2023_times_as_pandas_did(traces, tmp_path, cached):
    path = traces / "azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    times = pd.to_datetime(pd.read_csv(path)["TIMESTAMP"], format="ISO8601")
    expected = (times - times.iloc[0]).dt.total_seconds().to_numpy()
    assert np.array_equal(load(path).arrival_s, expected)  # cold
    assert np.array_equal(load(path).arrival_s, expected)  # cached
    assert len(cached) == 1


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SERVESIM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "servesim" / "traces"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says so
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "servesim" / "traces"
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine" / "traces"


def _load_prompts(path: str) -> list[int]:
    return load(path).num_prompt_tokens.tolist()


def test_workers_loading_at_once_leave_one_whole_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVESIM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(30_000))  # over MIN_CACHED_BYTES: the workers cache it too
    assert path.stat().st_size > cache.MIN_CACHED_BYTES
    with ProcessPoolExecutor(3, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_load_prompts, [str(path)] * 3))
    assert results[0] == results[1] == results[2] == _load_prompts(str(path))
    assert len(entries(tmp_path)) == 1 and not list(tmp_path.glob("cache/traces/*.tmp"))


def test_the_cache_keeps_to_its_size_evicting_the_least_recently_used(tmp_path, cached,
                                                                      monkeypatch):
    """Each new entry evicts the entries used longest ago (a hit counts as a use), and their
    lock files, until the rest fit `SERVESIM_CACHE_MAX_GB`; the newest entry always stays."""
    folder = tmp_path / "cache" / "traces"
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"t{i}.csv")
        paths[-1].write_text(azure_2024(400 + i))
    load(paths[0])
    one = next(folder.glob("*.parquet")).stat().st_size
    # Room for two entries, not three.
    monkeypatch.setenv("SERVESIM_CACHE_MAX_GB", str(2.5 * one / 1e9))
    load(paths[1])
    assert len(entries(tmp_path)) == 2
    os.utime(folder / entries(tmp_path)[0], (1, 1))  # both long ago; then t0 is used again
    os.utime(folder / entries(tmp_path)[1], (1, 1))
    load(paths[0])
    assert len(cached) == 2  # a hit: t0 was not parsed again
    load(paths[2])  # evicts t1, the least recently used
    assert len(cached) == 3 and len(entries(tmp_path)) == 2
    load(paths[0])
    assert len(cached) == 3  # still cached
    load(paths[1])
    assert len(cached) == 4  # evicted: parsed again
    locks = sorted(p.name.removesuffix(".lock") for p in folder.glob("*.lock"))
    assert set(locks) <= set(entries(tmp_path))  # no lock file outlives its entry
    # No room at all: only the entry just written stays.
    monkeypatch.setenv("SERVESIM_CACHE_MAX_GB", "0")
    paths[2].write_text(azure_2024(450))
    load(paths[2])
    assert len(entries(tmp_path)) == 1


def test_a_bad_cache_size_is_one_line(tmp_path, cached, monkeypatch):
    path = tmp_path / "t.csv"
    path.write_text(azure_2024(100))
    for value in ("lots", "-1", "nan", "inf", "1e300"):
        monkeypatch.setenv("SERVESIM_CACHE_MAX_GB", value)
        with pytest.raises(InputError) as exc:
            load(path)
        assert str(exc.value) == (f"<environment>: SERVESIM_CACHE_MAX_GB={value!r}: must be a "
                                  "size in GB, 0 or more")
