"""`collect` from token runs (issue 14: no per-token arrays) gives what one entry per token gave:
the same per-request figures and pooled TBT distribution, on random scenarios with preemption,
prefix caching, horizons and disaggregated clusters (requests moving between replicas)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sim.config.scenario import Scenario, parse_scenario
from sim.core.request import Request
from sim.engine.cluster import Cluster
from sim.engine.iteration_log import IterationLog
from sim.results.columns import to_frame
from sim.results.metrics.summary import FINISHED_COLUMNS, WeightedSample, distribution, summarize
from sim.results.records import TokenRuns, request_table, token_stats
from sim.results.run_dir import Results
from sim.runner import (
    ReplicaRecord,
    collect,
    load_workload,
    make_requests,
    mark_after_horizon,
)
from tests.test_properties import clusters


def simulate(scenario: Scenario) -> tuple[list[Request], list[ReplicaRecord], Results]:
    """`run_scenario`, keeping the requests and replica logs for the per-token reference."""
    requests = make_requests(load_workload(scenario))
    cluster = Cluster(scenario)
    cluster.run(mark_after_horizon(requests, scenario.horizon_s))
    records = [ReplicaRecord(r.pool, r.log, r.state.kv) for r in cluster.replicas]
    return requests, records, collect(scenario, requests, records,
                                      cluster.replicas[0].latency.describe())


def per_token(requests: list[Request], logs: list[IterationLog]) -> dict[str, Any]:
    """The old way, one entry per token (written out in Python, apart from `sim.results.records`):
    every token's time; per request its count, first and last time and largest gap; all the
    gaps of all requests pooled, in request order. A recorded run holds a token at its first
    iteration and at each later one in it with decodes (`Request.record_token`)."""
    ends = [log.end_s() for log in logs]
    decodes = [log.arrays()["num_decode_tokens"] for log in logs]
    # A pipelined (or async) replica logs each sampled token as a (request, iteration) pair.
    sampled: dict[int, list[float]] = {}
    for replica, log in enumerate(logs):
        for rid, j in zip(log.sampled_request_ids, log.sampled_iterations, strict=True):
            sampled.setdefault(rid, []).append(ends[replica][j])
    times = [np.array(sorted([ends[replica][j] for replica, first, end in req.all_token_runs()
                              for j in range(first, end) if j == first or decodes[replica][j] > 0]
                             + sampled.get(req.request_id, [])),
                      dtype=np.float64) for req in requests]
    gaps = [t[1:] - t[:-1] for t in times]
    return {
        "times": times,
        "count": np.array([len(t) for t in times], dtype=np.int64),
        "first": np.array([t[0] if len(t) else np.nan for t in times]),
        "last": np.array([t[-1] if len(t) else np.nan for t in times]),
        "max_gap": np.array([g.max() if len(g) else np.nan for g in gaps]),
        "gaps": np.concatenate([np.zeros(0), *gaps]),
    }


def assert_same_as_per_token(scenario: Scenario) -> Results:
    requests, records, res = simulate(scenario)
    ref = per_token(requests, [r.log for r in records])
    req = res.requests
    arrival = req["arrival_s"].to_numpy()
    count = ref["count"]

    # Per request, to the last bit.
    np.testing.assert_array_equal(req["num_generated_tokens"].to_numpy(), count)
    np.testing.assert_array_equal(req["ttft_s"].to_numpy(), ref["first"] - arrival)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(count > 1, (ref["last"] - ref["first"]) / (count - 1), np.nan)
    np.testing.assert_array_equal(req["tpot_s"].to_numpy(), tpot)
    np.testing.assert_array_equal(req["max_tbt_s"].to_numpy(), ref["max_gap"])

    # The summary, against the one from the expanded gaps: equal but for the mean TBT's last
    # bits (summed as value times count, not gap by gap).
    expected = summarize(req, res.iterations, ref["gaps"], scenario.slo)
    got = {key: res.summary[key] for key in expected}
    if expected["tbt_s"]["mean"] is not None:
        assert got["tbt_s"]["mean"] == pytest.approx(expected["tbt_s"]["mean"], rel=1e-13)
        got["tbt_s"] = {**got["tbt_s"], "mean": expected["tbt_s"]["mean"]}
    assert got == expected
    assert res.summary["tbt_s"]["count"] == len(ref["gaps"])
    if scenario.slo.tbt_s is not None and len(ref["gaps"]):
        assert res.summary["slo"]["tbt_gap_attainment"] == float(
            (ref["gaps"] <= scenario.slo.tbt_s).mean())

    if res.tokens is not None:  # the tokens frame, as before
        tokens = res.tokens
        np.testing.assert_array_equal(tokens["time_s"].to_numpy(),
                                      np.concatenate([np.zeros(0), *ref["times"]]))
        np.testing.assert_array_equal(
            tokens["request_id"].to_numpy(),
            np.repeat(req["request_id"].to_numpy(), count))
        np.testing.assert_array_equal(
            tokens["token_index"].to_numpy(),
            np.concatenate([np.zeros(0, dtype=np.int64), *[np.arange(c) for c in count]]))
    return res


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.sampled_from([None, 0.005, 0.01, 0.02, 0.05]), st.booleans())
def test_collect_equals_per_token_computation(data, tbt_slo, record_tokens):
    data["slo"] = {"ttft_s": 1.0, "tbt_s": tbt_slo}
    data["record_token_times"] = record_tokens
    res = assert_same_as_per_token(parse_scenario(data, "hypothesis"))
    event(f"preempted: {res.summary['num_preemptions'] > 0}")
    event(f"moved between replicas: {res.requests['transfer_end_s'].notna().any()}")
    event(f"unfinished at the horizon: {(res.requests['status'] == 'unfinished').any()}")


# Small replicas without a decode reserve (so they preempt), and a busy workload.
REPLICA = {"model": "tiny", "latency": {"kind": "constant", "iteration_s": 0.01},
           "scheduler": {"name": "chunked_prefill", "token_budget": 64, "max_num_seqs": 8,
                         "decode_reserve_tokens": 0},
           "kv_cache": {"block_size": 4, "num_blocks": 40}}
WORKLOAD = {"format": "synthetic", "num_requests": 30,
            "arrivals": {"process": "poisson", "qps": 50},
            "lengths": {"prompt": {"dist": "uniform", "low": 4, "high": 60},
                        "output": {"dist": "uniform", "low": 1, "high": 90}}}


def test_preemption_and_transfer_cases():
    """Cases sure to have what the random ones may miss: preempted requests (several runs on
    one replica) and requests moved from prefill to decode replicas, with a horizon."""
    tight = parse_scenario({"seed": 1, "workload": WORKLOAD, "replica": REPLICA,
                            "slo": {"tbt_s": 0.01}}, "test")
    res = assert_same_as_per_token(tight)
    assert res.summary["num_preemptions"] > 0
    assert res.summary["tbt_s"]["count"] > 0

    roomy = {**REPLICA, "kv_cache": {"block_size": 4, "num_blocks": 400}}
    moving = parse_scenario({
        "seed": 2, "workload": WORKLOAD, "horizon_s": 0.5, "slo": {"tbt_s": 0.02},
        "cluster": {"prefill": {"replicas": 2, "replica": roomy},
                    "decode": {"replicas": 2, "replica": REPLICA},
                    "link": {"bandwidth_gb_s": 0.01, "latency_s": 0.001},
                    "router": {"name": "round_robin"}}}, "test")
    res = assert_same_as_per_token(moving)
    assert res.requests["transfer_end_s"].notna().sum() > 0
    assert res.summary["num_preemptions"] > 0
    assert (res.requests["status"] == "unfinished").any()


def test_record_token_times_changes_only_the_tokens_frame():
    data = {"seed": 5, "workload": WORKLOAD, "replica": REPLICA,
            "slo": {"ttft_s": 0.5, "tbt_s": 0.02}}
    plain = simulate(parse_scenario(data, "test"))[2]
    recorded = simulate(parse_scenario({**data, "record_token_times": True}, "test"))[2]
    assert plain.tokens is None and recorded.tokens is not None
    pd.testing.assert_frame_equal(plain.requests, recorded.requests)
    pd.testing.assert_frame_equal(plain.iterations, recorded.iterations)
    assert plain.summary == recorded.summary


def runs(*rows: tuple[int, int, int], num_requests: int) -> TokenRuns:
    owner, start, end = (np.array(col, dtype=np.int64) for col in zip(*rows, strict=True))
    return TokenRuns(owner, start, end, np.bincount(owner, minlength=num_requests))


def test_token_stats_by_hand():
    # Iterations end at these times (one replica's log, or several laid end to end).
    end_s = np.array([1.0, 2.0, 4.0, 7.0, 11.0, 16.0, 22.0])
    stats = token_stats(runs(
        (0, 0, 3),  # request 0: tokens at 1, 2, 4 (gaps 1, 2) ...
        (0, 5, 7),  # ... then preempted: 16 (gap 12 across runs), 22 (gap 6)
        (2, 3, 4),  # request 2: one token, at 7
        (3, 1, 7),  # request 3: 2 .. 22, up to the last iteration (gaps 2, 3, 4, 5, 6)
        (4, 6, 7),  # request 4: one token at 22 ...
        num_requests=6), end_s)  # requests 1 and 5: no tokens
    np.testing.assert_array_equal(stats.num_tokens, [5, 0, 1, 6, 1, 0])
    np.testing.assert_array_equal(stats.first_token_s, [1.0, np.nan, 7.0, 2.0, 22.0, np.nan])
    np.testing.assert_array_equal(stats.last_token_s, [22.0, np.nan, 7.0, 22.0, 22.0, np.nan])
    np.testing.assert_array_equal(stats.max_gap_s, [12.0, np.nan, np.nan, 6.0, np.nan, np.nan])
    expanded = np.repeat(stats.gaps.values, stats.gaps.counts)
    assert sorted(expanded) == sorted([1.0, 2.0, 12.0, 6.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_token_stats_of_nothing():
    stats = token_stats(runs((0, 0, 1), num_requests=2), np.array([0.5]))
    np.testing.assert_array_equal(stats.max_gap_s, [np.nan, np.nan])
    assert stats.gaps.size == 0
    assert distribution(stats.gaps)["count"] == 0
    empty = token_stats(TokenRuns(*(np.zeros(0, dtype=np.int64),) * 3,
                                  np.zeros(3, dtype=np.int64)), np.zeros(0))
    np.testing.assert_array_equal(empty.num_tokens, [0, 0, 0])
    assert empty.gaps.size == 0


def test_request_frame_columns_unchanged():
    """Column names and dtypes of the request frame (what result files and notebooks read)."""
    requests = [Request(0, 0.0, 10, 3), Request(1, 0.5, 10, 3)]
    table, gaps = request_table(requests, [IterationLog()])
    frame = to_frame(table)
    assert isinstance(gaps, WeightedSample)
    assert list(frame.columns) == [
        "request_id", "replica_id", "decode_replica_id", "arrival_s", "num_prompt_tokens",
        "num_output_tokens", "num_generated_tokens", "first_scheduled_s", "first_token_s",
        "finish_s", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "num_recomputed_tokens", "status", "reason", "scheduling_delay_s", "ttft_s", "e2e_s",
        "tpot_s", "max_tbt_s", "prefill_end_s", "transfer_start_s", "transfer_wire_start_s",
        "transfer_end_s",
        "decode_wait_s", "transfer_s"]
    assert frame["num_generated_tokens"].dtype == np.int64
    assert all(frame[c].dtype == np.float64 for c in FINISHED_COLUMNS)


def test_runs_through_iterations_without_decodes_give_the_same_results(monkeypatch):
    """Prefill-first pauses every decode while prompts run: a run of token iterations goes
    on through those iterations (one run, not one per prompt) and the tables cut it there.
    Every result is what closing the run at each of them gives."""
    from sim.core.state import ReplicaState
    from sim.results.records import split_where_none_decoded

    data = {"seed": 3, "workload": {**WORKLOAD, "num_requests": 60},
            "replica": {**REPLICA, "scheduler": {"name": "prefill_first", "max_num_seqs": 8},
                        "kv_cache": {"block_size": 4, "num_blocks": 400}},
            "record_token_times": True}
    scenario = parse_scenario(data, "test")
    requests, records, res = simulate(scenario)
    logs = [r.log for r in records]
    spans = [(first, end) for req in requests for _, first, end in req.all_token_runs()
             if (logs[0].arrays()["num_decode_tokens"][first + 1:end] == 0).any()]
    assert len(spans) > 10  # runs that go on through iterations without decodes
    assert_same_as_per_token(scenario)

    # Every run closed where this request decoded not in the iteration before, as before.
    commit, record_token = ReplicaState.commit, Request.record_token
    monkeypatch.setattr(ReplicaState, "commit",
                        lambda self, plan, iteration, start_s, end_s, since=None: commit(
                            self, plan, iteration, start_s, end_s))
    monkeypatch.setattr(Request, "record_token",
                        lambda self, iteration, since=None: record_token(self, iteration))
    requests_closed, records_closed, closed = simulate(scenario)
    assert sum(len(r.all_token_runs()) for r in requests_closed) > sum(
        len(r.all_token_runs()) for r in requests)
    for name in ("requests", "iterations", "tokens", "tbt_gaps"):
        pd.testing.assert_frame_equal(getattr(res, name), getattr(closed, name))
    assert res.summary == closed.summary
    assert split_where_none_decoded(*_runs(requests_closed, [r.log for r in records_closed]),
                                    [r.log for r in records_closed]) is None


def _runs(requests: list[Request], logs: list[IterationLog]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [(i, first, end) for i, req in enumerate(requests)
            for _, first, end in req.all_token_runs()]
    owner, start, end = (np.array(col, dtype=np.int64) for col in zip(*rows, strict=True))
    return owner, start, end


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.data())
def test_runs_are_cut_at_each_iteration_without_decodes(decodes, data):
    """`split_where_none_decoded` against the tokens written out: a run [first, end) holds a
    token at first and at each later iteration with decodes; the pieces are those tokens'
    runs of consecutive iterations."""
    from sim.results.records import split_where_none_decoded

    log = IterationLog()
    for n in decodes:
        log.append(0.0, 1.0, 0, n, max(n, 1), 0, 0, 0)
    num = len(decodes)
    # Runs whose last iteration holds a token (its first, or one with decodes).
    ends_ok = [j for j in range(num) if decodes[j] > 0]
    runs = []
    for owner in range(data.draw(st.integers(1, 6))):
        first = data.draw(st.integers(0, num - 1))
        last = data.draw(st.sampled_from([first] + [j for j in ends_ok if j > first]))
        runs.append((owner, first, last + 1))
    owner, start, end = (np.array(col, dtype=np.int64) for col in zip(*runs, strict=True))
    expected = []
    for o, first, stop in runs:
        tokens = [j for j in range(first, stop) if j == first or decodes[j] > 0]
        piece = [tokens[0]]
        for j in tokens[1:]:
            if j == piece[-1] + 1:
                piece.append(j)
            else:
                expected.append((o, piece[0], piece[-1] + 1))
                piece = [j]
        expected.append((o, piece[0], piece[-1] + 1))
    split = split_where_none_decoded(owner, start, end, [log])
    got = runs if split is None else list(zip(*(a.tolist() for a in split), strict=True))
    assert got == expected
