"""Disaggregated prefill and decode pools (`sim.engine.disaggregation`), with the constant
latency model: exact timestamps of prefills, KV transfers queueing on a prefill replica's link,
decode back-pressure, a transfer overlapped with its prefill, and each policy's own rule for
admitting a transferred request."""

from __future__ import annotations

import pytest

from sim import run_scenario
from sim.core.request import Request
from sim.core.state import ReplicaState
from tests.engine.fastpath_helpers import assert_same_results
from tests.helpers import disaggregated, replica, trace


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


def _engine_replica(name: str) -> dict:
    """The constant-step replica with an engine's policy, synchronous."""
    data = replica()
    data["scheduler"] = ({"name": "vllm_v1", "async_scheduling": False} if name == "vllm_v1"
                         else {"name": "sglang", "overlap_schedule": False})
    return data


@pytest.mark.parametrize("engine", ["vllm_v1", "sglang"])
def test_where_each_engine_samples_the_first_token(tmp_path, engine):
    """The first test's requests on vLLM and SGLang pools. vLLM's proxy drops the prefill
    request's answer (`max_tokens=1`): the decode side loads the prompt's KV, computes its
    last token again and samples the first token there (`_update_waiting_for_remote_kv`), so
    the client's first token comes after the transfer and one decode step. A: prefill
    [0, 0.25], KV [0.25, 0.75], its first token at 1.0; B: prefill [0.25, 0.5], KV behind
    A's until 0.95, its first token at 1.25, beside A's second. SGLang sends the prefill's
    first token on with the KV and the decode server streams it when a pass takes the request
    in (`process_batch_result_prebuilt`): A's at 0.75 (the decode replica idle), B's, landed
    at 0.95 during A's step, at that step's end, 1.0."""
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 3), (0.125, 40, 2)],
                                     prefill=_engine_replica(engine),
                                     decode=_engine_replica(engine)))
    df = res.requests.set_index("request_id")
    assert df["prefill_end_s"].tolist() == [0.25, 0.5]
    assert df["transfer_end_s"].tolist() == pytest.approx([0.75, 0.95], abs=1e-12)
    assert (df["num_generated_tokens"] == df["num_output_tokens"]).all()
    if engine == "vllm_v1":
        assert tokens_of(res, 0) == [1.0, 1.25, 1.5]
        assert tokens_of(res, 1) == [1.25, 1.5]
        assert df["ttft_s"].tolist() == [1.0, 1.25 - 0.125]
        decode = res.iterations[res.iterations["pool"] == "decode"]
        # A's last prompt token alone; then A's decode beside B's last prompt token.
        assert decode["num_prefill_tokens"].tolist() == [1, 1, 0]
        assert decode["num_decode_tokens"].tolist() == [0, 1, 2]
    else:
        assert tokens_of(res, 0) == [0.75, 1.0, 1.25]
        assert tokens_of(res, 1) == [1.0, 1.25]
        assert df["ttft_s"].tolist() == [0.75, 1.0 - 0.125]
        assert df["max_tbt_s"].tolist() == [0.25, 0.25]  # the transfer is before the first
        decode = res.iterations[res.iterations["pool"] == "decode"]
        assert decode["num_decode_tokens"].tolist() == [1, 2]  # no prompt token again


