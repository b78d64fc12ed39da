"""Figures a paper would print: legends by the scenario's own names in numeric order, a log-2
budget axis, TTFT beside TBT for sweeps, CDFs of every TBT gap, a busiest-window timeline
with both pools, a comparison's variants overlaid; labels from `sim.results.labels`; plots of
runs and sweeps from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.container import BarContainer

from sim.cli import main
from sim.config.scenario import parse_scenario
from sim.plots import busiest_window, plot_results, tbt_sample
from sim.plots.timeline import requests_in_flight
from sim.results import labels
from sim.results.metrics.summary import distribution
from sim.results.run_dir import Results
from sim.runner import run_scenario
from sim.studies.compare import compare
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import assert_one_line_error, colocated_run, run_cli, run_cli_out
from tests.studies.test_sweep import sweep_file

# Chunked prefill on a small synthetic load; prompts long enough that the budget matters.
CHUNKED = {
    "name": "tiny",
    "workload": {"format": "synthetic", "num_requests": 60,
                 "arrivals": {"process": "poisson", "qps": 8.0},
                 "lengths": {"prompt": {"dist": "uniform", "low": 100, "high": 900},
                             "output": {"dist": "uniform", "low": 5, "high": 40}}},
    "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                "scheduler": {"name": "chunked_prefill", "token_budget": 256},
                "latency": {"kind": "roofline"}},
    "slo": {"ttft_s": 0.5, "tbt_s": 0.05},
}


def svg(path: Path) -> str:
    return path.with_suffix(".svg").read_text()


@pytest.fixture(scope="module")
def budget_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("budget")
    (root / "base.yaml").write_text(yaml.safe_dump(CHUNKED))
    (root / "sweep.yaml").write_text(
        "name: budget\nbase: base.yaml\ngrid:\n"
        "  replica.scheduler.token_budget: [2048, 128, 256, 512]\n"
        "  workload.arrivals.qps: [8.0]\n")
    _, runs = load_sweep(root / "sweep.yaml")
    run_sweep(runs, root / "out")
    return root / "out"


def test_labels_name_every_metric_once():
    assert labels.label("tbt_p99_s") == "P99 TBT" and labels.unit("tbt_p99_s") == labels.MS
    assert labels.axis_label("ttft_p50_s") == "P50 TTFT (ms)"
    assert labels.axis_label("tbt_p99_s_lo") == "P99 TBT, 95% CI low (ms)"
    assert labels.param_label("replica.scheduler.token_budget") == "token budget (tokens)"
    assert labels.param_label("workload.some_field") == "some field"
    assert labels.variant_label('{"name": "chunked_prefill", "token_budget": 2048}') == (
        "chunked prefill, budget 2048")
    assert labels.variant_label({"name": "prefill_first"}) == "prefill-first"
    names = ["chunked prefill, budget 2048", "chunked prefill, budget 256", "prefill-first"]
    assert sorted(names, key=labels.natural_key) == [names[1], names[0], names[2]]
    assert "ITL" in labels.__doc__ and "TPOT" in labels.__doc__  # the one definition of TBT


def test_budget_sweep_has_a_log2_budget_axis_and_ttft_beside_tbt(budget_sweep):
    files = plot_results([budget_sweep])
    names = [f.name for f in files]
    assert names[:4] == ["p99_tbt_vs_token_budget.png", "p99_tbt_vs_token_budget.svg",
                         "ttft_vs_token_budget.png", "ttft_vs_token_budget.svg"]
    from sim.plots.sweep import sweep_axes

    table = pd.read_parquet(budget_sweep / "results.parquet")
    assert sweep_axes(table) == ("replica.scheduler.token_budget", "seed",
                                 "arrival rate 8 req/s")
    text = svg(budget_sweep / "plots" / "p99_tbt_vs_token_budget")
    assert "P99 TBT vs token budget" in text and "token budget (tokens)" in text
    assert "P99 TBT (ms)" in text and "replica.scheduler" not in text
    import matplotlib.pyplot as plt

    from sim.plots.sweep import _finish, _lines
    fig, ax = plt.subplots()
    lines = _lines(table, "replica.scheduler.token_budget", "seed", "tbt_p99_s", None)
    _finish(ax, "replica.scheduler.token_budget", lines)
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256", "512", "2048"]
    plt.close(fig)
    assert "TTFT P50 and P99 vs token budget" in svg(budget_sweep / "plots" /
                                                      "ttft_vs_token_budget")


def test_load_sweep_legend_is_scheduler_names_in_numeric_order(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(CHUNKED))
    (tmp_path / "sweep.yaml").write_text(
        "name: sched\nbase: base.yaml\ngrid:\n  workload.arrivals.qps: [4.0, 8.0, 200.0]\n"
        "zip:\n  replica.scheduler:\n"
        "    - {name: chunked_prefill, token_budget: 2048}\n"
        "    - {name: chunked_prefill, token_budget: 256}\n"
        "    - {name: prefill_first}\n")
    _, runs = load_sweep(tmp_path / "sweep.yaml")
    run_sweep(runs, tmp_path / "out")
    plot_results([tmp_path / "out"])
    text = svg(tmp_path / "out" / "plots" / "p99_tbt_vs_load")
    entries = ["chunked prefill, budget 256", "chunked prefill, budget 2048", "prefill-first"]
    assert [text.index(e) for e in entries] == sorted(text.index(e) for e in entries)
    assert '"name"' not in text and "token_budget" not in text  # no raw JSON
    assert "arrival rate (req/s)" in text and "P99 TBT vs arrival rate" in text
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert (table["overload"] == "overloaded").any()
    for figure in ("p99_tbt_vs_load", "ttft_vs_load"):
        assert "overloaded" in svg(tmp_path / "out" / "plots" / figure)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    run_scenario(parse_scenario(CHUNKED, "test")).write(out)
    return out


@pytest.mark.parametrize("scheduler", [{"name": "chunked_prefill", "token_budget": 256},
                                       {"name": "prefill_first"}])
def test_the_written_gaps_are_the_summarys(tmp_path, scheduler):
    # prefill_first runs prefill-only iterations that skip the decodes: no rule on the
    # iteration log gives its gaps, the run's own gaps file does.
    out = tmp_path / "run"
    scenario = {**CHUNKED, "replica": {**CHUNKED["replica"], "scheduler": scheduler}}
    run_scenario(parse_scenario(scenario, "test")).write(out)
    summary = json.loads((out / "summary.json").read_text())
    sample = tbt_sample(Results.load(out))
    assert sample.key == "tbt_s"
    got, want = distribution(sample.values), summary["tbt_s"]
    assert got["count"] == want["count"] > 60
    for k in ("p50", "p90", "p99", "max", "mean"):
        assert got[k] == pytest.approx(want[k], rel=1e-12)


def test_recorded_token_times_give_the_same_gaps(tmp_path):
    out = tmp_path / "run"
    run_scenario(parse_scenario({**CHUNKED, "record_token_times": True}, "test")).write(out)
    (out / "tbt_gaps.parquet").unlink()  # as a run written before the gaps file existed
    summary = json.loads((out / "summary.json").read_text())
    got = distribution(tbt_sample(Results.load(out)).values)
    assert got["count"] == summary["tbt_s"]["count"]
    assert got["p99"] == pytest.approx(summary["tbt_s"]["p99"], rel=1e-12)


def test_run_cdf_draws_every_gap_with_slo_and_tail(run_dir):
    plot_results([run_dir])
    text = svg(run_dir / "plots" / "cdf")
    assert "TBT, every gap" in text and "worst TBT" not in text
    assert "SLO 50 ms" in text and "fraction above" in text and "P99" in text
    assert "SLO 500 ms" in text or "SLO 0.5 s" in text  # the TTFT panel names its line too


@pytest.mark.slow
def test_timeline_shows_the_busiest_window(run_dir):
    its = pd.read_parquet(run_dir / "iterations.parquet")
    start, end = busiest_window(its, 1.0)
    tokens = its["num_prefill_tokens"] + its["num_decode_tokens"]
    inside = tokens[(its["start_s"] >= start) & (its["start_s"] < end)].sum()
    for s in its["start_s"]:  # no window of 1 s from an iteration's start holds more
        assert tokens[(its["start_s"] >= s) & (its["start_s"] < s + 1.0)].sum() <= inside
    plot_results([run_dir])
    assert "(the busiest window)" in svg(run_dir / "plots" / "timeline")
    plot_results([run_dir], window_s=(0.5, 1.5))
    text = svg(run_dir / "plots" / "timeline")
    assert "iterations, 0.5 to 1.5 s" in text and "busiest" not in text


def test_timeline_counts_running_requests_across_a_pipeline(run_dir):
    """The running line counts the requests of every iteration in progress: an iteration's own
    where they follow one another; on a pipeline (two in flight, each its own micro-batch),
    their sum, which stepping between the micro-batches' counts would zig-zag."""
    its = pd.read_parquet(run_dir / "iterations.parquet")
    assert (requests_in_flight(its) == its["num_seqs"].to_numpy()).all()

    staged = dict(CHUNKED, replica={**CHUNKED["replica"], "model": "llama-3.1-70b",
                                    "parallelism": {"tensor": 4, "pipeline": 2}})
    its = run_scenario(parse_scenario(staged, "test")).iterations
    start = its["start_s"].to_numpy()
    end = start + its["duration_s"].to_numpy()
    seqs = its["num_seqs"].to_numpy()
    brute = [int(seqs[(start <= t) & (t < end)].sum()) for t in start]
    got = requests_in_flight(its)
    assert got.tolist() == brute
    assert (got > seqs).mean() > 0.5  # mostly two micro-batches in flight


