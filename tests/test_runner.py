"""`run_scenario` and `collect` (`sim.runner`): what `run_scenario` does for speed and memory
(issue 14) must not change what it computes. It gives what `collect` gives, frees the requests of
a large run before its iteration frame is made and leaves the garbage collector as it found it;
`collect` from token runs gives what one entry per token gave: the same per-request figures and
pooled TBT distribution, on random scenarios with preemption, prefix caching, horizons and
disaggregated clusters (requests moving between replicas)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import sim.runner as runner
from sim.config.scenario import Scenario, parse_scenario
from sim.core.request import Request
from sim.engine.cluster import Cluster
from sim.engine.iteration_log import IterationLog
from sim.results.metrics.summary import summarize
from sim.results.run_dir import Results
from sim.runner import (
    ReplicaRecord,
    collect,
    make_requests,
    mark_after_horizon,
    run_scenario,
)
from sim.workloads.load import load_workload
from tests.strategies import clusters


def scenario(tmp_path: Path, *, record_token_times: bool = False,
             horizon_s: float | None = None) -> Scenario:
    rows = [(0.02 * i, 50 + 37 * (i % 7), 2 + i % 5) for i in range(60)]
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    return parse_scenario({
        "seed": 0, "horizon_s": horizon_s, "record_token_times": record_token_times,
        "workload": {"format": "vidur", "path": str(path)},
        "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm", "latency": {"kind": "roofline"},
                    "scheduler": {"name": "chunked_prefill", "token_budget": 128},
                    "kv_cache": {"num_blocks": 64, "block_size": 16}},
        "cluster": {"replicas": 3, "router": {"name": "least_kv_load"}}}, "test")


def live_requests() -> int:
    # `type(...) is`, not isinstance: that reads `__class__`, which some modules' objects
    # (torch's, imported by other tests) answer with a deprecation warning.
    return sum(type(obj) is Request for obj in gc.get_objects())


@pytest.mark.parametrize(("record_token_times", "horizon_s"), [(False, None), (True, 1.0)])
def test_run_scenario_gives_what_collect_gives(tmp_path, record_token_times, horizon_s):
    sc = scenario(tmp_path, record_token_times=record_token_times, horizon_s=horizon_s)
    res = run_scenario(sc)
    requests = make_requests(load_workload(sc))
    cluster = Cluster(sc)
    cluster.run(mark_after_horizon(requests, horizon_s))
    records = [ReplicaRecord(r.pool, r.log, r.state.kv) for r in cluster.replicas]
    ref = collect(sc, requests, records, cluster.replicas[0].latency.describe())
    assert res.summary == ref.summary
    for name in ("requests", "iterations", "tbt_gaps", "tokens"):
        got, want = getattr(res, name), getattr(ref, name)
        assert (got is None) == (want is None) == (name == "tokens" and not record_token_times)
        if got is not None:
            pd.testing.assert_frame_equal(got, want)


def test_run_scenario_frees_the_requests_and_restores_the_collector(tmp_path, monkeypatch):
    sc = scenario(tmp_path)
    monkeypatch.setattr(runner, "COLLECT_AT_NUM_REQUESTS", 60)  # this run's size
    gc.collect()
    before = live_requests()
    assert gc.isenabled()
    # Gone before the summary and the iteration frame are built (the peak), not only after.
    alive_then = []
    collect_frames = runner.collect_frames

    def spy(*args, **kwargs):
        alive_then.append(live_requests())
        return collect_frames(*args, **kwargs)

    monkeypatch.setattr(runner, "collect_frames", spy)
    res = run_scenario(sc)
    assert alive_then == [before]
    assert res.summary["requests"]["total"] == 60
    assert live_requests() == before  # none left behind, not even in the cluster's cycles
    assert gc.isenabled()
    gc.disable()
    try:
        run_scenario(sc)
        assert not gc.isenabled()  # left off, as the caller had it
    finally:
        gc.enable()


def test_the_collector_is_on_again_when_making_requests_fails(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("stop")

    monkeypatch.setattr(runner, "make_requests", fail)
    with pytest.raises(RuntimeError, match="stop"):
        run_scenario(scenario(tmp_path))
    assert gc.isenabled()


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
    ends = [log.output_s() for log in logs]  # (an iteration's end, or when its result was taken)
    decodes = [log.arrays()["num_decode_tokens"] for log in logs]
    # A pipelined (or async) replica logs its sampled tokens as runs of iterations.
    sampled: dict[int, list[float]] = {}
    for replica, log in enumerate(logs):
        for rid, j in zip(*(a.tolist() for a in log.sampled_tokens()), strict=True):
            sampled.setdefault(rid, []).append(ends[replica][j])
    times = [np.array(sorted([ends[replica][j] for replica, first, end in req.all_token_runs()
                              for j in range(first, end) if j == first or decodes[replica][j] > 0]
                             + sampled.get(req.request_id, [])),
                      dtype=np.float64) for req in requests]
    # SGLang's disaggregated first token reaches the client when the decode side takes the
    # request in (inf: never did); it was sampled, first, on the prefill replica.
    for i, req in enumerate(requests):
        out_s = req.first_token_out_s
        if out_s is not None and len(times[i]):
            times[i] = times[i][1:] if out_s == np.inf else np.concatenate([[out_s], times[i][1:]])
    gaps = [t[1:] - t[:-1] for t in times]
    return {
        "times": times,
        "count": np.array([len(t) for t in times], dtype=np.int64),
        "first": np.array([t[0] if len(t) else np.nan for t in times]),
        "last": np.array([t[-1] if len(t) else np.nan for t in times]),
        "max_gap": np.array([g.max() if len(g) else np.nan for g in gaps]),
        "gaps": np.concatenate([np.zeros(0), *gaps]),
        "per_request_gaps": gaps,
    }


def per_class(scenario: Scenario, req: Any, ref: dict[str, Any]) -> tuple[list[Any], Any]:
    """Each class's pooled gaps and the run's SLO attainment with each request judged by its
    class's targets, written out request by request (apart from `sim.results.metrics`)."""
    classes = scenario.workload.classes or []
    names = req["request_class"].tolist()
    gaps = [np.concatenate([np.zeros(0), *[g for g, n in zip(ref["per_request_gaps"], names,
                                                             strict=True) if n == c.name]])
            for c in classes]
    slo = {c.name: c.slo or scenario.slo for c in classes}
    offered = [not r.startswith(("after_horizon", "after_stop", "abandoned", "after_duration"))
               for r in req["reason"]]
    rows = [(slo[n], s == "finished", t, w) for n, s, t, w, o in zip(
        names, req["status"], req["ttft_s"], req["max_tbt_s"], offered, strict=True) if o]
    out: dict[str, Any] = {}
    if not rows:
        return gaps, out
    inf = float("inf")
    ttft_ok = [done and t <= (s.ttft_s or inf) for s, done, t, _ in rows]
    tbt_ok = [done and not w > (s.tbt_s or inf) for s, done, _, w in rows]
    if any(s.ttft_s is not None for s in slo.values()):
        out["ttft_attainment"] = sum(ttft_ok) / len(rows)
    if any(s.tbt_s is not None for s in slo.values()):
        out["tbt_attainment"] = sum(tbt_ok) / len(rows)
        total = sum(len(g) for g in gaps)
        out["tbt_gap_attainment"] = sum(
            int((g <= (slo[c.name].tbt_s or inf)).sum()) for g, c in zip(gaps, classes,
                                                                        strict=True)
        ) / total if total else None
    if out:
        out["all_attainment"] = sum(
            done and (s.ttft_s is None or a) and (s.tbt_s is None or b)
            for (s, done, _, _), a, b in zip(rows, ttft_ok, tbt_ok, strict=True)) / len(rows)
    return gaps, out


