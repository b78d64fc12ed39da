"""Sweeps (`sim.studies.sweep`): grids, zips and seeds, the cache of runs done, parallel workers,
bad sweep files reported at once, and the Ray backend where installed."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import assert_one_line_error, run_cli

BASE = """
name: base
workload:
  format: synthetic
  num_requests: 80
  arrivals: {qps: 5}
  lengths:
    prompt: {dist: uniform, low: 50, high: 1500}
    output: {dist: uniform, low: 5, high: 80}
replica:
  scheduler: {name: chunked_prefill, token_budget: 512}
slo: {ttft_s: 2.0, tbt_s: 0.1}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def sweep_file(tmp_path: Path, body: str) -> Path:
    write(tmp_path, "base.yaml", BASE)
    return write(tmp_path, "sweep.yaml", "name: sw\nbase: base.yaml\n" + body)


def test_grid_zip_and_seeds_expand(tmp_path):
    path = sweep_file(tmp_path, (
        "seeds: [0, 1]\n"
        "grid:\n  replica.scheduler.token_budget: [256, 512, 1024]\n"
        "zip:\n  workload.arrivals.qps: [2, 8]\n  name: [slow, fast]\n"))
    name, runs = load_sweep(path)
    assert name == "sw" and len(runs) == 3 * 2 * 2
    points = {(r.point["replica.scheduler.token_budget"], r.point["workload.arrivals.qps"],
               r.point["name"], r.seed) for r in runs}
    assert (256, 2, "slow", 0) in points and (1024, 8, "fast", 1) in points
    assert (256, 2, "fast", 0) not in points  # zipped, not crossed
    run = next(r for r in runs if r.point["name"] == "fast" and r.seed == 1)
    assert run.scenario.workload.arrivals.qps == 8 and run.scenario.seed == 1
    assert len({r.key for r in runs}) == len(runs)


def test_cache_skips_runs_already_done_and_resumes(tmp_path):
    path = sweep_file(tmp_path, "grid:\n  replica.scheduler.token_budget: [256, 1024]\n"
                                "seeds: [0, 1]\n")
    _, runs = load_sweep(path)
    out = tmp_path / "out"
    # An interrupted sweep: only the first run finished.
    run_sweep(runs[:1], out)
    calls = []
    table = run_sweep(runs, out, on_progress=lambda done, total: calls.append(done))
    assert calls[0] == 1 and calls[-1] == 4  # resumed after the one already done
    assert len(table) == 4 and set(table["seed"]) == {0, 1}
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    calls.clear()
    run_sweep(runs, out, on_progress=lambda done, total: calls.append(done))
    assert calls == [4]  # everything cached: nothing ran
    assert mtimes == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    assert (out / "results.csv").is_file()
    assert pd.read_parquet(out / "results.parquet").equals(table)


def test_forced_sweep_never_replaces_a_point_holding_a_users_file(tmp_path):
    from sim.config.errors import InputError

    path = sweep_file(tmp_path, "grid:\n  replica.scheduler.token_budget: [256, 1024]\n")
    _, runs = load_sweep(path)
    out = tmp_path / "out"
    run_sweep(runs, out)
    run_dir = out / "runs" / runs[1].key
    (run_dir / "notes.txt").write_text("mine")
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    with pytest.raises(InputError, match="holds 'notes.txt', which no run writes"):
        run_sweep(runs, out, force=True)
    assert (run_dir / "notes.txt").read_text() == "mine"
    # Refused before any run: the other point was not run again either.
    assert mtimes == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}


def test_parallel_workers_give_the_same_table(tmp_path):
    path = sweep_file(tmp_path, "grid:\n  replica.scheduler.token_budget: [128, 256, 512]\n")
    _, runs = load_sweep(path)
    serial = run_sweep(runs, tmp_path / "serial")
    parallel = run_sweep(runs, tmp_path / "parallel", workers=2)
    assert serial.equals(parallel)


