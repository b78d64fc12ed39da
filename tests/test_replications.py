"""Replications and their confidence intervals (`servesim simulate --replications N`), and the
capacity search that decides each rate by a sequential test over replications.

The acceptance test is a coverage check on an M/D/1 queue, whose mean wait is known exactly
(Pollaczek-Khinchine): the 95% interval from replications must cover it in at least 90 of 100
independent repetitions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sim.config.scenario import parse_scenario
from sim.results.metrics.intervals import bootstrap_interval, estimate, t_interval, t_quantile
from sim.runner import run_scenario
from sim.studies.capacity import capacity
from sim.studies.capacity_log import CapacityLog
from sim.studies.rate_decision import SLOTargets, Trial, censored, decide, measured, violations
from sim.studies.replications import DETERMINISTIC, variation_sources
from tests.conftest import assert_one_line_error, run_cli
from tests.conftest import run_cli_out as cli

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


def csv_replay(tmp_path: Path, *, noise: bool = False) -> Path:
    """A replayed trace: 200 requests every 0.2 s (5 req/s), one token in, one out, served
    alone in 0.1 s: capacity 10 req/s, rate scale 2."""
    trace = tmp_path / "trace.csv"
    trace.write_text("t,p,o\n" + "".join(f"{0.2 * i:.1f},1,1\n" for i in range(200)))
    latency: dict = {"kind": "constant", "iteration_s": 0.1}
    if noise:
        latency["noise"] = {"kind": "lognormal", "sigma": 0.1}
    scenario = {"name": "replay", "workload": {
        "format": "csv", "path": "trace.csv",
        "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"}},
        "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                    "latency": latency, "kv_cache": {"num_blocks": 100}}}
    path = tmp_path / ("noisy.yaml" if noise else "replay.yaml")
    path.write_text(yaml.safe_dump(scenario))
    return path


def test_replications_of_a_deterministic_replay_are_refused(tmp_path, monkeypatch, capsys):
    path = csv_replay(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--replications", "3",
                        "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "--replications=3", DETERMINISTIC)
    assert not (tmp_path / "out").exists()
    code, err = run_cli(monkeypatch, capsys, "capacity", str(path), "--sched-delay-p50", "1",
                        "--replications", "3", "--out", str(tmp_path / "cap"))
    assert_one_line_error(code, err, "--replications=3", DETERMINISTIC)
    noisy = parse_scenario(yaml.safe_load(csv_replay(tmp_path, noise=True).read_text()), "x")
    assert variation_sources(noisy) == ["latency noise (lognormal)"]


def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({
        "name": "small",
        "workload": {"format": "synthetic", "num_requests": 60, "arrivals": {"qps": 4.0},
                     "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                                 "output": {"dist": "uniform", "low": 2, "high": 50}}},
        "slo": {"ttft_s": 0.5, "tbt_s": 0.05}}))
    return path


def test_table_has_intervals_and_repeats_byte_for_byte(tmp_path, monkeypatch, capsys):
    path, out = small(tmp_path), tmp_path / "reps"
    args = ("simulate", str(path), "--replications", "3", "--workers", "1", "--out", str(out))
    code, first = cli(monkeypatch, capsys, *args)
    assert code == 0
    saved = (out / "replications.json").read_text()
    code, second = cli(monkeypatch, capsys, *args)  # replaces the first whole
    assert code == 0 and first == second and (out / "replications.json").read_text() == saved
    table = [line for line in first.splitlines() if not line.startswith("results: ")]
    assert "95% CI" in first and max(len(line) for line in table) <= 80
    for label in ("P50 TTFT ms", "P99 TTFT ms", "P99 TBT ms", "mean E2E latency s",
                  "throughput req/s", "SLO attainment: ttft %"):
        row = next(line for line in first.splitlines() if label in line)
        assert ("[" in row and "]" in row) or "all equal" in row, row
    assert "[" in next(line for line in first.splitlines() if "P99 TTFT ms" in line)
    data = json.loads(saved)
    assert data["seeds"] == [0, 1, 2] and data["runs"] == ["rep0", "rep1", "rep2"]
    p99 = data["metrics"]["ttft_s"]["p99"]
    low, high = p99["ci95"]
    assert len(p99["per_replication"]) == 3 and low <= p99["estimate"] <= high
    assert p99["estimate"] == pytest.approx(np.mean(p99["per_replication"]))
    for k in range(3):
        summary = json.loads((out / f"rep{k}" / "summary.json").read_text())
        assert summary["run"]["seed"] == k
        assert (out / f"rep{k}" / "requests.parquet").is_file()


def test_one_replication_is_a_plain_run(tmp_path, monkeypatch, capsys):
    path = small(tmp_path)
    code, plain = cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "a"))
    code1, one = cli(monkeypatch, capsys, "simulate", str(path), "--replications", "1", "--out",
                     str(tmp_path / "b"))
    assert code == code1 == 0
    assert plain.replace(str(tmp_path / "a"), "X") == one.replace(str(tmp_path / "b"), "X")
    assert (tmp_path / "b" / "summary.json").is_file()
    assert not (tmp_path / "b" / "replications.json").exists()


def test_capacity_of_a_deterministic_replay_brackets_it_in_one_run_per_rate(tmp_path):
    scenario = parse_scenario(yaml.safe_load(csv_replay(tmp_path).read_text()), "replay",
                              tmp_path)
    result = capacity(scenario, SLOTargets(sched_delay_p50_s=1.0), precision=0.02)
    assert result["knob"] == "rate_scale" and result["deterministic"]
    assert result["replications"] == 1 and result["num_runs"] == len(result["rates"])
    low, high = result["interval_qps"]
    assert low <= 10.0 <= high and high - low <= (0.02 + 0.01) * high
    assert all(d.reason.startswith("deterministic: one run decides")
               or d.reason.startswith("overloaded") for d in result["rates"])


def test_capacity_with_noise_decides_each_rate_from_replications(tmp_path, monkeypatch, capsys):
    path = csv_replay(tmp_path, noise=True)
    out = tmp_path / "cap"
    code, printed = cli(monkeypatch, capsys, "capacity", str(path), "--sched-delay-p50", "1",
                        "--precision", "0.05", "--out", str(out))
    assert code == 0
    result = json.loads((out / "capacity.json").read_text())
    assert result["replications"] == 5 and result["varies_by"] == ["latency noise (lognormal)"]
    low, high = result["interval_qps"]
    assert 0 < low <= 10.0 <= high
    assert result["num_runs"] == sum(r["runs"] for r in result["rates"])
    for rate in result["rates"]:
        assert rate["decision"] in ("holds", "fails", "unsure") and rate["reason"]
        assert 1 <= rate["runs"] <= 5
        if rate["decision"] == "holds":
            assert rate["runs"] >= 2  # no confidence from one noisy run
    assert f"capacity in [{low:,.4g}, {high:,.4g}] req/s ({result['num_runs']} runs, up to 5 " \
           "per rate)" in " ".join(printed.split())
    for key in ("num_gpus", "capacity_qps_per_gpu", "usd_per_million_tokens"):
        assert key in result


def test_compare_with_replications(tmp_path, monkeypatch, capsys):
    base = yaml.safe_load(small(tmp_path).read_text())
    comparison = tmp_path / "cmp.yaml"
    comparison.write_text(yaml.safe_dump({"name": "cmp", "base": base, "variants": {
        "chunked": {}, "first": {"replica": {"scheduler": {"name": "prefill_first"}}}}}))
    out = tmp_path / "out"
    code, printed = cli(monkeypatch, capsys, "compare", str(comparison), "--replications", "3",
                        "--workers", "1", "--out", str(out))
    assert code == 0 and "[lo, hi]" in printed
    table = pd.read_csv(out / "comparison_replications.csv")
    assert table["variant"].tolist() == ["chunked", "first"]
    assert (table["ttft_p99_s_lo"] <= table["ttft_p99_s"]).all()
    assert (table["ttft_p99_s"] <= table["ttft_p99_s_hi"]).all()
    for variant in ("chunked", "first"):
        data = json.loads((out / variant / "replications.json").read_text())
        assert data["seeds"] == [0, 1, 2] and (out / variant / "rep2" / "summary.json").is_file()


def test_paired_differences_use_the_common_seeds(tmp_path, monkeypatch, capsys):
    # M/D/1 at two service times (load 0.3 and 0.6), the same arrivals in replication k of
    # each: both TTFTs rise and fall with the arrivals' bursts, so the paired interval is
    # narrower than the unpaired one from the same values. One output token a request: no
    # token gaps, no pairs to difference.
    comparison = tmp_path / "cmp.yaml"
    comparison.write_text(yaml.safe_dump({"name": "cmp", "base": md1(0.3, 400), "variants": {
        "fast": {}, "slow": {"replica": {"latency": {"kind": "constant",
                                                      "iteration_s": 2 * SERVICE_S}}}}}))
    out = tmp_path / "out"
    code, printed = cli(monkeypatch, capsys, "compare", str(comparison), "--replications", "5",
                        "--workers", "1", "--out", str(out))
    assert code == 0 and "slow - fast" in printed
    diff = pd.read_csv(out / "comparison_differences.csv").set_index("metric")
    assert set(diff["variant"]) == {"slow"} and set(diff["baseline"]) == {"fast"}
    assert diff["num_pairs"].to_dict() == {
        "ttft_p50_s": 5, "ttft_p99_s": 5, "tbt_p50_s": 0, "tbt_p99_s": 0, "e2e_p99_s": 5,
        "output_tokens_per_s": 5, "slo_attainment": 0}
    assert diff.loc[["tbt_p99_s", "slo_attainment"], "difference"].isna().all()
    per = {v: json.loads((out / v / "replications.json").read_text())["metrics"]
           for v in ("fast", "slow")}
    ttft = [np.array(per[v]["ttft_s"]["p99"]["per_replication"]) for v in ("fast", "slow")]
    row = diff.loc["ttft_p99_s"]
    assert row["difference"] == pytest.approx(float(np.mean(ttft[1] - ttft[0])), rel=1e-12)
    assert row["lo"] < row["difference"] < row["hi"] and bool(row["clear"])
    unpaired_half = t_quantile(0.975, 4) * math.sqrt(
        (ttft[0].var(ddof=1) + ttft[1].var(ddof=1)) / 5)
    assert row["hi"] - row["lo"] < 2 * unpaired_half
    assert diff.loc["ttft_p50_s", "difference"] > SERVICE_S  # at least the longer service


# -- review fixes ------------------------------------------------------------------------------

def constant_latency(tmp_path: Path) -> Path:
    """`small` with a constant iteration time: every run's token gaps are the same 10 ms."""
    data = yaml.safe_load(small(tmp_path).read_text())
    data["replica"] = {"latency": {"kind": "constant", "iteration_s": 0.01}}
    path = tmp_path / "syn.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_intervals_are_clipped_and_equal_replications_give_none():
    spread = estimate([0.001, 0.5], "bootstrap")  # a wide t interval would go below 0
    assert spread["ci95"][0] == 0.0 and spread["ci95"][1] > 0.5
    share = estimate([0.5, 1.0], "t", (0.0, 1.0))
    assert share["ci95"][0] >= 0.0 and share["ci95"][1] == 1.0
    same = estimate([0.01, 0.01, 0.01 * (1 + 1e-13)], "bootstrap")  # equal to rounding
    assert same["ci95"] is None and same["note"] == "all 3 replications equal"
    assert same["estimate"] == pytest.approx(0.01)
    assert estimate([None, 0.2, None], "t")["ci95"] == [None, None]  # one value: no interval


