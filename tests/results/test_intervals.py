"""Confidence intervals (`sim.results.metrics.intervals`): the t interval and the bootstrap on
known values, clipped and absent where replications are equal, and a coverage check on an M/D/1
queue, whose mean wait is known exactly (Pollaczek-Khinchine): the 95% interval from
replications must cover it in at least 90 of 100 independent repetitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.config.scenario import parse_scenario
from sim.results.metrics.intervals import bootstrap_interval, estimate, t_interval
from sim.runner import run_scenario

SERVICE_S = 0.01


def md1(rho: float, num_requests: int) -> dict:
    """Poisson arrivals at rho / D; each request one prompt token and one output token, served
    alone (max_num_seqs 1) in one iteration of exactly D: an M/D/1 queue."""
    return {
        "name": "md1",
        "workload": {"format": "synthetic", "num_requests": num_requests,
                     "arrivals": {"process": "poisson", "qps": rho / SERVICE_S},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                    "latency": {"kind": "constant", "iteration_s": SERVICE_S},
                    "kv_cache": {"num_blocks": 100}},
    }


@pytest.mark.slow
def test_md1_interval_for_the_mean_wait_covers_the_exact_value():
    """100 repetitions, each N = 5 replications (its own seeds) at rho 0.5, 0.6 or 0.7: the
    t interval of the mean wait covers rho D / (2 (1 - rho)) at least 90 times. Runs of 1,000
    requests, the first 100 dropped (the queue starts empty; its relaxation time at rho 0.7 is
    a few dozen services)."""
    replications, repetitions, skip = 5, 100, 100
    scenarios = {rho: parse_scenario(md1(rho, 1000), "md1") for rho in (0.5, 0.6, 0.7)}
    covered = 0
    for rep in range(repetitions):
        rho = (0.5, 0.6, 0.7)[rep % 3]
        exact = rho * SERVICE_S / (2 * (1 - rho))
        waits = []
        for k in range(replications):
            df = run_scenario(scenarios[rho], seed=1000 + rep * replications + k).requests
            wait = (df["first_scheduled_s"] - df["arrival_s"]).to_numpy()
            service = (df["ttft_s"] - df["scheduling_delay_s"]).to_numpy()
            assert np.allclose(service, SERVICE_S) and np.allclose(wait, df["scheduling_delay_s"])
            waits.append(wait[skip:].mean())
        _, low, high = t_interval(waits)
        covered += low <= exact <= high
    assert covered >= 90, f"covered {covered} of {repetitions}"


def test_intervals_are_reproducible_and_sensible():
    values = [1.0, 2.0, 4.0, 3.0, 2.5]
    mean, low, high = t_interval(values)
    assert mean == pytest.approx(2.5)
    # t(0.975, 4) = 2.776; s = 1.118
    assert (high - low) / 2 == pytest.approx(2.776 * 1.118 / math.sqrt(5), rel=1e-3)
    assert bootstrap_interval(values) == bootstrap_interval(values)  # fixed seed
    _, blo, bhi = bootstrap_interval(values)
    assert min(values) <= blo < mean < bhi <= max(values)
    assert t_interval([3.0]) == (3.0, None, None)  # no interval from one value
    assert t_interval([3.0, 3.0]) == (3.0, None, None)  # zero spread: no interval, and why:
    same = estimate([3.0, 3.0], "t")
    assert same["estimate"] == 3.0 and same["ci95"] is None
    assert same["note"] == "all 2 replications equal"


def test_intervals_are_clipped_and_equal_replications_give_none():
    spread = estimate([0.001, 0.5], "bootstrap")  # a wide t interval would go below 0
    assert spread["ci95"][0] == 0.0 and spread["ci95"][1] > 0.5
    share = estimate([0.5, 1.0], "t", (0.0, 1.0))
    assert share["ci95"][0] >= 0.0 and share["ci95"][1] == 1.0
    same = estimate([0.01, 0.01, 0.01 * (1 + 1e-13)], "bootstrap")  # equal to rounding
    assert same["ci95"] is None and same["note"] == "all 3 replications equal"
    assert same["estimate"] == pytest.approx(0.01)
    assert estimate([None, 0.2, None], "t")["ci95"] == [None, None]  # one value: no interval
