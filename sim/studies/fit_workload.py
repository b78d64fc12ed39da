"""A generator fitted to a trace (`servesim fit-workload`) that reproduces the trace's
statistics at any rate and length, with how close the fit is.

A trace without sessions becomes a `synthetic` workload: arrivals Poisson, gamma with the
trace's burstiness (the coefficient of variation of its gaps) or, where neither fits the gaps
(KS distance above MAX_RENEWAL_KS: a trace sending in bursts at one instant), the trace's own
gaps (`empirical`), at its mean rate; lengths as the trace's percentiles with their rank
correlation (a Gaussian copula). A trace whose prefix ids show sessions (requests continuing
earlier ones: `continuations`) becomes a `prefix` workload: conversations starting as the
trace's sessions start (the same arrival fit), the trace's turns per session, first messages,
follow-up messages and answers, a shared system prompt as long as its sessions' common
leading blocks, and the think time between turns; so the prefix cache meets the trace's
reuse, within what one system prompt and linear sessions can make.

The fit says what it keeps and what it loses: the two-sample Kolmogorov-Smirnov distance
between the trace and a draw of the generator (as many requests, the scenario's seed) for
prompt lengths, output lengths and gaps between arrivals; burstiness and rank correlation on
both sides; and, with prefix ids, the share of prompt blocks reused and the sessions' shape
on both sides. Arrivals are renewal: a trace's slow swings of rate (its busy hour) are not
kept, only its mean rate and its gaps' distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.workloads.load import load_workload
from sim.workloads.sessions import chains, continuations

MIN_REQUESTS = 20  # fewer cannot tell a distribution's shape
POISSON_CV_TOLERANCE = 0.1  # gaps' CV within this of 1: Poisson
NUM_QUANTILES = 101  # the percentiles a fitted distribution keeps
# Turns per session: few values, most sessions 1 turn; linear between percentiles, the last
# 1% (7 to 43 turns on Mooncake) would be drawn evenly, and its long sessions double the
# prompts of later turns. Per mille, the tail is drawn as the trace has it.
NUM_TURN_QUANTILES = 1001
# A Poisson or gamma process whose gap distribution is further than this (KS) from the
# trace's gaps does not describe them: the trace's own gaps are kept instead. Poisson and
# gamma fit the Azure traces within 0.025; Mooncake's ticks (89% of gaps 0) are 0.86 away.
MAX_RENEWAL_KS = 0.05
# Sessions are fitted where at least this share of requests continues an earlier one.
MIN_CONTINUING_SHARE = 0.02


@dataclass(frozen=True)
class Fit:
    """The fitted workload (a `synthetic` or `prefix` mapping) and the fit's report."""

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
    span_s = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if span_s <= 0:
        raise InputError(scenario.source, "workload", scenario.workload.format,
                         "every request arrives at once: no arrival rate to fit")
    before = (None if trace.hash_ids is None
              else continuations(trace.hash_ids, trace.num_prompt_tokens))
    if before is not None and (before >= 0).mean() >= MIN_CONTINUING_SHARE:
        starts_s = trace.arrival_s[before < 0]
        if len(starts_s) < 2 or not starts_s[-1] > starts_s[0]:
            raise InputError(scenario.source, "workload", scenario.workload.format,
                             f"its {len(starts_s)} session(s) all start at one instant: no "
                             "rate of sessions to fit")
        workload = _fit_sessions(trace, before)
    else:
        lengths: dict[str, Any] = {"prompt": _empirical(trace.num_prompt_tokens),
                                   "output": _empirical(trace.num_output_tokens)}
        correlation = rank_correlation(trace.num_prompt_tokens, trace.num_output_tokens)
        if correlation is not None:
            lengths["rank_correlation"] = round(correlation, 4)
        workload = {"format": "synthetic", "num_requests": n,
                    "arrivals": fit_arrivals(trace.arrival_s), "lengths": lengths}
    if scenario.workload.timeout_s is not None:  # the client's, not the trace's: kept
        workload["timeout_s"] = scenario.workload.timeout_s
    drawn = _draw(scenario, workload)
    if workload["format"] == "prefix":
        drawn = _match_turn_gaps(scenario, workload, trace, drawn)
    gaps = np.diff(trace.arrival_s)
    # Sessions go on past the span their starts take (the trace, a window of traffic, cuts
    # them): gaps are compared over the trace's span.
    drawn_gaps = np.diff(drawn.arrival_s[drawn.arrival_s <= span_s])
    report = {
        "num_requests": n, "span_s": span_s, "generator": workload["format"],
        "arrival_process": (workload.get("arrivals") or {}).get("process"),
        "num_drawn_requests": len(drawn),
        "ks": {"prompt_tokens": ks_distance(trace.num_prompt_tokens, drawn.num_prompt_tokens),
               "output_tokens": ks_distance(trace.num_output_tokens, drawn.num_output_tokens),
               "gap_s": ks_distance(gaps, drawn_gaps)},
        "burstiness_cv": {"trace": _cv(gaps), "fitted": _cv(drawn_gaps)},
        "length_rank_correlation": {
            "trace": rank_correlation(trace.num_prompt_tokens, trace.num_output_tokens),
            "fitted": rank_correlation(drawn.num_prompt_tokens, drawn.num_output_tokens)},
        "prefix_block_reuse": None, "sessions": None,
    }
    if trace.hash_ids is not None:
        ids = prompt_blocks(trace.hash_ids, trace.num_prompt_tokens, trace.hash_block_tokens)
        drawn_ids = None if drawn.hash_ids is None else prompt_blocks(
            drawn.hash_ids, drawn.num_prompt_tokens, drawn.hash_block_tokens)
        report["prefix_block_reuse"] = {
            "trace": block_reuse(ids),
            "fitted": None if drawn_ids is None else block_reuse(drawn_ids)}
        report["sessions"] = {
            "trace": session_shape(ids, trace.arrival_s, trace.num_prompt_tokens),
            "fitted": None if drawn_ids is None else session_shape(
                drawn_ids, drawn.arrival_s, drawn.num_prompt_tokens)}
    return Fit(workload, report)


