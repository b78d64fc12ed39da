"""Hashing a scenario's inputs (sweep cache keys, inputs.json): only regular files are read, and
a directory only as a replay's result directory, of bounded size."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sim.config.file_hash
from sim.config.errors import InputError
from sim.config.file_hash import file_sha256
from tests.helpers import within


def test_a_pipe_or_a_device_is_refused_not_read(tmp_path):
    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with within(5), pytest.raises(InputError) as info:
            file_sha256(path, source="s.yaml", field="workload.path")
        line = info.value.one_line()
        # (A long path is shortened from its start, keeping the file's name.)
        assert line.startswith("s.yaml: workload.path='") and f"{path.name}': " in line
        assert line.endswith(": not a regular file (a named pipe or a device)")


def test_a_directory_that_is_no_replay_is_refused_before_it_is_walked(tmp_path, monkeypatch):
    walked = []
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: walked.append(self) or iter(()))
    with pytest.raises(InputError, match="a directory without iterations.parquet"):
        file_sha256(Path("/usr"), source="s.yaml", field="replica.latency.path")
    assert walked == []


def test_a_replay_directory_of_too_many_entries_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sim.config.file_hash, "MAX_TREE_ENTRIES", 5)
    (tmp_path / "iterations.parquet").write_bytes(b"x")
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(b"y")
    file_sha256(tmp_path)  # 4 entries
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g").write_bytes(b"z")
    with pytest.raises(InputError, match="more than 5 entries: not a replay's result directory"):
        file_sha256(tmp_path, source="s.yaml", field="replica.latency.path")
