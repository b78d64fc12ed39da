"""Exports (`sim.export`): a run as vLLM's benchmark result and as a Chrome trace."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.export import export_run
from sim.export.chrome import chrome_trace, sample_requests, wire_intervals
from sim.results.run_dir import Results
from tests.helpers import (
    assert_one_line_error,
    colocated_run,
    disaggregated,
    disaggregated_run,
    replica,
    run_cli,
    run_cli_out,
    trace,
)

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


# --- vLLM -----------------------------------------------------------------------------------

def test_vllm_exact_on_the_disaggregated_timings(tmp_path):
    """The timestamps of tests/engine/test_disaggregation.py by hand: first tokens at 0.25, 0.5,
    0.75 s; tokens of request 0 at 0.25, 1.0, 1.25; of 1 at 0.5, 1.25; of 2 at 0.75, 1.5, 1.75,
    2.0, 2.25."""
    run = disaggregated_run(tmp_path)
    out = export_run(run, "vllm", percentiles=(50,))
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"], data["duration"]) == (3, 0, 2.25)
    assert data["total_input_tokens"] == 190 and data["total_output_tokens"] == 10
    # Client-side, as vLLM's client measures: plus the API front end (the prefill pool's).
    summary = json.loads((run / "summary.json").read_text())
    front = summary["latency_model"]["calibration"]["frontend_s"]["prefill"]
    assert front > 0 and any("client-side" in note for note in data["servesim_notes"])
    assert data["ttfts"] == pytest.approx([0.25 + front, 0.375 + front, 0.45 + front])
    assert data["latencies"] == pytest.approx([1.25 + front, 1.125 + front, 1.95 + front])
    assert data["itls"] == [[0.75, 0.25], [0.75], [0.75, 0.25, 0.25, 0.25]]
    # TPOT excludes the first token: (1.25 - 0.25) / 2, (1.125 - 0.375) / 1, (1.95 - 0.45) / 4.
    assert data["mean_tpot_ms"] == pytest.approx((500 + 750 + 375) / 3)
    assert data["median_itl_ms"] == pytest.approx(250)
    assert data["max_concurrent_requests"] == 3
    # Seconds from the first arrival: [0, 1) holds 3 tokens, [1, 2) 5, [2, 3) 2.
    assert data["max_output_tokens_per_s"] == 5


def test_vllm_matches_numpy_on_the_result_files(tmp_path, monkeypatch, capsys):
    run = colocated_run(tmp_path)
    out = tmp_path / "v.json"
    code, shown = run_cli_out(monkeypatch, capsys, "export", str(run), "--format", "vllm",
                              "--percentiles", "50,90,99,99.9", "--out", str(out))
    assert code == 0 and shown.strip() == str(out)
    got = json.loads(out.read_text())
    req = pd.read_parquet(run / "requests.parquet").sort_values("request_id")
    tok = pd.read_parquet(run / "tokens.parquet")
    ok = (req["status"] == "finished").to_numpy()
    assert 0 < ok.sum() < len(req) and (req["status"] == "rejected").any()
    fin = req[ok]
    duration = 2.6  # the horizon
    gen = fin["num_generated_tokens"].to_numpy()
    # Client-side: the engine's times plus the API front end, the same for every request.
    front = float((req["client_ttft_s"] - req["ttft_s"]).iloc[0])
    assert front > 0
    ttft = (fin["first_token_s"] - fin["arrival_s"]).to_numpy() + front
    e2e = (fin["finish_s"] - fin["arrival_s"]).to_numpy() + front
    tpot = ((e2e - ttft) / (gen - 1))[gen > 1]
    per_request = {rid: np.diff(np.sort(g["time_s"].to_numpy()))
                   for rid, g in tok.groupby("request_id")}
    itl = np.concatenate([per_request[r] for r in fin["request_id"]])
    expect = {"completed": int(ok.sum()), "failed": int((~ok).sum()), "duration": duration,
              "total_input_tokens": int(fin["num_prompt_tokens"].sum()),
              "total_output_tokens": int(gen.sum()),
              "request_throughput": ok.sum() / duration,
              "output_throughput": gen.sum() / duration,
              "total_token_throughput": (fin["num_prompt_tokens"].sum() + gen.sum()) / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        expect[f"mean_{name}_ms"] = values.mean() * 1e3
        expect[f"median_{name}_ms"] = np.median(values) * 1e3
        expect[f"std_{name}_ms"] = values.std() * 1e3
        for p, word in ((50, "50"), (90, "90"), (99, "99"), (99.9, "99.9")):
            expect[f"p{word}_{name}_ms"] = np.percentile(values, p) * 1e3
    for key, value in expect.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got["output_lens"] == np.where(ok, req["num_generated_tokens"], 0).tolist()
    assert got["itls"] == [per_request.get(r, np.zeros(0)).tolist() for r in req["request_id"]]
    assert got["errors"][6].startswith("rejected: kv_capacity")
    assert got["latencies"][7] == 0.0 and got["ttfts"][7] > 0  # running at the horizon
    # In flight at once: the most intervals holding any instant (ends first at ties).
    starts, ends = fin["arrival_s"].to_numpy(), fin["finish_s"].to_numpy() + front
    assert got["max_concurrent_requests"] == max(
        int(((starts <= t) & (ends > t)).sum()) for t in starts)
    times = tok.loc[tok["request_id"].isin(fin["request_id"]), "time_s"].to_numpy()
    buckets = [int(t - starts.min()) for t in times]
    assert got["max_output_tokens_per_s"] == max(buckets.count(b) for b in set(buckets))


def test_vllm_goodput_counts_completed_requests_meeting_the_scenarios_slo(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = json.loads(export_run(colocated_run(tmp_path / "a"), "vllm").read_text())
    assert plain["request_goodput"] is None  # no targets, as vLLM without --goodput
    req = pd.read_parquet(tmp_path / "a" / "colocated" / "requests.parquet")
    fin = req[req["status"] == "finished"]
    ttft_s, tbt_s = float(fin["ttft_s"].median()), float(fin["max_tbt_s"].median())
    run = colocated_run(tmp_path / "b", slo={"ttft_s": ttft_s, "tbt_s": tbt_s})
    got = json.loads(export_run(run, "vllm").read_text())
    good = ((fin["ttft_s"] <= ttft_s) & ~(fin["max_tbt_s"] > tbt_s)).sum()
    assert 0 < good < len(fin)
    assert got["request_goodput"] == pytest.approx(good / 2.6, rel=1e-12)
    assert any(note.startswith("request_goodput") for note in got["servesim_notes"])


def test_vllm_goodput_judges_each_request_by_its_classs_targets(tmp_path):
    """Classes with targets of their own: a request counts if it meets its class's (the run's
    `slo` judges no one), as the summary's attainment judges it."""
    data = {"seed": 4, "workload": {
        "format": "synthetic", "num_requests": 60, "arrivals": {"process": "poisson", "qps": 20},
        "lengths": {"prompt": {"dist": "uniform", "low": 20, "high": 200},
                    "output": {"dist": "uniform", "low": 2, "high": 40}},
        "classes": [{"name": "strict", "share": 0.5, "slo": {"ttft_s": 1e-9}},
                    {"name": "loose", "share": 0.5, "slo": {"ttft_s": 100.0}}]},
        "replica": replica(num_blocks=400, token_budget=256, max_num_seqs=8),
        "slo": {"ttft_s": 100.0}}
    run_scenario(parse_scenario(data, "test"), out_dir=tmp_path / "run")
    got = json.loads(export_run(tmp_path / "run", "vllm").read_text())
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    loose = ((req["status"] == "finished") & (req["request_class"] == "loose")).sum()
    assert 0 < loose < (req["status"] == "finished").sum()
    assert got["request_goodput"] == pytest.approx(loose / got["duration"], rel=1e-12)