def _draw(scenario: Scenario, workload: dict[str, Any]) -> Any:
    return load_workload(scenario.model_validate({**scenario.model_dump(), "workload": workload}))


def _match_turn_gaps(scenario: Scenario, workload: dict[str, Any], trace: Any, drawn: Any
                     ) -> Any:
    """Scale the think time so that the median gap between a turn and the one it is found to
    continue is the trace's. The trace's gaps alone overstate it: a short turn that brings no
    full block of its own cannot be found continued, so its successor is found continuing
    the turn before it, across two think times; a draw has the same blind spot, so the median
    found in a draw is matched (a few rescalings converge: the gap is proportional to it)."""
    def median_gap(w: Any) -> float | None:
        ids = prompt_blocks(w.hash_ids, w.num_prompt_tokens, w.hash_block_tokens)
        return session_shape(ids, w.arrival_s, w.num_prompt_tokens)["gap_between_turns_p50_s"]

    target = median_gap(trace)
    for _ in range(3):
        found = median_gap(drawn)
        if not target or not found or abs(found / target - 1) < 0.02:
            break
        workload["think_time_s"] = round(workload["think_time_s"] * target / found, 3)
        drawn = _draw(scenario, workload)
    return drawn


def fit_arrivals(arrival_s: np.ndarray) -> dict[str, Any]:
    """An arrival process for these times (module docstring): Poisson where the gaps' CV is
    within POISSON_CV_TOLERANCE of 1, else gamma with their CV; the gaps' own distribution
    where the chosen one is more than MAX_RENEWAL_KS from them."""
    from scipy.stats import gamma  # (here: a plain run imports no scipy)

    gaps = np.diff(arrival_s)
    qps = (len(arrival_s) - 1) / float(arrival_s[-1] - arrival_s[0])
    cv = _cv(gaps)
    arrivals: dict[str, Any] = {"process": "poisson", "qps": qps}
    if abs(cv - 1.0) > POISSON_CV_TOLERANCE:
        arrivals = {"process": "gamma", "qps": qps, "cv": min(max(cv, 1e-3), 1e3)}
    shape = 1.0 / arrivals.get("cv", 1.0) ** 2
    ks = float(np.abs(np.searchsorted(np.sort(gaps), np.sort(gaps), side="right") / len(gaps)
                      - gamma.cdf(np.sort(gaps), shape, scale=gaps.mean() / shape)).max())
    if ks > MAX_RENEWAL_KS:
        relative = gaps / gaps.mean()
        arrivals = {"process": "empirical", "qps": qps, "gap_quantiles": [
            round(float(q), 6) for q in np.quantile(relative, np.linspace(0, 1, NUM_QUANTILES))]}
    return arrivals


