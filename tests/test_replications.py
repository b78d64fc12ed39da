"""Replications and their confidence intervals (`servesim simulate --replications N`), and the
capacity search that decides each rate by a sequential test over replications.

The acceptance test is a coverage check on an M/D/1 queue, whose mean wait is known exactly
(Pollaczek-Khinchine): the 95% interval from replications must cover it in at least 90 of 100
independent repetitions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sim.capacity import SLOTargets, capacity
from sim.config import parse_scenario
from sim.replications import (
    DETERMINISTIC,
    bootstrap_interval,
    t_interval,
    variation_sources,
)
from sim.runner import run_scenario
from tests.conftest import assert_one_line_error, run_cli
from tests.conftest import run_cli_out as cli

SERVICE_S = 0.01


def md1(rho: float, num_requests: int) -> dict:
    """Poisson arrivals at rho / D; each request one prompt token and one output token, served
    alone (max_num_seqs 1) in one iteration of exactly D: an M/D/1 queue."""
    return {
        "name": "md1",
        "workload": {"format": "synthetic", "num_requests": num_requests,
                     "arrivals": {"process": "poisson", "qps": rho / SERVICE_S},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                    "latency": {"kind": "constant", "iteration_s": SERVICE_S},
                    "kv_cache": {"num_blocks": 100}},
    }


def test_md1_interval_for_the_mean_wait_covers_the_exact_value():
    """100 repetitions, each N = 5 replications (its own seeds) at rho 0.5, 0.6 or 0.7: the
    t interval of the mean wait covers rho D / (2 (1 - rho)) at least 90 times. Runs of 1,000
    requests, the first 100 dropped (the queue starts empty; its relaxation time at rho 0.7 is
    a few dozen services)."""
    replications, repetitions, skip = 5, 100, 100
    scenarios = {rho: parse_scenario(md1(rho, 1000), "md1") for rho in (0.5, 0.6, 0.7)}
    covered = 0
    for rep in range(repetitions):
        rho = (0.5, 0.6, 0.7)[rep % 3]
        exact = rho * SERVICE_S / (2 * (1 - rho))
        waits = []
        for k in range(replications):
            df = run_scenario(scenarios[rho], seed=1000 + rep * replications + k).requests
            wait = (df["first_scheduled_s"] - df["arrival_s"]).to_numpy()
            service = (df["ttft_s"] - df["scheduling_delay_s"]).to_numpy()
            assert np.allclose(service, SERVICE_S) and np.allclose(wait, df["scheduling_delay_s"])
            waits.append(wait[skip:].mean())
        _, low, high = t_interval(waits)
        covered += low <= exact <= high
    assert covered >= 90, f"covered {covered} of {repetitions}"


def test_intervals_are_reproducible_and_sensible():
    values = [1.0, 2.0, 4.0, 3.0, 2.5]
    mean, low, high = t_interval(values)
    assert mean == pytest.approx(2.5)
    # t(0.975, 4) = 2.776; s = 1.118
    assert (high - low) / 2 == pytest.approx(2.776 * 1.118 / math.sqrt(5), rel=1e-3)
    assert bootstrap_interval(values) == bootstrap_interval(values)  # fixed seed
    _, blo, bhi = bootstrap_interval(values)
    assert min(values) <= blo < mean < bhi <= max(values)
    assert t_interval([3.0]) == (3.0, None, None)  # no interval from one value
    assert t_interval([3.0, 3.0]) == (3.0, 3.0, 3.0)


def csv_replay(tmp_path: Path, *, noise: bool = False) -> Path:
    """A replayed trace: 200 requests every 0.2 s (5 req/s), one token in, one out, served
    alone in 0.1 s: capacity 10 req/s, rate scale 2."""
    trace = tmp_path / "trace.csv"
    trace.write_text("t,p,o\n" + "".join(f"{0.2 * i:.1f},1,1\n" for i in range(200)))
    latency: dict = {"kind": "constant", "iteration_s": 0.1}
    if noise:
        latency["noise"] = {"kind": "lognormal", "sigma": 0.1}
    scenario = {"name": "replay", "workload": {
        "format": "csv", "path": "trace.csv",
        "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"}},
        "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                    "latency": latency, "kv_cache": {"num_blocks": 100}}}
    path = tmp_path / ("noisy.yaml" if noise else "replay.yaml")
    path.write_text(yaml.safe_dump(scenario))
    return path


def test_replications_of_a_deterministic_replay_are_refused(tmp_path, monkeypatch, capsys):
    path = csv_replay(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--replications", "3",
                        "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "--replications=3", DETERMINISTIC)
    assert not (tmp_path / "out").exists()
    code, err = run_cli(monkeypatch, capsys, "capacity", str(path), "--sched-delay-p50", "1",
                        "--replications", "3", "--out", str(tmp_path / "cap"))
    assert_one_line_error(code, err, "--replications=3", DETERMINISTIC)
    noisy = parse_scenario(yaml.safe_load(csv_replay(tmp_path, noise=True).read_text()), "x")
    assert variation_sources(noisy) == ["latency noise (lognormal)"]


def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({
        "name": "small",
        "workload": {"format": "synthetic", "num_requests": 60, "arrivals": {"qps": 4.0},
                     "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                                 "output": {"dist": "uniform", "low": 2, "high": 50}}},
        "slo": {"ttft_s": 0.5, "tbt_s": 0.05}}))
    return path


def test_table_has_intervals_and_repeats_byte_for_byte(tmp_path, monkeypatch, capsys):
    path, out = small(tmp_path), tmp_path / "reps"
    args = ("simulate", str(path), "--replications", "3", "--workers", "1", "--out", str(out))
    code, first = cli(monkeypatch, capsys, *args)
    assert code == 0
    saved = (out / "replications.json").read_text()
    code, second = cli(monkeypatch, capsys, *args)  # replaces the first whole
    assert code == 0 and first == second and (out / "replications.json").read_text() == saved
    table = [line for line in first.splitlines() if not line.startswith("results: ")]
    assert "95% CI" in first and max(len(line) for line in table) <= 80
    for label in ("TTFT P50 ms", "TTFT P99 ms", "TBT P99 ms", "E2E mean s", "throughput req/s",
                  "SLO ttft met"):
        row = next(line for line in first.splitlines() if label in line)
        assert "[" in row and "]" in row, row
    data = json.loads(saved)
    assert data["seeds"] == [0, 1, 2] and data["runs"] == ["rep0", "rep1", "rep2"]
    p99 = data["metrics"]["ttft_s"]["p99"]
    low, high = p99["ci95"]
    assert len(p99["per_replication"]) == 3 and low <= p99["estimate"] <= high
    assert p99["estimate"] == pytest.approx(np.mean(p99["per_replication"]))
    for k in range(3):
        summary = json.loads((out / f"rep{k}" / "summary.json").read_text())
        assert summary["run"]["seed"] == k
        assert (out / f"rep{k}" / "requests.parquet").is_file()


def test_one_replication_is_a_plain_run(tmp_path, monkeypatch, capsys):
    path = small(tmp_path)
    code, plain = cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "a"))
    code1, one = cli(monkeypatch, capsys, "simulate", str(path), "--replications", "1", "--out",
                     str(tmp_path / "b"))
    assert code == code1 == 0
    assert plain.replace(str(tmp_path / "a"), "X") == one.replace(str(tmp_path / "b"), "X")
    assert (tmp_path / "b" / "summary.json").is_file()
    assert not (tmp_path / "b" / "replications.json").exists()


def test_capacity_of_a_deterministic_replay_brackets_it_in_one_run_per_rate(tmp_path):
    scenario = parse_scenario(yaml.safe_load(csv_replay(tmp_path).read_text()), "replay",
                              tmp_path)
    result = capacity(scenario, SLOTargets(sched_delay_p50_s=1.0), precision=0.02)
    assert result["knob"] == "rate_scale" and result["deterministic"]
    assert result["replications"] == 1 and result["num_runs"] == len(result["rates"])
    low, high = result["interval_qps"]
    assert low <= 10.0 <= high and high - low <= (0.02 + 0.01) * high
    assert all(d.reason.startswith("deterministic: one run decides")
               or d.reason.startswith("overloaded") for d in result["rates"])


def test_capacity_with_noise_decides_each_rate_from_replications(tmp_path, monkeypatch, capsys):
    path = csv_replay(tmp_path, noise=True)
    out = tmp_path / "cap"
    code, printed = cli(monkeypatch, capsys, "capacity", str(path), "--sched-delay-p50", "1",
                        "--precision", "0.05", "--out", str(out))
    assert code == 0
    result = json.loads((out / "capacity.json").read_text())
    assert result["replications"] == 5 and result["varies_by"] == ["latency noise (lognormal)"]
    low, high = result["interval_qps"]
    assert 0 < low <= 10.0 <= high
    assert result["num_runs"] == sum(r["runs"] for r in result["rates"])
    for rate in result["rates"]:
        assert rate["decision"] in ("holds", "fails", "unsure") and rate["reason"]
        assert 1 <= rate["runs"] <= 5
        if rate["decision"] == "holds":
            assert rate["runs"] >= 2  # no confidence from one noisy run
    assert f"capacity in [{low:,.4g}, {high:,.4g}] req/s ({result['num_runs']} runs, up to 5 " \
           "per rate)" in " ".join(printed.split())
    for key in ("num_gpus", "capacity_qps_per_gpu", "usd_per_million_tokens"):
        assert key in result


def test_compare_with_replications(tmp_path, monkeypatch, capsys):
    base = yaml.safe_load(small(tmp_path).read_text())
    comparison = tmp_path / "cmp.yaml"
    comparison.write_text(yaml.safe_dump({"name": "cmp", "base": base, "variants": {
        "chunked": {}, "first": {"replica": {"scheduler": {"name": "prefill_first"}}}}}))
    out = tmp_path / "out"
    code, printed = cli(monkeypatch, capsys, "compare", str(comparison), "--replications", "3",
                        "--workers", "1", "--out", str(out))
    assert code == 0 and "[lo, hi]" in printed
    table = pd.read_csv(out / "comparison_replications.csv")
    assert table["variant"].tolist() == ["chunked", "first"]
    assert (table["ttft_p99_s_lo"] <= table["ttft_p99_s"]).all()
    assert (table["ttft_p99_s"] <= table["ttft_p99_s_hi"]).all()
    for variant in ("chunked", "first"):
        data = json.loads((out / variant / "replications.json").read_text())
        assert data["seeds"] == [0, 1, 2] and (out / variant / "rep2" / "summary.json").is_file()
