"""A scheduler and a latency model written here, knowing nothing of stretches or run-ahead (as a
new contributor would write them), and the helpers that run a scenario fast-forwarded and stepped
or build a batch for a stretch by hand."""

from __future__ import annotations

import numpy as np

import sim.engine.clock
import sim.engine.fastpath.replica
import sim.engine.replica
from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.plan import Plan
from sim.core.state import ReplicaState
from sim.latency.base import BatchShape, LatencyConfig, LatencyModel, Num
from sim.schedulers.admission import try_admit
from sim.schedulers.base import Scheduler, schedule_decodes


class NewPolicy(Scheduler):
    """Decodes first, then admits whole prompts FCFS while blocks last: a policy as a new
    contributor would write it, with no fast-path code."""

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
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


def assert_same_results(fast, slow) -> None:
    """Fast-forwarded and stepped runs agree to the last bit: every table and the summary."""
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


def batch_with_a_prompt(bs: int, decodes: list[tuple[int, int, int]], pos: int, prompt: int,
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


def ended_counts_direct(stretch, num_steps):
    """`Stretch.ended_counts` computed from its arrays for this `num_steps` alone."""
    left = np.array(stretch.num_steps_left, dtype=np.int64)
    computed = np.array(stretch.num_computed, dtype=np.int64)
    gone = left <= num_steps
    not_sampled = (min(num_steps, stretch.num_prefill_steps - 1)
                   if stretch.prefill_pos >= 0 else 0)
    return (int(np.minimum(left, num_steps).sum()) - not_sampled, int(gone.sum()),
            int((computed[gone] + 1 + left[gone]).sum()))


def record_router_reads(monkeypatch, stretch_type: type) -> tuple[list[tuple], list[int]]:
    """Every load a router reads of a pipelined replica (`load_tokens` where it weighs
    tokens, `load` where it weighs requests), with its replica and time, to compare read
    for read with stepping's; and how many reads found a stretch of `stretch_type` in
    progress. Returns both lists, filled as the runs go."""
    from sim.engine.fastpath.pipeline import FastPipelinedReplica

    reads: list[tuple] = []
    mid_way = [0]
    depth = [0]  # (a fast replica's read may call the stepped one's)

    def recording(read_load):
        def read(self, *args):
            mid_way[0] += isinstance(getattr(self, "_stretch", None), stretch_type)
            depth[0] += 1
            seen = read_load(self, *args)
            depth[0] -= 1
            if not depth[0]:
                reads.append((self.replica_id, self.env.now, seen))
            return seen
        return read

    for cls in (FastPipelinedReplica, sim.engine.replica.Replica):
        monkeypatch.setattr(cls, "load", recording(cls.load))
        monkeypatch.setattr(cls, "load_tokens", recording(cls.load_tokens))
    return reads, mid_way
