"""`servesim calibrate`: a stage table read as experiments, and a fit that finds the
coefficients a known calibration made the "measurements" with (simulated here, so the truth is
known), its front end included."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from sim.cli.app import app
from sim.config.engine import load_calibration
from sim.config.errors import InputError
from sim.studies.calibrate import fit_frontend
from sim.studies.measured import METRICS, STAGE_COLUMNS, Stage, read_stages, simulate
from tests.helpers import assert_one_line_error, run_cli

MODEL = Path(__file__).resolve().parents[2] / "sim" / "data" / "models" / "llama-2-7b.json"
TRUTH = {"name": "truth", "engine": "vllm test", "latency": {"attention_mbu": 0.85},
         "frontend_s": 0.005, "frontend_per_extra_gpu_s": 0.001}


def row(experiment: str, tp: int, stage: int, rate: float) -> dict[str, Any]:
    return {"experiment": experiment, "row_type": "stage", "stage_index": stage,
            "stage_rate_req_per_s": rate, "stage_duration_s": 40, "overloaded_measured": "false",
            "model_hf": f"llama-tp{tp}", "model_config": str(MODEL), "tensor_parallel_size": tp,
            "gpu": "NVIDIA H100 80GB HBM3 (SXM)", "engine": "vllm", "engine_version": "0.15.1",
            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "chunked_prefill": "true",
            "prefix_caching": "true", "gpu_memory_utilization": 0.9, "kv_block_size_tokens": 16,
            "data_generator": "shared_prefix", "system_prompt_len_tokens": 100,
            "question_len_tokens": 200, "prompt_len_client_mean_tokens": 300, "max_tokens": 40,
            "num_groups": 2, "num_prompts_per_group": 5}


def measured_table(tmp_path: Path) -> Path:
    """Two experiments (TP1 and TP2, two stages each) 'measured' by simulating them with the
    TRUTH calibration."""
    truth = tmp_path / "truth.yaml"
    truth.write_text(yaml.safe_dump(TRUTH))
    rows = [row("a-tp1", 1, 0, 3.0), row("a-tp1", 1, 1, 6.0),
            row("b-tp2", 2, 0, 3.0), row("b-tp2", 2, 1, 6.0)]
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(STAGE_COLUMNS))
        writer.writeheader()
        for exp in ("a-tp1", "b-tp2"):
            stages = [r for r in rows if r["experiment"] == exp]
            writer.writerows(stages)  # placeholders, read to build the scenario below
    experiments = read_stages(path)
    for exp in experiments:
        sims = simulate((exp, {"engine": str(truth)}))
        for r, got in zip([r for r in rows if r["experiment"] == exp.name], sims, strict=True):
            r.update({column: got[name] for name, column, _, _ in METRICS})
            assert not got["overloaded"]  # measured so: every stage is compared
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(STAGE_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_calibrate_finds_the_coefficients_the_runs_were_made_with(tmp_path: Path):
    path = measured_table(tmp_path)
    out = tmp_path / "fitted.yaml"
    result = CliRunner().invoke(app, ["calibrate", str(path), "--out", str(out),
                                      "--grid", "attention_mbu=0.8,0.85,0.9", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    fitted = load_calibration(out)
    assert fitted.name == "fitted" and fitted.latency == {"attention_mbu": 0.85}
    assert fitted.frontend_s == pytest.approx(0.005, abs=1e-6)
    assert fitted.frontend_per_extra_gpu_s == pytest.approx(0.001, abs=1e-6)
    assert "TPOT mean 0.0%" in fitted.error and "runs.csv sha256" in fitted.provenance
    assert "equal at 4 of 4 stages" in fitted.error
    assert "leave one model out" in result.output
    # Leaving a model out still finds the same point: the other model's runs pin it.
    assert "llama-tp1" in result.output and "llama-tp2" in result.output


def test_fit_frontend_is_a_line_in_gpus_never_below_zero():
    def stage(gpus: int, measured_ms: float) -> Stage:
        return Stage("s", "m", gpus, False, {"TTFT mean": measured_ms})

    stages = [stage(1, 17.0), stage(2, 18.0), stage(4, 20.0)]
    sims = [{"TTFT mean": 10.0}] * 3
    assert fit_frontend(stages, sims) == pytest.approx((0.007, 0.001))
    # One GPU count: no slope; residuals below zero: no front end.
    assert fit_frontend(stages[:1], sims[:1]) == pytest.approx((0.007, 0.0))
    assert fit_frontend([stage(1, 5.0)], sims[:1]) == (0.0, 0.0)


def test_a_table_missing_a_column_or_naming_an_unknown_gpu_is_one_line(tmp_path: Path):
    path = tmp_path / "runs.csv"
    path.write_text("experiment,row_type\nx,stage\n")
    with pytest.raises(InputError) as err:
        read_stages(path)
    assert err.value.source == str(path) and err.value.field == "stage_index"
    values = row("x", 1, 0, 2.0) | {"gpu": "RTX 9090", **{c: 1 for _, c, _, _ in METRICS}}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(STAGE_COLUMNS))
        writer.writeheader()
        writer.writerow(values)
    with pytest.raises(InputError) as err:
        read_stages(path)
    assert err.value.field == "gpu" and "--gpu" in err.value.problem
    assert read_stages(path, gpu="h100-sxm")[0].gpu == "h100-sxm"


def test_calibrate_reads_a_vllm_benchmark_result_beside_its_deployment(tmp_path: Path,
                                                                       monkeypatch, capsys):
    """A run exported as `vllm bench serve` writes it (client-side TTFT and E2E), read back as
    a trace (`format: vllm_bench`) on the deployment it names: the fit finds the truth."""
    truth = tmp_path / "truth.yaml"
    truth.write_text(yaml.safe_dump(TRUTH))
    replica = {"model": "llama-2-7b", "scheduler": {"name": "vllm_v1", "max_num_seqs": 64}}
    workload = {"format": "synthetic", "num_requests": 150, "arrivals": {"qps": 5.0},
                "lengths": {"prompt": {"dist": "uniform", "low": 100, "high": 900},
                            "output": {"dist": "uniform", "low": 10, "high": 60}}}
    (tmp_path / "measured.yaml").write_text(yaml.safe_dump(
        {"name": "measured", "workload": workload, "replica": {**replica, "engine": "truth.yaml"}}))
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(
        {"name": "deployment", "workload": workload, "replica": replica}))
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", str(tmp_path / "measured.yaml"),
                                 "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["export", str(tmp_path / "run"), "--format", "vllm",
                                 "--out", str(tmp_path / "bench.json")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "fitted.yaml"
    args = ["calibrate", str(tmp_path / "bench.json"), "--out", str(out),
            "--grid", "attention_mbu=0.8,0.85,0.9", "--jobs", "1"]
    code, err = run_cli(monkeypatch, capsys, *args)  # no deployment: one line, exit 2
    assert_one_line_error(code, err, "bench.json", "--deployment")
    result = runner.invoke(app, [*args, "--deployment", str(tmp_path / "deployment.yaml")])
    assert result.exit_code == 0, result.output
    fitted = load_calibration(out)
    assert fitted.latency == {"attention_mbu": 0.85}
    assert fitted.frontend_s == pytest.approx(0.005, abs=1e-6)
    assert "TPOT mean 0.0%" in fitted.error and "verdict" not in fitted.error


def test_an_engine_run_with_per_request_timestamps_reads_back_exactly(tmp_path: Path):
    """A run in LLMServingSim's layout (meta.json, requests.jsonl of engine timestamps), made
    here from a servesim run, simulates back to its own statistics (engine-side)."""
    import json

    from sim import run_scenario
    from sim.config.scenario import parse_scenario
    from sim.studies.measured import errors_pct, read_engine_run

    truth = run_scenario(parse_scenario({
        "workload": {"format": "synthetic", "num_requests": 120, "arrivals": {"qps": 6.0},
                     "lengths": {"prompt": {"dist": "uniform", "low": 100, "high": 1500},
                                 "output": {"dist": "uniform", "low": 20, "high": 200}}},
        "replica": {"model": "llama-2-7b", "prefix_caching": True,
                    "scheduler": {"name": "vllm_v1", "max_num_seqs": 64,
                                  "max_num_batched_tokens": 2048}}}, "truth"))
    run = tmp_path / "vllm"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"vllm_version": "test", "engine_kwargs": {
        "model": "meta-llama/Llama-2-7b-hf", "tensor_parallel_size": 1,
        "data_parallel_size": 1, "max_num_seqs": 64, "max_num_batched_tokens": 2048}}))
    req = truth.requests.sort_values("arrival_s")
    with open(run / "requests.jsonl", "w") as f:
        for r in req.itertuples():
            f.write(json.dumps({"input_toks": r.num_prompt_tokens,
                                "output_toks": r.num_output_tokens,
                                "queued_ts": 1000 + r.arrival_s,
                                "first_token_ts": 1000 + r.first_token_s,
                                "last_token_ts": 1000 + r.finish_s}) + "\n")
    experiment = read_engine_run(run, gpu="h100-sxm")
    sims = simulate((experiment, {}))
    errors = errors_pct(experiment.stages, sims, np.zeros(1))[0]
    assert all(abs(e) < 1e-6 for e in errors.values() if e is not None), errors
    assert experiment.stages[0].measured_ms["TTFT mean"] == pytest.approx(
        1e3 * truth.summary["ttft_s"]["mean"])  # engine-side: no front end


def test_a_run_with_a_cpu_tier_is_simulated_with_it(tmp_path: Path):
    """The public H100 runs had vLLM's KV offloading on (`kv_cpu_offload_connector`,
    OffloadingConnector, 8 GiB): read as `replica.kv_offload`; another connector is refused."""
    path = tmp_path / "runs.csv"
    values = row("x", 1, 0, 2.0) | {c: 1 for _, c, _, _ in METRICS}
    columns = [*STAGE_COLUMNS, "kv_cpu_offload_connector", "kv_cpu_offload_size_GiB"]
    for connector, expect in (("OffloadingConnector", {"size_gib": 8.0}), ("", None),
                              ("LMCacheConnectorV1", "refused")):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerow(values | {"kv_cpu_offload_connector": connector,
                                      "kv_cpu_offload_size_GiB": 8})
        if expect == "refused":
            with pytest.raises(InputError) as err:
                read_stages(path)
            assert err.value.field == "kv_cpu_offload_connector"
            continue
        assert read_stages(path)[0].scenario["replica"].get("kv_offload") == expect
