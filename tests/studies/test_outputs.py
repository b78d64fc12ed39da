"""What sweeps, comparisons and capacity searches leave behind: the overload verdict in every
table and figure, capacity trials on disk and drawn, output directories checked before any run,
bad options and unreadable result files as one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sim.cli import main
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.studies.compare import compare, load_comparison
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import ONE_AT_A_TIME, assert_one_line_error, run_cli


def succeed(monkeypatch, capsys, *args: str) -> tuple[str, str]:
    """Run `servesim ARGS`, which must succeed; its stdout and stderr."""
    monkeypatch.setattr(sys, "argv", ["servesim", *args])
    try:
        main()
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    captured = capsys.readouterr()
    return captured.out, captured.err


def one_at_a_time_sweep(tmp_path: Path, qps: list[float]) -> Path:
    """Requests of two output tokens served one at a time (0.2 s each): 5 requests/s."""
    base = {**ONE_AT_A_TIME, "workload": {**ONE_AT_A_TIME["workload"], "lengths": {
        "prompt": {"dist": "fixed", "value": 1}, "output": {"dist": "fixed", "value": 2}}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: load\nbase: base.yaml\ngrid:\n  workload.arrivals.qps: {qps}\n")
    return sweep


def test_sweep_table_and_plots_show_overload(tmp_path, monkeypatch, capsys):
    sweep, out = one_at_a_time_sweep(tmp_path, [3.0, 30.0]), tmp_path / "out"
    printed, _ = succeed(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out),
                         "--workers", "1")
    table = pd.read_parquet(out / "results.parquet")
    assert table["overload"].tolist() == ["stable", "overloaded"]
    assert pd.read_csv(out / "results.csv")["overload"].tolist() == ["stable", "overloaded"]
    assert "overloaded" in printed and "1 of 2 runs overloaded" in printed
    succeed(monkeypatch, capsys, "plot", str(out))
    for figure in ("p99_tbt_vs_load", "latency_vs_throughput"):
        assert "overloaded" in (out / "plots" / f"{figure}.svg").read_text()  # legend entry


def test_comparison_table_shows_overload(tmp_path):
    base = parse_scenario(ONE_AT_A_TIME, "test")
    heavy = base.model_copy(update={"workload": base.workload.model_copy(update={
        "arrivals": base.workload.arrivals.model_copy(update={"qps": 30.0})})})
    table, _ = compare({"light": base, "heavy": heavy}, tmp_path / "cmp")
    assert table["overload"].tolist() == ["stable", "overloaded"]
    assert pd.read_csv(tmp_path / "cmp" / "comparison.csv")["overload"].tolist() == [
        "stable", "overloaded"]


def test_capacity_writes_its_trials_and_plot_draws_them(tmp_path, monkeypatch, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(ONE_AT_A_TIME))
    cap = tmp_path / "cap"
    _, log = succeed(monkeypatch, capsys, "capacity", str(scenario), "--sched-delay-p50", "0.5",
                     "--precision", "0.1", "--seeds", "2", "--out", str(cap),
                     "--set", "replica.kv_cache.num_blocks=200")  # no change to the answer
    searched = yaml.safe_load((cap / "scenario.yaml").read_text())  # resolved, --set in it
    assert searched["replica"]["kv_cache"]["num_blocks"] == 200
    trials = pd.read_csv(cap / "trials.csv")
    result = json.loads((cap / "capacity.json").read_text())
    assert len(trials) == result["num_runs"] == sum(r["runs"] for r in result["rates"]) == len(
        [line for line in log.splitlines() if line.startswith("seed ")])
    assert set(trials["seed"]) == {0, 1} and trials["ok"].any() and not trials["ok"].all()
    assert "overloaded" in set(trials["overload"])
    assert "rate 12 req/s: violates P50 scheduling delay" in log  # each trial as it finished
    assert result["targets_s"] == {"sched_delay_p50_s": 0.5}
    assert result["capacity_qps"] == pytest.approx(10.0, rel=0.1)
    low, high = result["ci95_qps"]
    assert low <= 10.0 <= high and result["replications"] == 2  # --seeds 2: --replications 2
    succeed(monkeypatch, capsys, "plot", str(cap))
    for figure in ("capacity", "capacity_trials"):
        assert (cap / "plots" / f"{figure}.png").stat().st_size > 5_000


@pytest.mark.parametrize("option,value", [
    ("--tbt-p99", "-0.05"), ("--tbt-p99", "0"), ("--ttft-p90", "nan"),
    ("--sched-delay-p50", "inf"), ("--precision", "0"), ("--precision", "1.5"),
])
def test_bad_capacity_options_fail_before_any_run(tmp_path, monkeypatch, capsys, option, value):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(ONE_AT_A_TIME))
    targets = [] if option != "--precision" else ["--tbt-p99", "0.1"]
    code, err = run_cli(monkeypatch, capsys, "capacity", str(scenario), *targets, option, value,
                        "--out", str(tmp_path / "cap"))
    assert_one_line_error(code, err, option)
    assert not (tmp_path / "cap").exists()


def test_sweep_out_must_be_a_sweep_directory(tmp_path, monkeypatch, capsys):
    sweep = one_at_a_time_sweep(tmp_path, [3.0])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, needle in ((a_file, "not a directory"), (run_dir, "single run"),
                        (other, "not a sweep"), (a_file / "sub", "is a file")):
        code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out))
        assert_one_line_error(code, err, "--out", needle)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["summary.json"]


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    _, runs = load_sweep(one_at_a_time_sweep(tmp_path, [3.0, 6.0]))
    run_sweep(runs, tmp_path / "out")
    return tmp_path / "out"


@pytest.mark.parametrize("damage,needles", [
    (lambda d: (d / "results.parquet").write_text("garbage"), ["results.parquet", "cannot read"]),
    (lambda d: (d / "results.parquet").unlink(), ["results.parquet", "not finished"]),
    (lambda d: pd.read_parquet(d / "results.parquet").drop(columns="tbt_p99_s")
     .to_parquet(d / "results.parquet"), ["tbt_p99_s", "missing"]),
    (lambda d: (next((d / "runs").iterdir()) / "requests.parquet").write_bytes(b"PAR1"),
     ["requests.parquet", "cannot read"]),
])
def test_unreadable_result_files_are_one_line_errors(sweep_dir, monkeypatch, capsys, damage,
                                                     needles):
    damage(sweep_dir)
    target = sweep_dir if "requests.parquet" not in needles else next(
        (sweep_dir / "runs").iterdir())
    code, err = run_cli(monkeypatch, capsys, "plot", str(target))
    assert_one_line_error(code, err, *needles)


def test_plot_draws_a_directory_of_its_own_kind(sweep_dir, monkeypatch, capsys):
    run_dir = next((sweep_dir / "runs").iterdir())
    # A stale sweep table left in a run's directory is not drawn as if it were this run's.
    (run_dir / "results.parquet").write_bytes((sweep_dir / "results.parquet").read_bytes())
    printed, _ = succeed(monkeypatch, capsys, "plot", str(run_dir))
    assert "cdf.png" in printed and "p99_tbt_vs_load" not in printed
    printed, _ = succeed(monkeypatch, capsys, "plot", str(sweep_dir))
    assert "p99_tbt_vs_load.png" in printed and "cdf" not in printed


def test_a_variant_with_a_bad_workload_fails_the_comparison_before_any_run(
        traces, tmp_path, monkeypatch, capsys):
    """Every variant's requests are read before the first runs: a window holding no request
    in the second variant leaves nothing written (not the first variant's run without a
    table), and the error names the variant's field."""
    trace = traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    path = tmp_path / "w.cmp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "w",
        "base": {"workload": {"format": "azure", "path": str(trace), "num_requests": 20},
                 "replica": {"model": "tiny"}},
        "variants": {"a": {}, "b": {"workload": {"start_s": 100000.0}}}}))
    out = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "compare", str(path), "--out", str(out))
    assert_one_line_error(code, err, "w.cmp.yaml", "variants.b.workload.start_s=100000.0",
                          "holds no request")
    assert not out.exists()
    with pytest.raises(InputError, match="variants.b.workload.start_s"):
        compare(load_comparison(path), tmp_path / "api")
    assert not (tmp_path / "api").exists()
    # Replicated (generated arrivals: seeds make runs differ), the same, before any run.
    path.write_text(yaml.safe_dump({
        "name": "w",
        "base": {"workload": {"format": "synthetic", "num_requests": 20, "arrivals": {"qps": 4},
                              "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                                          "output": {"dist": "uniform", "low": 1, "high": 50}}},
                 "replica": {"model": "tiny"}},
        "variants": {"a": {}, "b": {"workload": {"start_s": 100000.0}}}}))
    code, err = run_cli(monkeypatch, capsys, "compare", str(path), "--out", str(out),
                        "--replications", "2", "--workers", "1")
    assert_one_line_error(code, err, "w.cmp.yaml", "variants.b.workload.start_s=100000.0",
                          "holds no request")
    assert not out.exists()


BAD_BASE = """
name: b
seed: -1
workload:
  format: synthetic
  num_requests: 10
  arrivals: {qps: 2}
  lengths: {prompt: {dist: fixed, value: 100}, output: {dist: fixed, value: 5}}
replica: {model: tiny, scheduler: {name: chunked_prefill, token_budget: 512}}
"""


def test_a_base_files_own_problems_are_named_by_it(tmp_path, monkeypatch, capsys):
    """A sweep's or comparison's base scenario file with a bad field: the line names the base
    file and the field as it is written there; a problem an axis brings is still the sweep
    file's."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yaml").write_text(BAD_BASE)
    sweep = tmp_path / "s.sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": "sub/base.yaml", "grid": {
        "replica.scheduler.token_budget": [256, -5]}}))
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(tmp_path / "o"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "base.yaml: seed=-1:" in lines[0] and "s.sweep.yaml" not in lines[0]
    assert "s.sweep.yaml: replica.scheduler.token_budget=-5:" in lines[1]
    comparison = tmp_path / "c.cmp.yaml"
    comparison.write_text(yaml.safe_dump({"name": "c", "base": "sub/base.yaml",
                                          "variants": {"a": {}}}))
    code, err = run_cli(monkeypatch, capsys, "compare", str(comparison), "--out",
                        str(tmp_path / "c"))
    assert_one_line_error(code, err, "base.yaml", "seed=-1")
    assert "c.cmp.yaml" not in err and "variants.a" not in err
    # Set by an option, the same field is the option's.
    code, err = run_cli(monkeypatch, capsys, "compare", str(comparison), "--out",
                        str(tmp_path / "c"), "--set", "seed=-2")
    assert_one_line_error(code, err, "c.cmp.yaml", "--set seed=-2")


def test_a_sizing_sweep_table_shows_gpus_and_cost(tmp_path, monkeypatch, capsys):
    base = {**ONE_AT_A_TIME, "replica": {**ONE_AT_A_TIME["replica"], "gpu": "h100-sxm"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: size\nbase: base.yaml\ngrid:\n  cluster.replicas: [1, 2]\n")
    monkeypatch.setenv("COLUMNS", "80")
    printed, _ = succeed(monkeypatch, capsys, "sweep", str(sweep), "--out",
                         str(tmp_path / "out"), "--workers", "1")
    header = printed[:printed.index("───")]
    assert "GPUs" in header and "M tok" in header
    rows = [line.split() for line in printed.splitlines() if line.strip()[:1] in ("1", "2")]
    assert [row[-3] for row in rows[:2]] == ["1", "2"]  # GPUs, beside the cost
    table = printed[:printed.index("engine calibration")]
    assert max(len(line) for line in table.splitlines()) <= 80
