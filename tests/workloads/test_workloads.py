"""Each workload format, on its real file in ../shared/traces, and the synthetic generators."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload
from tests.helpers import assert_one_line_error, run_cli, run_cli_out, within


def workload(spec: dict, seed: int = 0):
    return load_workload(parse_scenario({"seed": seed, "workload": spec}, "test"))


def test_azure_conv_trace(traces):
    w = workload({"format": "azure",
                  "path": str(traces / "azure_llm_2023/AzureLLMInferenceTrace_conv.csv")})
    assert len(w) == 19366
    assert w.arrival_s[0] == 0.0 and w.arrival_s[-1] == pytest.approx(3501.722, abs=1e-3)
    assert np.all(np.diff(w.arrival_s) > 0)
    assert w.num_prompt_tokens.mean() == pytest.approx(1154.7, abs=0.05)
    assert (w.num_prompt_tokens.min(), w.num_prompt_tokens.max()) == (2, 14050)
    assert w.num_output_tokens.mean() == pytest.approx(211.1, abs=0.05)
    assert w.num_prompt_tokens[:3].tolist() == [374, 396, 879]  # CRLF did not leak into values


def test_vidur_trace_matches_the_azure_trace_it_was_made_from(traces):
    for kind in ("code", "conv"):
        azure_path = traces / f"azure_llm_2023/AzureLLMInferenceTrace_{kind}.csv"
        azure = workload({"format": "azure", "path": str(azure_path)})
        vidur = workload({"format": "vidur", "path": str(traces / f"vidur/splitwise_{kind}.csv")})
        assert np.array_equal(azure.num_prompt_tokens, vidur.num_prompt_tokens)
        assert np.array_equal(azure.num_output_tokens, vidur.num_output_tokens)
        assert np.abs(azure.arrival_s - vidur.arrival_s).max() < 1e-6


def test_mooncake_trace_keeps_prefix_hashes(traces):
    w = workload({"format": "mooncake",
                  "path": str(traces / "mooncake_fast25/conversation_trace.jsonl")})
    assert len(w) == 12031
    assert w.arrival_s[-1] == pytest.approx(3536.999)  # milliseconds became seconds
    assert w.hash_ids is not None and w.hash_ids[0] == tuple(range(14))
    assert all(len(h) == -(-p // 512) for h, p in zip(w.hash_ids, w.num_prompt_tokens,
                                                      strict=True))
    assert w.num_prompt_tokens.max() == 126195


@pytest.mark.parametrize("path,rows", [
    ("vidur/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 28257),
    ("sarathi_serve/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 30731),
])
def test_length_only_files_get_generated_arrivals(traces, path, rows):
    spec = {"format": "lengths", "path": str(traces / path),
            "arrivals": {"process": "poisson", "qps": 10}}
    w = workload(spec)
    assert len(w) == rows
    rate = (len(w) - 1) / w.arrival_s[-1]
    assert rate == pytest.approx(10, rel=0.03)
    assert np.array_equal(workload(spec).arrival_s, w.arrival_s)  # same seed, same arrivals
    assert not np.array_equal(workload(spec, seed=1).arrival_s, w.arrival_s)


def test_generic_csv_and_jsonl_with_column_mapping(traces, tmp_path):
    conv = traces / "vidur/splitwise_conv.csv"
    csv = workload({"format": "csv", "path": str(conv),
                    "columns": {"arrival": "arrived_at", "prompt_tokens": "num_prefill_tokens",
                                "output_tokens": "num_decode_tokens"}})
    vidur = workload({"format": "vidur", "path": str(conv)})
    assert np.array_equal(csv.arrival_s, vidur.arrival_s)
    moon = traces / "mooncake_fast25/conversation_trace.jsonl"
    jl = workload({"format": "jsonl", "path": str(moon), "time_unit": "ms",
                   "columns": {"arrival": "timestamp", "prompt_tokens": "input_length",
                               "output_tokens": "output_length"}})
    assert jl.arrival_s[-1] == pytest.approx(3536.999) and jl.hash_ids is None
    # No arrival column: arrivals are generated.
    gen = workload({"format": "csv", "path": str(conv), "arrivals": {"qps": 4},
                    "columns": {"prompt_tokens": "num_prefill_tokens",
                                "output_tokens": "num_decode_tokens"}})
    assert gen.arrival_s[-1] != vidur.arrival_s[-1]


def test_window_first_n_and_rate_scale(traces):
    path = str(traces / "vidur/splitwise_conv.csv")
    full = workload({"format": "vidur", "path": path})
    part = workload({"format": "vidur", "path": path, "start_s": 600, "end_s": 1200,
                     "num_requests": 500, "rate_scale": 2.0})
    first = int(np.searchsorted(full.arrival_s, 600))
    assert len(part) == 500
    assert part.arrival_s[0] == 0.0
    expected = (full.arrival_s[first:first + 500] - full.arrival_s[first]) / 2
    assert np.allclose(part.arrival_s, expected)
    assert np.array_equal(part.num_prompt_tokens, full.num_prompt_tokens[first:first + 500])


def test_token_scale_shrinks_lengths_keeping_arrivals(traces):
    path = str(traces / "azure_llm_2023/AzureLLMInferenceTrace_conv.csv")
    full = workload({"format": "azure", "path": path, "num_requests": 300})
    small = workload({"format": "azure", "path": path, "num_requests": 300,
                      "token_scale": 0.25})
    assert np.array_equal(small.arrival_s, full.arrival_s)
    for scaled, whole in ((small.num_prompt_tokens, full.num_prompt_tokens),
                          (small.num_output_tokens, full.num_output_tokens)):
        assert np.array_equal(scaled, np.maximum(1, np.rint(whole * 0.25)).astype(np.int64))
    assert small.num_prompt_tokens.min() >= 1 and small.num_output_tokens.min() >= 1


def test_token_scale_past_the_token_cap_is_refused(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,2000000,5\n")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"workload: {{format: vidur, path: {trace}, token_scale: 1000}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario))
    assert_one_line_error(code, err, "workload.token_scale", "tokens")


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_synthetic_arrivals_have_the_rate_and_burstiness_asked_for(process, cv):
    w = workload({"format": "synthetic", "num_requests": 20000,
                  "arrivals": {"process": process, "qps": 8, "cv": cv},
                  "lengths": {"prompt": {"dist": "fixed", "value": 100},
                              "output": {"dist": "fixed", "value": 10}}})
    gaps = np.diff(w.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(8, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert set(w.num_prompt_tokens.tolist()) == {100}


def test_synthetic_lengths(traces):
    base = {"format": "synthetic", "num_requests": 20000, "arrivals": {"qps": 1}}
    w = workload({**base, "lengths": {
        "prompt": {"dist": "lognormal", "mean": 1000, "std": 800, "max": 8000},
        "output": {"dist": "uniform", "low": 5, "high": 15}}})
    assert w.num_prompt_tokens.mean() == pytest.approx(1000, rel=0.05)
    assert w.num_prompt_tokens.max() <= 8000 and w.num_prompt_tokens.min() >= 1
    assert set(w.num_output_tokens.tolist()) == set(range(5, 16))
    share = traces / "sarathi_serve/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
    sampled = workload({**base, "lengths": {"file": str(share)}})
    assert sampled.num_prompt_tokens.mean() == pytest.approx(2340, rel=0.05)


# A lognormal of mean 10 and std 1 has 0.37% of its mass above 13, 0.031% above 14, 0.021% below
# 7 and 1.4% below 8: a bound that leaves less than 0.1% of the draws unclipped is refused.
@pytest.mark.parametrize(("bounds", "refused"), [
    ({"min": 13}, None), ({"min": 14}, "min=14"), ({"max": 8}, None), ({"max": 7}, "max=7"),
    ({"min": 10, "max": 10}, "min=10"), ({"min": 9, "max": 10}, None),
])
def test_lognormal_lengths_clipped_almost_whole_are_refused(bounds, refused):
    lengths = {"prompt": {"dist": "lognormal", "mean": 10, "std": 1, **bounds},
               "output": {"dist": "fixed", "value": 2}}
    data = {"format": "synthetic", "num_requests": 5, "arrivals": {"qps": 1}, "lengths": lengths}
    if refused is None:
        assert len(workload(data).num_prompt_tokens) == 5
        return
    with pytest.raises(InputError) as info:
        workload(data)
    assert f"workload.lengths.prompt.{refused}: clips " in info.value.one_line()


def test_mooncake_style_jsonl_written_here_round_trips(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 20, "output_length": 1, "hash_ids": [3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = workload({"format": "mooncake", "path": str(path)})
    assert w.arrival_s.tolist() == [0.0, 1.5] and w.hash_ids == [(1, 2), (3,)]


# Bad traces and selections: one line naming the file, the field (with the row's line) and the
# value, exit code 2.

VIDUR_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
CSV_COLUMNS = "columns: {prompt_tokens: p, output_tokens: o}, arrivals: {qps: 1}"


def simulate_trace(tmp_path, monkeypatch, capsys, name: str, content: str, workload: str):
    """Write `content` to `name`, run a scenario whose workload is `workload` (it may say
    {path}), return the exit code, stderr and the paths."""
    trace = tmp_path / name
    trace.write_text(content)
    scenario = tmp_path / "s.yaml"
    scenario.write_text("workload: {" + workload.replace("{path}", str(trace)) + "}\n"
                        "replica: {latency: {kind: constant, iteration_s: 0.01}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario),
                        "--out", str(tmp_path / "o"))
    return code, err, trace, scenario


@pytest.mark.parametrize("name,content,workload", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n", "format: azure, path: {path}"),
    ("v.csv", VIDUR_HEADER, "format: vidur, path: {path}"),
    ("m.jsonl", "\n\n", "format: mooncake, path: {path}"),
    ("m.jsonl", "", "format: mooncake, path: {path}"),
    ("l.csv", "num_prefill_tokens,num_decode_tokens\n",
     "format: lengths, path: {path}, arrivals: {qps: 1}"),
    ("g.csv", "p,o\n", "format: csv, path: {path}, " + CSV_COLUMNS),
    ("g.jsonl", "", "format: jsonl, path: {path}, " + CSV_COLUMNS),
    ("l.csv", "num_prefill_tokens,num_decode_tokens\n",
     "format: synthetic, num_requests: 5, arrivals: {qps: 1}, lengths: {file: {path}}"),
])
def test_a_trace_without_rows_is_a_one_line_error(tmp_path, monkeypatch, capsys, name, content,
                                                  workload):
    code, err, trace, _ = simulate_trace(tmp_path, monkeypatch, capsys, name, content, workload)
    assert_one_line_error(code, err, str(trace), "workload.")
    assert "no rows" in err or "empty file" in err


@pytest.mark.parametrize("row,needles", [
    ("0.5,1e30,3", ["num_prefill_tokens (line 3)", "=1e+30", "1e+09 tokens"]),
    # Past int64, pyarrow reads the column as floats: the value shows as one.
    (f"0.5,{2**63},3", ["num_prefill_tokens (line 3)", "=9.223372036854776e+18", "1e+09"]),
    (f"0.5,5,{10**9 + 1}", ["num_decode_tokens (line 3)", str(10**9 + 1)]),
    ("0.5,5,True", ["num_decode_tokens (line 3)", "positive integer"]),
])
def test_absurd_token_counts_are_refused_with_their_line(tmp_path, monkeypatch, capsys, row,
                                                         needles):
    code, err, trace, _ = simulate_trace(tmp_path, monkeypatch, capsys, "v.csv",
                                         VIDUR_HEADER + "0.0,10,2\n" + row + "\n",
                                         "format: vidur, path: {path}")
    assert_one_line_error(code, err, str(trace), *needles)


MOONCAKE_ROW = '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n'


@pytest.mark.parametrize("lines,needles", [
    ([MOONCAKE_ROW, "\n", '{"timestamp": 5, "input_length": 5\n'], ["line 3=", "not JSON"]),
    ([MOONCAKE_ROW, "[1, 2]\n"], ["line 2=[1, 2]", "JSON object"]),
    ([MOONCAKE_ROW, "\n", MOONCAKE_ROW.replace("5", "true")], ["input_length (line 3)=True"]),
    ([MOONCAKE_ROW, MOONCAKE_ROW.replace("[1]", '["x"]')], ["hash_ids (line 2)"]),
])
def test_jsonl_errors_give_the_line_number(tmp_path, monkeypatch, capsys, lines, needles):
    code, err, trace, _ = simulate_trace(tmp_path, monkeypatch, capsys, "m.jsonl",
                                         "".join(lines), "format: mooncake, path: {path}")
    assert_one_line_error(code, err, str(trace), *needles)


@pytest.mark.parametrize("selection,needles", [
    ("num_requests: 5", ["workload.num_requests=5", "only 2 requests in the trace"]),
    ("start_s: 0.2, num_requests: 2", ["workload.num_requests=2", "only 1 requests in the window"]),
    ("start_s: 100", ["workload.start_s=100.0", "holds no request", "0 to 0.5 s"]),
    ("start_s: 0.1, end_s: 0.3", ["workload.end_s=0.3", "[0.1, 0.3) s holds no request"]),
    ("rate_scale: 1.0e-10", ["workload.rate_scale=1e-10", "arrivals span 5e+09 s", "2**32",
                             "(the arrival times of", "v.csv, scaled by 1e-10)"]),
    # A scale so small the span overflows: refused, and numpy's overflow warning not printed.
    ("rate_scale: 5.0e-324", ["workload.rate_scale=5e-324", "arrivals span inf s", "2**32"]),
    # Arrivals 1e-300 s apart used to end in a traceback (inf in summary.json).
    ("rate_scale: 1.0e+300", ["workload.rate_scale=1e+300", "makes 2e+300 arrivals per second",
                              "faster than 1e+09 req/s"]),
    ("rate_scale: 1.0e+160", ["workload.rate_scale=1e+160", "faster than 1e+09 req/s"]),
    ("rate_scale: 6.0e+8", ["workload.rate_scale=600000000.0", "makes 1.2e+09 arrivals",
                            "faster than 1e+09 req/s"]),  # 2 req/s at scale 1
])
def test_selections_that_cannot_be_run_are_refused(tmp_path, monkeypatch, capsys, recwarn,
                                                   selection, needles):
    code, err, _, scenario = simulate_trace(tmp_path, monkeypatch, capsys, "v.csv",
                                            VIDUR_HEADER + "0.0,10,2\n0.5,20,3\n",
                                            "format: vidur, path: {path}, " + selection)
    assert_one_line_error(code, err, str(scenario), *needles)
    # pytest keeps warnings out of capsys: on a terminal they are extra lines on stderr.
    assert not [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_trace_whose_own_times_span_too_long_is_named(tmp_path, monkeypatch, capsys):
    """Times in milliseconds read as seconds, say: the error names the trace file, not only
    the rate scale (issue 49)."""
    code, err, _, scenario = simulate_trace(tmp_path, monkeypatch, capsys, "v.csv",
                                            VIDUR_HEADER + "0.0,10,2\n5.0e+9,20,3\n",
                                            "format: vidur, path: {path}")
    assert_one_line_error(code, err, str(scenario), "workload.rate_scale=1.0",
                          "arrivals span 5e+09 s (the arrival times of", "v.csv, scaled by 1)")


def test_a_trace_at_the_highest_rate_runs(tmp_path, monkeypatch, capsys, recwarn):
    """2 req/s scaled by 5e8: 1e9 arrivals per second, the most simulated. The run completes,
    called overloaded, with finite numbers everywhere in summary.json."""
    trace = tmp_path / "v.csv"
    trace.write_text(VIDUR_HEADER + "".join(f"{i * 0.5},10,2\n" for i in range(60)))
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"workload: {{format: vidur, path: {trace}, rate_scale: 5.0e+8}}\n"
                        "replica: {latency: {kind: constant, iteration_s: 0.01}}\n")
    code, _ = run_cli_out(monkeypatch, capsys, "simulate", str(scenario),
                          "--out", str(tmp_path / "o"))
    assert code == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["overload"]["verdict"] == "overloaded"
    assert not [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]


SYNTHETIC = ("format: synthetic, num_requests: {n}, arrivals: {{qps: {qps}}}, lengths: "
             "{{prompt: {{dist: fixed, value: 5}}, output: {{dist: fixed, value: 2}}}}")  # .format


@pytest.mark.parametrize("n,qps,needles", [
    ("1000000000000", "1", ["workload.num_requests=1000000000000", "10000000"]),
    ("1.0e+12", "1", ["workload.num_requests=1000000000000.0", "integer"]),
    ("100", "1.0e-9", ["workload.arrivals.qps=1e-09", "arrivals span", "2**32"]),
    ("100", "5.0e-324", ["workload.arrivals.qps=5e-324", "arrivals span inf s"]),
    # Arrivals 1e-160 s apart used to end in a traceback (inf in summary.json, numpy warnings
    # before it); at 1e+200 a capacity search called every rate stable.
    ("100", "1.0e+160", ["workload.arrivals.qps=1e+160", "faster than 1e+09 req/s"]),
    ("100", "1.0e+200", ["workload.arrivals.qps=1e+200", "faster than 1e+09 req/s"]),
    ("100", "1.0e+300", ["workload.arrivals.qps=1e+300", "faster than 1e+09 req/s"]),
    ("100", "1.1e+9", ["workload.arrivals.qps=1100000000.0", "faster than 1e+09 req/s"]),
])
def test_synthetic_workloads_too_large_to_simulate(tmp_path, monkeypatch, capsys, recwarn, n,
                                                   qps, needles):
    with within(60):  # refused before allocating anything (a hang guard, not a timing)
        code, err, _, scenario = simulate_trace(tmp_path, monkeypatch, capsys, "unused", "",
                                                SYNTHETIC.format(n=n, qps=qps))
    assert_one_line_error(code, err, str(scenario), *needles)
    assert not [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_rate_scale_on_generated_arrivals_counts_towards_the_highest_rate(
        tmp_path, monkeypatch, capsys):
    """qps 1e6 is allowed alone; scaled by 1e4 it makes 1e10 arrivals per second, and the
    error names the scale, the knob that went too far."""
    code, err, _, scenario = simulate_trace(
        tmp_path, monkeypatch, capsys, "unused", "",
        SYNTHETIC.format(n=100, qps="1.0e+6") + ", rate_scale: 1.0e+4")
    assert_one_line_error(code, err, str(scenario), "workload.rate_scale=10000.0",
                          "makes 1e+10 arrivals per second")


def test_a_directory_given_as_a_trace(tmp_path, monkeypatch, capsys):
    (tmp_path / "dir.csv").mkdir()
    code, err, _, _ = simulate_trace(tmp_path, monkeypatch, capsys, "x", "",
                                     f"format: vidur, path: {tmp_path / 'dir.csv'}")
    assert_one_line_error(code, err, "dir.csv", "workload.path", "is a directory")
