"""An inference-perf results folder (`config.yaml` and `stage_<i>_lifecycle_metrics.json`, as
the tool writes them) read as a measured experiment: the public H100 runs, written back into
that layout from `../shared/realruns/h100_vllm0151/runs.csv` (the figures the upstream files
held, at the table's rounding, in a temporary folder), read into the same experiment as the
stage table gives: workload, stages, measured statistics (TPOT corrected for the server's two
SSE messages per token), overload and success shares. Bad folders are one line."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from sim.studies.inference_perf import read_inference_perf
from sim.studies.measured import read_measured, read_stages
from tests.helpers import TRACES, assert_one_line_error, run_cli

REALRUNS = TRACES.parent / "realruns" / "h100_vllm0151"
NAME = "llama-2-7b-tp1-general"


def rows() -> list[dict[str, str]]:
    if not (REALRUNS / "runs.csv").is_file():
        pytest.skip(f"{REALRUNS} is missing: the public measurements are not here")
    with open(REALRUNS / "runs.csv", newline="") as f:
        return [r for r in csv.DictReader(f)
                if r["experiment"] == NAME and r["row_type"] == "stage"]


def stat(row: dict[str, str], prefix: str, stat_: str) -> float:
    return float(row[f"{prefix}_{stat_}_ms"]) / 1e3


def write_run(folder, stages, **changes):
    """The inference-perf layout of `stages` (rows of runs.csv)."""
    folder.mkdir()
    first = stages[0]
    config = {"data": {"type": "shared_prefix", "shared_prefix": {
        "num_groups": int(first["num_groups"]),
        "num_prompts_per_group": int(first["num_prompts_per_group"]),
        "system_prompt_len": int(first["system_prompt_len_tokens"]),
        "question_len": int(first["question_len_tokens"]),
        "output_len": int(first["max_tokens"])}},
        "load": {"type": "constant", "stages": [
            {"rate": float(r["stage_rate_req_per_s"]), "duration": float(r["stage_duration_s"])}
            for r in stages]},
        "api": {"type": "completion", "streaming": True}, "server": {"ignore_eos": True}}
    for key, value in changes.items():
        section, field = key.split(".")
        config[section][field] = value
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    for i, r in enumerate(stages):
        latency = {
            "time_to_first_token": {"mean": stat(r, "ttft", "mean"),
                                    "median": stat(r, "ttft", "p50"),
                                    "p99": stat(r, "ttft", "p99")},
            "time_per_output_token": {"mean": stat(r, "tpot_per_sse_message", "mean"),
                                      "median": stat(r, "tpot_per_sse_message", "p50")},
            "request_latency": {"mean": stat(r, "e2e", "mean")}}
        (folder / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps({
            "load_summary": {"count": int(r["requests_sent"])},
            "successes": {"count": int(r["requests_succeeded"]), "latency": latency,
                          "prompt_len": {"mean": float(r["prompt_len_client_mean_tokens"])}},
            "failures": {"count": int(r["requests_failed"])}}))


def deployment(tmp_path, row):
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"name": "server", "replica": {
        "model": str(REALRUNS.parent / row["model_config"]), "gpu": "h100-sxm",
        "scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 2048, "max_num_seqs": 128},
        "kv_cache": {"block_size": 16, "gpu_memory_utilization": 0.9},
        "prefix_caching": True}}))
    return path


def test_the_public_runs_read_as_the_stage_table_reads_them(tmp_path):
    stages = rows()
    write_run(tmp_path / NAME, stages)
    [got] = read_measured(tmp_path / NAME, deployment=deployment(tmp_path, stages[0]))
    want = next(e for e in read_stages(REALRUNS / "runs.csv") if e.name == NAME)
    assert [s.name for s in got.stages] == [s.name for s in want.stages]
    assert got.scenario["workload"] == want.scenario["workload"]
    for g, w in zip(got.stages, want.stages, strict=True):
        assert g.overloaded == w.overloaded and g.succeeded == pytest.approx(w.succeeded)
        for metric, value in w.measured_ms.items():
            # TPOT through the SSE correction, from figures rounded in the table.
            assert g.measured_ms[metric] == pytest.approx(value, rel=2e-3), metric


@pytest.mark.parametrize("change,field,needle", [
    ({"server.ignore_eos": False}, "server.ignore_eos", "needs ignore_eos: true"),
    ({"data.type": "random"}, "data.type", "only shared_prefix runs"),
])
def test_bad_runs_are_one_line(tmp_path, monkeypatch, capsys, change, field, needle):
    stages = rows()
    write_run(tmp_path / "run", stages, **change)
    code, err = run_cli(monkeypatch, capsys, "calibrate", str(tmp_path / "run"),
                        "--deployment", str(deployment(tmp_path, stages[0])),
                        "--out", str(tmp_path / "e.yaml"))
    assert_one_line_error(code, err, "config.yaml", field, needle)


def test_a_missing_stage_file_and_no_deployment_are_one_line(tmp_path, monkeypatch, capsys):
    stages = rows()
    write_run(tmp_path / "run", stages)
    code, err = run_cli(monkeypatch, capsys, "calibrate", str(tmp_path / "run"),
                        "--out", str(tmp_path / "e.yaml"))
    assert_one_line_error(code, err, "needs --deployment")
    (tmp_path / "run" / "stage_1_lifecycle_metrics.json").unlink()
    with pytest.raises(Exception, match="stage_1_lifecycle_metrics.json"):
        read_inference_perf(tmp_path / "run", deployment(tmp_path, stages[0]))