def test_vllm_without_token_times_says_so(tmp_path):
    data = json.loads(export_run(colocated_run(tmp_path, record_token_times=False),
                                 "vllm").read_text())
    assert "itls" not in data and not any("itl" in k for k in data)
    assert data["max_output_tokens_per_s"] is None
    assert any("record_token_times" in note for note in data["servesim_notes"])
    assert "p99_ttft_ms" in data and "p99_tpot_ms" in data


def test_vllm_without_token_times_takes_itl_from_the_pooled_gaps(tmp_path):
    """Every request finishes: the pooled gaps (tbt_gaps.parquet) are the completed requests'
    gaps, so the ITL statistics equal those of the same run with token times recorded."""
    rows = [(0.05 * i, 30 + 7 * i, 2 + i % 7) for i in range(16)]
    exported = {}
    for tokens in (True, False):
        scenario = parse_scenario({
            "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
            "replica": replica(num_blocks=64, token_budget=64, max_num_seqs=4),
            "record_token_times": tokens}, "test")
        run_scenario(scenario, out_dir=tmp_path / str(tokens))
        exported[tokens] = json.loads(export_run(tmp_path / str(tokens), "vllm",
                                                 percentiles=PERCENTILES).read_text())
    with_tokens, pooled = exported[True], exported[False]
    itl_keys = [k for k in with_tokens if k.endswith("_itl_ms")]
    assert len(itl_keys) == 7 and with_tokens["mean_itl_ms"] > 0
    for key in itl_keys:
        assert pooled[key] == pytest.approx(with_tokens[key], rel=1e-12), key
    assert "itls" not in pooled and pooled["max_output_tokens_per_s"] is None
    assert any("tbt_gaps.parquet" in note for note in pooled["servesim_notes"])


