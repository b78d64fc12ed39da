"""Committing a stretch (`sim.engine.fastpath.commit`): the requests' counters, tokens, KV blocks
and the iteration log's rows, against the same iterations counted request by request or
stepped with `ReplicaState.commit`, on random batches."""

from __future__ import annotations

import numpy as np

from sim.core.plan import Plan
from sim.core.state import ReplicaState
from sim.latency.base import LatencyConfig
from tests.engine.fastpath_helpers import NewLatency, batch_with_a_prompt, ended_counts_direct


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
        state, plan = batch_with_a_prompt(*args)
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
            assert stretch.ended_counts(k) == ended_counts_direct(stretch, k), k
        tokens_before = state.num_running_tokens
        log = IterationLog()
        done, rest = commit_stretch(state, stretch, first, log)
        if rest is not None:
            more, rest = commit_stretch(state, rest, int(rng.integers(1, len(rest) + 1)), log)
            done += more
        if rest is not None:  # the run stops mid-stretch: the next iteration's blocks held
            rest = allocate_first_step(state, rest)
        num_steps = len(log)

        ref, _ = batch_with_a_prompt(*args)
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
