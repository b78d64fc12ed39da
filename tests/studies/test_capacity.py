"""The capacity search (`servesim capacity`, `sim.studies.capacity`): the known capacity of one
request at a time, halving where load no longer matters, overload as a violation, deterministic
and noisy replays decided by replications, an unbounded upper end, and its printed lines."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import yaml

from sim.cli import main
from sim.config.scenario import parse_scenario
from sim.runner import run_scenario
from sim.studies.capacity import capacity
from sim.studies.capacity_log import CapacityLog
from sim.studies.rate_decision import SLOTargets, violations
from sim.workloads.load import with_rate
from tests.helpers import ONE_AT_A_TIME, assert_one_line_error, csv_replay, run_cli
from tests.helpers import run_cli_out as cli
from tests.studies.test_rate_decision import fake_results
from tests.studies.test_sweep import write


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


def test_capacity_with_no_failing_rate_has_an_unbounded_upper_end(tmp_path, monkeypatch,
                                                                   capsys):
    from sim.cli.study import capacity_table
    from sim.plots import plot_capacity
    from tests.helpers import ONE_AT_A_TIME

    scenario = parse_scenario(ONE_AT_A_TIME, "test")
    draws = iter(np.random.default_rng(0).uniform(0.01, 0.02, 1000))

    def run(s):
        return fake_results({}, p90=float(next(draws)))

    log = CapacityLog(tmp_path / "cap")
    targets = SLOTargets(ttft_p90_s=1.0)
    result = capacity(scenario, targets, 3, max_steps=2, run=run, on_trial=log.add)
    assert result["interval_qps"][1] is None and result["ci95_qps"][1] is None
    assert result["ci95_qps"][0] == result["capacity_qps"] > 0
    assert "unbounded" in result["interval_meaning"]
    assert "per probed rate" in result["interval_meaning"]
    log.finish(scenario, targets, 0.02, result)
    saved = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert saved["ci95_qps"][1] is None
    capsys.readouterr()
    from sim.cli.common import console
    console.print(capacity_table("test", result))
    assert "unbounded" in " ".join(capsys.readouterr().out.split())
    files = plot_capacity([tmp_path / "cap"])
    assert any(f.name == "capacity.png" for f in files)


def test_capacity_lines_show_milliseconds_never_equal_to_a_target_they_miss():
    from sim.studies.rate_decision import ms

    assert ms(0.03928) == "39.28 ms"
    assert ms(2.0) == "2,000 ms"
    assert ms(math.inf) == "unbounded"
    # 40.0003 ms misses a 40 ms target: shown with the digits that say so, not "40 > 40".
    assert ms(0.0400003, 0.04) == "40.0003 ms"
    assert ms(0.04, 0.04) == "40 ms"


def test_capacity_of_one_request_at_a_time_is_one_over_service_time():
    scenario = parse_scenario(ONE_AT_A_TIME, "test")
    result = capacity(scenario, SLOTargets(sched_delay_p50_s=0.5), [0, 1], precision=0.01)
    assert result["knob"] == "qps"
    assert result["capacity_qps"] == pytest.approx(10.0, rel=0.03)
    low, high = result["ci95_qps"]
    assert low <= 10.0 <= high  # the interval brackets the known answer
    assert low == result["capacity_qps"] and 0 < high - low <= 0.03 * high
    trials = [t for d in result["rates"] for t in d.trials]
    assert any(t.ok for t in trials) and any(not t.ok for t in trials)
    assert result["num_runs"] == len(trials)


def test_capacity_stops_halving_where_load_no_longer_matters():
    """A TTFT target below one unloaded iteration (0.1 s) cannot be met at any rate: once a
    rate and half of it miss alike, the search stops and says why (it halved 116 times, to
    6e-08 req/s, before)."""
    scenario = parse_scenario(ONE_AT_A_TIME, "test")
    result = capacity(scenario, SLOTargets(ttft_p90_s=0.05), [0, 1], precision=0.01)
    assert result["capacity_qps"] == 0.0
    assert len(result["rates"]) <= 3, [d.qps for d in result["rates"]]
    assert len(result["stopped"]) == 1 and "P90 TTFT 100 ms > 50 ms" in result["stopped"][0]
    assert "below what an unloaded server gives" in result["interval_meaning"]


def test_overload_is_a_violation_even_when_percentiles_pass():
    scenario = parse_scenario(ONE_AT_A_TIME, "test")
    over = run_scenario(with_rate(scenario, 12.0, 0))  # 20% over capacity: the queue grows
    assert over.summary["overload"]["verdict"] == "overloaded"
    # TBT is trivially met (one output token each), yet the run must count as a violation.
    found = violations(over, SLOTargets(tbt_p99_s=0.1))
    assert len(found) == 1 and found[0].startswith("overloaded: "), found
    under = run_scenario(with_rate(scenario, 8.0, 0))
    assert under.summary["overload"]["verdict"] == "stable"
    assert violations(under, SLOTargets(tbt_p99_s=0.1)) == []


def test_capacity_command(tmp_path, monkeypatch, capsys):
    import yaml

    path = write(tmp_path, "s.yaml", yaml.safe_dump(ONE_AT_A_TIME))
    monkeypatch.setattr(sys, "argv", ["servesim", "capacity", str(path), "--sched-delay-p50",
                                      "0.5", "--precision", "0.05", "--out",
                                      str(tmp_path / "cap")])
    main()
    out = capsys.readouterr().out
    assert "capacity in [" in out and "95% confidence" in out and "overloaded" in out


def test_capacity_is_searched_again_at_the_ends_of_the_error_band(tmp_path, monkeypatch,
                                                                  capsys):
    # A roofline replica on the calibrated H100: its band is the calibration's 7%. Slower
    # iteration times hold less, faster ones more; the interval with the band holds both.
    from sim.studies.capacity import latency_band

    scenario = parse_scenario({"seed": 0, "workload": {
        "format": "synthetic", "num_requests": 200, "arrivals": {"process": "gamma", "qps": 20,
                                                                  "cv": 1e-3},
        "lengths": {"prompt": {"dist": "fixed", "value": 300},
                    "output": {"dist": "fixed", "value": 50}}}}, "test")
    assert latency_band(scenario) == (0.07, False)
    h200 = scenario.model_copy(update={"replica": scenario.replica.model_copy(
        update={"gpu": "h200"})})
    assert latency_band(h200) == (0.25, True)
    result = capacity(scenario, SLOTargets(tbt_p99_s=0.03), 1, precision=0.05, band=0.07)
    ends = result["band"]
    assert ends["slow"]["capacity_qps"] < result["capacity_qps"] < ends["fast"]["capacity_qps"]
    low, high = result["with_band_qps"]
    assert low == ends["slow"]["interval_qps"][0] and high == ends["fast"]["interval_qps"][1]
    assert low <= result["interval_qps"][0] and high >= result["interval_qps"][1]
    path = write(tmp_path, "s.yaml", "workload: {format: synthetic, num_requests: 5, "
                                     "arrivals: {qps: 1}, lengths: {prompt: {dist: fixed, "
                                     "value: 5}, output: {dist: fixed, value: 5}}}\n")
    code, err = run_cli(monkeypatch, capsys, "capacity", str(path), "--tbt-p99", "0.1",
                        "--band", "2", "--out", str(tmp_path / "c"))
    assert_one_line_error(code, err, "--band", "a fraction in [0, 1)")
