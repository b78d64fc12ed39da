"""vLLM v1's unified scheduler, step by step without SimPy, then through the simulator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.kv_cache import KVCacheManager
from sim.schedulers.vllm_v1 import VllmV1, VllmV1Config
from tests.helpers import Stepper, is_finished, make_request, make_state


def vllm_v1(**params) -> VllmV1:
    return VllmV1(VllmV1Config(name="vllm_v1", **params))


def part_way(request_id: int, prompt: int, computed: int, output: int = 2):
    """A request admitted earlier that has computed `computed` tokens of its prompt."""
    req = make_request(request_id, prompt=prompt, output=output)
    req.num_computed_tokens = computed
    return req


def test_defaults_are_vllms():
    cfg = VllmV1Config(name="vllm_v1")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.enable_chunked_prefill) == (
        8192, 256, True)
    assert (cfg.long_prefill_token_threshold, cfg.decode_reserve_tokens) == (0, 0)
    assert cfg.max_num_partial_prefills is None and cfg.min_chunk_tokens is None
    # A small budget alone brings max_num_seqs down with it; given, a contradiction is refused.
    assert VllmV1Config(name="vllm_v1", max_num_batched_tokens=64).max_num_seqs == 64


@pytest.mark.parametrize(("params", "field"), [
    ({"max_num_batched_tokens": 64, "max_num_seqs": 65}, "max_num_seqs"),
    ({"enable_chunked_prefill": False, "long_prefill_token_threshold": 512},
     "long_prefill_token_threshold"),
    ({"enable_chunked_prefill": False, "min_chunk_tokens": 16}, "min_chunk_tokens"),
    ({"max_long_partial_prefills": 1}, "max_long_partial_prefills"),
    ({"max_num_partial_prefills": 1, "max_long_partial_prefills": 2,
      "long_prefill_token_threshold": 512}, "max_long_partial_prefills"),
    ({"long_prefill_token_threshold": 256, "min_chunk_tokens": 300}, "min_chunk_tokens"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
])
def test_contradictory_settings_are_refused(params, field):
    with pytest.raises(ValidationError, match=field):
        VllmV1Config(name="vllm_v1", **params)


def test_running_first_long_prefill_capped_by_threshold_and_short_one_joins():
    """Budget 2048, threshold 512: a 3000-token prompt advances 512 an iteration behind the
    running decodes, and a short prompt behind it is admitted whole with the rest."""
    decoding = tuple(make_request(i, prompt=10, output=50, generated=1) for i in range(2))
    long = make_request(2, prompt=3000, output=5)
    short = make_request(3, prompt=100, output=3)
    state = make_state(running=decoding, waiting=(long, short))
    run = Stepper(vllm_v1(max_num_batched_tokens=2048, long_prefill_token_threshold=512), state)

    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 512, 3: 100}
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0
    # Running order is admission order: the long prefill continues before the short decode.
    assert list(run.step().num_scheduled_tokens.items()) == [(0, 1), (1, 1), (2, 512), (3, 1)]
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 512, 3: 1}  # short finishes
    assert is_finished(short)
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 512}
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 512}
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 440}  # 5 x 512 + 440 = 3000
    assert long.num_output_tokens == 1  # its first token, at the end of the last chunk
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 1}


def test_long_prompts_prefill_side_by_side_unless_partial_prefills_are_limited():
    def first_plan(**limits):
        waiting = (make_request(0, prompt=3000, output=2), make_request(1, prompt=400, output=2),
                   make_request(2, prompt=3000, output=2))
        state = make_state(waiting=waiting)
        run = Stepper(vllm_v1(max_num_batched_tokens=1100, long_prefill_token_threshold=512,
                              **limits), state)
        return run.step().num_scheduled_tokens, run.step().num_scheduled_tokens

    # vLLM v1 has no limit: the second long prompt takes what the first and the short one leave.
    assert first_plan() == ({0: 512, 1: 400, 2: 188}, {0: 512, 1: 1, 2: 512})
    # With one long partial prefill at most (vLLM v0's rule), the second waits (FCFS).
    limited = first_plan(max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert limited == ({0: 512, 1: 400}, {0: 512, 1: 1})


def test_last_running_request_is_preempted_by_recompute_and_readmitted():
    a = make_request(0, prompt=8, output=10)
    b = make_request(1, prompt=8, output=10)
    state = make_state(num_blocks=6, block_size=4, waiting=(a, b))
    run = Stepper(vllm_v1(max_num_batched_tokens=64), state)
    plans = [run.step() for _ in range(5)]
    assert plans[0].num_scheduled_tokens == {0: 8, 1: 8}
    assert state.kv.num_free_blocks == 0  # 3 blocks each: 12 tokens computed

    plan = run.step()  # a's decode needs a block: b, the last running, is preempted
    assert (plan.num_scheduled_tokens, plan.preempted_ids) == ({0: 1}, [1])
    assert list(state.waiting) == [b] and state.running == [a]
    assert (b.num_computed_tokens, b.num_recomputed_tokens, b.num_preemptions) == (0, 12, 1)
    assert state.kv.num_held_blocks(1) == 0
    plans.append(plan)

    for _ in range(4):  # b's recompute (8 + 5 tokens) needs 4 blocks: it waits for a to finish
        plans.append(run.step())
        assert plans[-1].num_scheduled_tokens == {0: 1}
    assert is_finished(a)
    plans.append(run.step())
    assert plans[-1].num_scheduled_tokens == {1: 13}  # prompt + the 5 tokens it had generated
    while not is_finished(b):
        plans.append(run.step())
    computed = sum(p.total_num_scheduled_tokens for p in plans)
    assert computed == a.num_max_kv_tokens + b.num_max_kv_tokens + b.num_recomputed_tokens
    assert state.kv.num_free_blocks == 6


def test_a_request_that_is_its_own_victim_stops_the_running_pass():
    a = make_request(0, prompt=5, output=10, generated=1)  # 5 computed: its 2 blocks suffice
    b = make_request(1, prompt=8, output=10, generated=1)  # 8 computed: needs a third block
    waiting = make_request(2, prompt=4, output=2)
    state = make_state(num_blocks=4, block_size=4, running=(a, b), waiting=(waiting,))
    plan = Stepper(vllm_v1(max_num_batched_tokens=64), state).step()
    # b preempted itself; nothing is admitted from the queue in a step that preempted.
    assert (plan.num_scheduled_tokens, plan.preempted_ids) == ({0: 1}, [1])
    assert list(state.waiting) == [b, waiting]


def test_a_step_that_preempted_everyone_plans_the_next_one_at_once():
    """vLLM's step after preempting all running requests is empty; an iteration cannot be."""
    prefilling = part_way(0, prompt=100, computed=48)  # 3 blocks of 16
    state = make_state(num_blocks=5, block_size=16, running=(prefilling,))
    # Blocks held outside the running list (a KV transfer in flight, say).
    assert state.kv.try_allocate(make_request(99, prompt=32, output=1), 32)
    run = Stepper(vllm_v1(max_num_batched_tokens=32), state)
    plan = run.step()  # 48 + 32 needs 5 blocks, 3 held, none free: it preempts itself
    assert (plan.num_scheduled_tokens, plan.preempted_ids) == ({0: 32}, [0])  # restarted at 0
    assert prefilling.num_recomputed_tokens == 48


