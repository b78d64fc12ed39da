"""Sessions found in a trace's prefix ids (`workload.sessions`): a request continuing an earlier
one is sent at its trace time, or once the answer it continues has come back (plus a think
time) if that is later; exact times on a constant-latency replica, the fast path equal to
stepping, on the Mooncake trace, and bad input."""

from __future__ import annotations

import json

from sim import run_scenario
from sim.config.clients import ClientsConfig
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload
from tests.engine.fastpath_helpers import assert_same_results
from tests.helpers import assert_one_line_error, replica, run_cli


def jsonl_trace(tmp_path, rows, sessions):
    """Requests (time s, prompt, output, prefix ids of 16 tokens) on one tiny replica, each
    iteration 0.25 s, no API front end: a prompt of up to 256 tokens and 4 output tokens take
    4 iterations (1 s)."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"t": t, "p": p, "o": o, "ids": list(ids)}) + "\n"
                            for t, p, o, ids in rows))
    workload = {"format": "jsonl", "path": str(path), "hash_block_tokens": 16,
                "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o",
                            "hash_ids": "ids"}}
    if sessions is not None:
        workload["sessions"] = sessions
    return parse_scenario({"workload": workload, "record_token_times": True,
                           "replica": {**replica(), "engine": "none", "prefix_caching": True}},
                          "test")


# Prefix ids of 16 tokens; a request's last id may stand for a part-block. The third continues
# the first (all its ids but the last, then its own full block 3); the fourth continues the
# third (the third brought full blocks of its own: a turn holding only blocks seen before
# could not be told from a shared prompt).
ROWS = [(0.0, 32, 4, (1, 2)),  # a first turn
        (0.2, 32, 4, (9, 10)),  # another session's
        (0.5, 56, 4, (1, 2, 3, 4)),  # continues the first: due before its answer (1.0)
        (3.0, 90, 4, (1, 2, 3, 4, 5, 6))]  # continues that one: due after its answer


def run_both(scenario):
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    return fast


def test_a_follow_up_waits_for_the_answer_it_continues(tmp_path):
    req = run_both(jsonl_trace(tmp_path, ROWS, {})).requests
    assert req["arrival_s"].tolist() == [0.0, 0.2, 1.0, 3.0]
    assert req["session"].tolist() == [0, 1, 0, 0] and req["turn"].tolist() == [0, 0, 1, 2]
    assert (req["status"] == "finished").all()


def test_a_think_time_after_the_answer(tmp_path):
    req = run_both(jsonl_trace(tmp_path, ROWS, {"think_time_s": 0.25})).requests
    # The follow-up 0.25 s after the answer at 1.0; the next one still at its own time (its
    # turn before is answered at 2.25, plus 0.25 is before 3.0).
    assert req["arrival_s"].tolist() == [0.0, 0.2, 1.25, 3.0]


def test_without_sessions_the_trace_times_are_kept(tmp_path):
    req = run_both(jsonl_trace(tmp_path, ROWS, None)).requests
    assert req["arrival_s"].tolist() == [0.0, 0.2, 0.5, 3.0]
    assert "session" not in req


def test_the_mooncake_conversations_keep_their_order(traces):
    data = {"seed": 1, "workload": {
        "format": "mooncake", "num_requests": 400, "token_scale": 0.05, "rate_scale": 40.0,
        "sessions": {"think_time_s": 5.0},
        "path": str(traces / "mooncake_fast25" / "conversation_trace.jsonl")},
        "record_token_times": True,
        "replica": {"model": "llama-3.1-8b", "prefix_caching": True,
                    "scheduler": {"name": "vllm_v1", "max_num_seqs": 32}},
        "cluster": {"replicas": 2, "router": {"name": "prefix_affinity"}}}
    scenario = parse_scenario(data, "test")
    res = run_both(scenario)
    due_s = load_workload(scenario).arrival_s  # the trace times, at 40x
    assert (res.requests["arrival_s"].to_numpy() >= due_s).all()
    assert (res.requests["arrival_s"].to_numpy() > due_s).sum() > 0  # some waited
    req = res.requests.set_index(["session", "turn"]).sort_index()
    later = req[req.index.get_level_values("turn") > 0]
    assert len(later) > 30  # the first 400 requests: 37 continue an earlier one
    before = req.loc[[(s, t - 1) for s, t in later.index]]
    done = before["status"].to_numpy() == "finished"
    # Sent a think time (5 s) or more after the answer before (the front end too), and never
    # before its own time in the trace (at 40x).
    answer_s = before["finish_s"].to_numpy()[done] + before["client_e2e_s"].to_numpy()[done] \
        - before["e2e_s"].to_numpy()[done]
    assert (later["arrival_s"].to_numpy()[done] >= answer_s + 5.0 - 1e-9).all()
    assert res.summary["sessions"]["num_sessions"] == len(req.index.unique("session"))


def test_sessions_need_prefix_ids(tmp_path, monkeypatch, capsys, traces):
    path = tmp_path / "s.yaml"
    path.write_text("workload: {format: csv, path: t.csv, columns: {arrival: t, prompt_tokens: "
                    "p, output_tokens: o}, sessions: {}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", "workload.sessions",
                          "are found in prefix ids: name them (columns.hash_ids)")
    azure = traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(f"workload: {{format: azure, path: '{azure}', sessions: {{}}}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", "workload.sessions")
    path.write_text("workload: {format: mooncake, path: x.jsonl, sessions: {think_time_s: -1}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", "workload.sessions.think_time_s")


def test_a_shared_prefix_sent_alone_first_is_no_turn(tmp_path):
    # The first request is the shared system prompt (block 7) and a part-block: the three
    # after it hold block 7 and go on, none longer than the one before: they share a prefix,
    # they do not continue the first (which would hold them until its answer).
    rows = [(0.0, 20, 200, (7, 100)), (0.1, 50, 4, (7, 201, 202, 203)),
            (0.2, 50, 4, (7, 301, 302, 303)), (0.3, 50, 4, (7, 401, 402, 403))]
    req = run_both(jsonl_trace(tmp_path, rows, {})).requests
    assert req["arrival_s"].tolist() == [0.0, 0.1, 0.2, 0.3]
    assert req["turn"].tolist() == [0, 0, 0, 0]


def test_turns_too_short_for_a_block_of_their_own_are_a_chain(tmp_path):
    # Turn 0 brings full blocks of its own; turns 1 and 2 add too few tokens to fill one, so
    # both seem to continue turn 0: each longer than the one before, they are a chain.
    rows = [(0.0, 40, 4, (1, 2, 3)), (0.5, 44, 4, (1, 2, 4)), (3.0, 47, 4, (1, 2, 5))]
    req = run_both(jsonl_trace(tmp_path, rows, {})).requests
    assert req["turn"].tolist() == [0, 1, 2]
    assert req["arrival_s"].tolist() == [0.0, 1.0, 3.0]  # turn 1 waited for turn 0's answer


def test_unpaced_clients_send_follow_ups_as_answers_come(tmp_path):
    # One unpaced client: the trace's times are not used, the follow-ups' either (the last
    # was due at 3.0, after its turn before's answer). The client keeps its session (requests
    # 0, 2, 3, a second each), then sends the other session's request.
    scenario = jsonl_trace(tmp_path, ROWS, {})
    scenario = scenario.model_copy(update={"clients": ClientsConfig(concurrency=1)})
    req = run_both(scenario).requests
    assert req["arrival_s"].tolist() == [0.0, 3.0, 1.0, 2.0]
