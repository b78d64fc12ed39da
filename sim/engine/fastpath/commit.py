"""Committing a stretch (`sim.engine.fastpath.stretch`): the requests' counters, token times and KV
blocks, and the iteration log's rows, for the first iterations of a planned stretch, as stepping
them one by one would leave them. Pure: no SimPy, no clock.

The request computing its prompt in chunks (a stretch's `prefill_pos`) is counted in the
stretch's arrays as if it had decoded from the first iteration; the functions here correct for
it where its chunks differ (`_prompt_blocks`, `_prompt_steps`).
"""

from __future__ import annotations

from itertools import accumulate

from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.engine.fastpath.stretch import Stretch
from sim.engine.iteration_log import IterationLog


def commit_stretch(state: ReplicaState, stretch: Stretch, num_steps: int, log: IterationLog
                   ) -> tuple[list[Request], Stretch | None]:
    """Apply the first `num_steps` iterations of `stretch`. Returns the requests they finished
    (in the order a step-by-step run finishes them) and the rest of the stretch (None if
    nothing is left). KV blocks grow to hold what the committed iterations computed; the
    rest's first iteration allocates its own (as the step-by-step run's `schedule()` would,
    when it plans that iteration)."""
    done, num_used_next = _commit_requests(state, stretch, num_steps, log)
    if num_steps == len(stretch):
        return done, None
    return done, stretch.after(num_steps, num_used_next)


