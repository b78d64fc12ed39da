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
from sim.studies.compare import compare, load_comparison
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import Run, load_sweep
from tests.helpers import REPO
from tests.helpers import run_cli_out as cli


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


def first_requests(scenario, n: int = 300):
    """Keep a test short: the first few hundred requests of a scenario."""
    workload = scenario.workload.model_copy(update={"num_requests": n})
    return scenario.model_copy(update={"workload": workload})


SHIPPED = sorted((REPO / "scenarios").glob("*.yaml"))


def kind(path: Path) -> str:
    text = path.read_text()
    if "\ntarget_qps:" in text or "\nsearch:" in text:
        return "plan"
    return "comparison" if "variants:" in text else "sweep" if "\ngrid:" in text else "scenario"


@pytest.mark.parametrize("path", [p for p in SHIPPED if kind(p) == "scenario"],
                         ids=lambda p: p.name)
def test_shipped_scenarios_run(path: Path, traces):
    results = run_scenario(first_requests(load_scenario(path)))
    assert results.summary["requests"]["finished"] + results.summary["requests"]["rejected"] == 300


@pytest.mark.parametrize("path", [p for p in SHIPPED if kind(p) == "sweep"],
                         ids=lambda p: p.name)
def test_shipped_sweeps_run(path: Path, traces, tmp_path):
    _, runs = load_sweep(path)
    assert len(runs) >= 6
    small = [Run(r.point, r.seed, first_requests(r.scenario, 200)) for r in runs[:3]]
    table = run_sweep(small, tmp_path)
    assert (table["finished"] == 200).all()


SLOW_COMPARISONS = {"compare_prefix_caching.yaml"}  # 20 s of Mooncake conversations


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_COMPARISONS else p
    for p in SHIPPED if kind(p) == "comparison"], ids=lambda p: p.name)
def test_shipped_comparisons_run(path: Path, traces, tmp_path):
    scenarios = {k: first_requests(s) for k, s in load_comparison(path).items()}
    table, results = compare(scenarios, tmp_path)
    assert len(table) == len(scenarios) >= 3
    assert (table["finished"] == 300).all()
    assert (tmp_path / "comparison.csv").is_file()
    for variant in scenarios:
        assert (tmp_path / variant / "summary.json").is_file()


COMPARISON = """
name: cmp
base:
  workload:
    format: synthetic
    num_requests: 60
    arrivals: {qps: 20}
    lengths:
      prompt: {dist: uniform, low: 100, high: 2000}
      output: {dist: uniform, low: 5, high: 60}
  replica: {scheduler: {name: chunked_prefill, token_budget: 256}}
variants:
  colocated: {cluster: {replicas: 2}}
  first: {cluster: {replicas: 2}, replica: {scheduler: {name: prefill_first}}}
  split: {cluster: {prefill: {replicas: 1}, decode: {replicas: 1}}}
"""


def test_compare_command_prints_one_table(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON)
    code, out = cli(monkeypatch, capsys, "compare", str(path), "--out", str(tmp_path / "r"))
    assert code == 0
    for text in ("colocated", "first", "split", "1P+1D", "P99 TBT ms", "P99 KV transfer"):
        assert text in out
    rows = pd.read_csv(tmp_path / "r" / "comparison.csv")
    assert rows["scheduler"].tolist() == ["chunked_prefill", "prefill_first",
                                          "chunked_prefill/chunked_prefill"]


