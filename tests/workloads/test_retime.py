"""Any trace re-timed (`workload.retime`): the selected requests keep their order, lengths and
prefix ids at a Poisson or gamma process's times, Mooncake included; generic CSV and JSON-lines
traces carry prefix ids (`columns.hash_ids`, `hash_block_tokens`); the rate knob of sweeps and
capacity searches is the new rate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload, rate_knob, with_rate
from tests.helpers import assert_one_line_error, run_cli


def mooncake(traces, **workload):
    return parse_scenario({"workload": {
        "format": "mooncake", "path": str(traces / "mooncake_fast25" / "conversation_trace.jsonl"),
        "num_requests": 2000, **workload}}, "test")


def test_a_retimed_mooncake_trace_keeps_its_requests_at_poisson_times(traces):
    plain = load_workload(mooncake(traces))
    retimed = load_workload(mooncake(traces, retime={"process": "poisson", "qps": 50.0}))
    assert np.array_equal(plain.num_prompt_tokens, retimed.num_prompt_tokens)
    assert np.array_equal(plain.num_output_tokens, retimed.num_output_tokens)
    assert plain.hash_ids == retimed.hash_ids and retimed.hash_block_tokens == 512
    gaps = np.diff(retimed.arrival_s)
    assert retimed.arrival_s[0] == 0.0 and (gaps >= 0).all()
    # 1,999 exponential gaps of mean 20 ms: their mean within 10% (7 standard errors) and
    # their coefficient of variation near 1, where the trace's own is not.
    assert abs(gaps.mean() - 0.02) < 0.002
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1
    # Same seed, same times; a gamma process is burstier at the same rate.
    again = load_workload(mooncake(traces, retime={"process": "poisson", "qps": 50.0}))
    assert np.array_equal(again.arrival_s, retimed.arrival_s)
    bursty = np.diff(load_workload(mooncake(
        traces, retime={"process": "gamma", "qps": 50.0, "cv": 3.0})).arrival_s)
    assert bursty.std() / bursty.mean() > 2.0


def test_the_rate_knob_of_a_retimed_trace_is_its_rate(traces):
    scenario = mooncake(traces, retime={"process": "poisson", "qps": 5.0})
    assert rate_knob(scenario) == "qps"
    faster = with_rate(scenario, 20.0, seed=3)
    assert faster.workload.retime.qps == 20.0 and faster.seed == 3


@pytest.mark.parametrize(("workload", "field", "needle"), [
    ({"format": "synthetic", "num_requests": 5, "arrivals": {"qps": 1.0},
      "lengths": {"prompt": {"dist": "fixed", "value": 5},
                  "output": {"dist": "fixed", "value": 5}}},
     "workload.retime", "makes its own arrivals"),
    ({"format": "vidur", "rate_scale": 2.0}, "workload.rate_scale", "no effect with retime"),
])
def test_retime_where_it_cannot_apply_is_refused(tmp_path, monkeypatch, capsys, workload, field,
                                                 needle):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n1,6,6\n")
    path = tmp_path / "s.yaml"
    body = {**workload, "retime": {"process": "poisson", "qps": 2.0}}
    if body["format"] == "vidur":
        body["path"] = str(trace)
    path.write_text(json.dumps({"workload": body}))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", field, needle)


def test_a_generic_trace_carries_prefix_ids(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text('t,p,o,ids\n0,40,5,"[1, 2]"\n0.5,40,5,"[1, 3]"\n')
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 0, "p": 40, "o": 5, "ids": [1, 2]}\n'
                     '{"t": 0.5, "p": 40, "o": 5, "ids": [1, 3]}\n')
    for fmt, path in (("csv", csv), ("jsonl", jsonl)):
        w = load_workload(parse_scenario({"workload": {
            "format": fmt, "path": str(path), "hash_block_tokens": 16,
            "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o",
                        "hash_ids": "ids"}}}, "test"))
        assert w.hash_ids == [(1, 2), (1, 3)] and w.hash_block_tokens == 16


def test_bad_prefix_ids_are_one_line_errors(tmp_path, monkeypatch, capsys):
    csv = tmp_path / "t.csv"
    csv.write_text('t,p,o,ids\n0,40,5,"[1, 2]"\n0.5,40,5,"one, two"\n')
    scenario = tmp_path / "s.yaml"
    columns = {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o", "hash_ids": "ids"}
    scenario.write_text(json.dumps({"workload": {
        "format": "csv", "path": str(csv), "hash_block_tokens": 16, "columns": columns}}))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "t.csv", "line 3", "must be a list of ints")
    scenario.write_text(json.dumps({"workload": {"format": "csv", "path": str(csv),
                                                 "columns": columns}}))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", "workload.hash_block_tokens", "comes with")
