"""Sessions read from a trace's prefix ids (`workload.sessions` on a trace with `hash_ids`):
a request that continues an earlier one (`continuations`) is a later turn of its session, and
is sent, as a chat user sends it, not before the answer to the turn it continues has reached
its client: at its time in the trace, or `think_time_s` after that answer if it comes later.
So a trace replayed on a slower deployment keeps its conversations' order and their prefix
reuse instead of sending a follow-up before the answer it resends exists.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sim.config.errors import InputError
from sim.workloads.base import Sessions, TraceSessionsConfig, Workload, WorkloadConfig

# A request that more than this many later requests would continue, none of them longer than
# the one before, is a prefix they share (a system prompt or a document, whose first user sent
# it alone), not a turn of one conversation: a turn is continued once, or again when its
# answer is regenerated.
MAX_CONTINUATIONS = 2


def continuations(hash_ids: list[tuple[int, ...]],
                  num_prompt_tokens: np.ndarray | None = None) -> np.ndarray:
    """Which earlier request each one continues, from its prefix ids (-1: none): request j
    continues request i when j's ids start with all of i's but its last (a part-block, which
    grows), i brought full blocks of its own (not only shared ones: a common system prompt is
    a prefix of many, not a turn of one), and j goes on past them; the latest such i with the
    deepest match.

    Turns too short to fill a block of their own cannot be found continued, so the turns after
    them all seem to continue the last turn that could: where those are each longer than the
    one before (`num_prompt_tokens`, else their counts of ids), they are a chain, each
    continuing the one before. Where they are not, and more than MAX_CONTINUATIONS, the
    request they seem to continue is a prefix they share: they continue nothing."""
    ends: dict[tuple[int, int], int] = {}  # prefix-tree node -> the latest request ending there
    nodes: dict[tuple[int, int], int] = {}
    before = np.full(len(hash_ids), -1, dtype=np.int64)
    for j, ids in enumerate(hash_ids):
        node, new, last_full = 0, False, 0
        for k, block in enumerate(ids):
            if k and (node, -1) in ends:  # a request whose ids but the last end here
                before[j] = ends[(node, -1)]
            key = (node, block)
            if key not in nodes:
                nodes[key] = len(nodes) + 1
                new = new or k < len(ids) - 1
            node = nodes[key]
            if k == len(ids) - 2:
                last_full = node
        if len(ids) >= 2 and new:
            ends[(last_full, -1)] = j
    length = (np.array([len(ids) for ids in hash_ids]) if num_prompt_tokens is None
              else np.asarray(num_prompt_tokens))
    followers: dict[int, list[int]] = {}
    for j in np.flatnonzero(before >= 0).tolist():
        followers.setdefault(int(before[j]), []).append(j)
    for chain in followers.values():
        if len(chain) < 2:
            continue
        if (np.diff(length[chain]) > 0).all():
            before[chain[1:]] = chain[:-1]
        elif len(chain) > MAX_CONTINUATIONS:
            before[chain] = -1
    return before


def chains(before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each request's session (the index of the first request of its chain of
    continuations) and its turn in it (from 0); `before` points earlier, so one pass in order
    resolves both."""
    root = np.arange(len(before), dtype=np.int64)
    turn = np.zeros(len(before), dtype=np.int64)
    for j in np.flatnonzero(before >= 0).tolist():
        root[j] = root[before[j]]
        turn[j] = turn[before[j]] + 1
    return root, turn


def with_trace_sessions(workload: Workload, config: WorkloadConfig,
                        sessions: TraceSessionsConfig) -> Workload:
    """`workload` (a selected trace, in arrival order) with the sessions its prefix ids show."""
    if workload.hash_ids is None:
        raise InputError(config._source, "workload.sessions", sessions.model_dump(),
                         f"the {config.format} trace has no prefix ids (hash_ids) to find "
                         "sessions in")
    before = continuations(workload.hash_ids, workload.num_prompt_tokens)
    session, turn = chains(before)
    # Sessions numbered by their first request, in arrival order.
    _, session = np.unique(session, return_inverse=True)
    delay_s = np.where(before >= 0, sessions.think_time_s, 0.0)
    return dataclasses.replace(workload, sessions=Sessions(
        before, delay_s, session.astype(np.int64), turn, paced=True))