def test_window_and_replica_options_are_checked(run_dir, monkeypatch, capsys):
    for args, needle in ((["--window", "5"], "START:END"), (["--window", "3:1"], "START < END"),
                         (["--replica", "7"], "no such replica")):
        code, err = run_cli(monkeypatch, capsys, "plot", str(run_dir), *args)
        assert_one_line_error(code, err, needle)


@pytest.mark.slow
def test_comparison_overlays_variants_and_shows_both_pools(tmp_path):
    base = parse_scenario(CHUNKED, "test")
    disagg = parse_scenario({**CHUNKED, "cluster": {
        "prefill": {"replicas": 1, "replica": CHUNKED["replica"]},
        "decode": {"replicas": 1, "replica": CHUNKED["replica"]}}}, "test")
    compare({"colocated": base, "disaggregated": disagg}, tmp_path / "cmp")
    files = plot_results([tmp_path / "cmp"])
    assert [f.name for f in files if f.suffix == ".png"] == ["cdf.png", "headline.png"]
    text = svg(tmp_path / "cmp" / "plots" / "cdf")
    assert "colocated" in text and "disaggregated" in text
    headline = svg(tmp_path / "cmp" / "plots" / "headline")
    assert "P99 TTFT" in headline and "SLO attainment" in headline
    plot_results([tmp_path / "cmp" / "disaggregated"])
    timeline = svg(tmp_path / "cmp" / "disaggregated" / "plots" / "timeline")
    assert "prefill replica 0" in timeline and "decode replica 1" in timeline