def _commit_requests(state: ReplicaState, stretch: Stretch, num_steps: int, log: IterationLog
                     ) -> tuple[list[Request], int]:
    """`commit_stretch`'s work, in one pass over the batch: each request's counters and blocks,
    and what it changes in the per-iteration counts (a block added where its tokens fill the
    last one; all its blocks and its place freed when it leaves), summed over iterations at the
    end. Returns the finished requests and the blocks in use during the first iteration after
    the commit.

    A plain loop rather than arrays: the requests' counters need the loop anyway, and most
    commits are short (a stretch is cut by new work a few iterations in: median 1 on the decode
    replicas of `bench/sim_speed.py`'s 2P+2D case, 14 on its single replica), where the dozen
    numpy calls of an array version cost more than the loop (`bench/instructions.py`,
    2026-11-23: 6.3% fewer instructions on its `azure` case, 5.5% on `disagg`)."""
    bs = stretch.block_size
    requests = stretch.requests
    first_iter = len(log)
    since = log.last_decode_iteration  # before the stretch's iterations are logged
    # Changes from iteration j on, j = 1 .. num_steps (index num_steps: the rest's first).
    used_change = [0] * (num_steps + 1)
    seqs_change = [0] * (num_steps + 1)
    leaving: list[tuple[int, int]] = []  # (iterations it is in, position in the batch)
    grow_blocks = state.kv.grow_blocks
    num_decoded = 0
    requests_in = requests
    num_computed = stretch.num_computed
    num_steps_left = stretch.num_steps_left
    # Tokens the blocks were allocated for, beyond the computed ones (the first iteration's).
    allocated_ahead = 1 if stretch.first_allocated else 0
    prefill_pos = stretch.prefill_pos
    if prefill_pos >= 0:  # the request computing its prompt: after the loop
        requests_in = requests[:prefill_pos] + requests[prefill_pos + 1:]
        prefill_computed = num_computed[prefill_pos]
        prefill_left = num_steps_left[prefill_pos]
        num_computed = num_computed[:prefill_pos] + num_computed[prefill_pos + 1:]
        num_steps_left = num_steps_left[:prefill_pos] + num_steps_left[prefill_pos + 1:]
    for pos, (req, computed, left) in enumerate(zip(requests_in, num_computed, num_steps_left,
                                                    strict=True)):
        steps_in = left if left < num_steps else num_steps
        # It holds the blocks of computed + j + 1 tokens during iteration j: one more from
        # each j where computed + j fills its blocks, while it is in the batch.
        in_until = left if left <= num_steps else num_steps + 1
        j = -computed % bs or bs
        while j < in_until:
            used_change[j] += 1
            j += bs
        if left <= num_steps:  # gone from iteration `left` on, with every block it held
            used_change[left] -= -(-(computed + left) // bs)
            seqs_change[left] -= 1
            # (Its place in the batch: `requests_in` lacks the prompt's request.)
            leaving.append((left, pos + (0 <= prefill_pos <= pos)))
        req.decode_steps(first_iter, steps_in, since)
        num_decoded += steps_in
        # Blocks to hold what it computed (a finishing request's too: with prefix caching,
        # what it frees is cached); the plan counted every request's growth, so they fit.
        grow = -(-(computed + steps_in) // bs) + (-(computed + allocated_ahead) // bs)
        if grow > 0:
            grow_blocks(req.request_id, grow)
    if prefill_pos >= 0:
        # Its chunks' blocks, then, from its first decode, the same as any request's.
        req, computed, left = requests[prefill_pos], prefill_computed, prefill_left
        in_until = left if left <= num_steps else num_steps + 1
        j = _prompt_blocks(req, stretch, min(in_until, len(stretch)), used_change)
        j += -(computed + j) % bs
        while j < in_until:
            used_change[j] += 1
            j += bs
        if left <= num_steps:
            used_change[left] -= -(-(computed + left) // bs)
            seqs_change[left] -= 1
            leaving.append((left, prefill_pos))
        num_decoded += _prompt_steps(req, stretch, first_iter, min(left, num_steps))
        grow = -(-req.num_computed_tokens // bs) - state.kv.num_held_blocks(req.request_id)
        if grow > 0:
            grow_blocks(req.request_id, grow)
    used = list(accumulate(used_change[1:], initial=stretch.num_used_blocks))
    num_seqs: int | list[int] = len(requests)
    if leaving:
        num_seqs = list(accumulate(seqs_change[1:num_steps], initial=len(requests)))
    prefill = stretch.prefill_tokens
    log.extend_stretch(stretch.starts_s[:num_steps], stretch.duration_s[:num_steps], num_seqs,
                       used[:num_steps], stretch.num_preempted,
                       None if prefill is None else prefill[:num_steps])
    state.decoded(num_decoded)
    done: list[Request] = []
    leaving.sort()  # by the iteration that ends it, then running order, as stepping finishes them
    end_s = stretch.end_s
    for left, pos in leaving:
        req = requests[pos]
        state.finish(req, float(end_s[left - 1]))
        done.append(req)
    return done, used[num_steps]


def _prompt_blocks(req: Request, stretch: Stretch, num_steps: int, used_change: list[int]
                   ) -> int:
    """Add to `used_change` the blocks the chunks of `stretch`'s prompt take in its first
    `num_steps` iterations (the first's are allocated already: counted in the stretch's
    blocks in use); return the first iteration it may decode in."""
    assert stretch.prefill_tokens is not None
    bs = stretch.block_size
    last = min(stretch.num_prefill_steps, num_steps)
    computed = req.num_computed_tokens
    held = 0
    for j, chunk in enumerate(stretch.prefill_tokens[:last]):
        computed += chunk
        blocks = -(-computed // bs)
        if j:
            used_change[j] += blocks - held
        held = blocks
    return stretch.num_prefill_steps


def _prompt_steps(req: Request, stretch: Stretch, first_iter: int, num_steps: int) -> int:
    """Apply the first `num_steps` iterations (those it is in) to the request of `stretch`
    computing its prompt: its chunks, then its first token at the end of the last and a decode
    in each iteration after. Returns the tokens it sampled."""
    assert stretch.prefill_tokens is not None
    if req.first_scheduled_s is None:  # its first chunk is the stretch's first iteration
        req.first_scheduled_s = float(stretch.starts_s[0])
    num_prefill_steps = stretch.num_prefill_steps
    if num_steps < num_prefill_steps:
        req.num_computed_tokens += sum(stretch.prefill_tokens[:num_steps])
        return 0
    req.num_computed_tokens = req.num_tokens  # the prompt (and output before) computed
    req.num_output_tokens += 1
    req.record_token(first_iter + num_prefill_steps - 1)
    if num_steps > num_prefill_steps:
        req.decode_steps(first_iter + num_prefill_steps, num_steps - num_prefill_steps)
    return num_steps - num_prefill_steps + 1


def allocate_first_step(state: ReplicaState, stretch: Stretch) -> Stretch:
    """KV blocks for the first iteration of `stretch` (as `schedule()` allocates a plan's), if
    not allocated yet; the stretch, knowing they are."""
    if stretch.first_allocated:
        return stretch
    for pos, req in enumerate(stretch.requests):
        num_tokens = 1
        if pos == stretch.prefill_pos:
            assert stretch.prefill_tokens is not None
            num_tokens = stretch.prefill_tokens[0]
        grow = state.kv.num_blocks_to_grow(req, num_tokens)
        if grow:
            state.kv.grow_blocks(req.request_id, grow)
    stretch.first_allocated = True
    return stretch