def test_sglang_decode_side_streams_the_first_token_it_takes_in(tmp_path):
    """SGLang's decode server streams the token the prefill server sent as a pass takes the
    request in, in the overlap loop (on) the pass that plans a step ahead. A lands at 0.75,
    the decode replica idle: its first token then, its next from the steps [0.75, 1.0] and
    [1.0, 1.25] (planned at once). B lands at 0.95: taken in at 1.0, when the oldest step
    ends and the loop plans [1.25, 1.5]; A's last token is in flight, so that step is B's
    alone. C, arriving at 0.8, has its KV preallocated at the decode replica's next pass, 1.0,
    and only then is prefilled (SGLang's bootstrap); its KV is still on its way when the run
    stops at 1.7: its client saw no token."""
    sglang = dict(replica(), scheduler={"name": "sglang"})
    res = run_scenario(disaggregated(
        tmp_path, [(0.0, 100, 3), (0.3, 40, 2), (0.8, 150, 2)],
        prefill=sglang, decode=sglang, horizon_s=1.7))
    df = res.requests.set_index("request_id")
    assert df["prefill_end_s"].tolist() == [0.25, 0.55, 1.25]
    assert df["first_scheduled_s"].tolist() == [0.0, 0.3, 1.0]
    assert df["transfer_end_s"].tolist()[:2] == pytest.approx([0.75, 0.95], abs=1e-12)
    assert tokens_of(res, 0) == [0.75, 1.0, 1.25]
    assert tokens_of(res, 1) == [1.0, 1.5]
    assert df["ttft_s"].tolist()[:2] == [0.75, 1.0 - 0.3]
    assert df["num_generated_tokens"].tolist() == [3, 2, 0]
    assert df.loc[2, "status"] == "unfinished" and df.loc[2, "ttft_s"] != df.loc[2, "ttft_s"]
    decode = res.iterations[res.iterations["pool"] == "decode"]
    assert decode["start_s"].tolist() == [0.75, 1.0, 1.25]
    assert decode["num_decode_tokens"].tolist() == [1, 1, 1]


def test_sglang_one_token_request_finishes_on_the_decode_side(tmp_path):
    """SGLang's prefill server sends every request's KV on, finished or not; the decode
    server's pass that takes it in streams its token and finishes it, with no step
    (`process_batch_result_prebuilt`). vLLM's proxy sends it to the decode side too."""
    sglang = dict(replica(), scheduler={"name": "sglang", "overlap_schedule": False})
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 1)], prefill=sglang, decode=sglang))
    row = res.requests.iloc[0]
    assert (row["prefill_end_s"], row["transfer_end_s"]) == (0.25, 0.75)
    assert (row["ttft_s"], row["finish_s"], row["num_generated_tokens"]) == (0.75, 0.75, 1)
    assert row["decode_replica_id"] == 1 and row["status"] == "finished"
    assert (res.iterations["pool"] == "decode").sum() == 0



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


def test_admitting_a_transferred_request_is_each_policys_own_decision():
    """Decode side of a disaggregated cluster: vLLM v1 takes the KV while blocks last; SGLang
    keeps 512 tokens back for the request already there (`test_sglang_decode_preallocation`)."""
    from sim.core.kv_cache import KVCacheManager
    from sim.schedulers.sglang import SGLang, SGLangConfig
    from sim.schedulers.vllm_v1 import VllmV1, VllmV1Config

    for scheduler, admitted in ((VllmV1(VllmV1Config(name="vllm_v1")), True),
                                (SGLang(SGLangConfig(name="sglang")), False)):
        state = ReplicaState(KVCacheManager(num_blocks=10, block_size=16))
        running = Request(0, 0.0, 64, 64)  # 4 blocks now, 8 at its end
        running.num_computed_tokens, running.num_output_tokens = 64, 1
        state.add(running)
        assert state.kv.try_allocate(running, 0)
        state.admit(running)
        arriving = Request(1, 0.0, 64, 2)
        arriving.num_computed_tokens, arriving.num_output_tokens = 64, 1
        assert scheduler.admit_transfer(state, arriving) is admitted
        assert state.kv.num_held_blocks(1) == (4 if admitted else 0)


