"""Routers, each on its own rule: round robin, least outstanding, least KV load (tokens, not
requests), random (seeded), prefix affinity (the cache unless loads are out of balance); ties go
to the lowest replica."""

from __future__ import annotations

import numpy as np

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.routers.base import ReplicaLoad, argmin_first
from sim.routers.prefix_affinity import PrefixAffinity, PrefixAffinityConfig
from tests.helpers import hashed, replica, trace


def colocated(tmp_path, rows, router: str, replicas: int, seed: int = 0):
    return run_scenario(parse_scenario({
        "seed": seed,
        "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
        "replica": replica(),
        "cluster": {"replicas": replicas, "router": {"name": router}}}, "test"))


def test_round_robin_and_least_outstanding(tmp_path):
    rows = [(0.0, 10, 1), (0.1, 10, 10), (0.2, 10, 10), (1.5, 10, 5), (1.6, 10, 5)]
    rr = colocated(tmp_path, rows, "round_robin", 3)
    assert rr.requests["replica_id"].tolist() == [0, 1, 2, 0, 1]
    lo = colocated(tmp_path, rows, "least_outstanding", 3)
    # A (one token) is done by 0.25, so D finds replica 0 empty; then all hold one: lowest wins.
    assert lo.requests["replica_id"].tolist() == [0, 1, 2, 0, 0]


def test_least_kv_load_weighs_tokens_not_requests(tmp_path):
    rows = [(0.0, 1000, 20), (0.1, 10, 20), (0.2, 10, 20)]
    lo = colocated(tmp_path, rows, "least_outstanding", 2)
    kv = colocated(tmp_path, rows, "least_kv_load", 2)
    assert lo.requests["replica_id"].tolist() == [0, 1, 0]
    assert kv.requests["replica_id"].tolist() == [0, 1, 1]  # replica 0 holds 1000+ tokens


def test_random_router_is_seeded(tmp_path):
    rows = [(0.01 * i, 10, 2) for i in range(40)]
    a = colocated(tmp_path, rows, "random", 4, seed=5).requests["replica_id"].tolist()
    b = colocated(tmp_path, rows, "random", 4, seed=5).requests["replica_id"].tolist()
    c = colocated(tmp_path, rows, "random", 4, seed=6).requests["replica_id"].tolist()
    assert a == b and a != c
    assert set(a) == {0, 1, 2, 3}
    expected = np.random.default_rng(np.random.SeedSequence(5).spawn(2)[0]).integers(0, 4, 40)
    assert a == expected.tolist()


def test_ties_go_to_the_lowest_replica():
    assert argmin_first([3, 1, 2, 1]) == 1
    assert argmin_first([0]) == 0
    assert argmin_first([5, 5, 5]) == 0


def test_prefix_affinity_follows_the_cache_unless_loads_are_out_of_balance():
    router = PrefixAffinity(PrefixAffinityConfig(name="prefix_affinity"), None)
    req = hashed(0, prompt=1000, output=1, ids=(1,))
    loads = [ReplicaLoad(5, 9000, 0), ReplicaLoad(9, 20000, 600), ReplicaLoad(2, 100, 300)]
    assert router.choose(req, loads) == 1  # 60% cached there
    # Too little cached anywhere (below 30%): the least KV load.
    loads = [ReplicaLoad(5, 9000, 0), ReplicaLoad(9, 20000, 200), ReplicaLoad(2, 100, 0)]
    assert router.choose(req, loads) == 2
    # Out of balance (max - min > 64 and max > 1.5 min): the fewest in flight.
    loads = [ReplicaLoad(10, 9000, 0), ReplicaLoad(90, 20000, 900), ReplicaLoad(20, 100, 0)]
    assert router.choose(req, loads) == 0