def _fit_sessions(trace: Any, before: np.ndarray) -> dict[str, Any]:
    """A `prefix` workload for a trace with sessions (module docstring)."""
    size = trace.hash_block_tokens
    prompt, output = trace.num_prompt_tokens, trace.num_output_tokens
    root, _ = chains(before)
    first = before < 0
    turns = np.bincount(root, minlength=len(before))[first]
    continued = ~first
    follow_up = (prompt[continued] - prompt[before[continued]] - output[before[continued]])
    system_tokens, num_groups, shared_fraction = _system_prompt(
        [trace.hash_ids[i] for i in np.flatnonzero(first)], prompt[first], size)
    first_question = np.maximum(prompt[first] - system_tokens, 1)
    gaps_s = trace.arrival_s[continued] - trace.arrival_s[before[continued]]
    workload: dict[str, Any] = {
        "format": "prefix", "num_conversations": int(first.sum()),
        "arrivals": fit_arrivals(trace.arrival_s[first]),
        "num_turns": _empirical(turns, NUM_TURN_QUANTILES),
        "first_question_tokens": _empirical(first_question),
        "question_tokens": _empirical(np.maximum(follow_up, 1)),
        "output_tokens": _empirical(output),
        "think_time_s": round(float(gaps_s.mean()), 3), "think_time": "exponential",
        "hash_block_tokens": size,
    }
    if system_tokens:
        workload.update(system_prompt_tokens=system_tokens, num_groups=num_groups,
                        shared_fraction=round(shared_fraction, 4))
    return workload


def _system_prompt(ids: list[tuple[int, ...]], prompt: np.ndarray, size: int
                   ) -> tuple[int, int, float]:
    """(tokens, groups, shared fraction) of the system prompt that sessions' first requests
    share: each one's leading full blocks held by another first request; the median of those
    runs among the sharing ones, in whole blocks; groups, the distinct first blocks of the
    sharing ones."""
    count: dict[tuple[int, ...], int] = {}
    full = [h[:int(p) // size] for h, p in zip(ids, prompt.tolist(), strict=True)]
    for h in full:
        for k in range(1, len(h) + 1):
            count[h[:k]] = count.get(h[:k], 0) + 1
    shared = []
    for h in full:
        k = 0
        while k < len(h) and count[h[:k + 1]] > 1:
            k += 1
        shared.append(k)
    runs = np.array(shared)
    sharing = runs > 0
    if not sharing.any():
        return 0, 1, 0.0
    blocks = int(np.median(runs[sharing]))
    groups = len({h[0] for h, s in zip(full, sharing.tolist(), strict=True) if s})
    return blocks * size, groups, float(sharing.mean())


def _cv(gaps: np.ndarray) -> float:
    return float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else 0.0


def _empirical(tokens: np.ndarray, num_quantiles: int = NUM_QUANTILES) -> dict[str, Any]:
    """The trace's quantiles (at `num_quantiles` equally spaced probabilities, percentiles by
    default) as an empirical distribution; fixed where every value is one."""
    low, high = int(tokens.min()), int(tokens.max())
    if low == high:
        return {"dist": "fixed", "value": low}
    quantiles = np.quantile(tokens.astype(np.float64), np.linspace(0, 1, num_quantiles))
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


def prompt_blocks(hash_ids: list[tuple[int, ...]], num_prompt_tokens: np.ndarray,
                  block_tokens: int) -> list[tuple[int, ...]]:
    """Each request's ids over its prompt only (a generated workload's ids go on over its
    answer; a trace's, Mooncake's, end with the prompt): what reuse is counted on, alike on
    both sides of a fit."""
    counts = (-(-num_prompt_tokens // block_tokens)).tolist()
    return [ids[:k] for ids, k in zip(hash_ids, counts, strict=True)]


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


def session_shape(hash_ids: list[tuple[int, ...]], arrival_s: np.ndarray,
                  num_prompt_tokens: np.ndarray | None = None) -> dict[str, Any]:
    """What prefix ids say of sessions (`continuations`): the share of requests that continue
    one, turns per session (P50, max) and the gap between a turn's arrival and its
    continuation's (P50)."""
    before = continuations(hash_ids, num_prompt_tokens)
    turns = chains(before)[1] + 1
    is_last = np.ones(len(hash_ids), dtype=bool)
    is_last[before[before >= 0]] = False
    continued = before >= 0
    gaps = arrival_s[continued] - arrival_s[before[continued]]
    return {"continuing_share": float(continued.mean()),
            "turns_p50": float(np.median(turns[is_last])), "turns_max": int(turns.max()),
            "gap_between_turns_p50_s": float(np.median(gaps)) if gaps.size else None}
