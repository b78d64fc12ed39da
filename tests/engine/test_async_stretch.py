"""Stretches on a replica that schedules ahead (vLLM v1's async scheduling, SGLang's overlap
loop: `sim.engine.fastpath.pipeline`): every result equal to a step-by-step run, bit for bit,
with far fewer steps taken one by one, alone or behind a router that reads no loads; and
where something outside may read the replica mid-stretch (a router reading loads, a timeout,
a closed-loop client), no stretch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sim.engine.fastpath.pipeline as fast_pipeline
from sim import load_scenario, run_scenario
from sim.config.scenario import parse_scenario
from sim.core.plan import Plan
from sim.core.request import Request
from sim.engine.fastpath.async_stretch import AsyncStretch
from sim.schedulers.sglang import SGLang
from tests.engine.fastpath_helpers import (
    assert_same_results,
    fast_and_stepped,
    record_router_reads,
)
from tests.strategies import assert_nothing_lost, scenarios


def _default(scheduler: str, **changes) -> dict:
    """The embedded default workload (chat lengths, Poisson 5.5 req/s) on one replica."""
    data = load_scenario().model_dump(mode="json")
    data["replica"]["scheduler"] = {"name": scheduler}
    data["workload"]["num_requests"] = 400
    data["workload"]["ignore_eos"] = True  # (outputs known; SGLang's ratio: below)
    data["record_token_times"] = True
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][field] = value
    return data


def _counting(monkeypatch) -> dict[str, int]:
    """How many stretches the runs take back whole and cut short by an arrival."""
    counts = {"whole": 0, "cut": 0}
    take_back = fast_pipeline.FastPipelinedReplica._take_back

    def counted(self, stretch, k, now_s):
        counts["whole" if k == len(stretch) else "cut"] += 1
        return take_back(self, stretch, k, now_s)

    monkeypatch.setattr(fast_pipeline.FastPipelinedReplica, "_take_back", counted)
    return counts


@pytest.mark.parametrize("scheduler", ["vllm_v1", "sglang"])
@pytest.mark.parametrize(("changes", "num_stretches", "events"), [
    ({}, 50, 0.7),
    ({"replica__latency": {"kind": "roofline",
                           "noise": {"kind": "lognormal", "sigma": 0.3}}}, 50, 0.7),
    # (the cache full: stretches stop where the blocks would run out, preemptions between)
    ({"replica__kv_cache": {"num_blocks": 300}}, 3, 1.0),
    ({"workload__arrivals": {"process": "poisson", "qps": 14.0}, "horizon_s": 30.0}, 20, 1.0),
    ({"replica__latency": {"kind": "constant", "iteration_s": 0.01}}, 50, 0.7)],  # (ties)
    ids=["default", "noise", "tight-kv", "busy-horizon", "constant"])
def test_async_stretches_equal_stepping(monkeypatch, scheduler, changes, num_stretches, events):
    data = _default(scheduler, **{k: v for k, v in changes.items() if "__" in k})
    data.update({k: v for k, v in changes.items() if "__" not in k})
    counts = _counting(monkeypatch)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    assert counts["whole"] + counts["cut"] >= num_stretches, counts
    # Most iterations need no step of their own (the default: about 40% of the events).
    assert num_fast < events * num_slow, (num_fast, num_slow)


@pytest.mark.parametrize(("overlap", "num_blocks", "qps", "pipeline"), [
    (True, 12_000, 5.5, 1), (False, 12_000, 5.5, 1), (False, 6_000, 2.0, 1),
    (False, 12_000, 3.0, 2)],
    ids=["overlap", "synchronous", "synchronous-tight", "two-stages"])
def test_sglang_stretches_decay_its_new_token_ratio_as_stepping_does(
        monkeypatch, overlap, num_blocks, qps, pipeline):
    """Outputs unknown to SGLang (no `ignore_eos`): admission reserves outputs times
    `new_token_ratio`, which each decode step decays from 0.7 to its floor and an idle pass
    resets. A stretch made while it decays tells the policy of every decode plan it made
    (`Scheduler.decodes_repeated`), so later admissions see the ratio stepping leaves. (The
    cases were chosen where one decay fewer a stretch changes who is admitted when.)"""
    data = _default("sglang", workload__arrivals={"process": "poisson", "qps": qps},
                    replica__kv_cache={"num_blocks": num_blocks})
    data["replica"]["scheduler"]["overlap_schedule"] = overlap
    data["replica"]["parallelism"] = {"pipeline": pipeline}
    data["workload"].update(num_requests=300, ignore_eos=False)
    decaying = []
    repeated = SGLang.decodes_repeated

    def counted(self, num_plans):
        if self.new_token_ratio > self.ratio_min:
            decaying.append(num_plans)
        return repeated(self, num_plans)

    monkeypatch.setattr(SGLang, "decodes_repeated", counted)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    # (Stretches while it decays: 17-79 of them, 470-4,666 plans, in these cases.)
    assert len(decaying) >= 10 and sum(decaying) >= 300, decaying
    assert num_fast < num_slow


@pytest.mark.parametrize("scheduler", ["vllm_v1", "sglang"])
def test_a_lone_replica_cuts_its_stretch_at_the_next_arrival_even_one_rejected(
        monkeypatch, scheduler):
    # A lone replica fed by the trace alone knows, when it plans a stretch, the arrival that
    # will cut it, and waits for that plan's turn with no poke; one rejected (beyond the
    # context window) cuts it all the same, and stepping again gives the same results.
    data = _default(scheduler, replica__max_model_len=1500)
    counts = _counting(monkeypatch)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    assert (fast.requests["status"] == "rejected").sum() >= 50
    assert counts["cut"] >= 100, counts
    assert num_fast < num_slow


@pytest.mark.parametrize(("scheduler", "arrivals"), [
    ({"name": "vllm_v1"}, {"process": "poisson", "qps": 5.5}),
    # (bursts: several prompts in one plan)
    ({"name": "vllm_v1"}, {"process": "gamma", "qps": 8.0, "cv": 4.0}),
    # (SGLang's prompts beside the decodes: --enable-mixed-chunk)
    ({"name": "sglang", "mixed_chunk": True}, {"process": "poisson", "qps": 5.5})],
    ids=["vllm_v1", "bursts", "sglang-mixed"])
def test_a_plan_computing_prompts_opens_a_stretch(monkeypatch, scheduler, arrivals):
    """A plan that gives every running request all its known tokens (a new prompt beside the
    decodes, or several) opens a stretch: each request samples at the end of its iteration
    and decodes from the next plan on. Cut at its first plan (the iteration of the prompts in
    flight) or later, it leaves the replica as stepping does."""
    data = _default("vllm_v1", workload__arrivals=arrivals)
    data["replica"]["scheduler"] = scheduler
    if scheduler["name"] == "sglang":  # (SGLang's mixed chunks: on pages of one token)
        data["replica"]["kv_cache"]["block_size"] = 1
    opened = {"prompts": 0, "several": 0, "cut_in_first": 0}
    plan = fast_pipeline.plan_async_stretch
    take_back = fast_pipeline.FastPipelinedReplica._take_back

    def counted_plan(*args, **kwargs):
        stretch = plan(*args, **kwargs)
        tokens = kwargs.get("first_tokens")
        if stretch is not None and tokens is not None:
            opened["prompts"] += 1
            opened["several"] += sum(t > 1 for t in tokens) > 1
        return stretch

    def counted_take_back(self, stretch, k, now_s):
        opened["cut_in_first"] += k == 1 and stretch.first is not None
        return take_back(self, stretch, k, now_s)

    monkeypatch.setattr(fast_pipeline, "plan_async_stretch", counted_plan)
    monkeypatch.setattr(fast_pipeline.FastPipelinedReplica, "_take_back", counted_take_back)
    fast, slow, _, _ = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    assert opened["prompts"] > 50, opened
    assert opened["cut_in_first"] > 0, opened
    if arrivals["process"] == "gamma":
        assert opened["several"] > 20, opened


@pytest.mark.parametrize("router", ["round_robin", "random"])
def test_replicas_behind_a_router_that_reads_no_loads_take_stretches(monkeypatch, router):
    """Round robin and random routing read no replica's load: an arrival touches only the
    replica it goes to, and the others' stretches go on."""
    data = _default("vllm_v1", workload__arrivals={"process": "poisson", "qps": 14.0})
    data["cluster"] = {"replicas": 3, "router": {"name": router}}
    counts = _counting(monkeypatch)
    scenario = parse_scenario(data, "t")
    assert_same_results(run_scenario(scenario), run_scenario(scenario, fast_forward=False))
    assert counts["whole"] + counts["cut"] > 50


