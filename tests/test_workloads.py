"""Each workload format, on its real file in ../shared/traces, and the synthetic generators."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.config import parse_scenario
from sim.runner import load_workload


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


def test_mooncake_style_jsonl_written_here_round_trips(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 20, "output_length": 1, "hash_ids": [3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = workload({"format": "mooncake", "path": str(path)})
    assert w.arrival_s.tolist() == [0.0, 1.5] and w.hash_ids == [(1, 2), (3,)]