def test_chunking_off_prompts_wait_whole_and_too_long_ones_are_refused():
    decoding = make_request(0, prompt=10, output=20, generated=1)
    waiting = tuple(make_request(i, prompt=n, output=3) for i, n in ((1, 600), (2, 500), (3, 100)))
    state = make_state(running=(decoding,), waiting=waiting)
    sched = vllm_v1(max_num_batched_tokens=1000, enable_chunked_prefill=False)
    run = Stepper(sched, state)
    # 999 left after the decode; 600 fits, then 500 does not: it waits whole and blocks 100.
    assert run.step().num_scheduled_tokens == {0: 1, 1: 600}
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1, 2: 500, 3: 100}

    kv = KVCacheManager(num_blocks=1000, block_size=16)
    fits, too_long = make_request(4, prompt=990, output=11), make_request(5, prompt=990, output=12)
    assert sched.reject_reason(fits, kv, fits.num_max_kv_tokens) is None
    reason = sched.reject_reason(too_long, kv, too_long.num_max_kv_tokens)
    assert reason is not None and reason.startswith("max_num_batched_tokens: needs 1001 tokens")
    chunking = vllm_v1(max_num_batched_tokens=1000)
    assert chunking.reject_reason(too_long, kv, too_long.num_max_kv_tokens) is None
    # vLLM 0.33.0 with a draft model: the request's draft slot comes out of the budget, so
    # 1,000 tokens leave 999 for it (found by the invariant tests: it waited for ever).
    drafting = vllm_v1(max_num_batched_tokens=1000, enable_chunked_prefill=False,
                       engine_version="0.33.0",
                       speculative={"method": "draft_model", "num_speculative_tokens": 1,
                                    "acceptance_rate": 0.5, "draft_time_ratio": 0.1})
    reason = drafting.reject_reason(fits, kv, fits.num_max_kv_tokens)
    assert reason is not None and "less its draft model's 1 slot(s)" in reason
    just = make_request(6, prompt=990, output=10)
    assert drafting.reject_reason(just, kv, just.num_max_kv_tokens) is None