def test_compare_refuses_a_folder_of_other_files(tmp_path, monkeypatch, capsys):
    # A comparison replaces the tables in --out: a user's folder keeps its files.
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "comparison_replications.csv").write_text("kept\n")
    (folder / "notes.txt").write_text("kept\n")
    monkeypatch.setattr(sys, "argv", ["servesim", "compare", str(path), "--out", str(folder)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "holds notes.txt" in err and len(err.strip().splitlines()) == 1
    assert (folder / "comparison_replications.csv").read_text() == "kept\n"


def test_bad_comparison_names_the_variant(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON.replace("colocated: {cluster: {replicas: 2}}",
                                       "colocated: {cluster: {replicas: 0}}"))
    monkeypatch.setattr(sys, "argv", ["servesim", "compare", str(path)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert "variants.colocated.cluster.replicas=0" in capsys.readouterr().err


def test_list_params_give_units_and_allowed_values_in_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code, out = cli(monkeypatch, capsys, "list", "--params")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out  # a long word (an engine flag's name) folds, it is not cut
    from sim.cli.listing import MIN_MEANING_COLUMNS

    lines: dict[str, str] = {}  # parameter -> its row, wrapped lines joined
    last = ""
    for line in out.splitlines():
        raw = line.split("│")[1:-1]
        cells = [c.strip() for c in raw]
        if len(cells) == 3:  # parameter | default | meaning, the meaning wide enough to read
            assert len(raw[2]) >= MIN_MEANING_COLUMNS + 2
            last = cells[0] or last
            lines[last] = " ".join(filter(None, (lines.get(last, ""), *cells[1:])))
        elif len(cells) == 1 and raw[0].startswith(" " * 5):  # a meaning, beneath its parameter
            lines[last] += " " + cells[0]
        elif len(cells) == 1 and " = " in cells[0]:  # a parameter = its default
            last, default = cells[0].split(" = ", 1)
            lines[last] = " ".join(filter(None, (lines.get(last, ""), default)))
    assert "hierarchical_cache.write_policy" in lines  # (SGLang's long names: stacked)
    assert "0.002 s" in lines["overhead_s"] and "0<=x<=1" in lines["overhead_s"]
    assert "one of: calibrated, naive" in lines["linear"]  # from its Literal type
    assert "8192 tokens" in lines["max_num_batched_tokens"]
    for nested in ("noise.kind", "noise.sigma", "noise.correlation"):  # flattened, not repr'd
        assert nested in lines
    assert "x>0" in lines["max_num_seqs"] and "256 requests" in lines["max_num_seqs"]
    # A unit the name does not carry comes from the field's own schema.
    assert "512 tokens" in lines["token_budget"]
    # SGLang's chunk, resolved by the GPU, says so.
    assert lines["chunked_prefill_size"].startswith("by the GPU")


def test_list_without_params_says_how_to_see_them(monkeypatch, capsys):
    code, out = cli(monkeypatch, capsys, "list")
    assert code == 0 and "servesim list --params" in out


COMMANDS = ("simulate", "list", "compare", "sweep", "capacity", "profile", "fit", "replay",
            "validate")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_80_columns_and_shows_defaults(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code, out = cli(monkeypatch, capsys, command, "--help")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if "…" in line]  # nothing cut off
    defaults = {"simulate": "results/<scenario", "compare": "results/<name>",
                "sweep": "[default: local]", "capacity": "results/<scenario",
                "replay": "best here", "validate": "validation/<name>"}
    if command in defaults:  # the custom defaults are shown, not swallowed as markup
        assert defaults[command] in out
    if command in ("simulate", "compare", "sweep", "capacity"):
        assert "--set" in out and "PATH=VALUE" in out


def test_top_level_help_lists_each_command_on_unbroken_lines(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = cli(monkeypatch, capsys, "--help")
    assert code == 0
    # At 200 columns each command's summary is one line: the docstring's own breaks are gone.
    row = next(line for line in out.splitlines() if "capacity " in line)
    assert row.rstrip(" │").endswith("as an interval.")


def test_table_numbers_are_never_in_exponent_form():
    from sim.cli.common import fmt

    assert fmt(274.2, 1e3) == "274,200"
    assert fmt(16037.4) == "16,037"
    assert fmt(9999.4) == "9,999"
    assert fmt(9_999_999.4) == "9,999,999"  # the widest whole number, 9 characters
    assert fmt(11_854_512.0) == "1.185e+07"  # then an exponent: an 80-column table cuts none
    assert fmt(12.3456) == "12.35"
    assert fmt(None) == fmt(float("nan")) == "-"


@pytest.mark.parametrize(("args", "needles"), [
    (["simulate", "--workers", "3"], ["--workers=3", "only with --replications"]),
    (["compare", "COMPARISON", "--workers", "2"], ["--workers=2", "only with --replications"]),
    (["sweep", "SWEEP", "--address", "10.0.0.1:6379"],
     ["--address='10.0.0.1:6379'", "only with --backend ray"]),
    (["export", "RUN", "--format", "chrome", "--percentiles", "50"],
     ["--percentiles='50'", "only with --format vllm"]),
    (["export", "RUN", "--format", "chrome", "--summary-only"],
     ["--summary-only=True", "only with --format vllm"]),
    (["export", "RUN", "--format", "vllm", "--num-flows", "5"],
     ["--num-flows=5", "only with --format chrome"]),
])
def test_an_option_this_command_would_ignore_is_refused(args, needles, tmp_path, monkeypatch,
                                                        capsys):
    """An option given where it does nothing (workers for one run, a Ray address for local
    processes, another export format's option) is one line, before anything runs or is
    written, not dropped in silence."""
    from tests.helpers import assert_one_line_error, run_cli

    comparison = tmp_path / "c.yaml"
    comparison.write_text("name: c\nbase: {}\nvariants: {a: {}, b: {seed: 3}}\n")
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {}\ngrid: {seed: [1, 2]}\n")
    run = tmp_path / "run"
    run_scenario(None, out_dir=run) if args[0] == "export" else None
    given = [{"COMPARISON": str(comparison), "SWEEP": str(sweep), "RUN": str(run)}.get(a, a)
             for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_cli(monkeypatch, capsys, *given, "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "<command line>", *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