def test_constant_latency_replications_print_all_equal(tmp_path, monkeypatch, capsys):
    out = tmp_path / "reps"
    code, printed = cli(monkeypatch, capsys, "simulate", str(constant_latency(tmp_path)),
                        "--replications", "2", "--workers", "1", "--out", str(out))
    assert code == 0
    data = json.loads((out / "replications.json").read_text())
    tbt = data["metrics"]["tbt_s"]["p50"]
    assert tbt["ci95"] is None and tbt["note"] == "all 2 replications equal"
    for section in ("ttft_s", "tbt_s", "e2e_s"):
        for metric in data["metrics"][section].values():
            assert metric["ci95"] is None or metric["ci95"][0] >= 0.0
    for metric in data["metrics"]["throughput"].values():
        assert metric["ci95"] is None or metric["ci95"][0] >= 0.0
    for metric in data["metrics"]["slo"].values():
        assert metric["ci95"] is None or 0.0 <= metric["ci95"][0] <= metric["ci95"][1] <= 1.0
    row = next(line for line in printed.splitlines() if "P50 TBT ms" in line)
    assert "all equal" in row and "[" not in row
    marks = data["censoring"]["ttft_all_arrived_s"]
    assert marks["num_lower_bounds"] == [0, 0] and marks["is_lower_bound"]["p99"] == [False] * 2