@pytest.mark.parametrize(("scheduler", "router"), [
    ("vllm_v1", "least_kv_load"), ("vllm_v1", "least_outstanding"),
    ("sglang", "least_kv_load"), ("sglang", "least_outstanding")])
def test_routers_read_async_stretches_in_progress_as_stepping_shows_them(
        monkeypatch, scheduler, router):
    """A router weighing loads reads every replica at every arrival: a replica in a stretch
    answers from the stretch's arrays, as the stepped replica stands then (plans made before
    the arrival started, iterations ended by it complete, leavers gone, their blocks freed),
    and goes on; only the replica chosen hands its stretch back."""
    data = _default(scheduler, workload__arrivals={"process": "poisson", "qps": 14.0})
    data["cluster"] = {"replicas": 3, "router": {"name": router}}
    counts = _counting(monkeypatch)
    reads, mid_way = record_router_reads(monkeypatch, AsyncStretch)
    scenario = parse_scenario(data, "t")
    fast = run_scenario(scenario)
    fast_reads, reads[:] = list(reads), []
    assert_same_results(fast, run_scenario(scenario, fast_forward=False))
    assert fast_reads == reads
    assert counts["whole"] + counts["cut"] > 50 and mid_way[0] > 100, (counts, mid_way)


@pytest.mark.parametrize("scheduler", ["vllm_v1", "sglang"])
@pytest.mark.parametrize("decode_router", ["least_kv_load", "round_robin"])
def test_decode_replicas_of_a_disaggregated_cluster_take_stretches(monkeypatch, scheduler,
                                                                   decode_router):
    """A decode replica is read between its hand-offs only by the decode router: its
    stretches run on until a transfer asks it for blocks or its KV lands (vLLM's decode side
    then computes the prompt's last token; SGLang's streams the first token and the request
    decodes at once, a decode replica's first work possibly a stretch), as stepping shows."""
    data = _default(scheduler, workload__arrivals={"process": "poisson", "qps": 3.0})
    data["workload"]["lengths"] = {"prompt": {"dist": "uniform", "low": 200, "high": 1500},
                                   "output": {"dist": "uniform", "low": 200, "high": 1500}}
    replica = data.pop("replica")
    data["cluster"] = {"prefill": {"replicas": 1, "replica": replica},
                       "decode": {"replicas": 2, "replica": replica},
                       "decode_router": {"name": decode_router}}
    counts = _counting(monkeypatch)
    fast, slow, num_fast, num_slow = fast_and_stepped(monkeypatch, parse_scenario(data, "t"))
    assert_same_results(fast, slow)
    assert counts["whole"] + counts["cut"] > 100, counts
    assert num_fast < 0.5 * num_slow, (num_fast, num_slow)


