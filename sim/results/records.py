"""Records to tables (`sim.results.columns`): one row per request, per iteration and (on request)
per token."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from sim.core.request import Request, Status
from sim.engine.iteration_log import (
    ALL_TO_ALL_COLUMN,
    COLUMNS,
    SPEC_COLUMN,
    IterationLog,
    split_at_idle,
)
from sim.results.columns import Categorical, Columns, texts
from sim.results.metrics.summary import WeightedSample

UNFINISHED = "unfinished"


@dataclass(frozen=True)
class TokenRuns:
    """Every request's token runs, flattened in request order (each request's in time order):
    run k belongs to request position `owner[k]` and sampled one token at the end of each
    iteration in [start[k], end[k]), numbered in the replica logs laid end to end."""

    owner: np.ndarray  # int64, non-decreasing
    start: np.ndarray  # int64
    end: np.ndarray  # int64, > start
    num_runs: np.ndarray  # int64 per request
    # Tokens that reached the client apart from any iteration's end (SGLang's disaggregated
    # first tokens, streamed when the decode side takes the request in): one-token runs
    # numbered after the logs' iterations, at these times.
    out_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def first_run(self) -> np.ndarray:
        """Each request's first run (meaningful where it has one)."""
        return np.cumsum(self.num_runs) - self.num_runs

    def times_s(self, logs: Sequence[IterationLog]) -> np.ndarray:
        """When each numbered iteration's tokens reached the client (`end_times`), then the
        tokens apart (`out_s`): the times the runs index."""
        ends = end_times(logs)
        return np.concatenate([ends, self.out_s]) if len(self.out_s) else ends


def token_runs(requests: Sequence[Request], logs: Sequence[IterationLog]) -> TokenRuns:
    """The requests' token runs as arrays (one row per run, never one per token); `logs[i]` is
    replica i's."""
    offsets = np.cumsum([0] + [len(log) for log in logs]).astype(np.int64)
    flat = array("q")
    num_runs = array("q")
    extend, count = flat.extend, num_runs.append
    for req in requests:
        runs = req.all_token_runs()
        count(len(runs))
        # One call a request: a request decoding beside others' prefills has a run per
        # prefill that kept it out of the batch.
        extend(chain.from_iterable(runs))
    triples = np.frombuffer(flat, dtype=np.int64).reshape(-1, 3)
    per_request = np.frombuffer(num_runs, dtype=np.int64)
    base = offsets[triples[:, 0]] if len(triples) else np.zeros(0, dtype=np.int64)
    start, end = base + triples[:, 1], base + triples[:, 2]
    owner = np.repeat(np.arange(len(requests), dtype=np.int64), per_request)
    split = split_where_none_decoded(owner, start, end, logs)
    if split is not None:
        owner, start, end = split
        per_request = np.bincount(owner, minlength=len(requests)).astype(np.int64)
    if any(len(log.sampled_starts) for log in logs):
        owner, start, end = _with_sampled(requests, logs, offsets, owner, start, end)
        per_request = np.bincount(owner, minlength=len(requests)).astype(np.int64)
    if (end <= start).any():  # a run always holds a token; drop any that does not
        keep = end > start
        owner, start, end = owner[keep], start[keep], end[keep]
        per_request = np.bincount(owner, minlength=len(requests)).astype(np.int64)
    found = TokenRuns(owner, start, end, per_request.copy())
    out = [(i, t) for i, r in enumerate(requests) if (t := r.first_token_out_s) is not None]
    return _first_tokens_out(found, out, int(offsets[-1])) if out else found


def _first_tokens_out(runs: TokenRuns, out: list[tuple[int, float]], num_iterations: int
                      ) -> TokenRuns:
    """`runs` with the first token of each request in `out` (request position, time) moved
    from the prefill iteration that sampled it to when it reached the client, or dropped
    where it never did (inf: held when the run stopped)."""
    pos = np.array([i for i, _ in out], dtype=np.int64)
    times = np.array([t for _, t in out], dtype=np.float64)
    sampled = runs.num_runs[pos] > 0
    pos, times = pos[sampled], times[sampled]
    first = runs.first_run[pos]
    assert (runs.end[first] - runs.start[first] == 1).all(), "a held token is a run of its own"
    start, end = runs.start.copy(), runs.end.copy()
    sent = np.isfinite(times)
    start[first[sent]] = num_iterations + np.arange(int(sent.sum()), dtype=np.int64)
    end[first[sent]] = start[first[sent]] + 1
    keep = np.ones(len(start), dtype=bool)
    keep[first[~sent]] = False
    num_runs = runs.num_runs.copy()
    num_runs[pos[~sent]] -= 1
    return TokenRuns(runs.owner[keep], start[keep], end[keep], num_runs, times[sent])


def split_where_none_decoded(owner: np.ndarray, start: np.ndarray, end: np.ndarray,
                             logs: Sequence[IterationLog]
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A recorded run goes on through iterations in which no request of its replica decoded
    (`Request.record_token`: a prefill-first policy's prompts pause every decode, and would
    otherwise close every running request's run, millions of them under overload). Here it
    is cut before each such iteration and starts again after it: runs of consecutive
    iterations, each with a token, as the tables need. None if no run spans one."""
    decodes = np.concatenate([np.frombuffer(log.columns["num_decode_tokens"], dtype=np.int64)
                              for log in logs]) if logs else np.zeros(0, dtype=np.int64)
    split = split_at_idle(np.flatnonzero(decodes == 0), start, end)
    if split is None:
        return None
    run, piece_start, piece_end = split
    return owner[run], piece_start, piece_end


def _with_sampled(requests: Sequence[Request], logs: Sequence[IterationLog],
                  offsets: np.ndarray, owner: np.ndarray, start: np.ndarray, end: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs with the runs pipelined replicas logged (`IterationLog.add_sampled`) added,
    every request's in time order (a request's tokens may come from several replicas, whose
    iterations are numbered apart)."""
    ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    owners, starts, ends = [owner], [start], [end]
    for offset, log in zip(offsets.tolist(), logs, strict=False):
        if not len(log.sampled_starts):
            continue
        rid, run_start, run_end = log.sampled_runs()
        at = np.minimum(np.searchsorted(sorted_ids, rid), len(ids) - 1)
        mine = sorted_ids[at] == rid  # runs of the requests given
        owners.append(order[at[mine]])
        starts.append(run_start[mine] + offset)
        ends.append(run_end[mine] + offset)
    owner, start, end = np.concatenate(owners), np.concatenate(starts), np.concatenate(ends)
    # Each request's runs by the time of their first token (strictly increasing per request).
    by = np.lexsort((end_times(logs)[start], owner))
    return owner[by], start[by], end[by]


def end_times(logs: Sequence[IterationLog]) -> np.ndarray:
    """When every iteration's tokens leave the engine (its end, unless the engine took its
    result later: `IterationLog.output_s`), the replica logs laid end to end."""
    return np.concatenate([log.output_s() for log in logs]) if logs else np.zeros(0)


def token_times(requests: Sequence[Request], logs: Sequence[IterationLog],
                runs: TokenRuns | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every sampled token's time, grouped by request in order: (request position, time_s).
    One entry per token: only for the tokens table (`record_token_times`). `runs`: the
    requests' `token_runs`, where the caller has them already."""
    if runs is None:
        runs = token_runs(requests, logs)
    lengths = runs.end - runs.start
    total = int(lengths.sum())
    run_begin = np.cumsum(lengths) - lengths
    index = (np.arange(total, dtype=np.int64) - np.repeat(run_begin, lengths)
             + np.repeat(runs.start, lengths))
    return np.repeat(runs.owner, lengths), runs.times_s(logs)[index]


@dataclass(frozen=True)
class TokenStats:
    """What the results need of the token times, computed from runs (no per-token arrays)."""

    num_tokens: np.ndarray  # int64 per request
    first_token_s: np.ndarray  # NaN without tokens
    last_token_s: np.ndarray  # NaN without tokens
    max_gap_s: np.ndarray  # largest gap between consecutive tokens; NaN with fewer than two
    gaps: WeightedSample  # the gaps between consecutive tokens of every request, pooled


def token_stats(runs: TokenRuns, end_s: np.ndarray) -> TokenStats:
    """Per-request token figures and the pooled gaps, in O(iterations + runs) memory.

    Within a run the gaps are the differences of consecutive iteration ends: gap j (iteration
    j's end less iteration j-1's) belongs to the runs with start < j < end. Between two runs of
    a request the gap is from the end of the first's last iteration to the second's first."""
    n = len(runs.num_runs)
    has = runs.num_runs > 0
    first_run = runs.first_run
    last_run = first_run + runs.num_runs - 1
    lengths = runs.end - runs.start
    cum = np.concatenate([[0], np.cumsum(lengths)])
    num_tokens = (cum[first_run + runs.num_runs] - cum[first_run]).astype(np.int64)
    first_token = np.full(n, np.nan)
    last_token = np.full(n, np.nan)
    first_token[has] = end_s[runs.start[first_run[has]]]
    last_token[has] = end_s[runs.end[last_run[has]] - 1]

    # gap[j] = end_s[j] - end_s[j - 1]; gap[0] (no previous) and gap[T] (a sentinel, so that
    # run ends index inside the array) are never inside a range.
    num_iterations = len(end_s)
    gap = np.empty(num_iterations + 1)
    gap[0] = gap[-1] = -np.inf
    np.subtract(end_s[1:], end_s[:-1], out=gap[1:num_iterations])

    # Largest gap inside each run of two tokens or more: ranges [start + 1, end). reduceat
    # reduces every interleaved [start + 1, end) and [end, next start + 1) pair; sorted by
    # start, the second kind are disjoint, so the work is the tokens plus the iterations.
    run_max = np.full(len(lengths), -np.inf)
    long_runs = np.flatnonzero(lengths >= 2)
    if long_runs.size:
        long_runs = long_runs[np.argsort(runs.start[long_runs], kind="stable")]
        bounds = np.empty(2 * long_runs.size, dtype=np.int64)
        bounds[0::2] = runs.start[long_runs] + 1
        bounds[1::2] = runs.end[long_runs]
        run_max[long_runs] = np.maximum.reduceat(gap, bounds)[0::2]

    # Gaps between consecutive runs of one request (preempted, or moved between replicas).
    follows = np.flatnonzero(runs.owner[1:] == runs.owner[:-1]) + 1  # runs after another
    cross = end_s[runs.start[follows]] - end_s[runs.end[follows - 1] - 1]
    run_max[follows] = np.maximum(run_max[follows], cross)
    max_gap = np.full(n, np.nan)
    if has.any():
        found = np.maximum.reduceat(run_max, first_run[has])
        max_gap[has] = np.where(np.isfinite(found), found, np.nan)

    # Pooled: gap j counted once per run covering it (a difference array over the runs).
    covering = np.bincount(runs.start + 1, minlength=num_iterations + 2)
    covering -= np.bincount(runs.end, minlength=num_iterations + 2)
    np.cumsum(covering, out=covering)
    used = covering[:num_iterations] > 0
    num_used = int(np.count_nonzero(used))
    values = np.empty(num_used + len(cross))
    weights = np.ones(num_used + len(cross), dtype=np.int64)
    np.compress(used, gap[:num_iterations], out=values[:num_used])
    np.compress(used, covering[:num_iterations], out=weights[:num_used])
    values[num_used:] = cross
    gaps = WeightedSample(values, weights)
    return TokenStats(num_tokens, first_token, last_token, max_gap, gaps)


def request_table(requests: Sequence[Request], logs: Sequence[IterationLog],
                  runs: TokenRuns | None = None) -> tuple[Columns, WeightedSample]:
    """Per-request records with derived latencies, and the pooled TBT gaps of all requests
    (as distinct values with counts). `logs[i]` is replica i's. `runs`: the requests'
    `token_runs`, where the caller has them already."""
    if runs is None:
        runs = token_runs(requests, logs)
    tokens = token_stats(runs, runs.times_s(logs))
    # A run holds one token per iteration; speculative decoding samples more in some. (Its
    # counters read from the requests only where a replica decoded speculatively.)
    def ints(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    speculative = any(SPEC_COLUMN in log.columns for log in logs)
    counts = tokens.num_tokens
    if speculative:
        counts = counts + ints([r.num_extra_tokens for r in requests])
    first_token, last_token = tokens.first_token_s, tokens.last_token_s

    def floats(values: list[float | None]) -> np.ndarray:
        return np.array(values, dtype=np.float64)  # None as NaN

    arrival = floats([r.arrival_s for r in requests])
    first_scheduled = floats([r.first_scheduled_s for r in requests])
    finish = floats([r.finish_s for r in requests])
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(counts > 1, (last_token - first_token) / (counts - 1), np.nan)
    prefill_end = floats([r.prefill_end_s for r in requests])
    transfer_start = floats([r.transfer_start_s for r in requests])
    wire_start = floats([r.transfer_wire_start_s for r in requests])
    transfer_end = floats([r.transfer_end_s for r in requests])
    table: Columns = {
        "request_id": ints([r.request_id for r in requests]),
        "replica_id": ints([r.prefill_replica_id for r in requests]),
        "decode_replica_id": ints(
            [r.replica_id if r.transfer_end_s is not None else -1 for r in requests]),
        "arrival_s": arrival,
        "num_prompt_tokens": ints([r.num_prompt_tokens for r in requests]),
        "num_output_tokens": ints([r.num_target_output_tokens for r in requests]),
        "num_generated_tokens": counts.astype(np.int64),
        "first_scheduled_s": first_scheduled,
        "first_token_s": first_token,
        "finish_s": finish,
        "num_computed_tokens": ints([r.num_computed_tokens for r in requests]),
        "num_cached_tokens": ints([r.num_cached_tokens for r in requests]),
        "num_preemptions": ints([r.num_preemptions for r in requests]),
        "num_recomputed_tokens": ints([r.num_recomputed_tokens for r in requests]),
        "status": texts([STATUS[r.status] for r in requests]),
        "reason": texts([_reason(r.status, r.reason) for r in requests]),
        "scheduling_delay_s": first_scheduled - arrival,
        "ttft_s": first_token - arrival,
        "e2e_s": finish - arrival,
        "tpot_s": tpot,
        "max_tbt_s": tokens.max_gap_s,
        "prefill_end_s": prefill_end,
        "transfer_start_s": transfer_start,
        "transfer_wire_start_s": wire_start,  # its link free: the KV goes on the wire
        "transfer_end_s": transfer_end,
        "decode_wait_s": transfer_start - prefill_end,  # waiting for decode KV blocks
        "transfer_s": transfer_end - transfer_start,  # link queueing and wire time
        # Last: earlier columns keep their places.
        "failed_s": floats([r.failed_s for r in requests]),  # its client gave up (a timeout)
        # Speculative decoding: drafts verified, and accepted (0 without it).
        "num_drafts_verified": (ints([r.num_drafts_verified for r in requests])
                                if speculative else np.zeros(len(requests), dtype=np.int64)),
        "num_drafts_accepted": (ints([r.num_drafts_accepted for r in requests])
                                if speculative else np.zeros(len(requests), dtype=np.int64)),
    }
    return table, tokens.gaps


POOLS = ("colocated", "prefill", "decode")


def iteration_table(logs: Sequence[IterationLog], pools: Sequence[str]) -> Columns:
    """Every replica's iterations; `pools[i]` is replica i's. Each column is built once, the
    logs laid end to end (no table per replica, no second copy to join them)."""
    sizes = np.array([len(log) for log in logs], dtype=np.int64)
    codes = np.array([POOLS.index(pool) for pool in pools], dtype=np.int8)
    if len(codes) != len(sizes):
        raise ValueError(f"{len(logs)} logs but {len(pools)} pools")
    ends = np.cumsum(sizes)
    columns: Columns = {
        "replica_id": np.repeat(np.arange(len(logs), dtype=np.int64), sizes),
        "pool": Categorical(np.repeat(codes, sizes), POOLS),
        "iteration": np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        - np.repeat(ends - sizes, sizes),
    }
    arrays = [log.arrays() for log in logs]
    for name, code in COLUMNS.items():
        columns[name] = np.concatenate([a[name] for a in arrays]) if arrays else np.zeros(
            0, dtype=np.float64 if code == "d" else np.int64)
    for optional in (SPEC_COLUMN, ALL_TO_ALL_COLUMN):
        # (Where some replicas have it: a disaggregated cluster's decode pool verifies drafts,
        # its prefill pool none.)
        present = [a[optional] for a in arrays if optional in a]
        if present:
            columns[optional] = np.concatenate([
                a[optional] if optional in a else np.zeros(int(n), dtype=present[0].dtype)
                for a, n in zip(arrays, sizes, strict=True)])
    return columns


def token_table(requests: Sequence[Request], owner: np.ndarray, times: np.ndarray
                ) -> Columns:
    ids = np.array([r.request_id for r in requests], dtype=np.int64)
    counts = np.bincount(owner, minlength=len(requests))
    index = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return {"request_id": ids[owner], "token_index": index.astype(np.int64), "time_s": times}


# A request's status in the results: finished, rejected, failed (its client gave up), or
# unfinished (wherever it was).
STATUS = {status: status.value if status in (Status.FINISHED, Status.REJECTED, Status.FAILED)
          else UNFINISHED for status in Status}
# Why a request is unfinished at the horizon, by where it was.
AT_HORIZON = {Status.WAITING: "queued_at_horizon", Status.RUNNING: "running_at_horizon",
              Status.TRANSFERRING: "transferring_at_horizon"}
_FINISHED = Status.FINISHED  # an enum member read from its class costs a descriptor call


def _reason(status: Status, reason: str | None) -> str:
    """`kind: detail` (or just `kind`); empty for a finished request. Summaries group by kind."""
    if status is _FINISHED:
        return ""
    return reason or AT_HORIZON[status]