def test_a_single_run_and_replications_replace_each_other(tmp_path, monkeypatch, capsys):
    path, out = small(tmp_path), tmp_path / "out"
    reps = ("simulate", str(path), "--replications", "3", "--workers", "1", "--out", str(out))
    assert cli(monkeypatch, capsys, *reps)[0] == 0
    assert cli(monkeypatch, capsys, "simulate", str(path), "--out", str(out))[0] == 0
    assert (out / "summary.json").is_file() and not (out / "replications.json").exists()
    assert cli(monkeypatch, capsys, *reps)[0] == 0
    assert (out / "replications.json").is_file() and not (out / "summary.json").exists()


def test_replications_holding_more_than_their_runs_are_never_replaced(tmp_path, monkeypatch,
                                                                     capsys):
    path, out = small(tmp_path), tmp_path / "out"
    reps = ("simulate", str(path), "--replications", "2", "--workers", "1", "--out", str(out))
    assert cli(monkeypatch, capsys, *reps)[0] == 0
    (out / "plots").mkdir()
    (out / "rep0" / "plots").mkdir()
    (out / "report.html").write_text("")
    assert cli(monkeypatch, capsys, *reps)[0] == 0  # only what servesim writes there
    (out / "rep1" / "notes.txt").write_text("mine")
    for args in (reps, ("simulate", str(path), "--out", str(out))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, "holds 'rep1/notes.txt', which no run writes",
                              "replacing the earlier replications would delete it")
    assert (out / "rep1" / "notes.txt").read_text() == "mine"


