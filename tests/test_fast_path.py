"""The fast path needs nothing from a policy or a latency model: a scheduler and a latency model
written here, knowing nothing of stretches or run-ahead, get both, and the results equal a
step-by-step run to the last bit."""

from __future__ import annotations

import numpy as np
import pytest

import sim.engine.clock
import sim.engine.replica
from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.plan import Plan
from sim.core.state import ReplicaState
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyConfig, LatencyModel, Num
from sim.schedulers.base import SCHEDULERS, Scheduler, schedule_decodes, try_admit


class NewPolicy(Scheduler):
    """Decodes first, then admits whole prompts FCFS while blocks last: a policy as a new
    contributor would write it, with no fast-path code."""

    def schedule(self, state: ReplicaState, now_s: float) -> Plan:
        plan = Plan()
        schedule_decodes(state, plan)
        while state.waiting and len(state.running) < self.config.max_num_seqs:
            req = state.waiting[0]
            num_tokens = req.num_uncomputed_tokens
            if try_admit(state, req, num_tokens, None, 0) is None:
                break
            plan.num_scheduled_tokens[req.request_id] = num_tokens
        return plan


class NewLatency(LatencyModel):
    """A made-up model with a non-linear decode term, element-wise on arrays."""

    def __init__(self, config: LatencyConfig, model: object, gpu: object) -> None:
        pass

    def iteration_time_s(self, shape: BatchShape) -> Num:
        return 0.004 + 1e-5 * shape.num_prefill_tokens + 3e-8 * np.sqrt(
            shape.decode_kv_tokens * 1.0) * shape.num_decode_tokens


def synthetic(replica: dict, cluster: dict, *, seed: int, num_requests: int, qps: float,
              max_prompt: int, max_output: int):
    """Poisson arrivals, uniform lengths, token times recorded; `replica` on every replica of
    `cluster` (both pools of a disaggregated one)."""
    data = {"seed": seed, "record_token_times": True,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": qps},
                         "lengths": {"prompt": {"dist": "uniform", "low": 20, "high": max_prompt},
                                     "output": {"dist": "uniform", "low": 1,
                                                "high": max_output}}},
            "cluster": cluster}
    if "prefill" in cluster:
        cluster["prefill"]["replica"] = cluster["decode"]["replica"] = replica
    else:
        data["replica"] = replica
    return parse_scenario(data, "test")


@pytest.fixture
def registered():
    SCHEDULERS.register("new_policy")(NewPolicy)
    LATENCY_MODELS.register("new_latency")(NewLatency)
    yield
    del SCHEDULERS._entries["new_policy"], LATENCY_MODELS._entries["new_latency"]


def count_events(monkeypatch) -> list[int]:
    """How many SimPy events the runs process (appended to the returned list)."""
    counts = [0]
    step = sim.engine.clock.Environment.step

    def counting(env):
        counts[0] += 1
        step(env)

    monkeypatch.setattr(sim.engine.clock.Environment, "step", counting)
    return counts


def fast_and_stepped(monkeypatch, scenario):
    """The scenario's results fast-forwarded and stepped, and the SimPy events each took."""
    events = count_events(monkeypatch)
    fast = run_scenario(scenario)
    num_fast = events[0]
    slow = run_scenario(scenario, fast_forward=False)
    return fast, slow, num_fast, events[0] - num_fast