def test_vllm_without_detail_drops_what_vllm_drops(tmp_path, monkeypatch, capsys):
    run = disaggregated_run(tmp_path)
    code, _ = run_cli_out(monkeypatch, capsys, "export", str(run), "--format", "vllm",
                          "--summary-only")
    data = json.loads((run / "vllm_result.json").read_text())
    assert code == 0 and not {"input_lens", "ttfts", "itls", "errors"} & data.keys()
    front = data["latencies"][0] - 1.25  # client-side: plus the front end
    assert front > 0 and data["mean_itl_ms"] > 0
    assert data["latencies"] == pytest.approx([1.25 + front, 1.125 + front, 1.95 + front])


# --- Chrome trace ---------------------------------------------------------------------------

REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "C": {"name", "ph", "ts", "pid",
            "args"}, "M": {"name", "ph", "pid", "args"}, "s": {"name", "cat", "ph", "ts", "pid",
            "tid", "id"}, "t": {"name", "cat", "ph", "ts", "pid", "tid", "id"},
            "f": {"name", "cat", "ph", "ts", "pid", "tid", "id", "bp"}}


def check_trace(trace: dict) -> dict[str, list[dict]]:
    """The Trace Event Format rules a viewer relies on; the events by phase."""
    assert trace["displayTimeUnit"] == "ms"
    by_phase: dict[str, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        assert REQUIRED[e["ph"]] <= e.keys(), e
        by_phase[e["ph"]].append(e)
    named = {e["pid"] for e in by_phase["M"] if e["name"] == "process_name"}
    assert {e["pid"] for e in trace["traceEvents"]} == named
    threads = {(e["pid"], e["tid"]) for e in by_phase["M"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in by_phase["X"]} <= threads
    # Slices on one thread nest or follow each other, never partly overlap; starts in order.
    slices = defaultdict(list)
    for e in by_phase["X"]:
        assert e["dur"] >= 0
        slices[(e["pid"], e["tid"])].append(e)
    for track in slices.values():
        ts = [e["ts"] for e in track]
        assert ts == sorted(ts)
        open_ends: list[float] = []
        for e in track:
            while open_ends and open_ends[-1] <= e["ts"] + 1e-6:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-6, e
            open_ends.append(e["ts"] + e["dur"])
    counters = defaultdict(list)
    for e in by_phase["C"]:
        counters[(e["pid"], e["name"])].append(e["ts"])
    assert all(ts == sorted(ts) for ts in counters.values())
    # Flows: one start, one finish, in time order, every point inside a slice of its thread.
    flows = defaultdict(list)
    for ph in "stf":
        for e in by_phase[ph]:
            flows[e["id"]].append(e)
            assert any(s["ts"] < e["ts"] < s["ts"] + s["dur"] or s["ts"] == e["ts"] == 0.0
                       or (ph == "s" and s["ts"] == e["ts"])
                       for s in slices[(e["pid"], e["tid"])]), e
    for points in flows.values():
        assert [p["ph"] for p in points][0] == "s" and [p["ph"] for p in points][-1] == "f"
        assert sum(p["ph"] == "s" for p in points) == sum(p["ph"] == "f" for p in points) == 1
        assert [p["ts"] for p in points] == sorted(p["ts"] for p in points)
    return by_phase


def test_chrome_trace_of_a_disaggregated_run(tmp_path):
    run = disaggregated_run(tmp_path)
    out = export_run(run, "chrome", tmp_path / "t.json", num_flows=2)
    trace = json.loads(out.read_text())
    by_phase = check_trace(trace)
    its = pd.read_parquet(run / "iterations.parquet")
    req = pd.read_parquet(run / "requests.parquet")
    slices = by_phase["X"]
    assert sum(e["cat"] == "iteration" for e in slices) == len(its) == 9
    transfers = [e for e in slices if e["cat"] == "transfer"]
    assert len(transfers) == req["transfer_end_s"].notna().sum() == 3
    # One link, FIFO: request 1's KV waits behind request 0's (on the wire 0.25-0.75 s).
    assert [(e["ts"], e["dur"]) for e in transfers] == [(250e3, 500e3), (750e3, 200e3),
                                                        (950e3, 250e3)]
    assert transfers[1]["args"]["queued_ms"] == 250.0
    # The engine records when each went on the wire; a run written before it did gets the
    # same slices worked out from its link's order.
    sent = req[req["transfer_end_s"].notna()].sort_values("transfer_end_s")
    assert sent["transfer_wire_start_s"].tolist() == [0.25, 0.75, 0.95]
    older = wire_intervals(req.drop(columns="transfer_wire_start_s"))["wire_start_s"]
    assert older.tolist() == wire_intervals(req)["wire_start_s"].tolist()
    assert len({e["id"] for e in by_phase["f"]}) == 2  # requests 0 and 2 (first and last)
    # Request 0: arrival, first token (prefill replica), its transfer, finish (decode replica).
    flow = [(e["ph"], e["pid"]) for e in trace["traceEvents"] if e.get("id") == 0]
    assert flow == [("s", 4), ("t", 1), ("t", 3), ("f", 2)]
    names = {e["args"]["name"] for e in by_phase["M"] if e["name"] == "process_name"}
    assert names == {"replica 0 (prefill)", "replica 1 (decode)", "KV links",
                     "requests (2 sampled)"}


def test_chrome_trace_of_a_colocated_run_with_a_horizon(tmp_path):
    run = colocated_run(tmp_path)
    trace = json.loads(export_run(run, "chrome", num_flows=20).read_text())
    by_phase = check_trace(trace)
    its = pd.read_parquet(run / "iterations.parquet")
    assert sum(e["cat"] == "iteration" for e in by_phase["X"]) == len(its)
    assert not any(e["cat"] == "transfer" for e in by_phase["X"])
    # 13 requests, all sampled; flows only for the 7 that got a first token.
    assert trace["otherData"]["num_sampled_requests"] == 13
    assert len(by_phase["s"]) == len(by_phase["f"]) == 7
    kinds = {e["name"] for e in by_phase["X"] if e["cat"] == "iteration"}
    assert kinds <= {"prefill", "decode", "prefill+decode"} and "prefill+decode" in kinds
    queue = [e["args"]["num_waiting"] for e in by_phase["C"] if e["name"] == "queue"]
    assert max(queue) == its["num_waiting"].max() > 0


def test_more_flows_than_requests_samples_every_request():
    requests = pd.DataFrame({"request_id": [5, 1, 3]})
    assert sample_requests(requests, 2)["request_id"].tolist() == [1, 5]
    # 99999999999 points were asked of numpy first (a MemoryError of 745 GiB).
    assert sample_requests(requests, 99_999_999_999)["request_id"].tolist() == [1, 3, 5]


def pipelined(tmp_path: Path, rows: list[tuple[float, int, int]], pipeline: int,
              **scheduler) -> dict:
    """A replica as `tests.helpers.replica` makes (constant latency) with `pipeline` stages."""
    return {"workload": {"format": "vidur", "path": trace(tmp_path, rows)},
            "replica": replica(**scheduler) | {"parallelism": {"pipeline": pipeline}},
            "record_token_times": True}


def iteration_threads(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """Iteration slices by (pid, tid), in time order."""
    threads = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "iteration":
            threads[(e["pid"], e["tid"])].append(e)
    return {key: sorted(track, key=lambda e: e["ts"]) for key, track in threads.items()}


def check_iteration_threads(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """Iteration slices on one thread never overlap (touching is fine: the rounding of a µs
    with 3 decimals apart); every flow point on a replica lies inside an iteration slice of
    its thread."""
    threads = iteration_threads(trace)
    for track in threads.values():
        for before, after in zip(track, track[1:], strict=False):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, (before, after)
    replicas = {pid for pid, _ in threads}
    points = [e for e in trace["traceEvents"] if e["ph"] in "stf" and e["pid"] in replicas]
    for e in points:
        assert any(s["ts"] < e["ts"] < s["ts"] + s["dur"]
                   for s in threads.get((e["pid"], e["tid"]), [])), e
    return threads


def test_chrome_trace_puts_a_pipelines_iterations_in_flight_on_threads_of_their_own(tmp_path):
    # test_pipeline's prompt of 200 tokens in chunks of 64, 64, 64, 8 on two stages of TICK / 2:
    # iterations of TICK starting at 0, 0.125, 0.25, 0.375, 0.625, 0.875 s. Each goes to the
    # first thread free at its start: the third starts as the first ends, and shares its thread.
    res = run_scenario(parse_scenario(pipelined(tmp_path, [(0.0, 200, 3)], 2, token_budget=64),
                                      "test"))
    assert res.iterations["start_s"].tolist() == [0.0, 0.125, 0.25, 0.375, 0.625, 0.875]
    exported = chrome_trace(res)
    by_phase = check_trace(exported)
    threads = check_iteration_threads(exported)
    assert {tid: [(e["ts"], e["dur"]) for e in track] for (_, tid), track in threads.items()} == {
        0: [(0.0, 250e3), (250e3, 250e3), (625e3, 250e3), (875e3, 250e3)],
        1: [(125e3, 250e3), (375e3, 250e3)]}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in by_phase["M"]
             if e["name"] == "thread_name" and e["pid"] == 1}
    assert names == {(1, 0): "iterations", (1, 1): "iterations (in flight 2)"}
    # The request's flow: the first token from the iteration ending at 0.625 s (thread 1), the
    # last from the one ending at 1.125 s (thread 0).
    flow = [(e["ph"], e["pid"], e["tid"], e["ts"]) for e in exported["traceEvents"]
            if e.get("id") == 0]
    assert flow == [("s", 3, 0, 0.0), ("t", 1, 1, 500e3), ("f", 1, 0, 1000e3)]
    # Counters stay on thread 0.
    assert {e["tid"] for e in by_phase["C"]} == {0}


@pytest.mark.parametrize("engine", ["vllm_v1", "sglang"])
def test_chrome_flows_where_the_first_token_comes_from_the_decode_side(tmp_path, engine):
    """vLLM's decode side samples the first token and SGLang's streams it when it takes the
    request in: the flow still goes arrival, the prefill's iteration, the link, the decode
    replica's last iteration."""
    side = dict(replica(), scheduler={"name": engine})
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 3), (0.125, 40, 2)],
                                     prefill=side, decode=side))
    trace = chrome_trace(res, num_flows=2)
    check_trace(trace)
    for rid in (0, 1):
        flow = [(e["ph"], e["pid"]) for e in trace["traceEvents"] if e.get("id") == rid
                and e["ph"] in "stf"]
        assert flow == [("s", 4), ("t", 1), ("t", 3), ("f", 2)]


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_chrome_trace_of_pipelined_runs_never_overlaps_iterations_on_a_thread(tmp_path, layout):
    rows = [(0.05 * i, 200 + 37 * (i % 7), 8 + i % 5) for i in range(40)]
    if layout == "colocated":
        # A GPU model (roofline latency), tensor x pipeline parallel: overlaps of any length.
        scenario = parse_scenario({
            "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "parallelism": {"tensor": 2, "pipeline": 4},
                        "scheduler": {"name": "chunked_prefill", "token_budget": 256}}},
            "test")
        pipeline = 4
    else:
        # Both pools pipelined: flows leave one pipeline and land in another.
        staged = replica(token_budget=128) | {"parallelism": {"pipeline": 2}}
        scenario = disaggregated(tmp_path, rows, prefill=staged, decode=staged,
                                 link={"bandwidth_gb_s": 1.0, "latency_s": 0.0})
        pipeline = 2
    res = run_scenario(scenario)
    its = res.iterations
    overlaps = 0
    for _, replica_its in its.groupby("replica_id"):
        start = replica_its["start_s"].to_numpy()
        end = start + replica_its["duration_s"].to_numpy()
        overlaps += int((start[1:] < end[:-1]).sum())
    assert overlaps > 0  # iterations in flight at once, which one thread cannot hold
    exported = chrome_trace(res, num_flows=40)
    check_trace(exported)
    threads = check_iteration_threads(exported)
    assert sum(len(track) for track in threads.values()) == len(its)
    tids = {tid for _, tid in threads}
    assert len(tids) > 1 and max(tids) < pipeline
    # A flow point binds to the slice around it on its thread: the iteration that gave the
    # request its first or last token, not one beside it in flight on another thread.
    req = res.requests.set_index("request_id")
    points = [e for e in exported["traceEvents"]
              if e["ph"] in "tf" and (e["pid"], e["tid"]) in threads]
    assert {e["tid"] for e in points} == tids
    for e in points:
        (around,) = [s for s in threads[(e["pid"], e["tid"])]
                     if s["ts"] < e["ts"] < s["ts"] + s["dur"]]
        ends_us = [req.at[e["id"], c] * 1e6
                   for c in ("first_token_s", "prefill_end_s", "finish_s") if c in req]
        assert any(abs(around["ts"] + around["dur"] - end) < 1e-3 for end in ends_us), e


