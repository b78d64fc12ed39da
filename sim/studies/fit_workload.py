"""A generator fitted to a trace (`servesim fit-workload`): a `synthetic` workload whose
arrivals (Poisson, or gamma with the trace's burstiness: the coefficient of variation of its
gaps) and lengths (the trace's percentiles of prompt and output tokens, and their rank
correlation through a Gaussian copula) reproduce the trace's statistics at any rate and
length, with how close the fit is.

The fit says what it keeps and what it loses: the two-sample Kolmogorov-Smirnov distance
between the trace and a draw of the generator (as many requests, the scenario's seed) for the
prompt lengths, the output lengths and the gaps between arrivals; the burstiness (1 for
Poisson) and the rank correlation of prompt and output lengths on both sides; and, where the
trace has prefix ids, the share of prompt blocks a request shares with an earlier one, which
the generator does not make (`retime` the trace to keep them). Arrivals are renewal: a trace's
slow swings of rate (its busy hour) are not kept, only its mean rate and its gaps' spread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.workloads.load import load_workload

MIN_REQUESTS = 20  # fewer cannot tell a distribution's shape
POISSON_CV_TOLERANCE = 0.1  # gaps' CV within this of 1: Poisson
NUM_QUANTILES = 101  # the percentiles a fitted length distribution keeps


@dataclass(frozen=True)
class Fit:
    """The fitted workload (a `synthetic` mapping) and the fit's report."""

    workload: dict[str, Any]
    report: dict[str, Any]


def fit_workload(scenario: Scenario) -> Fit:
    """Fit a generator to `scenario`'s workload (as selected: window, `where`, first N)."""
    trace = load_workload(scenario)
    n = len(trace)
    if n < MIN_REQUESTS:
        raise InputError(scenario.source, "workload", scenario.workload.format,
                         f"{n} requests: at least {MIN_REQUESTS} are needed to fit lengths and "
                         "arrivals")
    gaps = np.diff(trace.arrival_s)
    span_s = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if span_s <= 0:
        raise InputError(scenario.source, "workload", scenario.workload.format,
                         "every request arrives at once: no arrival rate to fit")
    qps = (n - 1) / span_s
    cv = float(gaps.std() / gaps.mean())
    arrivals: dict[str, Any] = {"process": "poisson", "qps": qps}
    if abs(cv - 1.0) > POISSON_CV_TOLERANCE:
        arrivals = {"process": "gamma", "qps": qps, "cv": min(max(cv, 1e-3), 1e3)}
    lengths: dict[str, Any] = {"prompt": _empirical(trace.num_prompt_tokens),
                               "output": _empirical(trace.num_output_tokens)}
    correlation = rank_correlation(trace.num_prompt_tokens, trace.num_output_tokens)
    if correlation is not None:
        lengths["rank_correlation"] = round(correlation, 4)
    workload = {"format": "synthetic", "num_requests": n, "arrivals": arrivals,
                "lengths": lengths}
    if scenario.workload.timeout_s is not None:  # the client's, not the trace's: kept
        workload["timeout_s"] = scenario.workload.timeout_s
    drawn = load_workload(scenario.model_validate(
        {**scenario.model_dump(), "workload": workload}))
    report = {
        "num_requests": n, "span_s": span_s,
        "ks": {"prompt_tokens": ks_distance(trace.num_prompt_tokens, drawn.num_prompt_tokens),
               "output_tokens": ks_distance(trace.num_output_tokens, drawn.num_output_tokens),
               "gap_s": ks_distance(gaps, np.diff(drawn.arrival_s))},
        "burstiness_cv": {"trace": cv, "fitted": float(np.diff(drawn.arrival_s).std()
                                                        / np.diff(drawn.arrival_s).mean())},
        "length_rank_correlation": {
            "trace": correlation,
            "fitted": rank_correlation(drawn.num_prompt_tokens, drawn.num_output_tokens)},
        "prefix_block_reuse": (None if trace.hash_ids is None
                               else block_reuse(trace.hash_ids)),
        "sessions": (None if trace.hash_ids is None
                     else session_shape(trace.hash_ids, trace.arrival_s)),
    }
    return Fit(workload, report)


def _empirical(tokens: np.ndarray) -> dict[str, Any]:
    """The trace's percentiles (0 to 100) as an empirical distribution; fixed where every value
    is one."""
    low, high = int(tokens.min()), int(tokens.max())
    if low == high:
        return {"dist": "fixed", "value": low}
    quantiles = np.quantile(tokens.astype(np.float64), np.linspace(0, 1, NUM_QUANTILES))
    return {"dist": "empirical", "quantiles": [round(float(q), 1) for q in quantiles]}


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical
    CDFs of `a` and `b`."""
    a, b = np.sort(a), np.sort(b)
    values = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, values, side="right") / len(a)
    cdf_b = np.searchsorted(b, values, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None where one is constant."""
    from scipy.stats import spearmanr

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def block_reuse(hash_ids: list[tuple[int, ...]]) -> float:
    """The share of prompt blocks (prefix ids) that an earlier request had at the same place
    after the same blocks: what a prefix cache with room for everything could reuse."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node: a prefix tree
    total = reused = 0
    for ids in hash_ids:
        node, shared = 0, True
        for block in ids:
            key = (node, block)
            child = nodes.get(key)
            if child is None:
                shared = False
                child = nodes[key] = len(nodes) + 1
            reused += shared
            node = child
        total += len(ids)
    return reused / total if total else 0.0


def session_shape(hash_ids: list[tuple[int, ...]], arrival_s: np.ndarray) -> dict[str, Any]:
    """What a trace's prefix ids say of its sessions: request j continues request i (earlier)
    when j's ids start with all of i's but its last (a part-block, which grows), i brought
    full blocks of its own (not only shared ones), and j goes on past them; the deepest such
    i. Returns the share of requests that continue one, turns per
    session (P50, max) and the gap between a turn's arrival and its continuation's (P50): what
    a `prefix` workload's `num_turns` and `think_time_s` would be set from."""
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
        # Only a request that brought full blocks of its own can be continued: one made of
        # shared blocks only (a common system prompt) is a prefix of many, not a turn of one.
        if len(ids) >= 2 and new:
            ends[(last_full, -1)] = j
    turns = np.ones(len(hash_ids), dtype=np.int64)
    for j in range(len(hash_ids)):
        if before[j] >= 0:
            turns[j] = turns[before[j]] + 1
    is_last = np.ones(len(hash_ids), dtype=bool)
    is_last[before[before >= 0]] = False
    continued = before >= 0
    gaps = arrival_s[continued] - arrival_s[before[continued]]
    return {"continuing_share": float(continued.mean()),
            "turns_p50": float(np.median(turns[is_last])), "turns_max": int(turns.max()),
            "gap_between_turns_p50_s": float(np.median(gaps)) if gaps.size else None}