@pytest.mark.parametrize("body,needles", [
    ("grid:\n  replica.schedular.token_budget: [256]\n", ["replica.schedular", "Extra inputs"]),
    ("grid:\n  replica.scheduler.token_budget: []\n", ["grid.replica.scheduler.token_budget",
                                                     "non-empty"]),
    ("zip:\n  workload.arrivals.qps: [1, 2]\n  name: [a]\n", ["zip", "same length"]),
    ("grid:\n  replica.scheduler.token_budget: [-5]\n", ["replica.scheduler.token_budget",
                                                       "-5"]),
    # Nothing to sweep: it ran as one point.
    ("grid: {}\n", ["grid={}", "holds no axis"]),
    ("zip:\n", ["zip=None", "holds no axis"]),
    ("", ["nothing to sweep"]),
])
def test_bad_sweep_files(tmp_path, monkeypatch, capsys, body, needles):
    path = sweep_file(tmp_path, body)
    code, err = run_cli(monkeypatch, capsys, "sweep", str(path))
    assert_one_line_error(code, err, str(path), *needles)


def test_every_bad_point_of_a_sweep_is_reported_at_once(tmp_path):
    # Only the first bad point's problem was reported: qps=-2.0, never qps=True or '512'.
    from sim.config.errors import InputError

    path = sweep_file(tmp_path, "grid:\n  workload.arrivals.qps: [1.0, -2.0, true]\n"
                                "  replica.scheduler.token_budget: [256, '512']\n")
    with pytest.raises(InputError) as exc:
        load_sweep(path)
    assert [line.split(": ", 2)[1] for line in exc.value.lines()] == [
        "replica.scheduler.token_budget='512'", "workload.arrivals.qps=-2.0",
        "workload.arrivals.qps=True"]  # each once, in the order the points come
    assert {line.split(": ")[0] for line in exc.value.lines()} == {str(path)}
    from sim.studies.sweep_file import (
        MAX_PROBLEMS,  # at most that many lines, then one counting the rest
    )

    values = ", ".join(str(-q) for q in range(1, MAX_PROBLEMS + 6))
    with pytest.raises(InputError) as exc:
        load_sweep(sweep_file(tmp_path, f"grid:\n  workload.arrivals.qps: [{values}]\n"))
    lines = exc.value.lines()
    assert len(lines) == MAX_PROBLEMS + 1 and "qps=-20: " in lines[MAX_PROBLEMS - 1]
    assert lines[-1].endswith(f"<more>=5: problems not shown (the first {MAX_PROBLEMS} are "
                              "above): fix those and check again")


def test_a_sweep_failing_everywhere_stops_checking_after_enough_points(tmp_path, monkeypatch):
    """A bad --set fails every point alike: checking stops after MAX_FAILED_POINTS of them (each
    check parses a whole scenario; a 10,000-point sweep would parse them all to say one line)."""
    import sim.studies.sweep_file
    from sim.config.errors import InputError
    from sim.config.overrides import parse_override

    calls = []
    real = sim.studies.sweep_file.parse_scenario
    monkeypatch.setattr(sim.studies.sweep_file, "parse_scenario",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    values = ", ".join(str(256 + k) for k in range(sim.studies.sweep_file.MAX_FAILED_POINTS + 50))
    path = sweep_file(tmp_path, f"grid:\n  replica.scheduler.token_budget: [{values}]\n")
    with pytest.raises(InputError) as exc:
        load_sweep(path, [parse_override("replica.kv_cache.block_size=-1")])
    assert len(calls) == sim.studies.sweep_file.MAX_FAILED_POINTS
    assert len(exc.value.lines()) == 1 and "block_size" in exc.value.lines()[0]


@pytest.mark.slow
def test_ray_backend_when_installed(tmp_path):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'servesim[ray]'")
    path = sweep_file(tmp_path, "grid:\n  replica.scheduler.token_budget: [256, 512]\n")
    _, runs = load_sweep(path)
    table = run_sweep(runs, tmp_path / "ray", backend="ray")
    assert table.equals(run_sweep(runs, tmp_path / "local"))
