"""The `servesim` command, `python -m sim`, the Python API and the shipped scenario files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim import Results, load_scenario, run_scenario
from sim.cli import main
from tests.conftest import REPO


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["servesim", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().out


def test_simulate_default_scenario(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out = cli(monkeypatch, capsys, "simulate")
    assert code == 0
    for text in ("TTFT ms", "TBT ms", "E2E s", "P99", "req/s", "results/default"):
        assert text in out
    out_dir = tmp_path / "results" / "default"
    summary = json.loads((out_dir / "summary.json").read_text())
    requests = pd.read_parquet(out_dir / "requests.parquet")
    iterations = pd.read_parquet(out_dir / "iterations.parquet")
    assert summary["requests"]["finished"] == len(requests) == 2000
    assert summary["num_iterations"] == len(iterations)
    assert summary["ttft_s"]["p99"] == pytest.approx(requests["ttft_s"].quantile(0.99))
    # The resolved scenario beside the results runs again to the same numbers.
    again = run_scenario(load_scenario(out_dir / "scenario.yaml"))
    assert again.summary["ttft_s"] == summary["ttft_s"]


def test_seed_and_out_options(tmp_path, monkeypatch, capsys):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(
        "name: small\nworkload:\n  format: synthetic\n  num_requests: 50\n"
        "  arrivals: {qps: 4}\n  lengths:\n    prompt: {dist: uniform, low: 10, high: 900}\n"
        "    output: {dist: uniform, low: 1, high: 50}\n")
    for seed in ("1", "2"):
        code, _ = cli(monkeypatch, capsys, "simulate", str(scenario), "--seed", seed,
                      "--out", str(tmp_path / seed))
        assert code == 0
    one = pd.read_parquet(tmp_path / "1" / "requests.parquet")
    two = pd.read_parquet(tmp_path / "2" / "requests.parquet")
    assert not one["num_prompt_tokens"].equals(two["num_prompt_tokens"])
    assert "seed: 2" in (tmp_path / "2" / "scenario.yaml").read_text()


def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sim", "simulate", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r" / "requests.parquet").is_file()


def test_list_names(monkeypatch, capsys):
    code, out = cli(monkeypatch, capsys, "list")
    assert code == 0
    for name in ("chunked_prefill", "prefill_first", "roofline", "azure", "mooncake",
                 "llama-3-8b", "qwen3-8b", "h200"):
        assert name in out


def test_python_api_returns_results():
    results = run_scenario(seed=7)
    assert isinstance(results, Results)
    assert results.scenario.seed == 7
    assert results.summary["run"]["seed"] == 7


@pytest.mark.parametrize("path", sorted((REPO / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_scenarios_run(path: Path, traces):
    scenario = load_scenario(path)
    # Keep the test short: the first few hundred requests of each.
    workload = scenario.workload.model_copy(update={"num_requests": 300})
    results = run_scenario(scenario.model_copy(update={"workload": workload}))
    assert results.summary["requests"]["finished"] + results.summary["requests"]["rejected"] == 300
