"""Issue 14, cluster-scale runs: what `run_scenario` does for speed and memory must not change
what it computes. It gives what `collect` gives, frees the requests of a large run before its
iteration frame is made, and leaves the garbage collector as it found it; routers read each
load once, lazily, and break ties to the lowest replica."""

from __future__ import annotations

import gc
from pathlib import Path

import pandas as pd
import pytest

import sim.runner as runner
from sim.config.scenario import Scenario, parse_scenario
from sim.core.request import Request
from sim.engine.cluster import Cluster, Loads
from sim.routers.base import ReplicaLoad, argmin_first
from sim.runner import (
    ReplicaRecord,
    collect,
    load_workload,
    make_requests,
    mark_after_horizon,
    run_scenario,
)


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


def test_ties_go_to_the_lowest_replica():
    assert argmin_first([3, 1, 2, 1]) == 1
    assert argmin_first([0]) == 0
    assert argmin_first([5, 5, 5]) == 0


class Counted:
    """A stand-in replica that counts how often its load is read."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.reads = 0

    def load(self, req: Request | None = None) -> ReplicaLoad:
        self.reads += 1
        return ReplicaLoad(1, self.tokens)


def test_loads_are_read_once_each_whether_iterated_or_indexed():
    replicas = [Counted(t) for t in (30, 10, 20)]
    loads = Loads(replicas, None)  # type: ignore[arg-type]
    assert loads[2].num_load_tokens == 20
    assert [load.num_load_tokens for load in loads] == [30, 10, 20]
    assert [load.num_load_tokens for load in loads[0:2]] == [30, 10]
    assert [r.reads for r in replicas] == [1, 1, 1]
    untouched = [Counted(5), Counted(6)]
    assert len(Loads(untouched, None)) == 2  # type: ignore[arg-type]
    assert [r.reads for r in untouched] == [0, 0]
