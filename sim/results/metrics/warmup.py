"""Warm-up: where a run with generated arrivals leaves its start-up transient (MSER-5 on the
scheduling delay), and the headline distributions over the requests after it."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.results.columns import Table, column
from sim.results.metrics.arrived import arrived_latencies, arrived_mask, censored_distribution
from sim.results.metrics.overload import too_few
from sim.results.metrics.summary import distribution, never_arrived
from sim.workloads.base import ArrivalConfig

# Warm-up: MSER-5 on scheduling delay, for generated arrivals.

MSER_BATCH = 5  # observations per batch mean (MSER-5)
# The last batches are never chosen: MSER(d) falls to 0 at d = k - 1 and rests on a few batch
# means near it, so a quiet stretch at the end of a spiky series (scheduling delays: mostly
# small, with bursts) wins by chance. Left out: the last 5% of batches, at least 5 (kim-
# convergence's `mser_m` leaves out 5 by default; with 5 only, stable runs of the default
# scenario were found without steady state for 3 seeds in 10, with 5% for 1).
MSER_IGNORE_END_MIN = 5
MSER_IGNORE_END_FRACTION = 0.05
MIN_REQUESTS_FOR_WARMUP = 50  # 10 batches
# The distributions reported trimmed: summary key -> request column (finished requests).
TRIMMED = {"ttft_s": "ttft_s", "e2e_s": "e2e_s", "scheduling_delay_s": "scheduling_delay_s",
           "max_tbt_per_request_s": "max_tbt_s", "tpot_s": "tpot_s"}


def mser(series: np.ndarray, batch: int = MSER_BATCH, ignore_end: int | None = None
         ) -> tuple[int, int]:
    """MSER-m truncation (White 1997; MSER-5 with batch = 5, Spratt 1998, Franklin & White
    2008): (d*, k), the batch index d* minimising the MSER statistic, and the number of
    batches k.

    The series (n observations) becomes k = n // batch batch means Z_0..Z_{k-1} of consecutive
    observations (the last n % batch dropped). For each truncation d,
        MSER(d) = 1 / (k - d)**2 * sum_{j >= d} (Z_j - mean(Z_d..Z_{k-1}))**2,
    the squared half-width of the mean's marginal confidence interval after dropping the
    first d batches. d* = argmin over 0 <= d < k - ignore_end (the first minimum on ties; the
    last batches are left out, by default the last 5% and at least 5: the statistic falls to 0
    at d = k - 1). The caller accepts d* (truncating d* * batch observations) when it lies in
    the first half, d* <= k / 2; in the second half, no steady state was found (the run is too
    short, or still changing)."""
    k = len(series) // batch
    if k == 0:
        return 0, 0
    if ignore_end is None:
        ignore_end = max(MSER_IGNORE_END_MIN, int(MSER_IGNORE_END_FRACTION * k))
    z = np.asarray(series[:k * batch], dtype=np.float64).reshape(k, batch).mean(axis=1)
    z = z - z.mean()  # the statistic is shift-invariant; centred sums lose fewer digits
    remaining = np.arange(k, 0, -1, dtype=np.float64)  # k - d
    tail_sum = np.cumsum(z[::-1])[::-1]
    tail_sq = np.cumsum((z * z)[::-1])[::-1]
    stat = (tail_sq - tail_sum**2 / remaining) / remaining**2
    last = max(k - ignore_end, 1)
    return int(np.argmin(stat[:last])), k


def generated_arrivals(workload: Any, clients: Any = None) -> bool:
    """Arrivals drawn from a process (synthetic, lengths, prefix, csv/jsonl with `arrivals`, a
    trace `retime`d), or sent by unpaced clients (a closed loop starts empty), rather than
    replayed from a trace."""
    if clients is not None and not clients.paced:
        return True
    return isinstance(getattr(workload, "arrivals", None), ArrivalConfig) or isinstance(
        getattr(workload, "retime", None), ArrivalConfig)


def warmup_stats(requests: Table, end_s: float, verdict: dict[str, Any],
                 generated: bool, warmup_requests: int = 0) -> dict[str, Any]:
    """`warmup` (where the run's start-up transient ends), `trimmed` (the headline
    distributions over the finished requests arriving after it; None where no warm-up is
    assumed or no steady state was found) and `overload` (`verdict`, with a line added when no
    steady state was found; `verdict` itself is left as it is).

    With generated arrivals the run starts with empty queues, not in its steady state: MSER-5
    (`mser`) on the scheduling delay of the arrived requests (`arrived_mask`) in arrival
    order, a request never scheduled counted at its time so far, finds how many to trim. A
    trace's start is its own (replayed as it was, no warm-up assumed): nothing is trimmed.

    No steady state when the overload verdict says `overloaded`, or MSER-5's truncation lands
    in the second half with delays no lower after it (a late cut after which delays are lower
    follows bursts, not a start-up that has not ended: a run starting empty warms up from
    below; it is steady then, nothing trimmed; not so with a prefix cache, which starts cold
    and warms up from above); the latter, for a run not found overloaded, is
    added to the verdict's detail and `steady_state: false`, without changing the verdict: the
    slope test on the queues decides overload (calibrated: a growth of 1% of arrivals, 3
    standard errors), and a late truncation also comes from slow swings of a loaded but stable
    queue: it says to run longer, not that the system cannot keep up.

    `warmup_requests` (clients' `warmup_requests`) > 0: the first that many requests sent are
    trimmed, as a benchmark leaves its warm-up requests out, whatever MSER-5 would say."""
    if warmup_requests:
        return _fixed_warmup(requests, end_s, verdict, warmup_requests)
    info: dict[str, Any] = {"method": "MSER-5", "applies": generated,
                            "steady_state": None, "num_trimmed_requests": None,
                            "trimmed_until_s": None}
    out: dict[str, Any] = {"warmup": info, "trimmed": None, "overload": verdict}
    if not generated:
        info["reason"] = ("replayed trace: its start is its own (no warm-up assumed); nothing "
                          "trimmed")
        return out
    arrived = arrived_mask(requests)
    arrival = column(requests, "arrival_s")[arrived]
    latencies = arrived_latencies(requests, end_s, arrived)
    delay, _ = latencies["scheduling_delay_s"]
    order = np.argsort(arrival, kind="stable")
    n = len(order)
    info["num_requests"] = n
    if n < MIN_REQUESTS_FOR_WARMUP:
        info["reason"] = too_few(requests, MIN_REQUESTS_FOR_WARMUP)
        return out
    series = delay[order]
    d, k = mser(series)
    cut = d * MSER_BATCH
    info["mser_truncation_requests"] = cut
    late = d > k / 2
    # Prefix caches start cold: their runs warm up from above (hits shorten prefills).
    cold_start = bool((column(requests, "num_cached_tokens") > 0).any()) \
        if "num_cached_tokens" in requests else False
    if late and not cold_start and series[:cut].mean() > series[cut:].mean():
        # A run starting empty, with nothing to warm but its queues, warms up from below:
        # delays rise to their steady level. A late cut after which delays are lower follows
        # bursts in the run's first part (the statistic takes them for a transient), not a
        # start-up that has not ended: steady, nothing to trim. (An early cut of that kind is
        # still taken, as MSER-5 says.)
        info["mser_cut_after_bursts"] = True
        late = False
        cut = 0
    if verdict.get("verdict") == "overloaded":
        info["steady_state"] = False
        info["reason"] = "overloaded: queues grow, latencies have no steady state"
        return out
    if late:
        info["steady_state"] = False
        info["reason"] = (f"no steady state: MSER-5 truncates at request {cut} of {n}, in the "
                          "second half (run longer)")
        out["overload"] = {**verdict, "steady_state": False,
                           "detail": f"{verdict.get('detail', '')}; {info['reason']}"}
        return out
    info["steady_state"] = True
    info["num_trimmed_requests"] = cut
    info["trimmed_until_s"] = float(arrival[order[cut]])
    info["reason"] = (f"MSER-5 on scheduling delay trims the first {cut} of {n} arrived "
                      "requests")
    if info.get("mser_cut_after_bursts"):
        info["reason"] = (f"no start-up transient: MSER-5's cut at request "
                          f"{info['mser_truncation_requests']} of {n} (second half) follows "
                          "bursts, delays being lower after it (a run starting empty warms "
                          "up from below); nothing trimmed")
    out["trimmed"] = _trimmed(requests, arrived, order[cut:], latencies)
    return out


def _fixed_warmup(requests: Table, end_s: float, verdict: dict[str, Any], num_warmup: int
                  ) -> dict[str, Any]:
    """The first `num_warmup` requests sent (rejected ones too: a benchmark counts what it
    sent) are the warm-up (`warmup_stats`)."""
    sent = ~never_arrived(requests)
    arrival = column(requests, "arrival_s")
    order_sent = np.flatnonzero(sent)[np.argsort(arrival[sent], kind="stable")]
    n = len(order_sent)
    cut = min(num_warmup, n)
    info: dict[str, Any] = {
        "method": "clients.warmup_requests", "applies": True,
        "steady_state": None if verdict.get("verdict") != "overloaded" else False,
        "num_requests": n, "num_trimmed_requests": cut,
        "trimmed_until_s": float(arrival[order_sent[cut]]) if cut < n else None,
        "reason": f"the first {cut} of {n} requests sent are warm-up (clients.warmup_requests: "
                  f"{num_warmup})"}
    out: dict[str, Any] = {"warmup": info, "trimmed": None, "overload": verdict}
    warm = np.zeros(len(sent), dtype=bool)
    warm[order_sent[:cut]] = True
    arrived = arrived_mask(requests)
    if (arrived & ~warm).any():
        # The arrived requests after the warm-up, as arrival ranks among the arrived.
        arrived_rows = np.flatnonzero(arrived)
        order = np.argsort(arrival[arrived], kind="stable")
        rest = order[~warm[arrived_rows[order]]]
        latencies = arrived_latencies(requests, end_s, arrived)
        out["trimmed"] = _trimmed(requests, arrived, rest, latencies)
    return out


def _trimmed(requests: Table, arrived: np.ndarray, after: np.ndarray,
             latencies: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The headline distributions over the arrived requests at positions `after` (of the
    arrived ones, in frame order): the finished among them, and all of them with lower bounds
    where unfinished."""
    kept = np.zeros(len(arrived), dtype=bool)
    kept[np.flatnonzero(arrived)[after]] = True
    kept &= column(requests, "status") == "finished"
    trimmed = {key: {**distribution(column(requests, col)[kept]),
                     "population": "finished, after warm-up"}
               for key, col in TRIMMED.items()}
    # And over every request arriving after the cut, one not there yet at the end counted at
    # its time so far (a lower bound), as `*_all_arrived_s` are for the whole run.
    for key, (values, censored) in latencies.items():
        trimmed[f"{key.removesuffix('_s')}_all_arrived_s"] = {
            **censored_distribution(values[after], censored[after]),
            "population": "arrived, after warm-up"}
    return trimmed