@pytest.mark.parametrize("changes", [
    {"cluster": {"replicas": 2, "router": {"name": "prefix_affinity"}}},
    {"workload": {"timeout_s": 5.0}},
    {"clients": {"concurrency": 4}}], ids=["prefix_router", "timeout", "clients"])
def test_no_stretch_where_something_reads_the_replica_mid_stretch(monkeypatch, changes):
    data = _default("vllm_v1")
    for section, value in changes.items():
        data[section] = {**(data.get(section) or {}), **value}
    counts = _counting(monkeypatch)
    scenario = parse_scenario(data, "t")
    assert_same_results(run_scenario(scenario), run_scenario(scenario, fast_forward=False))
    assert counts == {"whole": 0, "cut": 0}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.filter_too_much])
@given(scenarios())
def test_async_stretches_are_exact_on_random_workloads(data):
    """Random workloads (prefixes, priorities, timeouts, horizons, tight KV caches, noise)
    on one replica of vLLM v1 or SGLang with their default asynchronous loops."""
    scheduler = data["replica"]["scheduler"]
    assume(scheduler["name"] in ("vllm_v1", "sglang"))
    scheduler.pop("async_scheduling", None)  # (the engines' default: on)
    data.pop("clients", None)
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    assert_same_results(fast, run_scenario(scenario))
    assert_nothing_lost(data, fast)