@pytest.mark.parametrize("cluster", [
    {"replicas": 2, "router": {"name": "least_kv_load"}},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "round_robin"}},
])
def test_a_new_policy_and_latency_model_get_the_fast_path(registered, monkeypatch, cluster):
    replica = {"scheduler": {"name": "new_policy", "max_num_seqs": 24},
               "latency": {"kind": "new_latency"},
               "kv_cache": {"block_size": 16, "num_blocks": 400}}
    scenario = synthetic(replica, cluster, seed=3, num_requests=300, qps=20,
                         max_prompt=400, max_output=200)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, scenario)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary
    assert fast.summary["requests"]["finished"] == 300
    # Most iterations need no event of their own. Seen: colocated 1,370 events against 9,120
    # stepping; disaggregated 5,458 against 12,454 (prefill replicas step: their hand-offs are
    # events), so the bound is half.
    num_iterations = fast.summary["num_iterations"]
    assert num_slow > num_iterations
    assert num_fast < num_slow / 2, (num_fast, num_slow, num_iterations)


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 512},
                                       {"name": "vllm_v1"},
                                       {"name": "vllm_v1", "async_scheduling": False},
                                       {"name": "sglang"}, {"name": "prefill_first"}])
def test_fast_path_equals_stepping_on_a_real_trace(traces, scheduler):
    """The first 1,500 requests of the Azure conversation trace (long stretches, finishes
    inside them, arrivals cutting them): every result file equals a step-by-step run."""
    data = {"seed": 0, "record_token_times": True,
            "workload": {"format": "azure", "num_requests": 1500,
                         "path": str(traces / "azure_llm_2023" /
                                     "AzureLLMInferenceTrace_conv.csv")},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm", "scheduler": scheduler,
                        "latency": {"kind": "roofline"}}}
    scenario = parse_scenario(data, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.summary["requests"]["finished"] == 1500
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


@pytest.mark.parametrize("router", ["least_kv_load", "least_outstanding"])
def test_routers_read_stretches_in_progress_as_stepping_shows_them(traces, router):
    """Four replicas at 4x the Azure conversation trace's rate: at each arrival the router
    reads every replica, most of them mid-stretch and many past a finish in it. The counts it
    reads from a stretch without committing it route every request as a step-by-step run
    does, and no stretch is committed piece by piece for the router's sake."""
    data = {"seed": 0, "record_token_times": True,
            "workload": {"format": "azure", "num_requests": 1500, "rate_scale": 4.0,
                         "path": str(traces / "azure_llm_2023" /
                                     "AzureLLMInferenceTrace_conv.csv")},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "scheduler": {"name": "chunked_prefill", "token_budget": 512},
                        "latency": {"kind": "roofline"}},
            "cluster": {"replicas": 4, "router": {"name": router}}}
    scenario = parse_scenario(data, "test")
    commits = []
    commit_stretch = sim.engine.replica.commit_stretch

    def counting(state, stretch, num_steps, log):
        commits.append(num_steps == len(stretch))
        return commit_stretch(state, stretch, num_steps, log)

    sim.engine.replica.commit_stretch = counting
    try:
        fast = run_scenario(scenario)
    finally:
        sim.engine.replica.commit_stretch = commit_stretch
    slow = run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary
    # Each stretch is committed whole (cut short by new work on its replica, or not). When a
    # read past a finish committed the ended part, 936 of 2,108 commits were partial
    # (least_kv_load; least_outstanding 935 of 2,227).
    assert commits and all(commits), (sum(commits), len(commits))


def test_batch_sizes_follow_the_requests_left():
    """A shrinking stretch's batch sizes and KV reads, against a request-by-request count."""
    from sim.engine.fastpath.stretch import batch_sizes

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        computed = rng.integers(1, 5000, size=n)
        left = rng.integers(1, 60, size=n)
        num_steps = int(rng.integers(1, int(left.max()) + 1))
        seqs, kv = batch_sizes(computed.tolist(), left.tolist(), num_steps)
        for j in range(num_steps):
            inside = left > j
            assert np.broadcast_to(seqs, (num_steps,))[j] == inside.sum()
            assert kv[j] == int((computed[inside] + j + 1).sum())


