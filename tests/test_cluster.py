"""Clusters: routers, disaggregated prefill/decode pools, KV transfer links (constant latency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario, scenario_yaml

TICK = 0.25
TINY_KV_BYTES = 2048  # tiny model: 4 layers x 2 KV heads x 64 x (K, V) x 2 bytes


def trace(tmp_path: Path, rows: list[tuple[float, int, int]]) -> str:
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    return str(path)


def replica(num_blocks: int = 1000, **scheduler) -> dict:
    return {"model": "tiny",
            "scheduler": {"name": "chunked_prefill", "token_budget": 256, "max_num_seqs": 16,
                          **scheduler},
            "latency": {"kind": "constant", "iteration_s": TICK},
            "kv_cache": {"block_size": 16, "num_blocks": num_blocks}}


def disaggregated(tmp_path, rows, *, prefill=None, decode=None, link=None, **extra):
    return parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
        "cluster": {"prefill": {"replicas": 1, "replica": prefill or replica()},
                    "decode": {"replicas": 1, "replica": decode or replica()},
                    "link": link or {"bandwidth_gb_s": 0.0004096, "latency_s": 0.0}},
        "record_token_times": True, **extra}, "test")


def tokens_of(res, request_id):
    t = res.tokens
    return t.loc[t["request_id"] == request_id, "time_s"].tolist()


def test_one_prefill_one_decode_exact_timestamps(tmp_path):
    # 409,600 B/s: A's 100-token KV (204,800 B) takes 0.5 s; B's 40 tokens 0.2 s.
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 3), (0.125, 40, 2)]))
    df = res.requests.set_index("request_id")
    # Prefill replica: A prefilled in [0, 0.25], B in [0.25, 0.5]; first tokens there.
    assert df["prefill_end_s"].tolist() == [0.25, 0.5]
    assert df["ttft_s"].tolist() == [0.25, 0.5 - 0.125]
    # A's KV crosses the link in [0.25, 0.75]; B's waits behind it (FIFO) until 0.75, then 0.2 s.
    assert df["transfer_start_s"].tolist() == [0.25, 0.5]
    assert df["transfer_end_s"].tolist() == pytest.approx([0.75, 0.95], abs=1e-12)
    assert df["decode_wait_s"].tolist() == [0.0, 0.0]
    # Decode replica: A alone in [0.75, 1.0]; B joins at 0.95 and decodes with A in [1.0, 1.25].
    assert tokens_of(res, 0) == [0.25, 1.0, 1.25]
    assert tokens_of(res, 1) == [0.5, 1.25]
    assert df["max_tbt_s"].tolist() == [0.75, 0.75]  # the gap across the transfer counts
    assert df["replica_id"].tolist() == [0, 0] and df["decode_replica_id"].tolist() == [1, 1]
    assert df["finish_s"].tolist() == [1.25, 1.25]
    assert df["transfer_s"].tolist() == pytest.approx([0.5, 0.45])
    assert res.summary["transfer"]["transfer_s"]["max"] == pytest.approx(0.5)
    pools = {r["replica_id"]: r["pool"] for r in res.summary["replicas"]}
    assert pools == {0: "prefill", 1: "decode"}
    prefill, decode = res.summary["pools"]["prefill"], res.summary["pools"]["decode"]
    assert (prefill["num_replicas"], prefill["num_iterations"]) == (1, 2)
    assert decode["num_iterations"] == 2  # [0.75, 1.0] and [1.0, 1.25]
    # Busy 0.5 s of the 1.25 s from first arrival to last finish, on each side.
    assert prefill["mean_busy_fraction"] == pytest.approx(0.4)
    assert decode["mean_busy_fraction"] == pytest.approx(0.4)


def test_transfers_from_one_prefill_replica_queue_on_its_link(tmp_path):
    # Three prompts prefilled in one iteration; their transfers leave one after another.
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 2), (0.0, 100, 2), (0.0, 100, 2)],
                                     prefill=replica(token_budget=512)))
    df = res.requests.sort_values("transfer_end_s")
    assert df["prefill_end_s"].tolist() == [0.25] * 3
    assert df["transfer_end_s"].tolist() == pytest.approx([0.75, 1.25, 1.75])
    assert df["transfer_s"].tolist() == pytest.approx([0.5, 1.0, 1.5])


def test_two_prefill_replicas_send_in_parallel(tmp_path):
    scenario = disaggregated(tmp_path, [(0.0, 100, 2), (0.0, 100, 2)])
    cluster = scenario.cluster.model_copy(update={
        "prefill": scenario.cluster.prefill.model_copy(update={"replicas": 2})})
    res = run_scenario(scenario.model_copy(update={"cluster": cluster}))
    assert sorted(res.requests["replica_id"]) == [0, 1]  # round robin over the prefill pool
    assert res.requests["transfer_end_s"].tolist() == pytest.approx([0.75, 0.75])


def test_decode_back_pressure_keeps_kv_on_the_prefill_side(tmp_path):
    # The decode replica holds 10 blocks (160 slots): one 100-token request at a time.
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 4), (0.0, 100, 4)],
                                     decode=replica(num_blocks=10),
                                     link={"bandwidth_gb_s": 1000.0, "latency_s": 0.0}))
    df = res.requests.set_index("request_id")
    first, second = df.loc[0], df.loc[1]
    assert first["decode_wait_s"] == 0.0
    # The second waits until the first finishes on the decode replica and frees its blocks.
    assert second["transfer_start_s"] == first["finish_s"]
    assert second["decode_wait_s"] == first["finish_s"] - 0.25
    prefill_its = res.iterations[res.iterations["pool"] == "prefill"]
    assert prefill_its["num_kv_blocks_used"].tolist() == [14]  # both prompts' 7 blocks each
    assert res.summary["transfer"]["decode_wait_s"]["max"] == second["decode_wait_s"]
    assert (df["status"] == "finished").all()


def test_overlap_hides_transfer_behind_the_prefill(tmp_path):
    plain = run_scenario(disaggregated(tmp_path, [(0.0, 100, 2)]))
    scenario = disaggregated(tmp_path, [(0.0, 100, 2)])
    cluster = scenario.cluster.model_copy(update={"overlap_transfer": True})
    overlap = run_scenario(scenario.model_copy(update={"cluster": cluster}))
    assert plain.requests["transfer_s"].iloc[0] == pytest.approx(0.5)
    # 0.25 s of the 0.5 s streamed while the prefill iteration ran.
    assert overlap.requests["transfer_s"].iloc[0] == pytest.approx(0.25)


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


def test_pools_start_from_the_scenarios_replica():
    """A disaggregated cluster's pools inherit the top-level replica and change what they give;
    the top-level replica is never silently ignored."""
    scenario = parse_scenario({
        "workload": {"format": "synthetic", "num_requests": 5, "arrivals": {"qps": 1},
                     "lengths": {"prompt": {"dist": "fixed", "value": 10},
                                 "output": {"dist": "fixed", "value": 3}}},
        "replica": {"gpu": "h200", "scheduler": {"name": "chunked_prefill", "token_budget": 256},
                    "kv_cache": {"num_blocks": 500}},
        "cluster": {"prefill": {"replicas": 1, "replica": {"scheduler": {"token_budget": 1024}}},
                    "decode": {"replicas": 1,
                               "replica": {"gpu": "a100-80gb",
                                           "scheduler": {"name": "prefill_first"}}}},
    }, "test")
    prefill, decode = scenario.cluster.prefill.replica, scenario.cluster.decode.replica
    assert (prefill.gpu, prefill.scheduler.name, prefill.scheduler.token_budget) == (
        "h200", "chunked_prefill", 1024)
    assert prefill.kv_cache.num_blocks == decode.kv_cache.num_blocks == 500
    assert (decode.gpu, decode.scheduler.name) == ("a100-80gb", "prefill_first")
    # The resolved scenario reads back to the same one.
    import yaml

    from sim.config.scenario import scenario_yaml
    again = parse_scenario(yaml.safe_load(scenario_yaml(scenario)), "again")
    assert scenario_yaml(again) == scenario_yaml(scenario)


def test_kv_transfer_settings_on_a_colocated_cluster_are_shown_as_written(tmp_path):
    # They were shown as a Python repr: LinkConfig(bandwidth_gb_s=10.0, latency_s=5e-06).
    data = {"workload": {"format": "vidur", "path": trace(tmp_path, [(0.0, 16, 2)])},
            "cluster": {"link": {"bandwidth_gb_s": 10}, "decode_router": {"name": "round_robin"},
                        "overlap_transfer": True}}
    with pytest.raises(InputError) as exc:
        parse_scenario(data, "s.yaml")
    assert exc.value.lines() == [
        f"s.yaml: cluster.{field}={value}: only used by a disaggregated cluster (prefill and "
        "decode pools)" for field, value in [
            ("decode_router", "{name: round_robin}"),
            ("link", "{bandwidth_gb_s: 10.0, latency_s: 5.0e-06}"),
            ("overlap_transfer", "True")]]
    # Settings equal to the defaults, as a resolved scenario.yaml spells them out, still run.
    del data["cluster"]
    scenario = parse_scenario(data, "s.yaml")
    resolved = yaml.safe_load(scenario_yaml(scenario))
    assert resolved["cluster"]["link"] == {"bandwidth_gb_s": 50.0, "latency_s": 5e-06}
    assert parse_scenario(resolved, "s.yaml").cluster == scenario.cluster
