"""Deciding a rate from replications (`sim.studies.rate_decision`): a sequential test that runs on
while it cannot tell, Bonferroni over targets, missing and censored metrics judged at their
worst case."""

from __future__ import annotations

import math

import pytest

from sim.studies.rate_decision import SLOTargets, Trial, censored, decide, measured, violations

# -- capacity: decisions -----------------------------------------------------------------------

def trial(seed: int, **metrics) -> Trial:
    lower = metrics.pop("lower", {})
    return Trial(seed, 1.0, 1.0, True, [], "stable", metrics, {}, lower)


def test_zero_spread_runs_on_to_r_and_then_decides_by_the_value():
    targets = SLOTargets(tbt_p99_s=0.05)
    runs = [trial(k, tbt_p99_s=0.01) for k in range(3)]
    assert decide(runs[:2], targets, 3, deterministic=False) is None  # no 95% from no spread
    decision, reason, stats = decide(runs, targets, 3, deterministic=False)
    assert decision == "holds" and "all 3 runs equal" in reason
    assert "as deterministic as the model" in reason
    high = [trial(k, tbt_p99_s=0.07) for k in range(3)]
    assert decide(high[:2], targets, 3, deterministic=False) is None
    assert decide(high, targets, 3, deterministic=False)[0] == "fails"


def test_a_missing_tbt_p99_is_no_gap_not_a_zero():
    targets = SLOTargets(tbt_p99_s=0.05)
    runs = [trial(0, tbt_p99_s=None), trial(1, tbt_p99_s=0.02), trial(2, tbt_p99_s=0.03)]
    decided = decide(runs, targets, 3, deterministic=False)
    assert decided is not None
    assert decided[2]["tbt_p99_s"]["mean"] == pytest.approx(0.025)  # over the two with a gap
    none = [trial(k, tbt_p99_s=None) for k in range(2)]
    decision, reason, _ = decide(none, targets, 2, deterministic=False)
    assert decision == "holds" and "no gap" in reason


def test_bonferroni_over_targets():
    from sim.results.metrics.intervals import t_bounds

    targets = SLOTargets(tbt_p99_s=1.0, ttft_p90_s=1.0)
    values = [0.5, 0.6, 0.55]
    runs = [trial(k, tbt_p99_s=v, ttft_p90_s=v) for k, v in enumerate(values)]
    _, _, stats = decide(runs, targets, 3, deterministic=False)
    level = 1 - 0.05 / (2 * 2)  # 2 looks, 2 targets
    assert stats["ttft_p90_s"]["upper"] == pytest.approx(t_bounds(values, level)[2])
    assert stats["tbt_p99_s"]["lower"] == pytest.approx(t_bounds(values, level)[1])


def fake_results(summary_extra: dict, p90: float = 0.1) -> object:
    from types import SimpleNamespace

    summary = {"ttft_s": {"p90": p90}, "tbt_s": {"p99": 0.01},
               "scheduling_delay_s": {"p50": 0.0}, "overload": {"verdict": "stable"},
               **summary_extra}
    return SimpleNamespace(summary=summary)


def arrived(p90: float, lower: bool, at_most: float | None) -> dict:
    return {"ttft_all_arrived_s": {"p90": p90, "num_lower_bounds": 3 if lower else 0,
                                   "is_lower_bound": {"p90": lower},
                                   "at_most": {"p90": at_most}}}


def test_censored_ttft_is_judged_at_its_worst_case():
    targets = SLOTargets(ttft_p90_s=0.5)
    exact = fake_results(arrived(0.3, False, 0.3), p90=0.1)
    assert measured(exact)["ttft_p90_s"] == 0.3 and censored(exact) == {}  # over arrivals
    assert violations(exact, targets) == []
    maybe = fake_results(arrived(0.3, True, None), p90=0.1)  # finished-only P90 says 0.1
    assert measured(maybe)["ttft_p90_s"] == math.inf and censored(maybe) == {"ttft_p90_s": 0.3}
    (found,) = violations(maybe, targets)
    assert "may exceed" in found and "lower bound" in found and "unbounded" in found
    sure = fake_results(arrived(0.7, True, None))
    (found,) = violations(sure, targets)
    assert ">= 700 ms > 500 ms" in found and "a lower bound decided" in found
    bounded = fake_results(arrived(0.3, True, 0.4))
    assert measured(bounded)["ttft_p90_s"] == 0.4 and violations(bounded, targets) == []


def test_censored_runs_hold_only_when_guaranteed():
    targets = SLOTargets(ttft_p90_s=0.5)
    unbounded = [trial(k, ttft_p90_s=math.inf, lower={"ttft_p90_s": 0.1 + 0.01 * k})
                 for k in range(3)]
    decision, reason, stats = decide(unbounded, targets, 3, deterministic=False)
    assert decision == "unsure" and "unbounded" in reason and "unfinished" in reason
    assert stats["ttft_p90_s"]["upper"] is None  # JSON-safe: no Infinity
    failing = [trial(k, ttft_p90_s=math.inf, lower={"ttft_p90_s": 2.0 + 0.01 * k})
               for k in range(2)]
    decision, reason, _ = decide(failing, targets, 3, deterministic=False)
    assert decision == "fails" and "unfinished at the horizon" in reason
    one = [trial(0, ttft_p90_s=math.inf, lower={"ttft_p90_s": 0.1})]
    one[0].ok = False
    assert decide(one, targets, 1, deterministic=True)[0] == "unsure"