def assert_same_as_per_token(scenario: Scenario) -> Results:
    requests, records, res = simulate(scenario)
    ref = per_token(requests, [r.log for r in records])
    req = res.requests
    arrival = req["arrival_s"].to_numpy()
    count = ref["count"]  # streamed events: one per token, or per step's tokens (speculative)
    num_tokens = count + np.array([r.num_extra_tokens for r in requests], dtype=np.int64)

    # Per request, to the last bit.
    np.testing.assert_array_equal(req["num_generated_tokens"].to_numpy(), num_tokens)
    np.testing.assert_array_equal(req["ttft_s"].to_numpy(), ref["first"] - arrival)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(num_tokens > 1, (ref["last"] - ref["first"]) / (num_tokens - 1),
                        np.nan)
    np.testing.assert_array_equal(req["tpot_s"].to_numpy(), tpot)
    np.testing.assert_array_equal(req["max_tbt_s"].to_numpy(), ref["max_gap"])

    # The summary, against the one from the expanded gaps: equal but for the mean TBT's last
    # bits (summed as value times count, not gap by gap).
    expected = summarize(req, res.iterations, ref["gaps"], scenario.slo)
    classes = scenario.workload.classes or []
    if classes:
        class_gaps, combined = per_class(scenario, req, ref)
        for c, gaps, stats in zip(classes, class_gaps, res.summary["classes"], strict=True):
            assert stats["name"] == c.name and stats["tbt_s"]["count"] == len(gaps)
            assert stats["requests"]["total"] == int((req["request_class"] == c.name).sum())
            if len(gaps):
                assert stats["tbt_s"]["p99"] == np.percentile(gaps, 99)
                assert stats["tbt_s"]["mean"] == pytest.approx(gaps.mean(), rel=1e-13)
        if any(c.slo is not None for c in classes):
            expected["slo"] = {k: v if v is None else pytest.approx(v, rel=1e-13)
                               for k, v in combined.items()}
    got = {key: res.summary[key] for key in expected}
    if expected["tbt_s"]["mean"] is not None:
        assert got["tbt_s"]["mean"] == pytest.approx(expected["tbt_s"]["mean"], rel=1e-13)
        got["tbt_s"] = {**got["tbt_s"], "mean": expected["tbt_s"]["mean"]}
    assert got == expected
    assert res.summary["tbt_s"]["count"] == len(ref["gaps"])
    own_targets = any(c.slo is not None for c in scenario.workload.classes or [])
    if scenario.slo.tbt_s is not None and len(ref["gaps"]) and not own_targets:
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


@pytest.mark.slow
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