def test_min_chunk_tokens_holds_back_small_chunks_that_do_not_finish():
    def two_plans(**params):
        state = make_state(waiting=(make_request(0, prompt=450, output=3),
                                    make_request(1, prompt=1000, output=2)))
        run = Stepper(vllm_v1(max_num_batched_tokens=512, **params), state)
        return [run.step().num_scheduled_tokens for _ in range(3)]

    assert two_plans() == [{0: 450, 1: 62}, {0: 1, 1: 511}, {0: 1, 1: 427}]
    # 62 tokens is under the minimum and does not finish the prompt: it waits for a bigger one.
    assert two_plans(min_chunk_tokens=128) == [{0: 450}, {0: 1, 1: 511}, {0: 1, 1: 489}]


def test_min_chunk_tokens_skips_a_running_prefill_and_lets_the_decode_behind_it_run():
    def plan(**params):
        running = (part_way(0, prompt=1000, computed=96), part_way(1, prompt=1000, computed=96),
                   make_request(2, prompt=10, output=5, generated=1))
        state = make_state(running=running)
        sched = vllm_v1(max_num_batched_tokens=300, long_prefill_token_threshold=200, **params)
        return Stepper(sched, state).step().num_scheduled_tokens

    # vLLM: the second prefill takes the last 100 tokens and the decode behind it gets none.
    assert plan() == {0: 200, 1: 100}
    assert plan(min_chunk_tokens=128) == {0: 200, 2: 1}


def test_decodes_go_on_during_a_40k_document_prefill():
    """Background doc 001's example, a 40,000-token document with max_tokens 1000, beside a
    short request already decoding: with budget 8192 every iteration carries its decode."""
    short = make_request(0, prompt=200, output=100, generated=1)
    document = make_request(1, prompt=40_000, output=1000)
    state = make_state(num_blocks=3000, running=(short,), waiting=(document,))
    run = Stepper(vllm_v1(), state)
    chunks = []
    while document.num_output_tokens == 0:
        plan = run.step()
        assert plan.num_scheduled_tokens[0] == 1
        chunks.append(plan.num_scheduled_tokens[1])
    assert chunks == [8191, 8191, 8191, 8191, 7236]
    assert short.num_output_tokens == 1 + len(chunks)
    assert short.all_token_runs() == [(-1, 0, 5)]  # one token per iteration, no gap
    assert run.step().num_scheduled_tokens == {0: 1, 1: 1}


def scenario(scheduler: dict, seed: int, num_blocks: int | None = 400) -> dict:
    return {
        "name": "vllm_v1_random",
        "seed": seed,
        "workload": {
            "format": "synthetic",
            "num_requests": 150,
            "arrivals": {"process": "gamma", "qps": 40.0, "cv": 2.0},
            "lengths": {"prompt": {"dist": "uniform", "low": 1, "high": 1500},
                        "output": {"dist": "uniform", "low": 1, "high": 120}},
        },
        "replica": {"scheduler": {"name": "vllm_v1", **scheduler},
                    "latency": {"kind": "roofline"},
                    "kv_cache": {"block_size": 16, "num_blocks": num_blocks}},
        "record_token_times": True,
    }


