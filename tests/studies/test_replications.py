"""Replications (`servesim simulate --replications N`, `compare --replications N`): refused where
nothing varies, their interval tables byte for byte, paired differences on common seeds, and the
result directories they replace or keep (interrupts included)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sim.config.scenario import parse_scenario
from sim.results.metrics.intervals import t_quantile
from sim.studies.replications import DETERMINISTIC, variation_sources
from tests.helpers import assert_one_line_error, csv_replay, run_cli
from tests.helpers import run_cli_out as cli
from tests.results.test_intervals import SERVICE_S, md1


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


def test_one_replication_given_is_refused_not_run_plain(tmp_path, monkeypatch, capsys):
    """`--replications 1` ran a plain run without a word (no intervals, no replications.json):
    asked for, it is refused in one line; left out, the run is plain (issue 49)."""
    path = small(tmp_path)
    code, _ = cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "a"))
    assert code == 0 and (tmp_path / "a" / "summary.json").is_file()
    assert not (tmp_path / "a" / "replications.json").exists()
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--replications", "1",
                        "--out", str(tmp_path / "b"))
    assert_one_line_error(code, err, "--replications=1", "plain run", "2 or more")
    assert not (tmp_path / "b").exists()


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