@pytest.mark.slow
def test_figures_are_byte_identical_when_drawn_twice(run_dir, tmp_path):
    first = {f.name: f.read_bytes() for f in plot_results([run_dir], tmp_path / "a")}
    second = {f.name: f.read_bytes() for f in plot_results([run_dir], tmp_path / "b")}
    assert first == second and np.all([len(v) > 5_000 for v in first.values()])


def test_capacity_figures_name_their_interval_and_draw_per_gpu(tmp_path, monkeypatch, capsys):
    """A deterministic replay on two replicas: its interval is the bisection's bracket (not a
    confidence interval), said so in the figures and the report; per GPU drawn and labelled."""
    import sim.plots.capacity as capacity_plots
    from sim.report import render_report
    from tests.helpers import csv_replay
    from tests.outputs.test_report import check_self_contained

    code, _ = run_cli_out(monkeypatch, capsys, "capacity", str(csv_replay(tmp_path)),
                          "--sched-delay-p50", "1", "--set", "cluster.replicas=2",
                          "--out", str(tmp_path / "cap"))
    assert code == 0
    result = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert result["deterministic"] and result["num_gpus"] == 2
    drawn: dict = {}

    def keep(fig, path: Path) -> list[Path]:
        drawn[path.name] = fig
        return [path.with_suffix(".png")]

    with monkeypatch.context() as patched:
        patched.setattr(capacity_plots, "save", keep)
        plot_results([tmp_path / "cap"], tmp_path / "plots")
    assert sorted(drawn) == ["capacity", "capacity_per_gpu", "capacity_trials"]
    total, per_gpu = drawn["capacity"].axes[0], drawn["capacity_per_gpu"].axes[0]
    for ax in (total, per_gpu):
        title = " ".join(ax.get_title().split())
        assert "error bars: bisection bracket [rate held, rate failed]" in title
        assert "CI" not in title and "confidence" not in title
    assert total.get_ylabel() == "capacity (req/s)"
    assert per_gpu.get_ylabel() == "capacity per GPU (req/s)"
    low, high = result["interval_qps"]
    for ax, gpus in ((total, 1), (per_gpu, 2)):
        (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
        assert bars.patches[0].get_height() == pytest.approx(result["capacity_qps"] / gpus)
        (whisker,) = bars.errorbar.lines[2][0].get_segments()
        assert whisker[:, 1] == pytest.approx([low / gpus, high / gpus])
    trials = drawn["capacity_trials"].axes[0]
    assert "bisection bracket [rate held, rate failed]" in [
        t.get_text() for t in trials.get_legend().get_texts()]
    page = check_self_contained(render_report(tmp_path / "cap"))
    assert page.row("interval: bisection bracket [rate held, rate failed]")[1] == "req/s"
    assert page.row("capacity per GPU")[1:] == ["req/s", f"{result['capacity_qps_per_gpu']:.4g}"]


def test_one_load_budget_points_are_joined_in_budget_order(budget_sweep, monkeypatch):
    # At one load the throughputs barely differ: joined along throughput, the line zig-zags.
    import sim.plots.sweep as sweep_plots

    table = pd.read_parquet(budget_sweep / "results.parquet")
    captured = []
    real_save = sweep_plots.save

    def keep(fig, path):
        captured.append([t.get_text() for t in fig.axes[0].texts])
        return real_save(fig, path)

    monkeypatch.setattr(sweep_plots, "save", keep)
    sweep_plots.latency_vs_throughput(table, "seed", budget_sweep / "plots" / "lvt",
                                      point_labels="replica.scheduler.token_budget")
    assert captured == [[f"token budget {b}" for b in (128, 256, 512, 2048)]]


def test_a_window_without_iterations_is_refused(run_dir, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "plot", str(run_dir), "--window", "1000:2000")
    assert_one_line_error(code, err, "<command line>", "--window='1000:2000'", "no iteration")


def test_a_run_where_nothing_finished_draws_empty_panels_without_warnings(tmp_path):
    out = tmp_path / "run"
    run_scenario(parse_scenario({**CHUNKED, "horizon_s": 0.001}, "test")).write(out)
    assert json.loads((out / "summary.json").read_text())["requests"]["finished"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "identical low and high xlims", say
        plot_results([out])
    assert "no values in these runs" in svg(out / "plots" / "cdf")


@pytest.mark.slow
def test_worst_gap_per_request_only_when_asked(run_dir, tmp_path, monkeypatch, capsys):
    plot_results([run_dir], tmp_path / "w")
    code, _ = run_cli_out(monkeypatch, capsys, "plot", str(run_dir), "--worst-tbt", "--out",
                          str(tmp_path / "w"))
    assert code == 0
    text = svg(tmp_path / "w" / "cdf_worst_tbt")
    assert "worst TBT" in text and "every gap" not in text
    assert "every gap" in svg(tmp_path / "w" / "cdf")  # the figure drawn before is kept
    assert "every gap" in svg(plot_results([run_dir], tmp_path / "e")[0])
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "sweep.json").write_text("{}")
    code, err = run_cli(monkeypatch, capsys, "plot", str(tmp_path / "sw"), "--worst-tbt")
    assert_one_line_error(code, err, "--worst-tbt", "this is a sweep")


def test_bar_numbers_read_as_the_tables_print_them():
    from sim.plots.compare import _bar_number
    assert [_bar_number(v) for v in (5841.2, 621.4, 10.94, float("nan"))] == [
        "5,841", "621", "10.9", ""]


@pytest.mark.slow
def test_plots_are_written_for_runs_and_sweeps(tmp_path, monkeypatch, capsys):
    path = sweep_file(tmp_path, "grid:\n  workload.arrivals.qps: [2, 6]\n"
                                "  replica.scheduler.token_budget: [256, 1024]\n")
    _, runs = load_sweep(path)
    out = tmp_path / "out"
    run_sweep(runs, out)
    monkeypatch.setattr(sys, "argv", ["servesim", "plot", str(out)])
    main()
    run_dir = next((out / "runs").iterdir())
    monkeypatch.setattr(sys, "argv", ["servesim", "plot", str(run_dir)])
    main()
    for figure in ("p99_tbt_vs_load", "latency_vs_throughput"):
        for suffix in (".png", ".svg"):
            assert (out / "plots" / (figure + suffix)).stat().st_size > 5_000
        assert "SLO 100 ms" in (out / "plots" / f"{figure}.svg").read_text()  # the base's
    for figure in ("cdf", "timeline"):
        assert (run_dir / "plots" / (figure + ".png")).stat().st_size > 5_000
    from sim.plots import capacity_bars

    files = capacity_bars({"strict": {"chunked": 3.0, "prefill_first": 1.0},
                           "relaxed": {"chunked": 5.0, "prefill_first": 4.0}},
                          tmp_path / "cap")
    assert all(f.stat().st_size > 5_000 for f in files)


def test_plot_says_in_one_line_that_a_file_holds_its_default_directory(tmp_path, monkeypatch,
                                                                        capsys):
    """A run directory holding a file named `plots`: one line naming the default figure
    directory, not a traceback (FileExistsError)."""
    run = colocated_run(tmp_path)
    (run / "plots").write_text("not a directory")
    code, err = run_cli(monkeypatch, capsys, "plot", str(run))
    assert_one_line_error(code, err, "RESULTS/plots", "exists and is not a directory")


def test_plot_says_in_one_line_that_a_read_only_run_cannot_hold_figures(tmp_path, monkeypatch,
                                                                        capsys):
    """A read-only copy of a run: one line, not a PermissionError traceback (give --out). Root
    writes into read-only directories, so as root the command runs as `nobody` (setpriv),
    on a copy of the run that user can read."""
    if os.geteuid() != 0:
        run = colocated_run(tmp_path)
        run.chmod(0o555)
        try:
            code, err = run_cli(monkeypatch, capsys, "plot", str(run))
        finally:
            run.chmod(0o755)
        assert_one_line_error(code, err, "RESULTS/plots", "cannot write there")
        return
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("as root, needs setpriv (util-linux) to run the command as another user")
    shared = Path(tempfile.mkdtemp(prefix="servesim-read-only-"))  # pytest's is root's alone
    try:
        shared.chmod(0o755)
        run = shutil.copytree(colocated_run(tmp_path), shared / "run")
        for path in [run, *run.iterdir()]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        config = shared / "matplotlib"  # somewhere `nobody` may write its font cache
        config.mkdir(mode=0o777)
        config.chmod(0o777)
        done = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-m", "sim", "plot", str(run)], capture_output=True, text=True, timeout=300,
            cwd=shared, env={**os.environ, "MPLCONFIGDIR": str(config), "HOME": str(config)})
        assert_one_line_error(done.returncode, done.stderr, "RESULTS/plots", "cannot write there")
        assert not (run / "plots").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