def test_a_stretch_past_2_to_the_32_seconds_is_refused_as_a_step_is():
    """Iterations of 10**8 s pass 2**32 s (136 years) within a stretch's reach: the run is
    refused, one line, with the stretches as without them."""
    from sim.config.errors import InputError

    data = _default("vllm_v1", replica__latency={"kind": "constant", "iteration_s": 1e8})
    data["workload"]["num_requests"] = 3
    scenario = parse_scenario(data, "t")
    messages = []
    for fast in (True, False):
        with pytest.raises(InputError, match="2\\*\\*32") as err:
            run_scenario(scenario, fast_forward=fast)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def _blocks_plan_by_plan(num_used0: int, computed: list[int], left: list[int], n: int,
                         block_size: int) -> list[int]:
    """Blocks in use at each of plans 0..n-1, one plan and one request at a time: a request
    with `c` tokens (the one in flight counted) is in plans j < `left`, adds a block at each
    where c + j fills its last, and frees all it holds before plan left + 1."""
    used = []
    for j in range(n):
        total = num_used0
        for c, k in zip(computed, left, strict=True):
            total += sum(1 for i in range(1, min(j, k - 1) + 1) if (c + i) % block_size == 0)
            if j >= k + 1:
                total -= -(-(c + k) // block_size)
        used.append(total)
    return used


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 100), st.sampled_from([1, 2, 3, 16, 64]), st.integers(0, 500),
       st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 90)), max_size=40))
def test_blocks_in_use_at_each_plan_counted_plan_by_plan(n, block_size, num_used0, requests):
    """`AsyncStretch.num_used_blocks` (runs of blocks summed along each residue) against a
    count made plan by plan, for pages of one token (SGLang's) and larger, fewer plans than
    a page and more."""
    computed = [c for c, _ in requests]
    left = [k for _, k in requests]
    stretch = AsyncStretch(Plan({}), num_used0, [], computed, left, 0, block_size,
                           *(np.zeros(1),) * 5, 0, np.zeros(1))
    assert stretch.num_used_blocks(n) == _blocks_plan_by_plan(num_used0, computed, left, n,
                                                              block_size)


def _counts_request_by_request(stretch: AsyncStretch, now_s: float, inclusive: bool
                               ) -> tuple[int, int, int]:
    """What a router sees of `stretch` at `now_s`, counted one request at a time: plans
    made and iterations ended by then (`np.searchsorted`); a request whose last iteration
    ended left with its known tokens (its blocks freed since the last plan where its last
    iteration came after that plan's predecessor); every other one has a placeholder for
    each plan made, but for its last."""
    num_planned = max(1, int(np.searchsorted(stretch.plan_s, now_s,
                                             side="right" if inclusive else "left")))
    num_ended = int(np.searchsorted(stretch.end_s, now_s, side="right"))
    tokens = num_left = freed = 0
    for req, c, n in zip(stretch.requests, stretch.num_computed, stretch.num_steps_left,
                         strict=True):
        if num_ended >= n:
            num_left += 1
            tokens -= req.num_tokens
            if n + 1 > num_planned - 1:
                freed += -(-(c + n) // stretch.block_size)
        else:
            tokens += num_planned if num_planned < n else n - 1
    return tokens, num_left, stretch.num_used_blocks(num_planned)[-1] - freed


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.sampled_from([1, 2, 16]), st.integers(0, 300),
       st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 90), st.integers(0, 40)),
                max_size=30),
       st.lists(st.floats(0.0, 1.0), min_size=4, max_size=12), st.booleans(),
       st.integers(0, 10**6))
def test_routers_read_a_stretch_from_tables_as_counted_request_by_request(
        n, block_size, num_used0, requests, times, inclusive, seed):
    """`AsyncStretch.counts_at` and `tokens_at` (a few lookups in tables made at the first
    read) against a count over the requests at each read, for reads before, inside and past
    the stretch, at its plan and end times exactly, and requests leaving inside it and past
    it."""
    rng = np.random.default_rng(seed)
    end_s = np.sort(rng.choice(np.linspace(0.01, 0.9, 20), n))  # ties included
    plan_s = np.sort(np.concatenate(([0.0], rng.choice(np.linspace(0.0, 0.9, 20), n - 1))))
    reqs = []
    for i, (prompt, _, output) in enumerate(requests):
        req = Request(i, 0.0, prompt, output + 100)
        req.num_output_tokens = output
        reqs.append(req)
    stretch = AsyncStretch(Plan({}), num_used0, reqs, [r.num_tokens - 1 for r in reqs],
                           [k for _, k, _ in requests], 0, block_size, plan_s, plan_s, end_s,
                           end_s, end_s, 1, np.zeros(n))
    for now_s in [*times, *plan_s.tolist(), *end_s.tolist()]:
        # (tokens alone first: a read that makes the tables before any block is counted)
        tokens = stretch.tokens_at(now_s, inclusive=inclusive)
        counted = _counts_request_by_request(stretch, now_s, inclusive)
        assert stretch.counts_at(now_s, inclusive=inclusive) == counted
        assert tokens == counted[0]
