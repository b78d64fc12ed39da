"""A run says on which machine its latencies were measured, and when that is not its GPU."""

from __future__ import annotations

import json

import pytest

from sim import load_scenario, run_scenario
from sim.hardware.gpus import measured_on
from tests.helpers import REPO


@pytest.mark.parametrize(("gpu", "device", "same"), [
    ("h100-sxm", "NVIDIA H100 80GB HBM3", True),
    ("a100-80gb", "NVIDIA A100-SXM4-80GB", True),
    ("h200", "NVIDIA H200", True),
    ("h100-sxm", "NVIDIA H200", False),
    ("h100-sxm", "cpu: AMD EPYC 7B13", False),
])
def test_a_device_is_matched_to_its_gpu_kind_by_family(gpu, device, same):
    assert measured_on(gpu, device) is same


def test_a_cpu_profile_run_on_the_default_gpu_says_whose_capacity_and_cost_it_reports():
    scenario = load_scenario(REPO / "scenarios" / "tiny_cpu_profile.yaml")
    device = json.loads((REPO / "profiles" / "cpu_tiny.json").read_text())["device_name"]
    run = run_scenario(scenario).summary["run"]
    assert run["latency_measured_on"] == device
    gpu = run["gpu"]
    assert run["latency_device_note"] == (
        f"latencies measured on {device}, not on {gpu}; GPU count, KV capacity and cost are "
        f"those of {gpu} (replica.gpu)")


def test_runs_without_measured_latencies_carry_no_device(tmp_path):
    text = (REPO / "scenarios" / "tiny_cpu_profile.yaml").read_text().replace(
        "{kind: profile, path: ../profiles/cpu_tiny.json}", "{kind: roofline}")
    (tmp_path / "s.yaml").write_text(text)
    run = run_scenario(load_scenario(tmp_path / "s.yaml")).summary["run"]
    assert "latency_measured_on" not in run and "latency_device_note" not in run


def test_simulate_prints_the_note(monkeypatch, capsys, tmp_path):
    from tests.helpers import run_cli_out
    code, out = run_cli_out(monkeypatch, capsys, "simulate",
                            str(REPO / "scenarios" / "tiny_cpu_profile.yaml"),
                            "--out", str(tmp_path / "o"))
    assert code == 0
    assert "other device: latencies measured on cpu: " in " ".join(out.split())