def comparison(tmp_path: Path) -> Path:
    base = yaml.safe_load(small(tmp_path).read_text())
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump({"name": "cmp", "base": base, "variants": {
        "chunked": {}, "first": {"replica": {"scheduler": {"name": "prefill_first"}}}}}))
    return path


def test_compare_plain_and_replicated_replace_each_other(tmp_path, monkeypatch, capsys):
    path, out = comparison(tmp_path), tmp_path / "out"
    replicated = ("compare", str(path), "--replications", "2", "--workers", "1", "--out",
                  str(out))
    assert cli(monkeypatch, capsys, *replicated)[0] == 0
    assert cli(monkeypatch, capsys, "compare", str(path), "--out", str(out))[0] == 0
    assert (out / "comparison.csv").is_file()
    assert not (out / "comparison_replications.csv").exists()  # stale: removed
    assert (out / "first" / "summary.json").is_file()
    assert cli(monkeypatch, capsys, *replicated)[0] == 0
    assert (out / "comparison_replications.csv").is_file()
    assert not (out / "comparison.csv").exists()
    assert (out / "first" / "replications.json").is_file()
    (out / "notes.txt").write_text("mine")  # not a comparison's: never replaced
    code, err = run_cli(monkeypatch, capsys, *replicated)
    assert_one_line_error(code, err, "notes.txt")



@pytest.mark.parametrize("entry", [".notes", ".git/HEAD"])
def test_a_comparison_never_replaces_a_users_dot_entry(tmp_path, monkeypatch, capsys, entry):
    """A replicated comparison replaces its directory whole: an entry of the user's whose name
    starts with '.' was skipped by the check and deleted by the swap, without a word. Now it
    refuses both kinds of comparison, naming the entry; servesim's own leftovers and the
    Finder's .DS_Store do not."""
    path, out = comparison(tmp_path), tmp_path / "out"
    replicated = ("compare", str(path), "--replications", "2", "--workers", "1", "--out",
                  str(out))
    assert cli(monkeypatch, capsys, *replicated)[0] == 0
    (out / ".DS_Store").write_text("finder")
    (out / ".first.tmp-x1y2z3").mkdir()  # a crashed run's temporary
    assert cli(monkeypatch, capsys, *replicated)[0] == 0
    mine = out / entry
    mine.parent.mkdir(exist_ok=True)
    mine.write_text("mine")
    for args in (replicated, ("compare", str(path), "--out", str(out))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, f"holds {entry.split('/')[0]}",
                              "not part of an earlier comparison")
    assert mine.read_text() == "mine"
    assert (out / "comparison_replications.csv").is_file()  # the earlier comparison, untouched