@pytest.mark.parametrize("scheduler", [
    {"max_num_batched_tokens": 256, "max_num_seqs": 16},
    {"max_num_batched_tokens": 512, "max_num_seqs": 8, "long_prefill_token_threshold": 128,
     "min_chunk_tokens": 64, "max_num_partial_prefills": 2, "max_long_partial_prefills": 1},
    {"max_num_batched_tokens": 2048, "enable_chunked_prefill": False},
    {"max_num_batched_tokens": 1024, "decode_reserve_tokens": None},
    {},
])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_runs_respect_budget_and_max_num_seqs(scheduler, seed):
    cfg = VllmV1Config(name="vllm_v1", **scheduler)
    data = scenario(scheduler, seed)
    res = run_scenario(parse_scenario(data, "test"))
    it, req = res.iterations, res.requests
    assert (it["num_prefill_tokens"] + it["num_decode_tokens"] <= cfg.max_num_batched_tokens).all()
    assert (it["num_seqs"] <= cfg.max_num_seqs).all()
    assert (req["status"] == "finished").all()
    assert (req["num_generated_tokens"] == req["num_output_tokens"]).all()
    computed = int(it["num_prefill_tokens"].sum() + it["num_decode_tokens"].sum())
    assert computed == int((req["num_computed_tokens"] + req["num_recomputed_tokens"]).sum())
    # Decode stretches (steady plans) give what stepping every iteration gives.
    slow = run_scenario(parse_scenario(data, "test"), fast_forward=False)
    assert slow.requests.equals(req) and slow.iterations.equals(it)


def test_tight_kv_preempts_and_still_finishes_everything():
    res = run_scenario(parse_scenario(scenario({"max_num_batched_tokens": 512}, 3, 110), "test"))
    assert res.iterations["num_preempted"].sum() > 0
    assert (res.requests["status"] == "finished").all()


def test_bad_settings_are_one_line_input_errors():
    with pytest.raises(InputError, match="min_chunk_tokens"):
        parse_scenario(scenario({"max_num_batched_tokens": 256, "min_chunk_tokens": 300}, 0),
                       "test")


def test_engine_versions_spell_out_their_defaults_and_unknown_ones_are_refused():
    old = VllmV1Config(name="vllm_v1")  # 0.15.1, the release the public H100 runs used
    new = VllmV1Config(name="vllm_v1", engine_version="0.33.0")
    assert (old.engine_version, old.async_scheduling, old.scheduler_reserve_full_isl) == (
        "0.15.1", True, False)
    assert (new.async_scheduling, new.scheduler_reserve_full_isl) == (True, True)
    assert VllmV1Config(name="vllm_v1", async_scheduling=False).async_scheduling is False
    with pytest.raises(ValidationError, match=r"unknown vLLM version; known: 0\.15\.1, 0\.33\.0"):
        VllmV1Config(name="vllm_v1", engine_version="0.20.0")
    with pytest.raises(ValidationError, match="has no such setting"):
        VllmV1Config(name="vllm_v1", scheduler_reserve_full_isl=True)


def test_async_scheduling_resolves_off_on_a_pipeline_and_is_refused_there():
    replica = {"model": "tiny", "latency": {"kind": "constant"},
               "parallelism": {"pipeline": 2}, "scheduler": {"name": "vllm_v1"}}
    base = {"workload": {"format": "synthetic", "num_requests": 1,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                     "output": {"dist": "fixed", "value": 2}}}}
    scenario = parse_scenario({**base, "replica": replica}, "s.yaml")
    assert scenario.replica.scheduler.async_scheduling is False
    replica["scheduler"] = {"name": "vllm_v1", "async_scheduling": True}
    with pytest.raises(InputError, match=r"replica\.scheduler\.async_scheduling=True: .*pipeline"):
        parse_scenario({**base, "replica": replica}, "s.yaml")


def test_the_null_block_is_never_allocated():
    """vLLM's `BlockPool` keeps one of `num_gpu_blocks` as its null block: 4 blocks of 16 hold
    a 48-token request, not a 64-token one."""
    def run_one(prompt: int, num_blocks: int):
        return run_scenario(parse_scenario({
            "workload": {"format": "synthetic", "num_requests": 1,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": prompt},
                                     "output": {"dist": "fixed", "value": 1}}},
            "replica": {"model": "tiny", "latency": {"kind": "constant"},
                        "scheduler": {"name": "vllm_v1"},
                        "kv_cache": {"block_size": 16, "num_blocks": num_blocks}}}, "s.yaml"))
    assert run_one(48, 4).requests["status"].tolist() == ["finished"]
    assert run_one(64, 4).requests["reason"].str.startswith("kv_capacity").all()
    with pytest.raises(InputError, match="null block"):
        run_one(8, 1)
