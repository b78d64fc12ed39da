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


def continuations(hash_ids: list[tuple[int, ...]]) -> np.ndarray:
    """Which earlier request each one continues, from its prefix ids (-1: none): request j
    continues request i when j's ids start with all of i's but its last (a part-block, which
    grows), i brought full blocks of its own (not only shared ones: a common system prompt is
    a prefix of many, not a turn of one), and j goes on past them; the latest such i with the
    deepest match."""
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
    return before


def with_trace_sessions(workload: Workload, config: WorkloadConfig,
                        sessions: TraceSessionsConfig) -> Workload:
    """`workload` (a selected trace, in arrival order) with the sessions its prefix ids show."""
    if workload.hash_ids is None:
        raise InputError(config._source, "workload.sessions", sessions.model_dump(),
                         f"the {config.format} trace has no prefix ids (hash_ids) to find "
                         "sessions in")
    before = continuations(workload.hash_ids)
    session = np.arange(len(before), dtype=np.int64)
    turn = np.zeros(len(before), dtype=np.int64)
    for j in np.flatnonzero(before >= 0).tolist():
        session[j] = session[before[j]]
        turn[j] = turn[before[j]] + 1
    # Sessions numbered by their first request, in arrival order.
    _, session = np.unique(session, return_inverse=True)
    delay_s = np.where(before >= 0, sessions.think_time_s, 0.0)
    return dataclasses.replace(workload, sessions=Sessions(
        before, delay_s, session.astype(np.int64), turn, paced=True))
