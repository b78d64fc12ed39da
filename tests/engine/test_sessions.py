"""Sessions (`prefix` conversations with `wait_for_answer`): each later turn is sent a think time
after the answer to the turn before reaches its client, so the prefix cache has that answer;
a turn that gets no answer abandons the rest; exact times on a constant-latency replica, the
`session` and `turn` columns, clients over sessions, and the fast path equal to stepping."""

from __future__ import annotations

import numpy as np
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.engine.fastpath_helpers import assert_same_results
from tests.helpers import max_in_flight, replica


def conversations(num, turns, *, think_s=0.5, wait=True, **extra):
    """`num` conversations of `turns` turns (questions of 16 tokens, answers of 4: a turn of
    prompt P takes 4 iterations of TICK = 0.25 s alone), started 0.1 s apart."""
    workload = {"format": "prefix", "num_conversations": num, "num_turns": turns,
                "arrivals": {"process": "gamma", "qps": 10.0, "cv": 1e-3},
                "question_tokens": 16, "output_tokens": 4, "hash_block_tokens": 16,
                "think_time_s": think_s, "think_time": "fixed", "wait_for_answer": wait,
                **extra.pop("workload", {})}
    return parse_scenario({"workload": workload, "record_token_times": True,
                           "replica": {**replica(), "engine": "none", "prefix_caching": True,
                                       **extra.pop("replica", {})}, **extra}, "test")


def run_both(scenario):
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    return fast


def test_a_turn_is_sent_its_think_time_after_the_answer_before():
    res = run_both(conversations(1, 3))
    req = res.requests
    assert req["turn"].tolist() == [0, 1, 2] and req["session"].tolist() == [0, 0, 0]
    # Each turn takes 4 iterations (1 s); the next goes 0.5 s after its answer.
    assert req["arrival_s"].tolist() == [0.0, 1.5, 3.0]
    assert req["finish_s"].tolist() == [1.0, 2.5, 4.0]
    # Turn 1 resends turn 0's prompt and answer (16 + 4 = 20 tokens): the prefix cache holds
    # its full block of 16; turn 2 the 32 of 40.
    assert req["num_prompt_tokens"].tolist() == [16, 36, 56]
    assert req["num_cached_tokens"].tolist() == [0, 16, 32]


def test_open_loop_turns_do_not_wait():
    req = run_both(conversations(1, 3, wait=False)).requests
    assert req["arrival_s"].tolist() == [0.0, 0.5, 1.0]  # think times after each send
    assert "turn" not in req  # no sessions: the turns are independent requests


def test_a_turn_that_gets_no_answer_abandons_the_rest_of_its_session():
    # A 1.2 s timeout: the second conversation's first turn, queued behind the first's (one
    # request at a time), times out; its later turns are never sent.
    scenario = conversations(2, 3, workload={"timeout_s": 1.2},
                             replica={"scheduler": {"name": "chunked_prefill",
                                                    "max_num_seqs": 1}})
    res = run_both(scenario)
    req = res.requests.set_index(["session", "turn"])
    assert req.loc[(1, 0), "status"] == "failed"
    for turn in (1, 2):
        row = req.loc[(1, turn)]
        assert row["status"] == "unfinished" and row["reason"].startswith("abandoned: never sent")
    # Abandoned turns were never offered: not counted in the arrivals' latencies or the SLOs.
    assert res.summary["ttft_s"]["count"] == 3  # the first conversation's turns


def test_turns_not_sent_by_the_horizon_say_why():
    req = run_both(conversations(1, 4, horizon_s=2.0)).requests
    assert req["status"].tolist() == ["finished", "unfinished", "unfinished", "unfinished"]
    assert req.loc[1, "reason"] == "running_at_horizon"
    assert req.loc[2, "reason"] == ("after_horizon: never sent (its session's turn before had "
                                    "no answer yet)")


@pytest.mark.parametrize("clients", [None, {"concurrency": 4}, {"concurrency": 2, "paced": True}])
@pytest.mark.parametrize("cluster", [{}, {"cluster": {"replicas": 2,
                                                       "router": {"name": "prefix_affinity"}}}])
