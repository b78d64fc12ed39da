"""Simulated time (`sim.engine.clock`): events at an absolute time, the order of events at one
instant (planning last, in replica order), and the feed of arrivals with its progress reports."""

from __future__ import annotations

import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.core.request import Request
from sim.engine.clock import NORMAL, PLAN, At, Environment, simulate

TICK = 0.25  # a binary fraction, so sums of iteration times are exact


def run(data: dict, **kwargs):
    return run_scenario(parse_scenario(data, "test"), **kwargs)


def test_progress_ends_with_every_request_fed(tmp_path, capsys):
    # Reported every total // 200 arrivals only: 451 requests ended at 450/451 (a 2p2d re-run
    # at 19,296/19,366), so the final "done" line never said the total.
    from sim.studies.progress import ProgressReport

    trace = tmp_path / "many.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{i * 0.01},16,1\n" for i in range(451)))
    data = {"workload": {"format": "vidur", "path": str(trace)},
            "replica": {"latency": {"kind": "constant", "iteration_s": TICK}}}
    calls: list[tuple[int, int]] = []
    with ProgressReport("simulating many", "arrivals", every_s=0.0) as progress:
        def report(done: int, total: int) -> None:
            calls.append((done, total))
            progress.update(done, total)

        run(data, on_progress=report)
    assert calls[-1] == (451, 451) and len(calls) <= 451 // 2 + 1  # still every 2nd arrival
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "simulating many: done 451/451 arrivals")


def processed(env: Environment, at_s: float, priority: int, name: str, log: list) -> At:
    """An event at `at_s` that notes, when processed, its name, the time and what the
    instant has reached."""
    event = At(env, at_s, priority)
    event.callbacks.append(lambda _: log.append(
        (name, env.now, env.reached(NORMAL), env.reached(PLAN))))
    return event


def test_events_at_one_instant_run_in_priority_order_planning_last():
    env = Environment()
    log: list = []
    # Scheduled out of order: planning first, an arrival after it, another instant before both.
    processed(env, 0.5, PLAN + 1, "replica 1 plans", log)
    processed(env, 0.5, PLAN, "replica 0 plans", log)
    processed(env, 0.5, NORMAL, "arrival", log)
    processed(env, 0.25, PLAN, "earlier plan", log)
    env.run()
    assert log == [("earlier plan", 0.25, True, True),
                   ("arrival", 0.5, True, False),  # a new instant: not yet planned
                   ("replica 0 plans", 0.5, True, True),
                   ("replica 1 plans", 0.5, True, True)]


def test_an_event_falls_on_exactly_the_float_given():
    """A stretch's iteration ends must be the floats a step-by-step run reaches: `At` is
    processed at that float, not at `now + delay` rounded another way."""
    env = Environment()
    ends = [0.1, 0.1 + 0.2, (0.1 + 0.2) + 1 / 3, 7.000000000000001]
    log: list = []
    for i, at_s in enumerate(ends):
        processed(env, at_s, NORMAL, str(i), log)
    env.run()
    assert [now for _, now, _, _ in log] == ends


def test_an_event_in_the_past_is_refused():
    env = Environment()
    At(env, 1.0, NORMAL)
    env.run()
    with pytest.raises(AssertionError):
        At(env, 0.5, NORMAL)


def test_arrivals_are_routed_at_their_times_and_none_at_or_after_the_horizon():
    env = Environment()
    requests = [Request(i, at_s, 10, 2) for i, at_s in enumerate([0.0, 0.0, 0.75, 2.0, 3.5])]
    routed: list[tuple[int, float]] = []
    progress: list[tuple[int, int]] = []
    simulate(env, requests,
             lambda req: routed.append((req.request_id, env.now)),
             horizon_s=2.0, on_progress=lambda done, total: progress.append((done, total)))
    # The arrival at the horizon itself never comes, nor any after it.
    assert routed == [(0, 0.0), (1, 0.0), (2, 0.75)]
    assert progress == [(1, 5), (2, 5), (3, 5)]
    assert env.now == 2.0