def test_results_lines_of_compare_and_capacity_fit_80_columns(tmp_path, monkeypatch, capsys):
    # They were one line of 110 (compare), 181 (compare --replications) and 96 (capacity)
    # columns for results/compare_prefix_caching_long: a terminal folded them inside paths.
    monkeypatch.chdir(tmp_path)
    path, out = comparison(tmp_path), "results/compare_prefix_caching_long"
    runs = [("compare", str(path), "--out", out),
            ("compare", str(path), "--replications", "2", "--workers", "1", "--out", out),
            ("capacity", str(small(tmp_path)), "--tbt-p99", "0.1", "--replications", "1",
             "--precision", "0.2", "--out", out + "-capacity")]
    for args in runs:
        code, printed = cli(monkeypatch, capsys, *args)
        lines = printed.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("results: "))
        assert lines[start].startswith(f"results: {args[-1]}/")
        assert len(lines) - start >= 2 and all(len(line) <= 80 for line in lines[start:]), \
            lines[start:]


def test_interrupted_replicated_compare_leaves_the_earlier_one(tmp_path, monkeypatch, capsys):
    import sim.studies.replications as reps

    path, out = comparison(tmp_path), tmp_path / "out"
    args = ("compare", str(path), "--replications", "2", "--workers", "1", "--out", str(out))
    assert cli(monkeypatch, capsys, *args)[0] == 0
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}
    real, calls = reps.run_replications, []

    def second_interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(reps, "run_replications", second_interrupted)
    code, err = run_cli(monkeypatch, capsys, *args)
    assert code == 130 and "nothing changed" in err
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


def test_interrupt_during_the_swap_says_the_new_results_are_in(tmp_path, monkeypatch, capsys):
    import sim.studies.replications as reps
    from sim.results.outdir import SwappedInterrupt, swap_in

    def swap_then_interrupt(tmp, out):
        swap_in(tmp, out)
        raise SwappedInterrupt

    monkeypatch.setattr(reps, "swap_in", swap_then_interrupt)
    out = tmp_path / "out"
    code, printed = cli(monkeypatch, capsys, "simulate", str(small(tmp_path)),
                        "--replications", "2", "--workers", "1", "--out", str(out))
    assert code == 130 and "new results are in" in printed and "previous" not in printed
    assert (out / "replications.json").is_file()


def test_interrupt_during_a_single_runs_swap_says_it_is_in(tmp_path, monkeypatch, capsys):
    import sim.results.outdir as outdir

    real = outdir.swap_in

    def swap_then_interrupt(tmp, out):
        real(tmp, out)
        raise outdir.SwappedInterrupt

    monkeypatch.setattr(outdir, "swap_in", swap_then_interrupt)
    out = tmp_path / "out"
    code, printed = cli(monkeypatch, capsys, "simulate", str(small(tmp_path)), "--out", str(out))
    assert code == 130 and "the new results are in" in printed and "previous" not in printed
    assert (out / "summary.json").is_file()


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


def test_capacity_with_no_failing_rate_has_an_unbounded_upper_end(tmp_path, monkeypatch,
                                                                   capsys):
    from sim.cli.study import capacity_table
    from sim.plots import plot_capacity
    from tests.test_sweep import ONE_AT_A_TIME

    scenario = parse_scenario(ONE_AT_A_TIME, "test")
    draws = iter(np.random.default_rng(0).uniform(0.01, 0.02, 1000))

    def run(s):
        return fake_results({}, p90=float(next(draws)))

    log = CapacityLog(tmp_path / "cap")
    targets = SLOTargets(ttft_p90_s=1.0)
    result = capacity(scenario, targets, 3, max_steps=2, run=run, on_trial=log.add)
    assert result["interval_qps"][1] is None and result["ci95_qps"][1] is None
    assert result["ci95_qps"][0] == result["capacity_qps"] > 0
    assert "unbounded" in result["interval_meaning"]
    assert "per probed rate" in result["interval_meaning"]
    log.finish(scenario, targets, 0.02, result)
    saved = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert saved["ci95_qps"][1] is None
    capsys.readouterr()
    from sim.cli.common import console
    console.print(capacity_table("test", result))
    assert "unbounded" in " ".join(capsys.readouterr().out.split())
    files = plot_capacity([tmp_path / "cap"])
    assert any(f.name == "capacity.png" for f in files)


def test_capacity_lines_show_milliseconds_never_equal_to_a_target_they_miss():
    from sim.studies.rate_decision import ms

    assert ms(0.03928) == "39.28 ms"
    assert ms(2.0) == "2,000 ms"
    assert ms(math.inf) == "unbounded"
    # 40.0003 ms misses a 40 ms target: shown with the digits that say so, not "40 > 40".
    assert ms(0.0400003, 0.04) == "40.0003 ms"
    assert ms(0.04, 0.04) == "40 ms"