def test_chrome_trace_without_a_pipeline_keeps_every_iteration_on_thread_0(tmp_path):
    for run in (colocated_run(tmp_path), disaggregated_run(tmp_path)):
        exported = chrome_trace(Results.load(run))
        threads = check_iteration_threads(exported)
        assert {tid for _, tid in threads} == {0}
        named = [e["args"]["name"] for e in exported["traceEvents"]
                 if e["name"] == "thread_name" and e["pid"] in {pid for pid, _ in threads}]
        assert named == ["iterations"] * len({pid for pid, _ in threads})


def test_exports_are_byte_identical(tmp_path):
    run = disaggregated_run(tmp_path)
    for fmt in ("vllm", "chrome"):
        first = export_run(run, fmt, tmp_path / f"a.{fmt}.json").read_bytes()
        assert export_run(run, fmt, tmp_path / f"b.{fmt}.json").read_bytes() == first


# --- command line ---------------------------------------------------------------------------

def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    run = disaggregated_run(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "export", str(run), "--format", "csv")
    assert_one_line_error(code, err, "csv")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    code, err = run_cli(monkeypatch, capsys, "export", str(sweep), "--format", "vllm")
    assert_one_line_error(code, err, "a sweep directory", "run directory")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = run_cli(monkeypatch, capsys, "export", str(run), "--format", "chrome",
                        "--out", str(blocker / "t.json"))
    assert_one_line_error(code, err, "--out", "cannot write it")
    code, err = run_cli(monkeypatch, capsys, "export", str(run), "--format", "vllm",
                        "--percentiles", "50,abc")
    assert_one_line_error(code, err, "--percentiles")
    code, err = run_cli(monkeypatch, capsys, "export", str(run), "--format", "vllm",
                        "--percentiles", "101")
    assert_one_line_error(code, err, "between 0 and 100")


