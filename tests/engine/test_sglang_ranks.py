"""SGLang's DP attention (`scheduler.name: sglang` with `replica.parallelism.data`): times
worked out by hand on a linear latency model (an idle rank's forward of no tokens while another
works, and no step once none has any), the controller's balancers, each rank's share of the
replica's limits, and which steps the ranks pad alike on the roofline."""

from __future__ import annotations

import numpy as np
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from sim.engine.data_parallel import DataParallelGroup
from sim.latency.base import BatchShape
from sim.routers.base import ReplicaLoad
from sim.routers.sglang_dp import SGLangDataParallel, SGLangDataParallelConfig
from tests.engine.test_fast_path import assert_same_results
from tests.helpers import assert_one_line_error, run_cli

BASE_S, PER_TOKEN_S = 0.01, 1e-5


def _raw(data=2, num_requests=1, **scheduler):
    return {"name": "dp", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": 40.0},
                         "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                                     "output": {"dist": "uniform", "low": 1, "high": 60}}},
            "replica": {"model": "qwen3-30b-a3b", "gpu": "h100-sxm",
                        "parallelism": {"data": data, "expert": data},
                        "scheduler": {"name": "sglang", "overlap_schedule": False,
                                      **scheduler},
                        "latency": {"kind": "linear", "base_s": BASE_S,
                                    "per_token_s": PER_TOKEN_S}}}


def _cluster(raw):
    return Cluster(parse_scenario(raw, "<test>"), fast_forward=False)


def _times(cluster, req):
    """When `req`'s tokens came out: the ends of the iterations its rank sampled it in."""
    log = cluster.replicas[req.replica_id].log
    ids, iterations = log.sampled_tokens()
    return log.output_s()[iterations[ids == req.request_id]]


def test_an_idle_rank_runs_an_empty_forward_and_no_step_trails_the_work():
    """A (8-token prompt, 5 out) alone on rank 0: rank 1 runs an idle forward (no tokens) in
    each of A's 5 steps, and once A is done the ranks stop at once (SGLang gathers every
    rank's token count every iteration: all zero, no forward), where vLLM's ranks run dummy
    steps to their next check. C, arriving 2.5 steps later, starts at its arrival. On the
    linear model the busy rank sets each step: A's prompt 10.08 ms, a decode 10.01."""
    cluster = _cluster(_raw())
    (group,) = cluster.front
    assert isinstance(group, DataParallelGroup)
    a = Request(0, 0.0, 8, 5)
    cluster.run([a])
    assert group.num_dummy_forwards == 5
    first_s, decode_s = BASE_S + 8 * PER_TOKEN_S, BASE_S + PER_TOKEN_S
    assert a.finish_s == pytest.approx(first_s + 4 * decode_s, abs=1e-12)
    cluster = _cluster(_raw())
    a = Request(0, 0.0, 8, 5)
    c_arrival = first_s + 4 * decode_s + 2.5 * decode_s
    c = Request(1, c_arrival, 8, 1)
    cluster.run([a, c])
    # (round robin: C goes to rank 1, whatever the load)
    assert (a.replica_id, c.replica_id) == (0, 1)
    assert _times(cluster, c)[0] == pytest.approx(c_arrival + first_s, abs=1e-12)
    assert cluster.front[0].num_dummy_forwards == 5 + 1


def test_a_prompt_on_one_rank_stretches_the_other_ranks_decode_step():
    """A (8 tokens, 20 out) on rank 0, B (1,000-token prompt) at 50 ms on rank 1: the step of
    B's prompt takes 20 ms for both ranks, A's other steps 10.01 ms."""
    cluster = _cluster(_raw())
    a, b = Request(0, 0.0, 8, 20), Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert [r.status for r in (a, b)] == [Status.FINISHED] * 2
    gaps = np.diff(_times(cluster, a))
    assert max(gaps) == pytest.approx(BASE_S + 1000 * PER_TOKEN_S, abs=1e-12)
    assert sorted(gaps)[:-1] == pytest.approx([BASE_S + PER_TOKEN_S] * 18, abs=1e-12)


