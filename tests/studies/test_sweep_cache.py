"""Sweep caches follow everything that changes the answer: the content of input files (not
their paths), the servesim code; `--force` re-runs; each run records its inputs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import sim.results.fingerprint
from sim.cli import main
from sim.config.file_hash import file_sha256
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import assert_one_line_error, run_cli

BASE = """
name: base
workload:
  format: synthetic
  num_requests: 40
  arrivals: {qps: 4}
  lengths: {file: a.csv}
replica:
  latency: {kind: constant, iteration_s: 0.01}
"""


def make_inputs(folder: Path) -> Path:
    """A sweep over two length files (a.csv, b.csv) and two rates: four points."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, lengths in (("a.csv", "100,20\n300,5\n"), ("b.csv", "50,10\n700,30\n")):
        (folder / name).write_text("num_prefill_tokens,num_decode_tokens\n" + lengths)
    (folder / "base.yaml").write_text(BASE)
    sweep = folder / "sweep.yaml"
    sweep.write_text("name: files\nbase: base.yaml\ngrid:\n"
                     "  workload.lengths.file: [a.csv, b.csv]\n  workload.arrivals.qps: [2, 4]\n")
    return sweep


def run_times(out: Path) -> dict[str, int]:
    """Each run directory's summary.json modification time, by key."""
    return {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}


def sweep_again(sweep: Path, out: Path, **options) -> tuple[list[int], dict[str, str]]:
    """Run a sweep; return its progress calls and each point's key by its length file."""
    _, runs = load_sweep(sweep)
    calls: list[int] = []
    run_sweep(runs, out, on_progress=lambda done, total: calls.append(done), **options)
    return calls, {f"{r.point['workload.lengths.file']}@{r.point['workload.arrivals.qps']}":
                   r.key for r in runs}


def test_editing_a_trace_reruns_its_points_and_only_those(tmp_path):
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    before = run_times(out)
    with (tmp_path / "in" / "b.csv").open("a") as f:
        f.write("900,40\n")
    calls, new_keys = sweep_again(sweep, out)
    assert calls[0] == 2  # the a.csv points were cached
    assert all(new_keys[p] == keys[p] for p in ("a.csv@2", "a.csv@4"))
    assert all(new_keys[p] != keys[p] for p in ("b.csv@2", "b.csv@4"))
    after = run_times(out)
    assert all(after[keys[p]] == before[keys[p]] for p in ("a.csv@2", "a.csv@4"))
    record = json.loads((out / "runs" / new_keys["b.csv@2"] / "inputs.json").read_text())
    [entry] = record["inputs"]
    assert entry["field"] == "workload.lengths.file" and entry["path"] == "b.csv"
    assert entry["sha256"] == file_sha256(tmp_path / "in" / "b.csv")
    assert entry["size_bytes"] == (tmp_path / "in" / "b.csv").stat().st_size


def test_moving_the_inputs_and_the_sweep_reuses_the_cache(tmp_path):
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    before = run_times(out)
    shutil.move(tmp_path / "in", tmp_path / "elsewhere" / "in")
    shutil.move(out, tmp_path / "elsewhere" / "out")
    calls, moved_keys = sweep_again(tmp_path / "elsewhere" / "in" / "sweep.yaml",
                                    tmp_path / "elsewhere" / "out")
    assert moved_keys == keys
    assert calls == [4]  # nothing ran
    assert run_times(tmp_path / "elsewhere" / "out") == before


def test_force_reruns_every_point(tmp_path, monkeypatch, capsys):
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    sweep_again(sweep, out)
    before = run_times(out)
    monkeypatch.setattr(sys, "argv", ["servesim", "sweep", str(sweep), "--out", str(out),
                                      "--force", "--workers", "1"])
    main()  # returns: success
    after = run_times(out)
    assert after.keys() == before.keys()
    assert all(after[k] > before[k] for k in before)


def test_a_code_change_changes_every_key(tmp_path, monkeypatch):
    sweep = make_inputs(tmp_path / "in")
    _, runs = load_sweep(sweep)
    keys = {r.key for r in runs}
    monkeypatch.setattr(sim.results.fingerprint, "code_fingerprint", lambda: "9.9.9+edited")
    _, edited = load_sweep(sweep)
    assert len(keys) == 4 and not keys & {r.key for r in edited}