def test_sessions_fast_forward_as_stepping(clients, cluster):
    data = {"seed": 9, "record_token_times": True, **cluster,
            **({"clients": clients} if clients else {}),
            "workload": {"format": "prefix", "num_conversations": 40,
                         "num_turns": {"dist": "uniform", "low": 1, "high": 5},
                         "arrivals": {"process": "poisson", "qps": 4},
                         "system_prompt_tokens": 128, "num_groups": 3,
                         "question_tokens": {"dist": "uniform", "low": 10, "high": 200},
                         "output_tokens": {"dist": "uniform", "low": 5, "high": 100},
                         "think_time_s": 2.0, "hash_block_tokens": 16},
            "replica": {"scheduler": {"name": "vllm_v1", "max_num_seqs": 16},
                        "latency": {"kind": "roofline"}, "prefix_caching": True}}
    res = run_both(parse_scenario(data, "test"))
    req = res.requests
    assert (req["status"] == "finished").all()
    # Every later turn went after its turn before had finished (and its answer came back).
    by = req.set_index(["session", "turn"]).sort_index()
    later = by[by.index.get_level_values("turn") > 0]
    before = by.loc[[(s, t - 1) for s, t in later.index]]
    assert (later["arrival_s"].to_numpy() > before["finish_s"].to_numpy()).all()
    # Later turns find their history cached.
    assert (later["num_cached_tokens"] > 0).mean() > 0.9
    if clients:
        assert max_in_flight(req) <= clients["concurrency"]


def test_the_summary_says_how_sessions_went_turn_by_turn():
    res = run_scenario(conversations(3, 4, horizon_s=4.0))
    sessions = res.summary["sessions"]
    req = res.requests
    assert sessions["num_sessions"] == 3
    done = req.groupby("session")["status"].apply(lambda s: (s == "finished").all())
    assert sessions["num_completed"] == int(done.sum()) < 3  # the horizon cut some
    turns = sessions["by_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2, 3]
    assert [t["requests"] for t in turns] == [3, 3, 3, 3]
    assert turns[0]["hit_rate_tokens"] == 0.0
    assert 0 < turns[1]["hit_rate_tokens"] < turns[2]["hit_rate_tokens"]
    for t in turns:
        finished = req[(req["turn"] == t["turn"]) & (req["status"] == "finished")]
        assert t["finished"] == len(finished) and t["ttft_s"]["count"] == len(finished)


def test_a_client_keeps_its_session_turn_after_turn():
    # Eight clients, 60 conversations of 3 turns: a client's next turn goes out its think time
    # after its answer (engine finish plus the front end), not after every first turn.
    data = {"seed": 2, "clients": {"concurrency": 8}, "record_token_times": True,
            "workload": {"format": "prefix", "num_conversations": 60, "num_turns": 3,
                         "arrivals": {"process": "poisson", "qps": 5},
                         "question_tokens": 200, "output_tokens": 50, "think_time_s": 1.0,
                         "think_time": "fixed", "hash_block_tokens": 16},
            "replica": {"prefix_caching": True}}
    scenario = parse_scenario(data, "test")
    res = run_both(scenario)
    req = res.requests.set_index(["session", "turn"]).sort_index()
    later = req[req.index.get_level_values("turn") > 0]
    before = req.loc[[(s, t - 1) for s, t in later.index]]
    answer_s = before["finish_s"].to_numpy() + scenario.replica.frontend_latency_s
    assert np.allclose(later["arrival_s"].to_numpy(), answer_s + 1.0)
    # Sessions take about three turns and two think times, not the whole run.
    duration = res.summary["sessions"]["duration_s"]
    assert res.summary["sessions"]["num_completed"] == 60 and duration["max"] < 10


def test_a_long_session_abandoned_early_is_reported_whole():
    # 1,500 turns whose first times out: the rest are abandoned (once recursion, 1,292 frames
    # of traceback), and the run ends with its last iteration, not at the abandoned turns'
    # planned times.
    data = {"workload": {"format": "prefix", "num_conversations": 1, "num_turns": 1500,
                         "arrivals": {"qps": 1}, "question_tokens": 1, "output_tokens": 400,
                         "think_time_s": 0.1, "think_time": "fixed", "hash_block_tokens": 16,
                         "timeout_s": 0.02},
            "replica": {"model": "tiny"}}
    res = run_scenario(parse_scenario(data, "test"))
    req = res.requests
    assert req.loc[0, "status"] == "failed"
    assert req.loc[1:, "reason"].str.startswith("abandoned").all()
    last_iteration_end_s = float((res.iterations["start_s"] + res.iterations["duration_s"]).max())
    assert res.summary["run"]["end_s"] == pytest.approx(last_iteration_end_s)