def _loads(*counts):
    """Ranks' loads from (waiting, running, tokens) each."""
    return [ReplicaLoad(w + r, tokens, 0, w, r, 0.0) for w, r, tokens in counts]


def _balancer(method):
    return SGLangDataParallel(SGLangDataParallelConfig(name="sglang_dp",
                                                       load_balance_method=method),
                              np.random.default_rng(0))


def test_sglang_balancers_choose_as_the_controller_does():
    """round_robin takes turns whatever the loads; follow_bootstrap_room draws a rank at
    random (a random bootstrap room modulo the ranks); total_requests the fewest running and
    waiting (ties to the lowest rank), total_tokens the fewest tokens (then requests, then the
    lowest rank), each bumped by its own dispatches until the loads are read again (20 ms
    on)."""
    rr = _balancer("round_robin")
    busy = _loads((9, 9, 9000), (0, 0, 0), (0, 0, 0))
    assert [rr.choose(Request(i, 0.0, 8, 1), busy) for i in range(5)] == [0, 1, 2, 0, 1]
    rooms = _balancer("follow_bootstrap_room")
    picks = [rooms.choose(Request(i, 0.0, 8, 1), busy) for i in range(300)]
    assert set(picks) == {0, 1, 2} and max(np.bincount(picks)) < 130  # (at random: ~100)
    by_requests = _balancer("total_requests")
    loads = _loads((1, 1, 10), (0, 1, 5000), (3, 0, 30))
    # rank 1 (1 request) twice, bumped to 2 and 3; then rank 0 (2: the lowest of the tied).
    assert [by_requests.choose(Request(i, 0.001 * i, 8, 1), loads) for i in range(3)] == [
        1, 0, 1]
    # 20 ms after the last read: the loads again, not the bumps.
    assert by_requests.choose(Request(3, 0.020, 8, 1), loads) == 1
    by_tokens = _balancer("total_tokens")
    loads = _loads((1, 1, 100), (0, 1, 100), (0, 0, 400))
    # ranks 0 and 1 tie on tokens: rank 1 has fewer requests; its 400-token prompt makes it
    # 500, then rank 0 (100), 450; then rank 2 (400) and rank 0 (450) again.
    prompts = [400, 350, 10, 10]
    assert [by_tokens.choose(Request(i, 0.0, n, 1), loads)
            for i, n in enumerate(prompts)] == [1, 0, 2, 2]


def test_a_replicas_limits_are_split_between_its_ranks():
    """SGLang divides `--chunked-prefill-size` and a given `--max-running-requests` by the
    ranks (DP attention) and scales the conservativeness by 0.3: with 4 ranks a 5,000-token
    prompt takes chunks of 2,048 (8,192 / 4), and 12 requests at once, 3 a rank, run 2 at a
    time on each (8 / 4). The resolved scenario keeps the replica's totals, and runs the same
    again."""
    raw = _raw(data=4, max_running_requests=8)
    cluster = _cluster(raw)
    (group,) = cluster.front
    for rank in group.ranks:
        config = rank.scheduler.config
        assert (config.chunked_prefill_size, config.max_num_seqs) == (2048, 2)
        assert rank.scheduler.ratio_init == pytest.approx(0.7 * 0.3)
    requests = [Request(0, 0.0, 5000, 2)] + [Request(i, 0.0, 8, 30) for i in range(1, 12)]
    cluster.run(requests)
    assert all(r.status is Status.FINISHED for r in requests)
    log = cluster.replicas[0].log
    # (The last chunk, 904 tokens, beside the 8 of rank 0's next request: 4, in turn.)
    assert list(log.columns["num_prefill_tokens"])[:3] == [2048, 2048, 904 + 8]
    for rank in group.ranks:
        assert max(rank.log.columns["num_seqs"]) == 2
    res = run_scenario(parse_scenario({**raw, "record_token_times": True, "workload": {
        **raw["workload"], "num_requests": 40}}, "<test>"))
    resolved = res.scenario.replica.scheduler
    assert (resolved.max_num_seqs, resolved.chunked_prefill_size) == (8, 8192)
    again = run_scenario(parse_scenario(res.scenario.model_dump(mode="json"), "<resolved>"))
    assert_same_results(res, again)


