"""Records to DataFrames: one row per request, per iteration and (on request) per token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from sim.iteration_log import IterationLog
from sim.request import Request, Status

UNFINISHED = "unfinished"


def token_times(requests: Sequence[Request], logs: Sequence[IterationLog]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Every sampled token's time, grouped by request in order: (request position, time_s).
    `logs[i]` is replica i's."""
    offsets = np.cumsum([0] + [len(log) for log in logs])
    end_s = np.concatenate([log.end_s() for log in logs]) if logs else np.zeros(0)
    starts: list[int] = []
    lengths: list[int] = []
    owners: list[int] = []
    for pos, req in enumerate(requests):
        for replica_id, first, end in req.all_token_runs():
            starts.append(int(offsets[replica_id]) + first)
            lengths.append(end - first)
            owners.append(pos)
    lengths_a = np.asarray(lengths, dtype=np.int64)
    total = int(lengths_a.sum())
    run_begin = np.cumsum(lengths_a) - lengths_a
    index = (np.arange(total, dtype=np.int64) - np.repeat(run_begin, lengths_a)
             + np.repeat(np.asarray(starts, dtype=np.int64), lengths_a))
    return np.repeat(np.asarray(owners, dtype=np.int64), lengths_a), end_s[index]


def request_frame(requests: Sequence[Request], owner: np.ndarray, times: np.ndarray
                  ) -> tuple[pd.DataFrame, np.ndarray]:
    """Per-request records with derived latencies, and the pooled TBT gaps of all requests."""
    n = len(requests)
    counts = np.bincount(owner, minlength=n)
    first_pos = np.cumsum(counts) - counts
    has_token = counts > 0
    padded = np.append(times, np.nan)  # requests without tokens index the NaN at the end
    first_token = np.where(has_token, padded[np.where(has_token, first_pos, -1)], np.nan)
    last_token = np.where(has_token, padded[np.where(has_token, first_pos + counts - 1, -1)],
                          np.nan)
    same = owner[1:] == owner[:-1]
    gaps = (times[1:] - times[:-1])[same]
    max_gap = np.full(n, np.nan)
    if gaps.size:
        gap_owner = owner[1:][same]
        max_gap_found = np.full(n, -np.inf)
        np.maximum.at(max_gap_found, gap_owner, gaps)
        max_gap = np.where(np.isfinite(max_gap_found), max_gap_found, np.nan)

    arrival = np.array([r.arrival_s for r in requests], dtype=np.float64)
    status = [_status(r) for r in requests]
    frame = pd.DataFrame({
        "request_id": np.array([r.request_id for r in requests], dtype=np.int64),
        "replica_id": np.array([r.prefill_replica_id for r in requests], dtype=np.int64),
        "decode_replica_id": np.array(
            [r.replica_id if r.transfer_end_s is not None else -1 for r in requests],
            dtype=np.int64),
        "arrival_s": arrival,
        "num_prompt_tokens": np.array([r.num_prompt_tokens for r in requests], dtype=np.int64),
        "num_output_tokens": np.array([r.num_target_output_tokens for r in requests],
                                      dtype=np.int64),
        "num_generated_tokens": counts.astype(np.int64),
        "first_scheduled_s": np.array([_nan(r.first_scheduled_s) for r in requests]),
        "first_token_s": first_token,
        "finish_s": np.array([_nan(r.finish_s) for r in requests]),
        "num_computed_tokens": np.array([r.num_computed_tokens for r in requests],
                                        dtype=np.int64),
        "num_cached_tokens": np.array([r.num_cached_tokens for r in requests], dtype=np.int64),
        "num_preemptions": np.array([r.num_preemptions for r in requests], dtype=np.int64),
        "num_recomputed_tokens": np.array([r.num_recomputed_tokens for r in requests],
                                          dtype=np.int64),
        "status": status,
        "reason": [_reason(r) for r in requests],
    })
    frame["scheduling_delay_s"] = frame["first_scheduled_s"] - arrival
    frame["ttft_s"] = first_token - arrival
    frame["e2e_s"] = frame["finish_s"] - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        frame["tpot_s"] = np.where(counts > 1, (last_token - first_token) / (counts - 1), np.nan)
    frame["max_tbt_s"] = max_gap
    prefill_end = np.array([_nan(r.prefill_end_s) for r in requests])
    transfer_start = np.array([_nan(r.transfer_start_s) for r in requests])
    transfer_end = np.array([_nan(r.transfer_end_s) for r in requests])
    frame["prefill_end_s"] = prefill_end
    frame["transfer_start_s"] = transfer_start
    frame["transfer_end_s"] = transfer_end
    frame["decode_wait_s"] = transfer_start - prefill_end  # waiting for decode KV blocks
    frame["transfer_s"] = transfer_end - transfer_start  # link queueing and wire time
    return frame, gaps


POOLS = ["colocated", "prefill", "decode"]


def iteration_frame(logs: Sequence[IterationLog], pools: Sequence[str]) -> pd.DataFrame:
    """Every replica's iterations; `pools[i]` is replica i's pool."""
    parts = []
    for replica_id, (log, pool) in enumerate(zip(logs, pools, strict=True)):
        part = pd.DataFrame(log.arrays())
        part.insert(0, "replica_id", np.int64(replica_id))
        part.insert(1, "pool", pd.Series(pd.Categorical([pool] * len(log), categories=POOLS)))
        part.insert(2, "iteration", np.arange(len(log), dtype=np.int64))
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def token_frame(requests: Sequence[Request], owner: np.ndarray, times: np.ndarray
                ) -> pd.DataFrame:
    ids = np.array([r.request_id for r in requests], dtype=np.int64)
    counts = np.bincount(owner, minlength=len(requests))
    index = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return pd.DataFrame({"request_id": ids[owner], "token_index": index.astype(np.int64),
                         "time_s": times})


def _status(req: Request) -> str:
    if req.status in (Status.FINISHED, Status.REJECTED):
        return req.status.value
    return UNFINISHED


# Why a request is unfinished at the horizon, by where it was.
AT_HORIZON = {Status.WAITING: "queued_at_horizon", Status.RUNNING: "running_at_horizon",
              Status.TRANSFERRING: "transferring_at_horizon"}


def _reason(req: Request) -> str:
    """`kind: detail` (or just `kind`); empty for a finished request. Summaries group by kind."""
    if req.status is Status.FINISHED:
        return ""
    if req.reason:
        return req.reason
    return AT_HORIZON[req.status]


def _nan(value: float | None) -> float:
    return np.nan if value is None else value
