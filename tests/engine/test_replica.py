"""The reference replica (`sim.engine.replica`) with the constant latency model: exact timestamps
under chunked prefill and prefill-first, a horizon that cuts the run (before any token too), and
requests rejected with their reason."""

from __future__ import annotations

from pathlib import Path

from sim import run_scenario
from sim.config.scenario import parse_scenario

TICK = 0.25  # a binary fraction, so sums of iteration times are exact


def three_requests(tmp_path: Path, scheduler: dict, **extra) -> dict:
    trace = tmp_path / "three.csv"
    # A arrives at 0, B halfway through the first iteration, C halfway through the third.
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     "0.0,100,3\n0.125,50,2\n0.625,200,1\n")
    return {
        "name": "three",
        "workload": {"format": "vidur", "path": str(trace)},
        "replica": {"scheduler": scheduler, "latency": {"kind": "constant", "iteration_s": TICK},
                    "kv_cache": {"block_size": 16, "num_blocks": 100}},
        "record_token_times": True,
        **extra,
    }


def token_times(results, request_id: int) -> list[float]:
    tokens = results.tokens
    return tokens.loc[tokens["request_id"] == request_id, "time_s"].tolist()


def run(data: dict, **kwargs):
    return run_scenario(parse_scenario(data, "test"), **kwargs)


def test_chunked_prefill_exact_timestamps(tmp_path):
    res = run(three_requests(tmp_path, {"name": "chunked_prefill", "token_budget": 64,
                                        "max_num_seqs": 8}))
    # it0 A[0:64]; it1 A[64:100] samples; it2 A decode + B whole (50); it3 A, B decode + C[0:62];
    # it4 C[62:126]; it5 C[126:190]; it6 C[190:200] samples.
    assert token_times(res, 0) == [2 * TICK, 3 * TICK, 4 * TICK]
    assert token_times(res, 1) == [3 * TICK, 4 * TICK]
    assert token_times(res, 2) == [7 * TICK]
    df = res.requests.set_index("request_id")
    assert df["first_scheduled_s"].tolist() == [0.0, 2 * TICK, 3 * TICK]
    assert df["finish_s"].tolist() == [4 * TICK, 4 * TICK, 7 * TICK]
    assert df["ttft_s"].tolist() == [2 * TICK, 3 * TICK - 0.125, 7 * TICK - 0.625]
    assert df["max_tbt_s"].tolist()[:2] == [TICK, TICK]
    assert res.iterations["num_prefill_tokens"].tolist() == [64, 36, 50, 62, 64, 64, 10]
    assert res.iterations["num_decode_tokens"].tolist() == [0, 0, 1, 2, 0, 0, 0]
    assert res.iterations["start_s"].tolist() == [i * TICK for i in range(7)]


def test_prefill_first_exact_timestamps(tmp_path):
    res = run(three_requests(tmp_path, {"name": "prefill_first"}))
    # it0 A prefill; it1 B prefill (A waits); it2 A, B decode (B done); it3 C prefill (done);
    # it4 A decode (done).
    assert token_times(res, 0) == [1 * TICK, 3 * TICK, 5 * TICK]
    assert token_times(res, 1) == [2 * TICK, 3 * TICK]
    assert token_times(res, 2) == [4 * TICK]
    df = res.requests.set_index("request_id")
    assert df["max_tbt_s"][0] == 2 * TICK  # the prefill stalls show up as TBT
    assert df["finish_s"].tolist() == [5 * TICK, 3 * TICK, 4 * TICK]
    assert res.summary["tbt_s"]["max"] == 2 * TICK
    assert res.iterations["num_prefill_tokens"].tolist() == [100, 50, 0, 200, 0]


def test_horizon_reports_unfinished_requests(tmp_path):
    res = run(three_requests(tmp_path, {"name": "prefill_first"}, horizon_s=0.8))
    df = res.requests.set_index("request_id")
    assert df["status"].tolist() == ["unfinished", "finished", "unfinished"]
    assert df["reason"][0] == "running_at_horizon"
    assert df["num_generated_tokens"].tolist() == [2, 2, 0]
    assert res.summary["requests"]["unfinished"] == 2
    assert set(res.iterations["start_s"] + res.iterations["duration_s"]) <= {0.25, 0.5, 0.75}


def test_rejected_requests_appear_with_their_reason(tmp_path):
    data = three_requests(tmp_path, {"name": "prefill_first"})
    data["replica"]["kv_cache"]["num_blocks"] = 10  # 160 slots: C (200 + 1 - 1) never fits
    res = run(data)
    row = res.requests.set_index("request_id").loc[2]
    assert row["status"] == "rejected" and "200" in row["reason"]
    assert res.summary["requests"]["rejected"] == 1
    assert res.summary["requests"]["finished"] == 2


def test_horizon_before_any_token(tmp_path):
    """Found by hypothesis: a run in which no request ever samples a token."""
    res = run(three_requests(tmp_path, {"name": "chunked_prefill", "token_budget": 8,
                                        "max_num_seqs": 1}, horizon_s=0.3))
    assert (res.requests["num_generated_tokens"] == 0).all()
    assert res.requests["ttft_s"].isna().all()
    # A is part-way through its prompt, B waits behind it; C arrives after the horizon.
    # Nothing is dropped: C is listed too, unfinished with its reason.
    assert res.requests["reason"].tolist() == ["running_at_horizon", "queued_at_horizon",
                                               "after_horizon: arrives at 0.625 s"]
    assert res.requests["status"].tolist() == ["unfinished"] * 3
    assert res.summary["requests"]["unfinished"] == 3
    assert res.summary["requests"]["reasons"] == {"after_horizon": 1, "queued_at_horizon": 1,
                                                  "running_at_horizon": 1}