@pytest.mark.parametrize("max_steps", [1, 3])
@pytest.mark.parametrize("cluster", [
    {},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "least_kv_load"}},
])
def test_stretches_planned_short_equal_stepping(monkeypatch, max_steps, cluster):
    """The engine plans a stretch for `STRETCH_STEPS` iterations at most, then plans again:
    stretches cut that short (and committed in pieces, finishing requests inside them) still
    give every result file of a step-by-step run."""
    monkeypatch.setattr(sim.engine.replica, "STRETCH_STEPS", max_steps)
    replica = {"scheduler": {"name": "chunked_prefill", "token_budget": 256},
               "latency": {"kind": "roofline"}, "kv_cache": {"block_size": 16, "num_blocks": 600}}
    scenario = synthetic(replica, cluster, seed=5, num_requests=200, qps=30,
                         max_prompt=600, max_output=120)
    lengths = []
    plan_stretch = sim.engine.replica.plan_stretch

    def planned(*args, **kwargs):
        stretch = plan_stretch(*args, **kwargs)
        if stretch is not None:
            lengths.append(len(stretch))
        return stretch

    monkeypatch.setattr(sim.engine.replica, "plan_stretch", planned)
    fast = run_scenario(scenario)
    slow = run_scenario(scenario, fast_forward=False)
    assert max(lengths) == max_steps  # stretches were planned, and cut at the cap
    assert fast.summary["requests"]["finished"] == 200
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


# Found by the cluster property test on a random seed (CI's derandomised seed never drew it):
# SGLang on a decode replica with a prefix cache preempts a request and takes it back at once,
# its prompt cached but for one token, so the plan is a steady decode batch and a stretch
# starts with it; the stretch logged 0 preemptions where stepping logs 1.
PREEMPT_THEN_STRETCH = {
    "seed": 23234,
    "workload": {"format": "prefix", "num_conversations": 37,
                 "arrivals": {"process": "gamma", "qps": 185.7382604807358,
                              "cv": 3.9726927040365916},
                 "question_tokens": {"dist": "uniform", "low": 1, "high": 107},
                 "output_tokens": {"dist": "uniform", "low": 1, "high": 64},
                 "hash_block_tokens": 4, "num_turns": 2, "think_time_s": 1.0,
                 "num_requests": 37},
    "record_token_times": True,
    "cluster": {
        **{pool: {"replicas": 2, "replica": {
            "scheduler": {"name": "sglang", "chunked_prefill_size": 14, "max_num_seqs": 31,
                          "mixed_chunk": True, "decode_reserve_tokens": 8,
                          "overlap_schedule": False},  # (stretches: the synchronous loop)
            "latency": {"kind": "roofline",
                        "noise": {"kind": "lognormal", "sigma": 0.1, "correlation": 0.8}},
            "kv_cache": {"block_size": 16, "num_blocks": 28}, "prefix_caching": True}}
           for pool in ("prefill", "decode")},
        "link": {"bandwidth_gb_s": 0.001, "latency_s": 0.0}, "overlap_transfer": True,
        "router": {"name": "round_robin"}},
}


def test_a_stretch_logs_the_preemptions_of_its_first_plan():
    scenario = parse_scenario(PREEMPT_THEN_STRETCH, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert slow.iterations["num_preempted"].sum() > 0
    assert fast.iterations.equals(slow.iterations)


@pytest.mark.parametrize("cluster", [
    {},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "least_kv_load"}},
])
def test_stretches_with_noise_shortfalls_and_a_horizon_equal_stepping(monkeypatch, cluster):
    """Stretches committed one iteration in and past a block's worth of iterations (16), with
    noise, KV shortfalls, finishes inside stretches and a horizon that stops the run
    mid-stretch: every result file equals a step-by-step run's."""
    lengths = []
    commit_stretch = sim.engine.replica.commit_stretch

    def committed(state, stretch, num_steps, log):
        lengths.append(num_steps)
        return commit_stretch(state, stretch, num_steps, log)

    monkeypatch.setattr(sim.engine.replica, "commit_stretch", committed)
    replica = {"scheduler": {"name": "chunked_prefill", "token_budget": 256},
               "latency": {"kind": "roofline",
                           "noise": {"kind": "lognormal", "sigma": 0.2, "correlation": 0.5}},
               "kv_cache": {"block_size": 16, "num_blocks": 500}}
    scenario = synthetic(replica, cluster, seed=11, num_requests=250, qps=25,
                         max_prompt=500, max_output=150)
    scenario = scenario.model_copy(update={"horizon_s": 9.0})
    fast = run_scenario(scenario)
    slow = run_scenario(scenario, fast_forward=False)
    assert min(lengths) == 1 and max(lengths) > 16 and len(lengths) > 50, lengths
    assert 0 < fast.summary["requests"]["finished"] < 250  # the horizon stopped it
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