def test_sglang_decode_preallocation():
    """SGLang's `pop_preallocated` (page 1, block size 1 here): A runs (prompt 50, 10 of 100
    out: 59 slots held, 141 free, 60 retractable). The free KV keeps back R per request running
    or on its way, or A's clipped promise past what all hold, 100 + 50 - 60 = 90, if more; a
    newcomer needs its prompt plus R, or plus its output less the 60, if more."""
    from sim.core.kv_cache import KVCacheManager
    from sim.schedulers.sglang import SGLang, SGLangConfig

    def decode_side(reserved: int, **config) -> tuple[SGLang, ReplicaState]:
        state = ReplicaState(KVCacheManager(num_blocks=200, block_size=1), decode_only=True)
        a = Request(0, 0.0, 50, 100)
        a.num_computed_tokens, a.num_output_tokens = 59, 10
        state.add(a)
        assert state.kv.try_allocate(a, 0)
        state.admit(a)
        return SGLang(SGLangConfig(name="sglang", num_reserved_decode_tokens=reserved,
                                   **config)), state

    def admit(sched: SGLang, state: ReplicaState, request_id: int, prompt: int,
              output: int) -> bool:
        req = Request(request_id, 0.0, prompt, output)
        req.num_computed_tokens, req.num_output_tokens = prompt, 1
        if not sched.admit_transfer(state, req):
            assert state.kv.num_held_blocks(request_id) == 0
            return False
        state.incoming[request_id] = req
        assert state.kv.num_held_blocks(request_id) == prompt
        return True

    sched, state = decode_side(20)  # allocatable 141 - max(20, 90) = 51
    assert not admit(sched, state, 1, 40, 5)  # needs 40 + 20 = 60
    assert admit(sched, state, 2, 30, 5)  # needs 50
    # (Now two active, 40 kept back, still less than 90: 111 - 90 = 21 for 10 + 20.)
    assert not admit(sched, state, 3, 10, 2)
    sched, state = decode_side(100)  # allocatable 141 - max(100, 90) = 41
    assert not admit(sched, state, 2, 30, 5)  # needs 30 + 100
    sched, state = decode_side(0)  # allocatable 141 - 90 = 51
    assert admit(sched, state, 5, 40, 70)  # max(40, 40 + 70 - 60) = 50
    sched, state = decode_side(0, max_running_requests=2)
    assert admit(sched, state, 6, 1, 1)
    assert not admit(sched, state, 7, 1, 1)  # two running or on their way: no request slot
    # Nothing running: its own clipped output counts whole, beyond any pool here.
    kv = KVCacheManager(num_blocks=200, block_size=1)
    reason = sched.transfer_reason(kv, Request(8, 0.0, 10, 300))
    assert reason is not None and "needs 310 KV slots" in reason
    assert sched.transfer_reason(kv, Request(9, 0.0, 10, 190)) is None


def _run_checked(scenario):
    from sim.schedulers.base import checks

    before = checks(True)
    try:
        return run_scenario(scenario)
    finally:
        checks(before)


def _vllm_async_pools(seed, num_requests, qps, cv, prompt_high, output_high, budget, seqs,
                      threshold, num_blocks):
    from sim.config.scenario import parse_scenario

    side = {"scheduler": {"name": "vllm_v1", "max_num_batched_tokens": budget,
                          "max_num_seqs": seqs, "long_prefill_token_threshold": threshold},
            "latency": {"kind": "roofline", "noise": {"kind": "none"}},
            "kv_cache": {"block_size": 1, "num_blocks": num_blocks}, "prefix_caching": False}
    return parse_scenario({
        "seed": seed,
        "workload": {"format": "synthetic", "num_requests": num_requests,
                     "arrivals": {"process": "gamma", "qps": qps, "cv": cv},
                     "lengths": {"prompt": {"dist": "uniform", "low": 1, "high": prompt_high},
                                 "output": {"dist": "uniform", "low": 1,
                                            "high": output_high}}},
        "cluster": {"prefill": {"replicas": 1, "replica": side},
                    "decode": {"replicas": 1, "replica": side},
                    "link": {"bandwidth_gb_s": 0.001, "latency_s": 0.0}}}, "test")


def test_prefill_replica_takes_no_stale_first_token(tmp_path):
    # vLLM v1 with async scheduling on both pools, tiny KV and budget: the prefill replica
    # preempts requests (1,500 times one of them) and some while their last prompt chunk is in
    # flight. That chunk's token is not delivered there (the KV it would be sent with is gone):
    # the prompt is computed again, and no request on the prefill side ever holds KV beyond
    # its prompt (`ReplicaState.check`, run after every plan here). Found by hypothesis.
    res = _run_checked(_vllm_async_pools(0, 7, 1.0, 1.0, 331, 47, 19, 2, 6, 379))
    df = res.requests
    assert (df["status"] == "finished").all()
    assert (df["num_generated_tokens"] == df["num_output_tokens"]).all()
    assert res.summary["num_preemptions"] > 1000


def test_decode_replica_drops_tokens_of_a_request_finished_by_a_stale_one():
    # vLLM v1, async scheduling: a decode replica preempts a request while its token is in
    # flight, admits it again, and the stale token (delivered) is its last: it finishes while
    # its recompute is in flight, whose token vLLM drops (`update_from_output`); counting it
    # left the replica's running-token count one too high. Found by hypothesis.
    res = _run_checked(_vllm_async_pools(2, 40, 2.0, 2.0, 232, 62, 224, 32, 74, 295))
    df = res.requests
    assert (df["status"] == "finished").all()
    assert (df["num_generated_tokens"] == df["num_output_tokens"]).all()
    assert res.summary["num_preemptions"] > 100


@pytest.mark.parametrize("policy", ["chunked_prefill", "prefill_first", "sglang"])
def test_decode_replica_counts_transfers_on_their_way_in_max_num_seqs(policy):
    # A starved decode replica (2 slots, 30 blocks) preempts; a request it admits again from
    # its queue must leave room for the transfers it took (each holds a slot, `admit_transfer`).
    # Counting only the running ones ran 3 at once here with every one of these policies.
    from sim.config.scenario import parse_scenario

    extra = {"chunked_prefill": {"token_budget": 64}, "prefill_first": {},
             "sglang": {"chunked_prefill_size": 64}}[policy]
    decode = {"model": "tiny", "latency": {"kind": "constant", "iteration_s": 0.01},
              "scheduler": {"name": policy, "max_num_seqs": 2, "decode_reserve_tokens": 0,
                            **extra},
              "kv_cache": {"block_size": 4, "num_blocks": 30}}
    scenario = parse_scenario({
        "seed": 0,
        "workload": {"format": "synthetic", "num_requests": 40,
                     "arrivals": {"process": "poisson", "qps": 40},
                     "lengths": {"prompt": {"dist": "uniform", "low": 4, "high": 40},
                                 "output": {"dist": "uniform", "low": 20, "high": 80}}},
        "cluster": {"prefill": {"replicas": 1, "replica": replica()},
                    "decode": {"replicas": 1, "replica": decode},
                    "link": {"bandwidth_gb_s": 0.0001, "latency_s": 0.0}}}, "test")
    res = _run_checked(scenario)
    iterations = res.iterations
    on_decode = iterations[iterations["replica_id"] == 1]
    assert on_decode["num_seqs"].max() == 2
    assert res.summary["num_preemptions"] > 10
    assert (res.requests["status"] == "finished").all()


@pytest.mark.parametrize("engine", ["vllm_v1", "sglang"])
def test_where_each_engine_waits_for_decode_room(tmp_path, engine):
    """A decode replica of 10 blocks (160 slots) holds one 100-token request at a time. vLLM
    prefills both at once and B's KV waits on the prefill side for A to finish (back-pressure,
    `decode_wait_s`); SGLang's decode server preallocates before the prefill may start (its
    bootstrap), so B waits unprefilled, in its prefill replica's stead, and its KV moves the
    moment its prefill ends."""
    side = _engine_replica(engine)
    decode = {**side, "kv_cache": {"block_size": 16, "num_blocks": 10}}
    if engine == "sglang":
        decode["scheduler"] = {**decode["scheduler"], "num_reserved_decode_tokens": 0}
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 3), (0.0, 100, 3)], prefill=side,
                                     decode=decode,
                                     link={"bandwidth_gb_s": 1000.0, "latency_s": 0.0}))
    df = res.requests.set_index("request_id")
    a_done = df.loc[0, "finish_s"]
    if engine == "vllm_v1":
        assert df.loc[1, "prefill_end_s"] < df.loc[0, "transfer_end_s"]  # prefilled at once
        assert df.loc[1, "decode_wait_s"] > 0 and df.loc[1, "transfer_start_s"] >= a_done
    else:
        assert df.loc[1, "first_scheduled_s"] >= a_done  # prefilled once A left
        assert df.loc[1, "decode_wait_s"] == 0
    assert (df["status"] == "finished").all()