def test_an_export_or_report_never_writes_over_the_runs_own_files(tmp_path, monkeypatch,
                                                                   capsys):
    run = disaggregated_run(tmp_path)
    summary = (run / "summary.json").read_bytes()
    for args in (("export", str(run), "--format", "vllm", "--out", str(run / "summary.json")),
                 ("report", str(run), "--out", str(run / "summary.json")),
                 ("export", str(run), "--format", "chrome",
                  "--out", str(run / "requests.parquet"))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, "--out", "the results' own files")
    assert (run / "summary.json").read_bytes() == summary
    # Beside them, any other name is fine.
    assert export_run(run, "vllm", run / "mine.json") == run / "mine.json"


def test_an_export_or_report_never_writes_into_another_runs_results(tmp_path, monkeypatch,
                                                                     capsys):
    """`export RUN --out OTHER_RUN/summary.json` destroyed OTHER_RUN: nothing may be written
    into other results (a run's directory, its plots, a sweep's runs), under any name."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = disaggregated_run(tmp_path / "a")
    other = colocated_run(tmp_path / "b")
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    (other / "plots").mkdir()
    for target in (other / "summary.json", other / "vllm_result.json", other / "mine.json",
                   other / "plots" / "x.json"):
        for args in (("export", str(run), "--format", "vllm", "--out", str(target)),
                     ("report", str(run), "--out", str(target))):
            code, err = run_cli(monkeypatch, capsys, *args)
            assert_one_line_error(code, err, "--out", "inside other results")
            assert not (target.exists() and target.name not in before)
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before
    # Outside any results, any name is fine.
    assert export_run(run, "vllm", tmp_path / "out.json") == tmp_path / "out.json"


def test_vllm_of_results_from_before_client_side_latencies_says_so(tmp_path):
    """Results written before `client_ttft_s` existed export the engine's own times, and say
    so (rather than a KeyError, or client-side figures made up)."""
    run = disaggregated_run(tmp_path)
    requests = pd.read_parquet(run / "requests.parquet")
    requests.drop(columns=["client_ttft_s", "client_e2e_s"]).to_parquet(
        run / "requests.parquet", index=False)
    data = json.loads(export_run(run, "vllm", percentiles=(50,)).read_text())
    assert data["ttfts"] == [0.25, 0.375, 0.45]
    assert any("engine's own" in note for note in data["servesim_notes"])
