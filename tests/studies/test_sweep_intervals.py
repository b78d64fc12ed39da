"""A sweep with several seeds a point: its interval table (results_ci) and the banded figures."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from sim.results.formats import METRICS
from sim.studies.sweep import interval_table, run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import run_cli_out

BASE = """
name: base
workload:
  format: synthetic
  num_requests: 40
  arrivals: {qps: 4}
  lengths:
    prompt: {dist: uniform, low: 50, high: 800}
    output: {dist: uniform, low: 5, high: 40}
replica:
  scheduler: {name: chunked_prefill, token_budget: 512}
slo: {ttft_s: 2.0, tbt_s: 0.1}
"""
SWEEP = ("name: ci\nbase: base.yaml\nseeds: [0, 1, 2]\n"
         "grid:\n  workload.arrivals.qps: [2, 8]\n")


def sweep_file(tmp_path: Path, body: str = SWEEP) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "sweep.yaml"
    path.write_text(body)
    return path


def cli(monkeypatch, capsys, *args: str) -> str:
    code, out = run_cli_out(monkeypatch, capsys, *args)
    assert code == 0, out
    return out


def test_intervals_over_seeds_are_written_and_reproducible(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path)
    out = tmp_path / "out"
    printed = cli(monkeypatch, capsys, "sweep", str(path), "--out", str(out), "--workers", "1")
    assert f"results: {out}/" in printed and "results_ci.csv: 95% intervals over seeds" in printed
    ci = pd.read_csv(out / "results_ci.csv")
    assert ci["workload.arrivals.qps"].tolist() == [2, 8]
    assert ci["num_seeds"].tolist() == [3, 3]
    assert "num_overloaded" in ci and "overload" not in ci
    numeric = [m for m in METRICS if m != "overload"]
    for metric in numeric:
        assert {metric, f"{metric}_lo", f"{metric}_hi"} <= set(ci.columns)
    results = pd.read_csv(out / "results.csv")
    defined = 0
    for metric in numeric:
        for _, row in ci.iterrows():
            est, lo, hi = row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"]
            seeds = results[results["workload.arrivals.qps"] == row["workload.arrivals.qps"]]
            if seeds[metric].notna().any():
                assert math.isclose(est, seeds[metric].mean(), rel_tol=1e-12)
            assert pd.isna(lo) == pd.isna(hi)
            if not pd.isna(lo):
                defined += 1
                assert 0 <= lo <= est <= hi
                if metric.endswith("attainment"):
                    assert hi <= 1
    assert defined >= 10  # arrivals differ by seed: most metrics have an interval
    # A constant across seeds (the GPU count) gets no interval.
    assert ci["num_gpus_lo"].isna().all() and ci["num_gpus_hi"].isna().all()

    first = {n: (out / n).read_bytes() for n in ("results_ci.csv", "results_ci.parquet")}
    cli(monkeypatch, capsys, "sweep", str(path), "--out", str(out), "--force",
        "--workers", "1")
    fresh = tmp_path / "fresh"
    run_sweep(load_sweep(path)[1], fresh)
    for name, data in first.items():
        assert (out / name).read_bytes() == data
        assert (fresh / name).read_bytes() == data

    cli(monkeypatch, capsys, "plot", str(out))
    for figure in ("p99_tbt_vs_load", "latency_vs_throughput"):
        for suffix in (".png", ".svg"):
            assert (out / "plots" / (figure + suffix)).stat().st_size > 5_000


def test_one_seed_writes_no_intervals_and_removes_stale_ones(tmp_path):
    path = sweep_file(tmp_path)
    out = tmp_path / "out"
    _, runs = load_sweep(path)
    run_sweep(runs, out)
    assert (out / "results_ci.csv").is_file()
    one = [r for r in runs if r.seed == 0]  # the same points, cached: nothing runs
    table = run_sweep(one, out)
    assert interval_table(table) is None
    assert not (out / "results_ci.csv").exists() and not (out / "results_ci.parquet").exists()


def test_grouped_lines_get_bands(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path, SWEEP.replace("seeds: [0, 1, 2]", "seeds: [0, 1]")
                      + "  replica.scheduler.token_budget: [256, 1024]\n")
    out = tmp_path / "out"
    run_sweep(load_sweep(path)[1], out)
    ci = pd.read_parquet(out / "results_ci.parquet")
    assert len(ci) == 4 and (ci["num_seeds"] == 2).all()
    cli(monkeypatch, capsys, "plot", str(out))
    assert (out / "plots" / "p99_tbt_vs_load.png").stat().st_size > 5_000