def test_a_commit_counts_blocks_batch_sizes_and_finishes_request_by_request():
    """`commit_stretch` against a count made request by request and iteration by iteration,
    on random batches (block sizes 1, 2 and 16, so blocks fill at every offset; requests
    leaving inside the commit and after it): the log's rows, the blocks held, who finished
    when and in which order, and the rest of the stretch."""
    from sim.core.kv_cache import KVCacheManager
    from sim.core.request import Request
    from sim.engine.fastpath.commit import commit_stretch
    from sim.engine.fastpath.stretch import Stretch
    from sim.engine.iteration_log import IterationLog

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        bs = int(rng.choice([1, 2, 16]))
        computed = rng.integers(20, 300, size=n)
        left = rng.integers(1, 60, size=n)
        num_steps = int(rng.integers(1, 41))
        length = num_steps + int(rng.integers(0, 3))
        kv = KVCacheManager(num_blocks=100_000, block_size=bs)
        state = ReplicaState(kv)
        for i in range(n):
            out = int(rng.integers(1, 6))  # tokens sampled so far; the last is not computed
            req = Request(i, 0.0, int(computed[i]) - out + 1, out + int(left[i]))
            req.num_computed_tokens, req.num_output_tokens = int(computed[i]), out
            state.requests[i] = req
            state._start_running(req)  # (and the counts kept of the running list)
            kv.grow_blocks(i, -(-(int(computed[i]) + 1) // bs))  # the first step's blocks
        base = kv.num_used_blocks
        durations = np.full(length, 0.01)
        ends = np.add.accumulate(durations)
        stretch = Stretch(list(state.running), computed.tolist(), ends - durations, durations,
                          ends, base, bs, True, left.tolist(), int(left.min()))
        log = IterationLog()
        done, rest = commit_stretch(state, stretch, num_steps, log)
        state.check()

        # Iteration j: a request still in the batch (left > j) holds the blocks of computed
        # + j + 1 tokens; one gone holds none.
        def held(i, j, computed=computed, left=left, bs=bs):
            return -(-(int(computed[i]) + j + 1) // bs) if left[i] > j else 0

        start = [held(i, 0) for i in range(n)]
        used = [base + sum(held(i, j) - start[i] for i in range(n))
                for j in range(num_steps + 1)]
        rows = log.arrays()
        assert rows["num_kv_blocks_used"].tolist() == used[:num_steps]
        assert rows["num_seqs"].tolist() == [int((left > j).sum()) for j in range(num_steps)]
        assert rows["num_decode_tokens"].tolist() == rows["num_seqs"].tolist()
        expected_done = sorted((int(left[i]), i) for i in range(n) if left[i] <= num_steps)
        assert [(int(left[r.request_id]), r.request_id) for r in done] == expected_done
        assert [r.finish_s for r in done] == [float(ends[k - 1]) for k, _ in expected_done]
        for i, req in state.requests.items():
            steps_in = min(int(left[i]), num_steps)
            assert req.num_computed_tokens == computed[i] + steps_in
            assert req.all_token_runs() == [(-1, 0, steps_in)]  # iterations 0 .. steps_in - 1
            # What it computed; the rest's first iteration allocates its own (as `schedule()`
            # would when it plans it).
            assert kv.num_held_blocks(i) == (-(-(int(computed[i]) + num_steps) // bs)
                                             if left[i] > num_steps else 0)
        assert kv.num_used_blocks == sum(kv.num_held_blocks(i) for i in range(n))
        if num_steps == length:
            assert rest is None
            continue
        staying = [i for i in range(n) if left[i] > num_steps]
        assert [r.request_id for r in rest.requests] == staying
        assert rest.num_computed == [int(computed[i]) + num_steps for i in staying]
        assert rest.num_steps_left == [int(left[i]) - num_steps for i in staying]
        assert not rest.first_allocated
        assert rest.num_used_blocks == used[num_steps]
        assert len(rest) == length - num_steps


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 256},
                                       # (stretches: the synchronous engine's fast path)
                                       {"name": "vllm_v1", "async_scheduling": False},
                                       {"name": "sglang", "overlap_schedule": False},
                                       {"name": "prefill_first"}, {"name": "new_policy"}])
@pytest.mark.parametrize("decode", [
    {"max_num_seqs": 64, "num_blocks": 2000},  # room: admissions rarely change a plan
    {"max_num_seqs": 6, "num_blocks": 150},  # transfers wait for slots and blocks
    {"max_num_seqs": 12, "num_blocks": 60},  # blocks run short: decodes are preempted
    # A slow link: KV takes long to arrive, so the rest of a stretch runs long enough for its
    # blocks to run short (vLLM v1 admits a transfer while blocks last).
    {"max_num_seqs": 24, "num_blocks": 50, "link_gb_s": 0.05, "seed": 7},
], ids=["room", "tight", "short", "slow_link"])
def test_a_stretch_cut_by_an_admission_resumes_as_stepping_plans(registered, monkeypatch,
                                                                 scheduler, decode):
    """A decode replica admitting a transfer (blocks for KV on its way) cuts its stretch; where
    its plan would not change, the rest of the stretch resumes instead of being planned again
    (`Replica._resume`): results equal stepping, with noise, whether the rest runs whole,
    stops at its first finish (a transfer still waits) or is refused (a join, blocks short)."""
    outcomes = []
    resume = sim.engine.replica.Replica._resume

    def resumed(self):
        rest = resume(self)
        outcomes.append(rest is not None)
        return rest

    monkeypatch.setattr(sim.engine.replica.Replica, "_resume", resumed)
    prefill = {"scheduler": {"name": "chunked_prefill", "token_budget": 512},
               "latency": {"kind": "roofline", "noise": {"kind": "lognormal", "sigma": 0.1}}}
    replica = {"scheduler": {**scheduler, "max_num_seqs": decode["max_num_seqs"]},
               "latency": {"kind": "roofline", "noise": {"kind": "lognormal", "sigma": 0.1}},
               "kv_cache": {"block_size": 16, "num_blocks": decode["num_blocks"]}}
    if scheduler["name"] == "new_policy":
        replica["latency"] = {"kind": "new_latency"}
    cluster = {"prefill": {"replicas": 1, "replica": None},
               "decode": {"replicas": 2, "replica": None}, "router": {"name": "least_kv_load"},
               "link": {"bandwidth_gb_s": decode.get("link_gb_s", 50.0)}}
    scenario = synthetic(replica, cluster, seed=decode.get("seed", 5), num_requests=200, qps=30,
                         max_prompt=300, max_output=120)
    data = scenario.model_dump(mode="json")
    data["cluster"]["prefill"]["replica"] = {**data["cluster"]["prefill"]["replica"], **prefill}
    scenario = parse_scenario(data, "test")
    fast = run_scenario(scenario)
    assert any(outcomes) and not all(outcomes), (sum(outcomes), len(outcomes))
    slow = run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


def _batch_with_a_prompt(bs: int, decodes: list[tuple[int, int, int]], pos: int, prompt: int,
                         out0: int, computed0: int, chunk: int, target: int
                         ) -> tuple[ReplicaState, Plan]:
    """A replica running `decodes` (computed tokens, output tokens, iterations left) and, at
    `pos` among them, request `len(decodes)` computing its prompt in chunks of `chunk` tokens,
    with the plan of their first iteration, its blocks allocated."""
    from sim.core.kv_cache import KVCacheManager
    from sim.core.request import Request

    n = len(decodes)
    state = ReplicaState(KVCacheManager(num_blocks=100_000, block_size=bs))
    reqs = [Request(i, 0.0, c - o + 1, o + left) for i, (c, o, left) in enumerate(decodes)]
    for req, (c, o, _) in zip(reqs, decodes, strict=True):
        req.num_computed_tokens, req.num_output_tokens = c, o
        req.first_scheduled_s = -1.0
    p = Request(n, 0.0, prompt, target)
    p.num_computed_tokens, p.num_output_tokens = computed0, out0
    if computed0 or out0:  # scheduled before
        p.first_scheduled_s = -1.0
    reqs.insert(pos, p)
    plan = Plan()
    for req in reqs:
        state.requests[req.request_id] = req
        state._start_running(req)  # (and the counts kept of the running list)
        tokens = 1 if req.is_decoding else chunk
        assert state.kv.try_allocate(req, tokens)  # the first iteration's blocks
        plan.num_scheduled_tokens[req.request_id] = tokens
    return state, plan


def _ended_counts_direct(stretch, num_steps):
    """`Stretch.ended_counts` computed from its arrays for this `num_steps` alone."""
    left = np.array(stretch.num_steps_left, dtype=np.int64)
    computed = np.array(stretch.num_computed, dtype=np.int64)
    gone = left <= num_steps
    not_sampled = (min(num_steps, stretch.num_prefill_steps - 1)
                   if stretch.prefill_pos >= 0 else 0)
    return (int(np.minimum(left, num_steps).sum()) - not_sampled, int(gone.sum()),
            int((computed[gone] + 1 + left[gone]).sum()))


def test_ended_counts_of_decode_stretches_and_their_pieces():
    """What a router reads of a decode-only stretch (`ended_counts`, from a table made on the
    first read past a finish), against the stretch's arrays, for every number of iterations
    of random stretches and of what `head` and `after` leave of them."""
    from sim.engine.fastpath.stretch import Stretch

    rng = np.random.default_rng(11)
    past_finish = 0
    for _ in range(300):
        n = int(rng.integers(1, 8))
        length = int(rng.integers(1, 60))
        computed = rng.integers(1, 500, n).astype(np.int64)
        left = rng.integers(1, 80, n).astype(np.int64)
        end = np.cumsum(rng.uniform(0.01, 0.02, length))
        stretch = Stretch(list(range(n)), computed.tolist(), end - 0.01, np.full(length, 0.01),
                          end, 0, 16, True, left.tolist(), int(left.min()))
        cut = int(rng.integers(1, length + 1))
        pieces = [stretch, stretch.head(cut)]
        if cut < length:
            pieces.append(stretch.after(cut, 0))
        for piece in pieces:
            for k in range(len(piece) + 1):
                assert piece.ended_counts(k) == _ended_counts_direct(piece, k), k
                past_finish += k >= piece.min_steps_left
    assert past_finish > 1000  # the table, not only the path before the first finish


def test_a_stretch_with_a_prompt_in_chunks_commits_as_stepping():
    """A stretch in which one request computes the rest of its prompt in chunks beside
    decodes (`plan_stretch` from the plan of its first iteration), committed in two pieces,
    against the same iterations stepped (`ReplicaState.commit`, blocks allocated before each
    as a policy does) on random batches: block sizes 1, 2 and 16; the prompt first, last or
    among the decodes, new or recomputed after a preemption, in one chunk or many, its first
    token its last or not; decodes leaving before, during and after its chunks; the stretch
    running through finishes or stopping at the first. Compared: the
    log's rows, every request's counters, tokens, finish and blocks (with the next
    iteration's, where the run stops mid-stretch), the replica's token count, and what a
    router reads mid-stretch (`ended_counts`)."""
    from sim.core.request import Status
    from sim.engine.fastpath.commit import allocate_first_step, commit_stretch
    from sim.engine.fastpath.stretch import plan_stretch
    from sim.engine.iteration_log import IterationLog

    latency = NewLatency(LatencyConfig(kind="new_latency"), None, None)
    rng = np.random.default_rng(5)
    seen = {"chunks": 0, "cut_in_chunks": 0, "first_is_last": 0, "recompute": 0,
            "leave_in_chunks": 0, "refused": 0}
    for _ in range(400):
        bs = int(rng.choice([1, 2, 16]))
        n = int(rng.integers(0, 6))
        pos = int(rng.integers(0, n + 1))
        decodes = [(int(rng.integers(20, 300)), int(rng.integers(1, 6)),
                    int(rng.integers(1, 40))) for _ in range(n)]  # computed, output, left
        out0 = int(rng.choice([0, 0, 0, int(rng.integers(1, 4))]))
        prompt = int(rng.integers(1, 400))
        known = prompt + out0
        # (A recompute with one token left is a decode: `is_decoding`.)
        computed0 = int(rng.integers(0, known - 1 if out0 else known))
        chunk = int(rng.integers(1, known - computed0 + 1))
        target = out0 + int(rng.choice([1, int(rng.integers(1, 40))]))

        args = (bs, decodes, pos, prompt, out0, computed0, chunk, target)
        state, plan = _batch_with_a_prompt(*args)
        stretch = plan_stretch(state, plan, latency, 0.0, None,
                               through_finishes=bool(rng.integers(0, 2)),
                               max_steps=int(rng.integers(1, 80)))
        if stretch is None:  # a recompute's last chunk would be a decode's one token
            assert out0 and (known - computed0 - 1) % chunk == 0
            seen["refused"] += 1
            continue
        assert stretch.prefill_pos == pos
        length = len(stretch)
        first = int(rng.integers(1, length + 1))
        peek = int(rng.integers(0, length + 1))
        counts = stretch.ended_counts(peek)
        for k in range(length + 1):  # the table read past finishes, against the arrays
            assert stretch.ended_counts(k) == _ended_counts_direct(stretch, k), k
        tokens_before = state.num_running_tokens
        log = IterationLog()
        done, rest = commit_stretch(state, stretch, first, log)
        if rest is not None:
            more, rest = commit_stretch(state, rest, int(rng.integers(1, len(rest) + 1)), log)
            done += more
        if rest is not None:  # the run stops mid-stretch: the next iteration's blocks held
            rest = allocate_first_step(state, rest)
        num_steps = len(log)

        ref, _ = _batch_with_a_prompt(*args)
        ref_log = IterationLog()
        ref_done = []
        p = ref.requests[n]
        for j in range(num_steps):
            if j == peek:
                assert counts[0] - counts[2] == ref.num_running_tokens - tokens_before
                assert counts[1] == len(ref_done)
            step = Plan()
            for req in ref.running:
                tokens = 1 if req.is_decoding else min(chunk, req.num_uncomputed_tokens)
                if j:
                    assert ref.kv.try_allocate(req, tokens)
                step.num_scheduled_tokens[req.request_id] = tokens
            prefill_tokens = 0 if p.is_decoding or p.status is not Status.RUNNING \
                else step.num_scheduled_tokens[n]
            ref_log.append(float(stretch.starts_s[j]), float(stretch.duration_s[j]),
                           prefill_tokens, step.num_seqs - (prefill_tokens > 0), step.num_seqs,
                           ref.kv.num_used_blocks, 0, 0)
            ref_done += ref.commit(step, j, float(stretch.starts_s[j]),
                                   float(stretch.end_s[j]))
        if rest is not None:
            for req in ref.running:
                tokens = 1 if req.is_decoding else min(chunk, req.num_uncomputed_tokens)
                assert ref.kv.try_allocate(req, tokens)
        state.check()
        for name, column in ref_log.arrays().items():
            assert log.arrays()[name].tolist() == column.tolist(), name
        assert sorted(r.request_id for r in done) == sorted(r.request_id for r in ref_done)
        assert [r.request_id for r in state.running] == [r.request_id for r in ref.running]
        assert state.num_running_tokens == ref.num_running_tokens
        for i, req in state.requests.items():
            other = ref.requests[i]
            assert (req.num_computed_tokens, req.num_output_tokens, req.status, req.finish_s,
                    req.first_scheduled_s, req.all_token_runs()) == (
                other.num_computed_tokens, other.num_output_tokens, other.status,
                other.finish_s, other.first_scheduled_s, other.all_token_runs()), i
            assert state.kv.num_held_blocks(i) == ref.kv.num_held_blocks(i), i
        k = stretch.num_prefill_steps
        seen["chunks"] += k > 1
        seen["cut_in_chunks"] += first < min(k, length)
        seen["first_is_last"] += target == out0 + 1 and num_steps >= k
        seen["recompute"] += out0 > 0
        seen["leave_in_chunks"] += any(left < k for _, _, left in decodes)
    assert min(seen.values()) >= 5, seen


@pytest.mark.parametrize("scheduler", [
    {"name": "chunked_prefill", "token_budget": 128},
    {"name": "chunked_prefill", "token_budget": 256, "chunk_size": 96, "min_chunk_tokens": 32},
    {"name": "vllm_v1", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 80,
     "async_scheduling": False},  # (stretches: the synchronous engine's fast path)
    {"name": "sglang", "chunked_prefill_size": 128, "mixed_chunk": True,
     "overlap_schedule": False},
    {"name": "sglang", "chunked_prefill_size": 128, "overlap_schedule": False},
    {"name": "new_policy"},
], ids=["chunked", "chunk_size", "vllm_v1", "sglang_mixed", "sglang", "new_policy"])
@pytest.mark.parametrize("num_blocks", [2000, 140], ids=["room", "tight"])
def test_prompts_in_chunks_fast_forward_as_stepping(registered, monkeypatch, scheduler,
                                                    num_blocks):
    """Long prompts cut into chunks beside decodes on two replicas (a router reading them
    mid-stretch), with noise: stretches that begin with a prompt's chunks (`plan_stretch`)
    give every result file of a step-by-step run, with KV to spare or so short that
    requests are preempted and recomputed and a prompt's chunks may not find their blocks."""
    planned = []
    plan_stretch = sim.engine.replica.plan_stretch

    def counted(*args, **kwargs):
        stretch = plan_stretch(*args, **kwargs)
        planned.append(stretch is not None and stretch.prefill_pos >= 0)
        return stretch

    monkeypatch.setattr(sim.engine.replica, "plan_stretch", counted)
    # Admitting while blocks last (no reserve for decodes' future tokens) runs them short.
    replica = {"scheduler": {**scheduler, "max_num_seqs": 16, "decode_reserve_tokens": 0},
               "latency": {"kind": "roofline",
                           "noise": {"kind": "lognormal", "sigma": 0.2, "correlation": 0.5}},
               "kv_cache": {"block_size": 16, "num_blocks": num_blocks}}
    if scheduler["name"] == "new_policy":
        replica["latency"] = {"kind": "new_latency"}
    cluster = {"replicas": 2, "router": {"name": "least_kv_load"}}
    scenario = synthetic(replica, cluster, seed=13, num_requests=150, qps=8,
                         max_prompt=1200, max_output=100)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, scenario)
    assert sum(planned) > 20, (sum(planned), len(planned))
    if num_blocks < 1000 and scheduler["name"] != "new_policy":  # it reserves every token
        assert slow.iterations["num_preempted"].sum() > 0
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary
