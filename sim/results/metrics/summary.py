"""Summary metrics: pure functions of a run's tables (its `Columns`, or DataFrames read back)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from sim.config.slo import SLOConfig
from sim.results.columns import Columns, Table, column, num_rows

if TYPE_CHECKING:
    from sim.core.kv_cache import KVCacheManager

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class WeightedSample:
    """A sample kept as values with counts: `values[i]` occurs `counts[i]` times (the pooled
    TBT gaps, whose expansion would hold one entry per generated token)."""

    values: np.ndarray  # float64
    counts: np.ndarray  # int64, >= 0

    @classmethod
    def of(cls, values: ArrayLike | WeightedSample) -> WeightedSample:
        if isinstance(values, WeightedSample):
            return values
        arr = np.asarray(values, dtype=np.float64)
        return cls(arr, np.ones(arr.shape, dtype=np.int64))

    @property
    def size(self) -> int:
        return int(self.counts.sum())

    @cached_property
    def distinct(self) -> WeightedSample:
        """The same sample as its distinct values, ascending, each with its total count (those
        counted zero times left out); NaNs, if any, as one value at the end. Kept once made:
        the summary's percentiles and the gaps' file both read it (sorting a million gaps
        twice cost a fifth of a run's summary and files)."""
        values, inverse = np.unique(np.asarray(self.values, dtype=np.float64),
                                    return_inverse=True)
        counts = np.bincount(inverse, weights=self.counts, minlength=len(values))
        keep = counts > 0
        return WeightedSample(values[keep], counts[keep].astype(np.int64))

    def fraction_at_most(self, limit: float) -> float | None:
        """Share of the sample <= limit, as `(expanded <= limit).mean()` gives it."""
        total = self.size
        return int(self.counts[self.values <= limit].sum()) / total if total else None


def distribution(values: ArrayLike | WeightedSample) -> dict[str, float | int | None]:
    """Count, mean, P50/P90/P99 and max of the finite values (None where there are none).

    A `WeightedSample` gives what its expansion would: the same count, percentiles and max
    (numpy's default 'linear' percentiles, exactly), and the mean up to rounding (summed as
    value times count, not one value at a time)."""
    if isinstance(values, WeightedSample):
        return _weighted_distribution(values)
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None})
        return out
    out["mean"] = float(arr.mean())
    for p, q in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = float(q)
    out["max"] = float(arr.max())
    return out


def _weighted_distribution(sample: WeightedSample) -> dict[str, float | int | None]:
    values = np.asarray(sample.values, dtype=np.float64)
    counts = np.asarray(sample.counts, dtype=np.int64)
    keep = np.isfinite(values) & (counts > 0)
    if not keep.all():
        values, counts = values[keep], counts[keep]
    del keep
    total = int(counts.sum())
    out: dict[str, float | int | None] = {"count": total}
    if total == 0:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None})
        return out
    # Summed in the sample's own order: the distinct values' sum may round differently.
    out["mean"] = float((values * counts).sum() / total)
    # Order statistics of the distinct values with their counts are those of the sample.
    distinct = sample.distinct
    finite = np.isfinite(distinct.values)
    values, counts = distinct.values[finite], np.cumsum(distinct.counts[finite])
    for p, q in zip(PERCENTILES, weighted_percentile(values, counts, PERCENTILES),
                    strict=True):
        out[f"p{p}"] = float(q)
    out["max"] = float(values[-1])
    return out


def weighted_percentile(sorted_values: np.ndarray, cumulative_counts: np.ndarray,
                        percentiles: Sequence[float]) -> np.ndarray:
    """`np.percentile(expanded, percentiles)` (method 'linear') of the sample in which
    `sorted_values[i]` (ascending) occurs `cumulative_counts[i] - cumulative_counts[i - 1]`
    times, without expanding it: the same order statistics, interpolated by the same float
    operations (numpy/lib/_function_base_impl.py: `_quantile`, `_get_indexes`, `_lerp`)."""
    n = int(cumulative_counts[-1])
    quantiles = np.true_divide(np.asarray(percentiles), 100)
    virtual = (n - 1) * quantiles
    previous = np.floor(virtual)
    following = previous + 1
    above = virtual >= n - 1  # numpy takes the largest value (index -1) for both
    previous[above] = -1
    following[above] = -1
    below = virtual < 0
    previous[below] = 0
    following[below] = 0
    gamma = virtual - previous.astype(np.intp)

    def order_statistic(index: np.ndarray) -> np.ndarray:
        position = np.where(index < 0, n + index, index).astype(np.int64)
        return sorted_values[np.searchsorted(cumulative_counts, position, side="right")]

    a, b = order_statistic(previous), order_statistic(following)
    diff_b_a = b - a
    result = np.add(a, diff_b_a * gamma)
    np.subtract(b, diff_b_a * (1 - gamma), out=result, where=gamma >= 0.5)
    return result


# The request columns that the summary's distributions read, of finished requests only.
FINISHED_COLUMNS = ["ttft_s", "max_tbt_s", "tpot_s", "e2e_s", "scheduling_delay_s"]


FINISHED = "finished"  # the population of the headline distributions
STALLED = "engine_stalled"  # the reason kind of requests a replica that stopped for good left


def finished_distribution(values: np.ndarray) -> dict[str, Any]:
    """`distribution` of finished requests' values, saying so (`population: finished`): with a
    horizon or rejections that is not every request (see `arrived_stats`)."""
    return {**distribution(values), "population": FINISHED}


def summarize(requests: Table, iterations: Table | int,
              tbt_gaps_s: np.ndarray | WeightedSample, slo: SLOConfig) -> dict[str, Any]:
    """Latency distributions, throughput, outcome counts and SLO attainment of one run.
    `iterations`: the iteration frame, or just its length; `tbt_gaps_s`: every gap between
    consecutive tokens of a request, pooled (or as values with counts). The per-request
    distributions are over finished requests (`population: finished`); `arrived_stats` adds
    them over every arrived request, and `warmup_stats` trimmed of the start-up transient."""
    status = column(requests, "status")
    done = status == FINISHED
    # Only the columns it reads, of finished requests (not a copy of the whole table).
    finished = {col: column(requests, col)[done] for col in FINISHED_COLUMNS}
    num_finished = int(done.sum())
    end_s = float(np.nanmax(column(requests, "finish_s"))) if num_finished else 0.0
    if "failed_s" in requests:  # a failed request's end counts, as a benchmark client's does
        failed_s = column(requests, "failed_s")
        if np.isfinite(failed_s).any():
            end_s = max(end_s, float(np.nanmax(failed_s)))
    start_s = float(column(requests, "arrival_s").min()) if len(status) else 0.0
    span_s = max(end_s - start_s, 0.0)
    counts = Counter(status.tolist())
    # Reasons are `kind: detail`; count them by kind (one key per kind, not per number).
    all_reasons = column(requests, "reason").tolist()
    reason_kinds = [reason.split(":", 1)[0] for reason in all_reasons]
    reasons = Counter(kind for kind in reason_kinds if kind)
    rejected_reasons = Counter(kind for kind, s in zip(reason_kinds, status.tolist(), strict=True)
                               if kind and s == "rejected")
    return {
        "requests": {
            "total": len(status),
            "finished": int(counts.get("finished", 0)),
            "rejected": int(counts.get("rejected", 0)),
            "failed": int(counts.get("failed", 0)),
            "unfinished": int(counts.get("unfinished", 0)),
            "reasons": {str(k): int(v) for k, v in sorted(reasons.items())},
            "rejected_reasons": {str(k): int(v) for k, v in sorted(rejected_reasons.items())},
            # Why a replica stopped for good, where one did (the first such reason in full).
            **({"stalled": next(r for r in all_reasons if r.startswith(STALLED))}
               if STALLED in reasons else {}),
        },
        "ttft_s": finished_distribution(finished["ttft_s"]),
        "tbt_s": distribution(tbt_gaps_s),
        "max_tbt_per_request_s": finished_distribution(finished["max_tbt_s"]),
        "tpot_s": finished_distribution(finished["tpot_s"]),
        "e2e_s": finished_distribution(finished["e2e_s"]),
        "scheduling_delay_s": finished_distribution(finished["scheduling_delay_s"]),
        "throughput": {
            "span_s": span_s,
            "requests_per_s": num_finished / span_s if span_s > 0 else None,
            "output_tokens_per_s": (
                float(column(requests, "num_generated_tokens").sum()) / span_s
                if span_s > 0 else None
            ),
        },
        "num_iterations": iterations if isinstance(iterations, int) else num_rows(iterations),
        "num_preemptions": int(column(requests, "num_preemptions").sum()),
        "slo": slo_attainment(requests, tbt_gaps_s, slo),
    }


# Reason kinds of requests that never arrived: after the run's horizon, after an interrupted
# replay stopped, or a session's turn whose turn before got no answer. They are in the results
# (nothing is lost) but were never offered to a server.
NEVER_ARRIVED = ("after_horizon", "after_stop", "abandoned", "after_duration")


def never_arrived(requests: Table) -> np.ndarray:
    """The requests whose arrival time the run never reached (`NEVER_ARRIVED`)."""
    reasons = column(requests, "reason").tolist()
    return np.fromiter((reason.startswith(NEVER_ARRIVED) for reason in reasons), dtype=bool,
                       count=len(reasons))


def slo_attainment(requests: Table, tbt_gaps_s: np.ndarray | WeightedSample,
                   slo: SLOConfig) -> dict[str, float | None]:
    """Fraction of the requests that arrived meeting each target; one not finished (rejected,
    or unfinished at the end) meets none. Requests the run never reached (after its horizon,
    or after an interrupted replay stopped) were never offered: they do not count."""
    gaps = (WeightedSample.of(tbt_gaps_s).fraction_at_most(slo.tbt_s)
            if slo.tbt_s is not None else None)
    return attainment(requests, slo.ttft_s, slo.tbt_s, gaps)


def attainment(requests: Table, ttft_s: float | np.ndarray | None,
               tbt_s: float | np.ndarray | None, tbt_gap_attainment: float | None
               ) -> dict[str, float | None]:
    """`slo_attainment` for targets given as one number or one per request (inf: none for
    that request; None: no target at all), with the gaps' share already found."""
    offered = ~never_arrived(requests)
    finished = (column(requests, "status") == FINISHED)[offered]
    if len(finished) == 0:
        return {}
    ok = finished.copy()
    out: dict[str, float | None] = {}
    if ttft_s is not None:
        target = ttft_s[offered] if isinstance(ttft_s, np.ndarray) else ttft_s
        ttft_ok = finished & (column(requests, "ttft_s")[offered] <= target)
        out["ttft_attainment"] = float(ttft_ok.mean())
        ok &= ttft_ok
    if tbt_s is not None:
        target = tbt_s[offered] if isinstance(tbt_s, np.ndarray) else tbt_s
        worst = column(requests, "max_tbt_s")[offered]
        tbt_ok = finished & ~(worst > target)  # a one-token request has no gap: it meets it
        out["tbt_attainment"] = float(tbt_ok.mean())
        out["tbt_gap_attainment"] = tbt_gap_attainment
        ok &= tbt_ok
    if out:
        out["all_attainment"] = float(ok.mean())
    return out


def replica_stats(iterations: Table, num_kv_blocks: dict[int, int], end_s: float
                  ) -> list[dict[str, Any]]:
    """Per replica: iterations, busy fraction of the run [0, end_s], queue length and KV
    utilisation over its iterations (time-weighted: what an iteration logged holds until it
    ends, or until the next starts if that is sooner, as on a pipelined replica)."""
    # Each replica's rows as slices of the columns read (the table's rows come grouped by
    # replica; otherwise they are grouped here, in order within each replica).
    replica_id = column(iterations, "replica_id")
    names = ["start_s", "duration_s", "num_kv_blocks_used", "num_waiting"]
    columns = {name: column(iterations, name) for name in names + ["pool"]}
    if (replica_id[1:] < replica_id[:-1]).any():
        order = np.argsort(replica_id, kind="stable")
        replica_id = replica_id[order]
        columns = {name: col[order] for name, col in columns.items()}
    out = []
    for replica_id_ in sorted(num_kv_blocks):
        lo, hi = np.searchsorted(replica_id, [replica_id_, replica_id_ + 1])
        n = int(hi - lo)
        duration = columns["duration_s"][lo:hi]
        # The time covered by at least one iteration within the run, so busy fraction <= 1: a
        # pipelined replica's iterations overlap (each starts before the one ahead ends; they
        # end in order), so each counts only from where the one before it ended.
        start = columns["start_s"][lo:hi]
        end = start + duration
        covered_from = np.concatenate((start[:1], np.maximum(start[1:], end[:-1])))
        busy_s = float((np.minimum(end, end_s) - np.minimum(covered_from, end_s)).sum())
        # Queue and KV as logged by each iteration hold until the next one starts: a pipelined
        # iteration weighs only until the next is sent, so overlapping passes count time once.
        # Back-to-back iterations weigh their durations, as the numbers were before pipelines.
        held = duration.copy()
        overlap = start[1:] < end[:-1]
        held[:-1][overlap] = (start[1:] - start[:-1])[overlap]
        weights = held / held.sum() if held.sum() > 0 else np.ones_like(held)
        kv = columns["num_kv_blocks_used"][lo:hi] / num_kv_blocks[replica_id_]
        waiting = columns["num_waiting"][lo:hi]
        out.append({
            "replica_id": replica_id_,
            "pool": str(columns["pool"][lo]) if n else None,
            "num_iterations": n,
            "busy_fraction": busy_s / end_s if end_s > 0 else None,
            "mean_queue_length": float((waiting * weights).sum()) if n else None,
            "max_queue_length": int(waiting.max()) if n else 0,
            "mean_kv_utilization": float((kv * weights).sum()) if n else None,
            "max_kv_utilization": float(kv.max()) if n else None,
        })
    return out


def pool_stats(replicas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pool (colocated, prefill, decode): its replicas' figures averaged, maxima kept."""
    out: dict[str, dict[str, Any]] = {}
    for pool in sorted({r["pool"] for r in replicas if r["pool"] is not None}):
        members = [r for r in replicas if r["pool"] == pool]

        def mean(key: str, members: list[dict[str, Any]] = members) -> float | None:
            values = [r[key] for r in members if r[key] is not None]
            return float(np.mean(values)) if values else None

        out[pool] = {
            "num_replicas": len(members),
            "num_iterations": sum(r["num_iterations"] for r in members),
            "mean_busy_fraction": mean("busy_fraction"),
            "mean_queue_length": mean("mean_queue_length"),
            "max_queue_length": max(r["max_queue_length"] for r in members),
            "mean_kv_utilization": mean("mean_kv_utilization"),
            "max_kv_utilization": max((r["max_kv_utilization"] or 0.0) for r in members),
        }
    return out


def transfer_stats(requests: Table) -> dict[str, Any]:
    """Disaggregated serving: how long KV waited for decode capacity and how long it moved."""
    return {"decode_wait_s": distribution(column(requests, "decode_wait_s")),
            "transfer_s": distribution(column(requests, "transfer_s"))}


def prefix_cache_stats(requests: Table, kvs: Sequence[KVCacheManager]) -> dict[str, Any]:
    """Hit rates over the requests that were admitted (their prompt tokens, and how many of
    them hit at all), and what eviction took."""
    admitted = ~np.isnan(column(requests, "first_scheduled_s"))
    prompt = column(requests, "num_prompt_tokens")[admitted]
    cached = column(requests, "num_cached_tokens")[admitted]
    num_prompt = int(prompt.sum())
    num_cached = int(cached.sum())
    num_evicted = sum(kv.num_evicted_blocks for kv in kvs)
    return {
        "hit_rate_tokens": num_cached / num_prompt if num_prompt else None,
        "hit_rate_requests": float((cached > 0).mean()) if len(cached) else None,
        "num_cached_tokens": num_cached,
        "num_evicted_blocks": num_evicted,
        "num_evicted_tokens": num_evicted * kvs[0].block_size,
    }


def gap_table(gaps: WeightedSample) -> Columns:
    """The pooled TBT gaps as distinct values with their counts, sorted: a file of at most one
    row per iteration, where one row per token would be 200 million for a million requests."""
    distinct = WeightedSample.of(gaps).distinct  # made once: the summary read it first
    return {"gap_s": distinct.values, "count": distinct.counts}