def test_an_unset_running_limit_is_each_ranks_own():
    """Unset, `--max-running-requests` is SGLang's default for each rank, not divided: the
    resolved scenario spells it out as the replica's total (the ranks' sum), which divides
    back to each rank's."""
    raw = _raw(data=2, num_requests=5)
    (group,) = _cluster(raw).front
    scenario = parse_scenario(raw, "<test>")
    rank_tokens = group.ranks[0].state.kv.num_blocks * scenario.replica.kv_cache.block_size
    per_rank = max(min(int(rank_tokens / scenario.replica.context_len * 512), 4096), 2048)
    assert [rank.scheduler.config.max_num_seqs for rank in group.ranks] == [per_rank] * 2
    res = run_scenario(scenario)
    assert res.scenario.replica.scheduler.max_num_seqs == 2 * per_rank
    cluster = _cluster(res.scenario.model_dump(mode="json"))
    assert [rank.scheduler.config.max_num_seqs for rank in cluster.front[0].ranks] == [
        per_rank] * 2


class _Recorder:
    """The ranks' latency model, recording the token counts each lockstep step runs at."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def lockstep_time_s(self, shapes, num_tokens):
        self.calls.append(([int(s.num_prefill_tokens) for s in shapes], list(num_tokens)))
        return self.model.lockstep_time_s(shapes, num_tokens)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize(("backend", "graphs", "pads_mixed"), [
    ("allgather_reducescatter", True, True),
    ("deepep_low_latency", True, False),
    ("deepep_auto", True, False),
    ("deepep_high_throughput", False, False)])
def test_which_steps_the_ranks_pad_alike(backend, graphs, pads_mixed):
    """On the roofline: A's prompt (8 tokens) beside an idle rank replays the prefill graph
    for 8 tokens on both ranks (the idle one runs a dummy extend of as many); A's decodes
    beside the idle rank replay the decode graphs at A's one request on both; B's
    1,000-token prompt beside A's decode replays the prefill graphs at 1,024 tokens on both,
    A's batch converted to one-token extends, but with an all-to-all backend A's decode
    cannot join them (its vote fails) and the step runs eagerly, each rank at its own
    count. DeepEP's normal kernels turn both kinds of graph off; its auto mode keeps them
    (its normal kernels run eagerly inside a prefill graph's replay)."""
    raw = _raw()
    raw["replica"]["latency"] = {"kind": "roofline", "all2all_backend": backend}
    cluster = _cluster(raw)
    (group,) = cluster.front
    recorder = group.latency = _Recorder(group.latency)
    a, b = Request(0, 0.0, 8, 40), Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert (a.replica_id, b.replica_id) == (0, 1)
    calls = recorder.calls
    assert calls[0] == ([8, 0], [8, 8] if graphs else [8, 0])
    assert calls[1] == ([0, 0], [1, 1] if graphs else [1, 0])
    (mixed,) = [counts for prompts, counts in calls if prompts == [0, 1000]]
    assert mixed == ([1024, 1024] if pads_mixed else [1, 1000])


@pytest.mark.parametrize(("backend", "padded"), [
    ("allgather_reducescatter", [4, 4]), ("deepep_low_latency", [8, 8]),
    ("deepep_auto", [8, 8])])
def test_deepep_rounds_the_prefill_graphs_up_to_multiples_of_8(backend, padded):
    """SGLang captures prefill graphs at 4, 8, 12, ... 32 tokens, then coarser; with DeepEP
    each size is rounded up to a multiple of 8 (`apply_deepep_adjustments`: capture can hang
    otherwise), so a 3-token prompt beside an idle rank replays the 8-token graph, not the
    4-token one."""
    raw = _raw()
    raw["replica"]["latency"] = {"kind": "roofline", "all2all_backend": backend}
    cluster = _cluster(raw)
    (group,) = cluster.front
    recorder = group.latency = _Recorder(group.latency)
    cluster.run([Request(0, 0.0, 3, 2)])
    assert recorder.calls[0] == ([3, 0], padded)


def test_auto_balances_a_prefill_pool_by_bootstrap_room():
    """`auto` is round_robin but on a disaggregated prefill pool, where SGLang follows the
    request's bootstrap room (a rank at random): 40 requests through a prefill pool of 4
    ranks land unevenly, and as the scenario's seed draws them."""
    raw = _raw(data=4, num_requests=40)
    replica = raw.pop("replica")
    raw["cluster"] = {"prefill": {"replicas": 1, "replica": replica},
                      "decode": {"replicas": 1, "replica": replica}}

    def ranks(seed):
        cluster = Cluster(parse_scenario({**raw, "seed": seed}, "<test>"), fast_forward=False)
        return [g.balancer.method for g in (*cluster.front, *cluster.decode)]

    assert ranks(0) == ["follow_bootstrap_room", "round_robin"]
    a = run_scenario(parse_scenario({**raw, "seed": 1}, "<test>")).requests
    b = run_scenario(parse_scenario({**raw, "seed": 2}, "<test>")).requests
    assert (a["status"] == "finished").all() and (b["status"] == "finished").all()
    # Prefill ranks are replicas 0-3 (their shares drawn), decode ranks 4-7 (in turn).
    shares_a, shares_b = (np.bincount(r["replica_id"], minlength=4).tolist() for r in (a, b))
    assert shares_a != shares_b and [10] * 4 not in (shares_a, shares_b)
    assert np.bincount(a["decode_replica_id"] - 4).tolist() == [10] * 4


@pytest.mark.parametrize(("change", "field", "needle"), [
    ({"chunked_prefill_size": 8192 + 8}, "replica.scheduler.chunked_prefill_size",
     "whole pages of kv_cache.block_size (16)"),
])
def test_what_sglang_ranks_refuse(tmp_path, monkeypatch, capsys, change, field, needle):
    """A rank's chunk must be whole pages (SGLang checks the divided size)."""
    import yaml

    raw = _raw(data=4, **change)
    raw["replica"]["kv_cache"] = {"block_size": 16}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


def test_graph_sizes_are_sglangs():
    """The decode graphs SGLang captures (its grid to the largest batch, then at most a
    scheduler's request pool, which is added where smaller) and the prefill graphs (to a
    rank's chunk); a step pads to the next size captured, and one past the largest runs
    eagerly, each rank at its own count."""
    from sim.schedulers.sglang_memory import decode_graph_sizes, prefill_graph_sizes

    assert decode_graph_sizes(512, 4096)[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert decode_graph_sizes(512, 4096)[-3:] == [480, 496, 512]
    assert decode_graph_sizes(256, 100)[-3:] == [88, 96, 100]
    assert decode_graph_sizes(100, 4096)[-2:] == [96, 100]
    assert decode_graph_sizes(512, 4096, spec=True)[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert decode_graph_sizes(512, 24, spec=True)[-2:] == [22, 24]
    assert prefill_graph_sizes(1024)[-2:] == [960, 1024]
    assert prefill_graph_sizes(1000)[-1] == 960
    cluster = _cluster(_raw())
    (group,) = cluster.front
    group.graph_sizes = ([1, 2, 4], [4, 8, 16])
    shapes = [BatchShape.decode_only(3, 30), BatchShape()]
    assert group._sglang_counts(shapes, [3, 0]) == [4, 4]
    five = [BatchShape.decode_only(5, 50), BatchShape()]
    assert group._sglang_counts(five, [5, 0]) == [5, 0]  # (past the largest: eager)
    group.spec_width = 3  # (verifying 3 tokens a request: graphs by requests)
    verify = [BatchShape(num_decode_tokens=3, num_spec_tokens=6, num_sampled_tokens=9,
                         decode_kv_tokens=30), BatchShape()]
    assert group._sglang_counts(verify, [9, 0]) == [12, 12]
    group.spec_width = 1
    prompt = BatchShape(num_prefill_tokens=9, num_prefill_seqs=1, num_sampled_tokens=1,
                        prefill_attn_pairs=45, prefill_kv_tokens=9)
    assert group._sglang_counts([prompt, shapes[0]], [9, 3]) == [16, 16]
    assert group._sglang_counts([prompt, shapes[1]], [9, 0]) == [16, 16]  # (a dummy extend)
    group.decodes_extend = False  # (an all-to-all backend, or drafting: the decode votes no)
    assert group._sglang_counts([prompt, shapes[0]], [9, 3]) == [9, 3]
    assert group._sglang_counts([prompt, shapes[1]], [9, 0]) == [16, 16]


# What SGLang 0.5.23's server-argument resolution printed for DP attention
# (`tools/golden/check_sglang_memory.py`, 2026-12-03): (GPU, --tp, --dp, more arguments) ->
# each rank's chunk, the conservativeness, the prefill and decode graphs' largest sizes.
RESOLVED_DP = [
    (("h200", 8, 8, {}), (1024, 0.3, 1024, 512)),
    (("h100-sxm", 4, 4, {}), (2048, 0.3, 2048, 512)),
    (("h200", 8, 2, {}), (4096, 0.3, 4096, 512)),
    (("h200", 8, 8, {"max_running_requests": 64}), (1024, 0.3, 1024, 64)),
]


@pytest.mark.parametrize(("case", "resolved"), RESOLVED_DP)
def test_a_ranks_settings_are_those_sglang_resolves(case, resolved):
    """Each rank's chunk and conservativeness, and the graphs' largest sizes, as SGLang
    resolved them; the decode graphs are then captured up to a rank's request pool (a given
    running limit's share: 8 of 64)."""
    gpu, tp, dp, extra = case
    chunk, conservativeness, prefill_max_bs, decode_max_bs = resolved
    raw = _raw(data=dp, **extra)
    raw["replica"].update(gpu=gpu, parallelism={"data": dp, "tensor": tp // dp, "expert": 1},
                          latency={"kind": "roofline"})
    (group,) = _cluster(raw).front
    config = group.ranks[0].scheduler.config
    assert config.chunked_prefill_size == chunk
    assert config.schedule_conservativeness == pytest.approx(conservativeness)
    decode_sizes, prefill_sizes = group.graph_sizes
    assert prefill_sizes[-1] == prefill_max_bs
    assert decode_sizes[-1] == min(decode_max_bs, config.max_num_seqs)
    if "max_running_requests" in extra:
        assert config.max_num_seqs == extra["max_running_requests"] // dp


def test_ranks_publish_their_loads_as_sglangs_schedulers_do():
    """A (8-token prompt, 40 out) alone on rank 0 of two: at the first pick the ranks are idle
    and publish; then each publishes after its batch every 15th step (rank 1's idle forwards
    count too), rank 0 at once after its prompt step. B, arriving at 0.3 s with
    `total_requests`, goes to rank 1: rank 0's last snapshot holds A."""
    raw = _raw(load_balance_method="total_requests")
    cluster = _cluster(raw)
    (group,) = cluster.front
    published = []
    publish = group.balancer.publish

    def spy(index, load, now_s):
        published.append((index, round(now_s, 9), load.num_running + load.num_waiting))
        publish(index, load, now_s)

    group.balancer.publish = spy
    a, b = Request(0, 0.0, 8, 40), Request(1, 0.3, 8, 2)
    cluster.run([a, b])
    assert (a.replica_id, b.replica_id) == (0, 1)
    first_s, decode_s = BASE_S + 8 * PER_TOKEN_S, BASE_S + PER_TOKEN_S
    step_starts = [0.0] + [first_s + k * decode_s for k in range(40)]
    rank0 = [at for index, at, _ in published if index == 0]
    # At A's arrival (idle), after its prompt step (planned at 0), then at every 15th batch
    # after it (planned at the start of steps 15 and 30); rank 1 at its 15th batch and 30th
    # (idle forwards, from step 0), then B's prompt step.
    assert rank0[:4] == pytest.approx([0.0, 0.0, step_starts[15], step_starts[30]])
    rank1 = [at for index, at, _ in published if index == 1]
    assert rank1[:4] == pytest.approx([0.0, step_starts[14], step_starts[29],
                                       step_starts[30]])
    # B arrived while a step was in flight: no rank published then.
    assert all(at != 0.3 for _, at, _ in published)


SPEC = {"algorithm": "eagle", "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3,
        "acceptance_rate": 0.0}


@pytest.mark.parametrize("speculative", [False, True])
def test_with_speculative_decoding_no_rank_decodes_while_one_prefills(speculative):
    """SGLang syncs the ranks on their prefill batches first when drafting: where one rank
    prefills, the others run idle forwards. A (8 tokens, 20 out, each step verifying 3
    tokens) on rank 0, B's 1,000-token prompt on rank 1 at 50 ms: A's decode waits out B's
    prompt step (20 ms), a 30.03 ms gap; without drafting A decodes beside it (20 ms).
    SGLang's cap of 48 running requests (for speculative decoding) is the replica's: 24 a
    rank."""
    raw = _raw(**({"speculative": {**SPEC, "draft_time_ratio": 0.0}} if speculative else {}))
    cluster = _cluster(raw)
    (group,) = cluster.front
    a, b = Request(0, 0.0, 8, 20), Request(1, 0.050, 1000, 2)
    cluster.run([a, b])
    assert [r.status for r in (a, b)] == [Status.FINISHED] * 2
    prompt_s = BASE_S + 1000 * PER_TOKEN_S
    decode_s = BASE_S + (3 if speculative else 1) * PER_TOKEN_S
    gaps = np.diff(_times(cluster, a))
    assert max(gaps) == pytest.approx(decode_s + prompt_s if speculative else prompt_s,
                                      abs=1e-12)
    assert sorted(gaps)[:-1] == pytest.approx([decode_s] * 18, abs=1e-12)
    if speculative:
        assert [rank.scheduler.config.max_num_seqs for rank in group.ranks] == [24, 24]


def test_the_drafters_passes_run_in_lockstep():
    """EAGLE's passes after each verify run on every rank together (an idle rank's idle
    ones): A alone on rank 0, each decode step the target's verify of 3 tokens, then at half
    the target's time the draft extend over those 3 and one draft pass of 1 token; rank 1's
    idle passes are shorter, so A's take the time."""
    raw = _raw(speculative={**SPEC, "draft_time_ratio": 0.5})
    cluster = _cluster(raw)
    a = Request(0, 0.0, 8, 10)
    cluster.run([a])
    verify_s, draft_s = BASE_S + 3 * PER_TOKEN_S, BASE_S + PER_TOKEN_S
    gaps = np.diff(_times(cluster, a))
    assert gaps == pytest.approx([verify_s + 0.5 * (verify_s + draft_s)] * 9, abs=1e-12)


@pytest.mark.parametrize("a_output", [60, 5])
def test_a_ranks_token_ratio_resets_only_when_every_rank_went_idle(a_output):
    """SGLang resets `new_token_ratio` in `on_idle`, which a rank reaches only when no rank
    has tokens (else it runs idle batches). B (5 tokens out) on rank 1 finishes early; D
    comes to rank 1 at 0.2 s. While A (60 tokens out) keeps rank 0 busy, rank 1's ratio
    at D's first pass is still the one its decodes decayed; with A done early (5 tokens),
    the ranks all went idle before D and it is back at its start (0.7 x 0.3)."""
    cluster = _cluster(_raw())
    (group,) = cluster.front
    scheduler = group.ranks[1].scheduler
    seen = []
    decide = scheduler.decide

    def spy(state, now_s):
        plan = decide(state, now_s)
        seen.append((now_s, scheduler.new_token_ratio))
        return plan

    scheduler.decide = spy
    a, b = Request(0, 0.0, 8, a_output), Request(1, 0.0, 8, 5)
    c, d = Request(2, 0.15, 8, 2), Request(3, 0.2, 8, 2)
    cluster.run([a, b, c, d])
    assert [r.replica_id for r in (a, b, c, d)] == [0, 1, 0, 1]
    before = [ratio for at, ratio in seen if at < 0.2][-1]
    at_d = next(ratio for at, ratio in seen if at >= 0.2)
    assert before < scheduler.ratio_init
    assert at_d == (before if a_output == 60 else pytest.approx(scheduler.ratio_init))


def _deepseek_dp8(**scheduler):
    return {"name": "lm", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 1,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 100},
                                     "output": {"dist": "fixed", "value": 2}}},
            "replica": {"model": "deepseek-v3", "quantization": "fp8", "gpu": "h200",
                        "parallelism": {"data": 8, "expert": 1},
                        "scheduler": {"name": "sglang", **scheduler},
                        "latency": {"kind": "roofline"}}}


def test_sglangs_lm_head_spans_every_gpu_of_the_ranks():
    """Under DP attention SGLang splits the LM head over all D x T GPUs (`ParallelLMHead`
    over the TP group; `--enable-dp-lm-head` keeps it to each rank's attention TP group):
    DeepSeek-V3 on 8 H200s (DP8, T=1) holds 16,160 of the 129,280 vocabulary rows a GPU, not
    all, 1.62 GB of bf16 weights less, which the KV pool gets. A decode step gathers the
    ranks' rows (8 x 32 here), computes its slice for all and gathers the logits back: faster
    than each rank reading the whole head for its own 32 rows. On a decode pool of one GPU
    a rank, logits go all-to-all where the ranks' rows are alike (each GPU gets only its
    rank's). vLLM's ranks each hold their own head."""
    from sim.engine.cluster import make_latency, num_kv_blocks
    from sim.latency.base import BatchShape

    split = parse_scenario(_deepseek_dp8(), "<test>").replica
    own = parse_scenario(_deepseek_dp8(enable_dp_lm_head=True), "<test>").replica
    vllm = _deepseek_dp8()
    vllm["replica"]["scheduler"] = {"name": "vllm_v1"}
    assert (split.lm_head_ranks, own.lm_head_ranks,
            parse_scenario(vllm, "<test>").replica.lm_head_ranks) == (8, 1, 1)
    model, par = split.model_shape, split.parallelism
    assert (par.vocab_rows_per_gpu(model), par.vocab_rows_per_gpu(model, 8)) == (129280, 16160)
    saved = par.weight_bytes_per_gpu(model) - par.weight_bytes_per_gpu(model, 8)
    assert saved == (129280 - 16160) * 7168 * 2
    kv_per_token = par.kv_bytes_per_token_per_gpu(model)
    gained = num_kv_blocks(split, model, 0) - num_kv_blocks(own, model, 0)
    assert gained == pytest.approx(saved / kv_per_token, abs=1)

    shapes = [BatchShape.decode_only(32, 32 * 2000)] * 8
    counts = [32] * 8
    timed = {}
    for name, cfg in (("split", split), ("own", own)):
        latency = make_latency(cfg, model, "<test>")
        if cfg.lm_head_ranks > 1:
            latency.split_lm_head(cfg.lm_head_ranks)
        timed[name] = latency.lockstep_time_s(shapes, counts)[0]
    tables = latency.tables
    head = timed["split"] - timed["own"]
    split_latency = make_latency(split, model, "<test>")
    split_latency.split_lm_head(8)
    lm_head_s = split_latency._lm_head_s(256, 32)
    assert head == pytest.approx(lm_head_s - float(tables.sampled_s(32)), rel=1e-9)
    assert head < 0  # (one eighth of the head's weights read a step)
    split_latency.split_lm_head(8, all_to_all=True)
    assert split_latency._lm_head_s(256, 32) < lm_head_s  # (own rows' logits only)
    assert split_latency._lm_head_s(256, 32, alike=False) == lm_head_s


def test_sglang_refuses_a_dp_lm_head_without_ranks(tmp_path, monkeypatch, capsys):
    import yaml

    raw = _deepseek_dp8(enable_dp_lm_head=True)
    raw["replica"]["parallelism"] = {"tensor": 8}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.scheduler.enable_dp_lm_head", "DP attention")