def test_sglang_preallocated_kv_comes_back_when_the_client_gives_up(tmp_path, monkeypatch):
    """A and B have their KV preallocated on the decode replica at arrival, before their
    prefill; A's prompt takes 7 steps of 16 tokens, B waits behind it, and both clients give
    up at 1.0 s: each is aborted on the prefill replica, and the blocks preallocated for it
    are free again. (The end-of-run check of every replica's state asserts that no request
    that will never come holds any; without the give-back it fails.)"""
    import sim.engine.disaggregation as disaggregation

    withdrawn = []
    withdraw = disaggregation.DecodeInbox.withdraw
    monkeypatch.setattr(disaggregation.DecodeInbox, "withdraw",
                        lambda self, req: withdrawn.append(req.request_id) or withdraw(self, req))
    side = _engine_replica("sglang")
    side["scheduler"] = {**side["scheduler"], "num_reserved_decode_tokens": 0,
                         "chunked_prefill_size": 16}
    res = run_scenario(_with_timeout(
        tmp_path, [(0.0, 100, 2), (0.0, 40, 2)], side,
        {**side, "kv_cache": {"block_size": 16, "num_blocks": 10}}, 1.0))
    df = res.requests.set_index("request_id")
    assert (df["status"] == "failed").all() and df["reason"].str.startswith("client_timeout").all()
    assert sorted(withdrawn) == [0, 1]
    assert not (res.iterations["pool"] == "decode").any()


def _sglang_side(**scheduler) -> dict:
    return dict(replica(), scheduler={"name": "sglang", "overlap_schedule": False, **scheduler})


def _with_timeout(tmp_path, rows, side: dict, decode: dict, timeout_s: float):
    """`disaggregated` with every client giving up `timeout_s` after arriving."""
    from sim.config.scenario import parse_scenario

    data = disaggregated(tmp_path, rows, prefill=side, decode=decode).model_dump(mode="json")
    data["workload"]["timeout_s"] = timeout_s
    return parse_scenario(data, "test")


@pytest.mark.parametrize("case", ["one_token_frees_a_slot", "room_between_finishes",
                                  "landing_in_the_planning_turn"])
