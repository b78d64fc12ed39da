"""`servesim fit-workload`: a synthetic generator fitted to a trace reproduces its marginals
(KS distances), burstiness and length correlation, on the Azure conversation trace and on a
generated trace of known parameters; a trace with sessions (Mooncake's) gets a `prefix`
generator that keeps its prefix reuse and sessions, and a generated one gives back its
parameters; bursts at one instant get the trace's own gaps; the empirical length distribution
and the copula it draws through; the written scenario runs; bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from scipy.stats import spearmanr

from sim.config.errors import InputError
from sim.config.scenario import load_scenario, parse_scenario
from sim.studies.fit_workload import (
    block_reuse,
    fit_arrivals,
    fit_workload,
    ks_distance,
    session_shape,
)
from sim.workloads.base import ArrivalConfig
from sim.workloads.load import load_workload
from sim.workloads.synthetic import LengthsConfig, TokenDist
from tests.helpers import assert_one_line_error, run_cli, run_cli_out


def azure(traces, n=5000):
    return parse_scenario({"workload": {
        "format": "azure", "num_requests": n,
        "path": str(traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")}}, "test")


def test_the_azure_conversation_trace_is_fitted_closely(traces):
    fit = fit_workload(azure(traces))
    report = fit.report
    assert max(report["ks"].values()) < 0.05
    cv = report["burstiness_cv"]
    assert abs(cv["fitted"] - cv["trace"]) < 0.1
    corr = report["length_rank_correlation"]
    assert abs(corr["fitted"] - corr["trace"]) < 0.05
    assert fit.workload["lengths"]["prompt"]["dist"] == "empirical"


def test_a_generated_trace_gives_back_its_parameters():
    data = {"workload": {"format": "synthetic", "num_requests": 20_000,
                         "arrivals": {"process": "gamma", "qps": 12.0, "cv": 2.0},
                         "lengths": {"prompt": {"dist": "lognormal", "mean": 800, "std": 600},
                                     "output": {"dist": "lognormal", "mean": 200, "std": 150},
                                     "rank_correlation": 0.5}}, "seed": 4}
    fit = fit_workload(parse_scenario(data, "test"))
    arrivals = fit.workload["arrivals"]
    assert arrivals["process"] == "gamma"
    assert arrivals["qps"] == pytest.approx(12.0, rel=0.05)
    assert arrivals["cv"] == pytest.approx(2.0, rel=0.05)
    assert fit.workload["lengths"]["rank_correlation"] == pytest.approx(0.5, abs=0.03)
    assert max(fit.report["ks"].values()) < 0.03


def mooncake(traces, **extra):
    return parse_scenario({"workload": {
        "format": "mooncake", **extra,
        "path": str(traces / "mooncake_fast25" / "conversation_trace.jsonl")}}, "test")


def test_mooncake_conversations_are_fitted_with_their_sessions_and_prefixes(traces):
    fit = fit_workload(mooncake(traces))
    workload, report = fit.workload, fit.report
    assert workload["format"] == "prefix" and report["generator"] == "prefix"
    # Every first turn starts with the same 512-token block: one shared system prompt.
    assert workload["system_prompt_tokens"] == 512 and workload["num_groups"] == 1
    assert workload["hash_block_tokens"] == 512
    # Its ticks (most requests at the same instant as the one before): the trace's own gaps.
    assert workload["arrivals"]["process"] == "empirical"
    ks = report["ks"]
    assert ks["prompt_tokens"] < 0.05 and ks["output_tokens"] < 0.02
    reuse = report["prefix_block_reuse"]
    assert reuse["trace"] == pytest.approx(0.366, abs=0.001)
    assert abs(reuse["fitted"] - reuse["trace"]) < 0.05
    trace, fitted = report["sessions"]["trace"], report["sessions"]["fitted"]
    assert abs(fitted["continuing_share"] - trace["continuing_share"]) < 0.06
    assert fitted["gap_between_turns_p50_s"] == pytest.approx(
        trace["gap_between_turns_p50_s"], rel=0.05)
    # As many requests as the trace, within the draw of turns per session.
    assert report["num_drawn_requests"] == pytest.approx(report["num_requests"], rel=0.05)


def test_a_generated_conversation_workload_gives_back_its_shape():
    data = {"seed": 3, "workload": {
        "format": "prefix", "num_conversations": 2000, "num_turns": 3,
        "arrivals": {"process": "poisson", "qps": 4.0},
        "system_prompt_tokens": 1024, "num_groups": 4, "shared_fraction": 0.5,
        "first_question_tokens": {"dist": "uniform", "low": 300, "high": 900},
        "question_tokens": 200, "output_tokens": 100, "think_time_s": 30.0,
        "hash_block_tokens": 64}}
    fit = fit_workload(parse_scenario(data, "test"))
    workload = fit.workload
    assert workload["format"] == "prefix"
    assert workload["num_turns"] == {"dist": "fixed", "value": 3}
    assert workload["num_conversations"] == 2000
    assert workload["system_prompt_tokens"] == 1024 and workload["num_groups"] == 4
    assert workload["shared_fraction"] == pytest.approx(0.5, abs=0.01)
    assert workload["question_tokens"] == {"dist": "fixed", "value": 200}
    assert workload["output_tokens"] == {"dist": "fixed", "value": 100}
    first = np.array(workload["first_question_tokens"]["quantiles"])
    assert first[0] == 300 and first[-1] == 900
    assert workload["arrivals"]["process"] == "poisson"
    assert workload["arrivals"]["qps"] == pytest.approx(4.0, rel=0.05)
    assert workload["think_time_s"] == pytest.approx(30.0, rel=0.1)
    reuse = fit.report["prefix_block_reuse"]
    assert reuse["fitted"] == pytest.approx(reuse["trace"], abs=0.01)


def test_bursts_at_one_instant_get_the_traces_own_gaps():
    # A request every 3 s, and nine more at the same instant: no gamma process has those gaps.
    arrival = np.repeat(np.arange(200) * 3.0, 10)
    arrivals = fit_arrivals(arrival)
    assert arrivals["process"] == "empirical"
    assert arrivals["qps"] == pytest.approx(1999 / 597)
    gaps = np.diff(ArrivalConfig(**arrivals).sample(200_000, np.random.default_rng(0)))
    assert (gaps == 0).mean() == pytest.approx(0.9, abs=0.01)
    assert gaps.mean() == pytest.approx(597 / 1999, rel=0.02)


def test_empirical_arrivals_keep_the_rate_asked_for():
    arrivals = ArrivalConfig(process="empirical", qps=50.0, gap_quantiles=[0, 0, 1, 3])
    draws = arrivals.sample(400_000, np.random.default_rng(1))
    assert (len(draws) - 1) / draws[-1] == pytest.approx(50.0, rel=0.01)
    for bad, words in [({"gap_quantiles": [0, 0]}, "every gap is 0"),
                       ({"gap_quantiles": [2, 1]}, "must not decrease"),
                       ({"gap_quantiles": [0, 1], "cv": 2.0}, "use process: gamma"),
                       ({"process": "gamma", "cv": 2.0, "gap_quantiles": [0, 1]},
                        "comes with process: empirical")]:
        data = {"process": "empirical", "qps": 1.0, **bad}
        with pytest.raises(InputError) as err:
            parse_scenario({"workload": {"format": "synthetic", "num_requests": 3,
                                         "arrivals": data, "lengths": {
                                             "prompt": {"dist": "fixed", "value": 2},
                                             "output": {"dist": "fixed", "value": 2}}}},
                           "test")
        assert "workload.arrivals" in str(err.value) and words in str(err.value)


def test_empirical_lengths_follow_their_quantiles_and_a_copula_its_correlation():
    rng = np.random.default_rng(0)
    dist = TokenDist(dist="empirical", quantiles=[10, 20, 20, 100, 1000])
    draws = dist.sample(100_000, rng)
    assert draws.min() == 10 and draws.max() == 1000
    # A quarter of the mass between each pair of quantiles: the median is 20.
    assert np.median(draws) == 20 and abs((draws <= 100).mean() - 0.75) < 0.01
    lengths = LengthsConfig(prompt=TokenDist(dist="lognormal", mean=500, std=400),
                            output=TokenDist(dist="uniform", low=1, high=300),
                            rank_correlation=-0.4)
    prompt, output = lengths.sample(50_000, rng)
    assert spearmanr(prompt, output).statistic == pytest.approx(-0.4, abs=0.02)
    assert ks_distance(output, rng.integers(1, 301, 50_000)) < 0.02  # the marginal is kept


def test_prefix_reuse_is_counted_along_shared_prefixes():
    # Reused: 1, 2 of the second; nothing of the third (5 starts anew); 1, 2, 3 of the last.
    assert block_reuse([(1, 2, 3), (1, 2, 4), (5, 2, 3), (1, 2, 3, 6)]) == pytest.approx(5 / 13)


def test_sessions_are_read_from_prefix_ids_that_grow():
    # r1 continues r0 (all of r0's ids but its last part-block, and more), r3 continues r1;
    # r4 continues r0; r2 holds block 1 but not r0's block 2: it continues nothing.
    ids = [(1, 2, 3), (1, 2, 3, 4, 5), (1, 9), (1, 2, 3, 4, 5, 6, 7), (1, 2, 8)]
    shape = session_shape(ids, np.array([0.0, 1.0, 2.0, 3.0, 4.0]))
    assert shape["continuing_share"] == 0.6
    assert shape["turns_max"] == 3 and shape["turns_p50"] == 2.0  # sessions of 3, 2 and 1
    assert shape["gap_between_turns_p50_s"] == 2.0  # gaps 1, 2 and 4
    # r1 of (1, 2, 3) brings no full block of its own (1 and 2 were r0's): r2, holding 1 and
    # 2, continues r0, not r1 (else a common system prompt would chain every request).
    assert session_shape([(1, 2), (1, 2, 3)], np.array([0.0, 1.0]))["continuing_share"] == 0.5
    assert session_shape([(1, 2), (1, 2, 3), (1, 2, 4)],
                         np.array([0.0, 1.0, 2.0]))["turns_max"] == 2


def test_the_written_scenario_runs_and_says_how_close_it_is(traces, tmp_path, monkeypatch,
                                                            capsys):
    source = tmp_path / "azure.yaml"
    source.write_text(yaml.safe_dump({"name": "azure_fit", "workload": {
        "format": "azure", "num_requests": 500,
        "path": str(traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")}}))
    out = tmp_path / "fitted.yaml"
    code, printed = run_cli_out(monkeypatch, capsys, "fit-workload", str(source), "--out",
                                str(out))
    assert code == 0 and "KS distance" in printed and "written" in printed
    text = out.read_text()
    assert text.startswith("# servesim fit-workload") and "KS distance" in text
    fitted = load_scenario(out)
    assert fitted.workload.format == "synthetic" and fitted.name == "azure_fit"
    assert len(load_workload(fitted)) == 500
    code, _ = run_cli_out(monkeypatch, capsys, "simulate", str(out), "--set",
                          "workload.num_requests=100", "--out", str(tmp_path / "run"))
    assert code == 0


def test_the_clients_timeout_is_kept(traces):
    scenario = azure(traces, 500)
    scenario = scenario.model_copy(update={"workload": scenario.workload.model_copy(
        update={"timeout_s": 30.0})})
    assert fit_workload(scenario).workload["timeout_s"] == 30.0


def test_sessions_that_all_start_at_once_have_no_rate_to_fit(tmp_path, monkeypatch, capsys):
    # Two sessions of 15 turns, both starting at t=0: each turn holds the one before's full
    # blocks and one more (a part-block last).
    rows, stems = [], {0: [], 1: []}
    for i in range(30):
        s = i % 2
        stems[s] = stems[s][:-1] + [1000 * (s + 1) + 2 * i, 1000 * (s + 1) + 2 * i + 1, 9000 + i]
        rows.append({"t": float(i // 2) if i > 1 else 0.0, "p": 16 * (len(stems[s]) - 1) + 5,
                     "o": 4, "ids": list(stems[s])})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"workload": {
        "format": "jsonl", "path": str(trace), "hash_block_tokens": 16,
        "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o",
                    "hash_ids": "ids"}}}))
    code, err = run_cli(monkeypatch, capsys, "fit-workload", str(path), "--out",
                        str(tmp_path / "f.yaml"))
    assert_one_line_error(code, err, "s.yaml", "2 session(s) all start at one instant")


def test_bad_input_is_one_line(traces, tmp_path, monkeypatch, capsys):
    source = tmp_path / "s.yaml"
    source.write_text(yaml.safe_dump({"workload": {
        "format": "azure", "num_requests": 5,
        "path": str(traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")}}))
    code, err = run_cli(monkeypatch, capsys, "fit-workload", str(source), "--out",
                        str(tmp_path / "f.yaml"))
    assert_one_line_error(code, err, "s.yaml", "5 requests", "at least 20")
    code, err = run_cli(monkeypatch, capsys, "fit-workload", str(source), "--out",
                        str(tmp_path / "f.txt"))
    assert_one_line_error(code, err, "--out", "a scenario is a .yaml file")
    bad = tmp_path / "q.yaml"
    bad.write_text("workload: {format: synthetic, num_requests: 5, arrivals: {qps: 1}, "
                   "lengths: {prompt: {dist: empirical, quantiles: [5, 3]}, "
                   "output: {dist: fixed, value: 2}}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(bad), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "q.yaml", "quantiles", "must not decrease")