def test_a_run_without_its_input_record_is_not_cached(tmp_path):
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    (out / "runs" / keys["a.csv@2"] / "inputs.json").unlink()
    calls, _ = sweep_again(sweep, out)
    assert calls[0] == 3


@pytest.mark.parametrize("damage", ["corrupt summary", "no summary", "no requests"])
def test_a_damaged_run_is_run_again(tmp_path, damage):
    """A run directory damaged by hand is neither trusted nor a traceback: it runs again."""
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    run = out / "runs" / keys["b.csv@4"]
    if damage == "corrupt summary":
        (run / "summary.json").write_text("{not json")
    elif damage == "no summary":
        (run / "summary.json").unlink()
    else:
        (run / "requests.parquet").unlink()
    calls, _ = sweep_again(sweep, out)
    assert calls[0] == 3
    assert json.loads((run / "summary.json").read_text())["run"]["complete"] is True
    assert (run / "requests.parquet").is_file()


@pytest.mark.parametrize("seeds", ["[true]", "[-1]", "[]", "3"])
def test_bad_seeds_are_refused(tmp_path, monkeypatch, capsys, seeds):
    sweep = make_inputs(tmp_path / "in")
    sweep.write_text(sweep.read_text() + f"seeds: {seeds}\n")
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "seeds=", "non-empty list of integers")


def test_each_file_is_hashed_once_per_process_until_it_changes(tmp_path):
    from sim.config.file_hash import _sha256

    path = tmp_path / "trace.csv"
    path.write_text("a")
    first = file_sha256(path)
    hits = _sha256.cache_info().hits
    assert file_sha256(path) == first and _sha256.cache_info().hits == hits + 1
    path.write_text("b")  # same size: the new modification time tells
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert file_sha256(path) != first


def test_a_directory_input_is_hashed_by_its_files(tmp_path):
    # The recorded latency model reads a replay's result directory: a run records its hash
    # in inputs.json, and a sweep keys on it.
    replay = tmp_path / "replay"
    (replay / "sub").mkdir(parents=True)
    (replay / "iterations.parquet").write_bytes(b"one")
    (replay / "sub" / "x").write_bytes(b"two")
    first = file_sha256(replay)
    (replay / ".hidden").write_bytes(b"ignored")
    assert file_sha256(replay) == first
    (replay / "sub" / "x").rename(replay / "sub" / "y")  # same bytes, another name
    assert file_sha256(replay) != first
    (replay / "sub" / "y").rename(replay / "sub" / "x")
    assert file_sha256(replay) == first
    (replay / "iterations.parquet").write_bytes(b"three")  # another size: no mtime needed
    assert file_sha256(replay) != first


@pytest.mark.parametrize("summary", ["none", "corrupt"])
def test_a_damaged_run_holding_a_users_file_is_refused_not_cleared(tmp_path, monkeypatch,
                                                                   capsys, summary):
    """A point's directory without a whole summary is cleared for the new run only where it holds
    servesim's own files: a user's file there refuses the sweep (one line naming it, exit 2)
    and nothing is deleted."""
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    run = out / "runs" / keys["b.csv@4"]
    if summary == "none":
        (run / "summary.json").unlink()
    else:
        (run / "summary.json").write_text("{not json")
    (run / "notes.txt").write_text("mine")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out))
    assert_one_line_error(code, err, str(run), "'notes.txt'", "no run writes")
    assert before == {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_a_file_in_place_of_a_points_directory_is_refused_before_any_run(tmp_path, monkeypatch,
                                                                         capsys):
    sweep, out = make_inputs(tmp_path / "in"), tmp_path / "out"
    _, keys = sweep_again(sweep, out)
    before = run_times(out)
    shutil.rmtree(out / "runs" / keys["b.csv@4"])
    (out / "runs" / keys["b.csv@4"]).write_text("mine")
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out), "--force")
    assert_one_line_error(code, err, keys["b.csv@4"], "is not a directory, which no sweep writes")
    assert (out / "runs" / keys["b.csv@4"]).read_text() == "mine"
    del before[keys["b.csv@4"]]
    assert run_times(out) == before  # no other point ran again