def test_sglang_pools_fast_forward_as_stepping(tmp_path, case):
    """Where a decode replica's room or batch changes at no finish: a one-token request that
    finishes as its KV lands frees a request slot a transfer waits for; SGLang's
    preallocation passes after a decode step (the tokens running requests hold grow); a
    transfer the replica admits in its own planning turn lands at once (an async vLLM decode
    pool behind SGLang's prefill, its plans of that turn made before it)."""
    from sim.config.scenario import parse_scenario

    if case == "one_token_frees_a_slot":
        side = _sglang_side(max_running_requests=2, num_reserved_decode_tokens=0)
        scenario = disaggregated(tmp_path, [(0.0, 16, 20), (0.0, 16, 1), (0.0, 16, 2)],
                                 prefill=side, decode=side)
    elif case == "room_between_finishes":
        side = _sglang_side(num_reserved_decode_tokens=0)
        scenario = disaggregated(tmp_path, [(0.0, 16, 50), (1.0, 16, 100)], prefill=side,
                                 decode={**side, "kv_cache": {"block_size": 16,
                                                              "num_blocks": 10}})
    else:
        lat = {"kind": "constant", "iteration_s": 0.01}
        rows = [(0.0, 103, 4), (0.00693369073139007, 451, 3), (0.027128607365949353, 324, 4),
                (0.047560543851789296, 254, 5)]
        scenario = parse_scenario({
            "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
            "record_token_times": True,
            "cluster": {
                "prefill": {"replicas": 1, "replica": {
                    "model": "tiny", "latency": lat,
                    "scheduler": {"name": "sglang", "overlap_schedule": False,
                                  "chunked_prefill_size": 256, "max_num_seqs": 2},
                    "kv_cache": {"block_size": 4, "num_blocks": 508}}},
                "decode": {"replicas": 1, "replica": {
                    "model": "tiny", "latency": lat,
                    "scheduler": {"name": "vllm_v1", "enable_chunked_prefill": False},
                    "kv_cache": {"block_size": 4, "num_blocks": 241}}},
                "link": {"bandwidth_gb_s": 50.0, "latency_s": 0.0},
                "overlap_transfer": True}}, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    assert (fast.requests["status"] == "finished").all()


def test_sglang_client_gives_up_while_its_kv_waits_for_preallocation(tmp_path):
    """A holds the decode replica's 10 blocks; B waits for its KV to be preallocated, before
    any prefill. Both clients give up at 1.0 s: A is aborted on the decode replica, B leaves
    the preallocation queue, having touched no replica."""

    side = _sglang_side(num_reserved_decode_tokens=0)
    res = run_scenario(_with_timeout(
        tmp_path, [(0.0, 100, 20), (0.0, 100, 20)], side,
        {**side, "kv_cache": {"block_size": 16, "num_blocks": 10}}, 1.0))
    df = res.requests.set_index("request_id")
    assert (df["status"] == "failed").all() and (df["failed_s"] == 1.0).all()
    assert "running" in df.loc[0, "reason"]
    assert "waiting for a decode replica to preallocate" in df.loc[1, "reason"]
    assert df["first_scheduled_s"].isna().tolist() == [False, True]


def test_prefill_ranks_before_an_sglang_decode_pool_reserve_first(tmp_path):
    """A prefill pool of data-parallel ranks (vLLM, an MoE model) in front of SGLang's decode
    pool: each request's KV is preallocated before a rank takes it; clients that give up give
    their reservations back (the end-of-run state checks hold)."""
    from sim.config.scenario import parse_scenario

    moe = {"model": "qwen3-30b-a3b", "latency": {"kind": "constant", "iteration_s": 0.25},
           "kv_cache": {"block_size": 16, "num_blocks": 1000}}
    prefill = {**moe, "parallelism": {"data": 2, "expert": 2},
               "scheduler": {"name": "vllm_v1", "async_scheduling": False,
                             "max_num_batched_tokens": 16}}
    decode = {**moe, "kv_cache": {"block_size": 16, "num_blocks": 20},
              "scheduler": {"name": "sglang", "overlap_schedule": False,
                            "num_reserved_decode_tokens": 0}}
    data = disaggregated(tmp_path, [(0.0, 100, 2)] * 4, prefill=prefill, decode=decode
                         ).model_dump(mode="json")
    assert (run_scenario(parse_scenario(data, "test")).requests["status"] == "finished").all()
    data["workload"]["timeout_s"] = 0.6
    res = run_scenario(parse_scenario(data, "test"))
    assert (res.requests["status"] == "failed").all()


def test_sglang_a_give_up_at_the_head_of_the_preallocation_queue_lets_the_next_in(tmp_path):
    """A holds 10 of the decode replica's 14 blocks; B (10 blocks) waits at the head of the
    preallocation queue and C (1 block), which would fit, behind it. B's client gives up at
    0.51: the decode replica, idle, takes C at once (SGLang checks its queue at every pass)."""

    side = _sglang_side(num_reserved_decode_tokens=0)
    res = run_scenario(_with_timeout(
        tmp_path, [(0.0, 160, 2), (0.01, 160, 2), (0.3, 16, 2)], side,
        {**side, "kv_cache": {"block_size": 16, "num_blocks": 14}}, 0.5))
    df = res.requests.set_index("request_id")
    assert df.loc[1, "failed_s"] == 0.51 and df["first_scheduled_s"].isna().tolist()[1]
    assert df.loc[2, "first_scheduled_s"] == 0.51


# SGLang's priority scheduling on disaggregated pools (`enable_priority_scheduling`): a step of
# 10 ms, a link fast enough that a transfer takes 33 ns (16 tokens' KV), requests given their
# priorities directly.
PRIORITY_STEP_S = 0.01


def _sglang_priority_side(priority: bool = True, **scheduler) -> dict:
    return {"model": "tiny",
            "scheduler": {"name": "sglang", "overlap_schedule": False,
                          "enable_priority_scheduling": priority, **scheduler},
            "latency": {"kind": "constant", "iteration_s": PRIORITY_STEP_S},
            "kv_cache": {"block_size": 16, "num_blocks": 1000}, "engine": "none"}


def _run_pools(requests: list[Request], prefill: dict, decode: dict) -> list[Request]:
    """`requests` through one prefill and one decode replica, fast and stepped (which must
    agree); the fast run's requests back."""
    import copy

    from sim.config.scenario import parse_scenario
    from sim.core.request import Status
    from sim.engine.cluster import Cluster

    data = {"name": "p", "workload": {"format": "synthetic", "num_requests": 1,
                                      "arrivals": {"process": "poisson", "qps": 1.0},
                                      "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                                  "output": {"dist": "fixed", "value": 1}}},
            "cluster": {"prefill": {"replicas": 1, "replica": prefill},
                        "decode": {"replicas": 1, "replica": decode},
                        "link": {"bandwidth_gb_s": 1000.0, "latency_s": 0.0}}}
    stepped = copy.deepcopy(requests)
    Cluster(parse_scenario(data, "test"), fast_forward=True).run(requests)
    Cluster(parse_scenario(data, "test"), fast_forward=False).run(stepped)

    def times(r: Request) -> tuple:
        return (r.first_scheduled_s, r.prefill_end_s, r.transfer_end_s, r.finish_s,
                r.num_preemptions)

    assert [times(r) for r in requests] == [times(r) for r in stepped]
    assert all(r.status is Status.FINISHED for r in requests)
    return requests


def _prio(request_id: int, arrival_s: float, priority: int, prompt: int = 16,
          output: int = 3) -> Request:
    return Request(request_id, arrival_s, prompt, output, priority=priority)


@pytest.mark.parametrize("low_first", [False, True])
def test_sglang_prefill_server_serves_its_queue_by_priority(low_first):
    """The prefill server's waiting queue is SGLang's priority order (`calc_priority`: higher
    values first, or lower with `schedule_low_priority_values_first`, then when each entered
    it, at its bootstrap's end). One 16-token prompt a prefill batch (`chunked_prefill_size`
    16): A runs in [0, 10 ms]; B (level 0), C and D (level 5) queue behind it and are
    prefilled C, D, B (B, C, D low values first), each ending 10 ms after the one before."""
    reqs = _run_pools([_prio(0, 0.0, 0), _prio(1, 0.001, 0), _prio(2, 0.002, 5),
                       _prio(3, 0.003, 5)],
                      _sglang_priority_side(chunked_prefill_size=16,
                                            schedule_low_priority_values_first=low_first),
                      _sglang_priority_side(schedule_low_priority_values_first=low_first))
    ends = [r.prefill_end_s for r in reqs]
    assert ends == pytest.approx([0.01, 0.02, 0.03, 0.04] if low_first
                                 else [0.01, 0.04, 0.02, 0.03])
    assert all(r.num_preemptions == 0 for r in reqs)


def test_sglang_prefill_server_never_preempts():
    """A prefill server's running batch stays empty (its batches go to the inflight queue), so
    `preempt_to_schedule` finds no victim, whatever the levels and the threshold. With the
    overlap loop and one request slot, A's last chunk (of four, 16 tokens each) is in flight
    when B, 50 levels above it (threshold 0), is tried: A is not preempted, its prefill ends
    at 40 ms and B's 10 ms later. (Taken for a running request, A would be preempted there
    and prefilled again after B: its prefill ending at 90 ms.)"""
    prefill = _sglang_priority_side(overlap_schedule=True, max_running_requests=1,
                                    chunked_prefill_size=16,
                                    priority_scheduling_preemption_threshold=0)
    a, b = _run_pools([_prio(0, 0.0, 0, prompt=64), _prio(1, 0.005, 50)], prefill,
                      _sglang_priority_side())
    assert (a.num_preemptions, b.num_preemptions) == (0, 0)
    assert (a.prefill_end_s, b.prefill_end_s) == pytest.approx((0.04, 0.05))


@pytest.mark.parametrize("order", ["priority", "low_first", "fcfs"])
def test_sglang_decode_server_preallocates_by_priority(order):
    """The decode server's preallocation queue is sorted by priority at every pass
    (`pop_preallocated`), stably: a level's requests keep their order. Its pool (32 tokens in
    pages of one, `num_reserved_decode_tokens` 0) holds one request at a time: A (level 0) runs
    to 30 ms; B (level 0) and C (level 5) wait unprefilled for their KV to be preallocated.
    C is preallocated as A finishes, prefilled [30, 40 ms] and finishes at 60 ms; B then.
    Low values first, or without priorities on the decode pool (the prefill pool's order
    changes nothing: one request reaches it at a time), B goes first."""
    decode = _sglang_priority_side(order != "fcfs", num_reserved_decode_tokens=0,
                                   schedule_low_priority_values_first=order == "low_first")
    decode["kv_cache"] = {"block_size": 1, "num_blocks": 32}
    a, b, c = _run_pools([_prio(0, 0.0, 0), _prio(1, 0.001, 0), _prio(2, 0.002, 5)],
                         _sglang_priority_side(), decode)
    first, second = (c, b) if order == "priority" else (b, c)
    assert a.finish_s == pytest.approx(0.03, abs=1e-6)
    assert first.first_scheduled_s == pytest.approx(0.03, abs=1e-6)
    assert first.finish_s == pytest.approx(0.06, abs=1e-6)
    assert second.first_scheduled_s == pytest.approx(0.06, abs=1e-6)
    assert second.finish_s == pytest.approx(0.09, abs=1e-6)
    assert all(r.num_preemptions == 0 for r in (a, b, c))


@pytest.mark.parametrize("priority", [True, False])
def test_sglang_decode_preallocation_stops_at_the_first_by_priority(priority):
    """`pop_preallocated` stops at the first request that does not fit, in its order. The
    decode pool holds 48 tokens (blocks of one); A (16 + 10 tokens) decodes from 10 to 100 ms.
    B (4 + 2, level 0) arrives at 21 ms and C (32 + 2, level 5) at 22 ms, during a decode step:
    at the pass of 30 ms C comes first and does not fit beside A, and B, which would, waits
    behind it; both are preallocated as A finishes and prefilled together. First come first
    served, B is preallocated at 30 ms and finishes at 60 ms. Nothing is preempted on the
    decode server (it runs no `PrefillAdder`)."""
    decode = _sglang_priority_side(priority, num_reserved_decode_tokens=0)
    decode["kv_cache"] = {"block_size": 1, "num_blocks": 48}
    a, b, c = _run_pools([_prio(0, 0.0, 0, output=10), _prio(1, 0.021, 0, prompt=4, output=2),
                          _prio(2, 0.022, 5, prompt=32, output=2)],
                         _sglang_priority_side(priority), decode)
    assert a.finish_s == pytest.approx(0.10, abs=1e-6)
    assert c.first_scheduled_s == pytest.approx(0.10, abs=1e-6)
    assert b.first_scheduled_s == pytest.approx(0.10 if priority else 0.03, abs=1e-6)
    assert b.finish_s == pytest.approx(0.13 if priority else 0.06, abs=1e-6)
    assert all(r.num_preemptions == 0 for r in (a, b, c))
