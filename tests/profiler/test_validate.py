"""`servesim validate`: the error table's arithmetic on hand-made result folders, the
host-overhead term, and one small sitting end to end (CPU, tiny model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from profiler.fit.fitting import add_host_overhead
from profiler.replay.agreement import compare_runs, iteration_error, relative_error
from sim.cli import main
from sim.latency import BatchShape
from sim.latency.profile import TERMS, load_fitted, predict_s
from tests.helpers import (
    REPO,
    assert_one_line_error,
    read_until,
    requires_torch,
    run_cli,
    sigint_default,
    within,
)


def dist(p50: float | None, p90: float | None = None, p99: float | None = None) -> dict:
    return {"p50": p50, "p90": p90, "p99": p99}


def hand_made_run(path: Path, *, ttft: tuple, tbt: tuple, e2e: tuple, delay: float | None,
                  tokens_per_s: float, iterations: list[tuple[int, int, int, int]],
                  requests: list[tuple[str, int, float, float]],
                  overload: str | None = None) -> Path:
    """A result folder with only what the table reads."""
    path.mkdir()
    summary = {"ttft_s": dist(*ttft), "tbt_s": dist(*tbt), "e2e_s": dist(*e2e),
               "scheduling_delay_s": dist(delay), "throughput": {"output_tokens_per_s":
                                                                 tokens_per_s}}
    if overload is not None:
        summary["overload"] = {"verdict": overload, "detail": "hand-made"}
    (path / "summary.json").write_text(json.dumps(summary))
    pd.DataFrame(iterations, columns=["num_prefill_tokens", "num_decode_tokens", "num_seqs",
                                      "num_preempted"]).to_parquet(path / "iterations.parquet")
    pd.DataFrame([{"request_id": i, "status": s, "num_generated_tokens": n, "ttft_s": t,
                   "e2e_s": e} for i, (s, n, t, e) in enumerate(requests)]
                 ).to_parquet(path / "requests.parquet")
    return path


def test_error_table_arithmetic_on_hand_made_runs(tmp_path):
    ref = hand_made_run(tmp_path / "replay", ttft=(0.100, 0.2, 0.400), tbt=(0.010, 0.02, 0.050),
                        e2e=(1.0, 2.0, 4.0), delay=0.0, tokens_per_s=200.0,
                        iterations=[(64, 0, 1, 0), (0, 1, 1, 0), (10, 2, 3, 0)],
                        requests=[("finished", 3, 0.1, 1.0), ("finished", 2, 0.2, 2.0),
                                  ("rejected", 0, np.nan, np.nan)])
    sim = hand_made_run(tmp_path / "sim", ttft=(0.110, 0.2, 0.300), tbt=(0.010, None, 0.055),
                        e2e=(0.9, 2.5, 4.0), delay=0.002, tokens_per_s=210.0,
                        iterations=[(64, 0, 1, 0), (0, 1, 1, 0), (10, 2, 2, 1)],
                        requests=[("finished", 3, 0.104, 1.0), ("finished", 2, 0.19, 2.5),
                                  ("rejected", 0, np.nan, np.nan)])
    got = compare_runs(ref, sim)
    assert got["ttft_p50"] == pytest.approx(0.10)
    assert got["ttft_p90"] == pytest.approx(0.0)
    assert got["ttft_p99"] == pytest.approx(-0.25)
    assert got["tbt_p50"] == pytest.approx(0.0) and got["tbt_p90"] is None  # missing: no number
    assert got["tbt_p99"] == pytest.approx(0.10)
    assert got["e2e_p50"] == pytest.approx(-0.10) and got["e2e_p90"] == pytest.approx(0.25)
    assert got["sched_delay_p50"] is None  # relative to a zero reference: undefined, not inf
    assert got["throughput"] == pytest.approx(0.05)
    assert got["same_plans"] is False and got["first_divergence"] == 2
    assert got["same_outcomes"] is True
    assert got["max_request_ttft_error"] == pytest.approx(0.05)  # |0.19 - 0.2| / 0.2
    assert got["max_request_e2e_error"] == pytest.approx(0.25)
    assert compare_runs(ref, ref)["same_plans"] is True
    assert relative_error(2.0, 3.0) == 0.5 and relative_error(None, 1.0) is None


def test_the_table_says_which_points_are_overloaded(tmp_path):
    """The README says the simulations' overload verdicts agree with every replay's (stable at
    0.5 and 0.8, overloaded at 0.95); neither errors.csv nor the table said any verdict."""
    from profiler.replay.report import verdict_lines

    run = {"ttft": (0.1, 0.2, 0.4), "tbt": (0.01, 0.02, 0.05), "e2e": (1.0, 2.0, 4.0),
           "delay": 0.0, "tokens_per_s": 200.0, "iterations": [(64, 0, 1, 0)],
           "requests": [("finished", 3, 0.1, 1.0)]}
    ref = hand_made_run(tmp_path / "replay", **run, overload="overloaded")
    rows = [{"scheduler": "chunked_prefill", "load": 0.95, "compared": name,
             **compare_runs(ref, hand_made_run(tmp_path / name, **run, overload=verdict))}
            for name, verdict in (("replay_2", "overloaded"), ("recorded", "overloaded"),
                                  ("roofline", "stable"))]
    assert [(r["reference_verdict"], r["verdict"]) for r in rows] == [
        ("overloaded", "overloaded"), ("overloaded", "overloaded"), ("overloaded", "stable")]
    lines = verdict_lines(pd.DataFrame(rows))
    assert lines[1].startswith("overload verdict") and all(len(x) <= 80 for x in lines)
    assert lines[2:] == ["chunke 0.95 overloaded; otherwise: roofline stable"]


def test_the_header_says_which_replays_the_host_time_is_from():
    """With --repeats 1 the host time comes from replay 1 (there is no other); the header said
    `replays 2+`."""
    from profiler.replay.report import header_lines

    meta = {"date": "d", "command": "c", "capacity": {}, "repeats": 1,
            "machine": {"device_name": "cpu: x", "cpu_count": 2, "torch": "t",
                        "torch_threads": 1},
            "profile": {"source": "p.json", "measured_now": False, "date": "d", "flags": [],
                        "holdout": {"mape": 0.1}},
            "replays": {"num": 1, "first_date": "d", "last_date": "d", "loadavg_1m": None},
            "host": {"median_s": 3e-4, "mean_s": 4e-4}}
    assert "host overhead (replay 1): median 0.30 ms" in "\n".join(header_lines(meta))
    meta["repeats"] = 3
    assert "host overhead (replays 2+): median 0.30 ms" in "\n".join(header_lines(meta))


def test_iteration_error_is_signed_and_relative():
    err = iteration_error(np.array([1.0, 2.0, 4.0]), np.array([1.5, 2.0, 2.0]))
    assert err["median_signed"] == pytest.approx(0.0)
    assert err["mape"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert err["total_signed"] == pytest.approx(5.5 / 7 - 1)


def test_host_overhead_is_a_per_iteration_term_in_the_same_format(tmp_path):
    fitted = load_fitted(REPO / "profiles" / "cpu_tiny.json")
    with_host = add_host_overhead(fitted, 0.0005, {"median_s": 0.0005})
    shape = BatchShape(num_prefill_tokens=100, num_prefill_seqs=1, num_sampled_tokens=1,
                       prefill_attn_pairs=5050, prefill_kv_tokens=100)

    def predict(data):
        return predict_s(shape, np.asarray(data["knots"]), np.asarray(data["knot_s"]),
                         [data["coef"][k] for k in TERMS])

    assert predict(with_host) - predict(fitted) == pytest.approx(0.0005)
    again = add_host_overhead(with_host, 0.0002)  # replaces, never stacks
    assert predict(again) - predict(fitted) == pytest.approx(0.0002)
    path = tmp_path / "host.json"
    path.write_text(json.dumps(with_host))
    assert load_fitted(path)["host_overhead_s"] == 0.0005


def small_scenario(tmp_path: Path, scheduler: str) -> Path:
    path = tmp_path / f"{scheduler}.yaml"
    sched = ("{name: chunked_prefill, token_budget: 64, max_num_seqs: 8}"
             if scheduler == "chunked_prefill"
             else "{name: prefill_first, max_num_batched_tokens: 192, max_num_seqs: 8}")
    path.write_text(
        f"name: small_{scheduler}\nseed: 2\n"
        "workload: {format: synthetic, num_requests: 8, arrivals: {qps: 10},\n"
        "  lengths: {prompt: {dist: uniform, low: 10, high: 90},\n"
        "            output: {dist: uniform, low: 2, high: 12}}}\n"
        f"replica: {{model: tiny, scheduler: {sched}, kv_cache: {{num_blocks: 64}}}}\n")
    return path


@pytest.mark.slow
def test_a_small_sitting_end_to_end(tmp_path, monkeypatch, capsys):
    """Profile measured in the sitting (a reduced grid), capacity by a saturated replay, two
    schedulers, one load, two replays each; the recorded simulation reproduces replay 1."""
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "v"
    monkeypatch.setattr(sys, "argv", [
        "servesim", "validate", str(small_scenario(tmp_path, "chunked_prefill")),
        str(small_scenario(tmp_path, "prefill_first")), "--loads", "0.6", "--out", str(out),
        "--profile-max-tokens", "64", "--profile-reps", "2", "--profile-holdout", "8",
        "--capacity-requests", "6"])
    main()  # returns: exit code 0
    captured = capsys.readouterr()
    printed = captured.out
    # Each replay's line says which scheduler, load and replay it is (the scenario's name is
    # the same in all of them).
    assert "prefill_first load 0.60: replay 2/2: " in captured.err
    errors = pd.read_csv(out / "errors.csv")
    assert set(errors["compared"]) == {"replay_2", "recorded", "profile", "profile_host",
                                       "host+noise", "roofline"}
    rec = errors[errors["compared"] == "recorded"]
    assert rec["same_plans"].all() and rec["same_outcomes"].all()
    assert (rec["max_request_e2e_error"] < 1e-6).all()
    # The profile with its measured jitter ran beside the noise-free one (P99 TBT off and on).
    noisy = errors[errors["compared"] == "host+noise"]
    assert len(noisy) == 2 and noisy["tbt_p99"].notna().all()
    assert "failed" not in errors or not errors["failed"].eq(True).any()
    iters = pd.read_csv(out / "iterations.csv")
    assert len(iters) == 2 and (iters["host_share"] > 0).all()
    assert (iters["replay_ratio_log_std"] > 0).all() and (iters["profile_ratio_log_std"] > 0).all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["profile"]["measured_now"] and meta["profile"]["grid"]["max_tokens"] == 64
    noise = meta["profile"]["noise"]
    assert 0 <= noise["correlation"] < 1 and "quantiles" not in noise["regimes"]["decode"]
    assert iters["profile_correlation"].eq(noise["correlation"]).all()
    ran = yaml.safe_load((out / "runs" / "chunked_prefill" / "load_0.60" / "sim_host+noise"
                          / "scenario.yaml").read_text())["replica"]["latency"]
    assert ran["noise"] == {"kind": "empirical", "sigma": None,
                            "correlation": noise["correlation"]}
    assert ran["path"] == str(out / "profile_host.json")
    assert "saturated replay" in meta["capacity"]["chunked_prefill"]["how"]
    assert load_fitted(out / "profile_host.json")["host_overhead_s"] == meta["host"]["median_s"]
    table = (out / "table.txt").read_text().splitlines()
    assert all(len(line) <= 80 for line in table), [x for x in table if len(x) > 80]
    assert "recorded: plans identical" in printed
    assert "overload verdict of replay 1" in printed and "overload verdict" in "".join(table)
    assert {"reference_verdict", "verdict"} <= set(errors.columns)
    assert any(line.split()[:1] == ["host+noise"] or " host+noise " in line for line in table)
    assert (out / "validation.png").stat().st_size > 10_000


def test_a_profile_of_another_model_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    other = json.loads((REPO / "profiles" / "cpu_tiny.json").read_text())
    other["model"] = "llama-3-8b"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    code, err = run_cli(monkeypatch, capsys, "validate",
                        str(small_scenario(tmp_path, "chunked_prefill")), "--profile", str(path),
                        "--out", str(tmp_path / "v"))
    assert_one_line_error(code, err, "other.json: model='llama-3-8b'", "scenarios run tiny")


def test_out_is_checked_before_the_sitting(tmp_path, monkeypatch, capsys):
    """`--out` a file ended in FileExistsError's traceback after every check had passed; a
    directory of something else (`--out scenarios`) was written into; a bad --profile left an
    empty --out behind."""
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    scenario = str(small_scenario(tmp_path, "chunked_prefill"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, err = run_cli(monkeypatch, capsys, "validate", scenario, "--out", str(a_file))
    assert_one_line_error(code, err, "--out=", "exists and is not a directory")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, err = run_cli(monkeypatch, capsys, "validate", scenario, "--out", str(other))
    assert_one_line_error(code, err, "--out=", "holds 'notes.txt'", "not an earlier sitting")
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "fresh"
    code, err = run_cli(monkeypatch, capsys, "validate", scenario, "--out", str(fresh),
                        "--profile", str(tmp_path / "nope.json"))
    assert_one_line_error(code, err, "nope.json", "file not found")
    assert not fresh.exists()


@pytest.mark.slow
def test_ctrl_c_leaves_no_table_of_an_earlier_sitting_beside_new_runs(tmp_path):
    """SIGINT mid-sitting exited 130 without a word and left the previous sitting's table.txt
    and errors.csv beside this sitting's new profile and replays (and simulations of the old
    ones): a mix. Now the old tables go when the sitting starts, and an interrupted one says so
    and leaves meta.json with complete false."""
    import os
    import signal
    import subprocess
    import time

    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    scenario = small_scenario(tmp_path, "chunked_prefill")
    scenario.write_text(scenario.read_text().replace("num_requests: 8", "num_requests: 200"))
    out = tmp_path / "v"
    out.mkdir()
    for name in ("table.txt", "errors.csv", "meta.json"):
        (out / name).write_text("an earlier sitting's\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "validate", str(scenario), "--loads", "0.5", "--out",
         str(out), "--profile-max-tokens", "64", "--profile-reps", "1", "--profile-holdout", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"},
        preexec_fn=sigint_default)
    assert proc.stdout is not None
    # Interrupted in the replays at half load, once the capacity run is written (what it
    # says, then the file; a hang guard each, no fixed wait).
    seen = read_until(proc.stdout, "capacity")
    capacity = out / "runs" / "chunked_prefill" / "capacity" / "summary.json"
    with within(120):
        while not capacity.is_file():
            time.sleep(0.05)
    time.sleep(1.0)  # into the replays at half load (whenever it is sent, it stops the same)
    os.kill(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    said = " ".join((seen + rest).split())
    assert proc.returncode == 130, said
    assert "Traceback" not in said and "interrupted: no tables written" in said, said
    assert not (out / "table.txt").exists() and not (out / "errors.csv").exists()
    assert json.loads((out / "meta.json").read_text())["complete"] is False
    assert (out / "runs" / "chunked_prefill" / "capacity" / "summary.json").is_file()


@requires_torch
@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_an_infinite_capacity_is_refused(tmp_path, monkeypatch, capsys, value):
    """`--capacity inf` (or 1e400) ran a whole sitting with arrivals at an infinite rate and
    the table said 'capacity chunked_prefill: inf req/s'."""
    code, err = run_cli(monkeypatch, capsys, "validate",
                        str(small_scenario(tmp_path, "chunked_prefill")), "--capacity", value,
                        "--profile", str(REPO / "profiles" / "cpu_tiny.json"), "--repeats", "1",
                        "--loads", "0.5", "--out", str(tmp_path / "v"))
    assert_one_line_error(code, err, "--capacity=inf", "finite")
    assert not (tmp_path / "v").exists()


@requires_torch
def test_a_profile_that_misses_its_own_held_out_mixes_is_flagged() -> None:
    """A sitting built on a profile whose held-out error is large says so: its simulations
    cannot be judged against replays closer than that (seen: 49.7% on a busy VM, no word)."""
    from profiler.replay.validate_profile import fit_flags

    assert fit_flags({"mape": 0.0966, "n": 200}) == []  # the committed CPU profile's
    (flag,) = fit_flags({"mape": 0.497, "n": 8})
    assert flag.startswith("misses its own held-out mixes by 49.7% (mean; over 20%)")
    assert "--profile-reps" in flag
    assert fit_flags(None) == ["records no held-out error: how well it fits is unknown"]


def test_table_names_stay_apart_in_six_columns() -> None:
    """Two scenarios of one scheduler are labelled by their names, which may share their first
    six characters: cut to six they were one row label for both (`azure_`)."""
    from profiler.replay.report import legend, short_names

    assert short_names(["sglang", "vllm"]) == {"sglang": "sglang", "vllm": "vllm"}
    assert legend(short_names(["sglang", "vllm"])) == []
    cut = short_names(["prefill_first", "chunked_prefill"])
    assert cut == {"chunked_prefill": "chunke", "prefill_first": "prefil"}
    assert legend(cut) == ["names: chunke = chunked_prefill, prefil = prefill_first"]
    apart = short_names(["azure_conv_budget2048", "azure_conv_budget256", "sglang"])
    assert apart == {"azure_conv_budget2048": "azur#1", "azure_conv_budget256": "azur#2",
                     "sglang": "sglang"}
    assert len(set(apart.values())) == 3 and all(len(v) <= 6 for v in apart.values())
