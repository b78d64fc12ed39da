"""Figures and reports of replications (`simulate --replications`) and replicated comparisons
(`compare --replications`), on real small runs: the directories are recognised, the CDF bands
span every replication's CDF, the markers' error bars are the intervals `replications.json`
states, and the report shows the interval table and its figures inline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import FillBetweenPolyCollection, LineCollection
from matplotlib.transforms import Bbox

import sim.plots.compare as compare_plots
import sim.plots.replicated as replicated
from sim.config.scenario import parse_scenario
from sim.plots import plot_results
from sim.plots.replicated import cdf_at, common_grid, load_replicated, pooled
from sim.report import render_report
from sim.report.markup import number
from sim.results.metrics.summary import WeightedSample
from sim.results.read import directory_kind
from sim.studies.replications import compare_replications, run_replications
from tests.helpers import assert_one_line_error, run_cli

# 120 requests, noisy roofline iterations: a fraction of a second a replication
SMALL: dict[str, Any] = {
    "name": "small", "seed": 0,
    "workload": {"format": "synthetic", "num_requests": 120, "arrivals": {"qps": 4.0},
                 "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 900},
                             "output": {"dist": "uniform", "low": 2, "high": 50}}},
    "replica": {"latency": {"kind": "roofline", "noise": {"kind": "lognormal", "sigma": 0.2}}},
    "slo": {"ttft_s": 0.5, "tbt_s": 0.05},
}
FIRST = {**SMALL, "replica": {**SMALL["replica"], "scheduler": {"name": "prefill_first"}}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Replications of one scenario (3) and a comparison of two schedulers (2 each)."""
    tmp = tmp_path_factory.mktemp("replicated")
    small = parse_scenario(SMALL, "small.yaml")
    run_replications(small, 3, tmp / "reps", workers=1)
    compare_replications({"chunked": small, "first": parse_scenario(FIRST, "first.yaml")}, 2,
                         tmp / "cmp", workers=1)
    return {"reps": tmp / "reps", "cmp": tmp / "cmp"}


@pytest.fixture
def figures(monkeypatch) -> dict[str, Any]:
    """The figures drawn, kept open by name instead of saved."""
    drawn: dict[str, Any] = {}

    def keep(fig: Any, path: Path) -> list[Path]:
        drawn[path.name] = fig
        return [path.with_suffix(".png"), path.with_suffix(".svg")]

    monkeypatch.setattr(replicated, "save", keep)
    monkeypatch.setattr(compare_plots, "save", keep)  # the headline bars are drawn there
    return drawn


def test_directories_are_recognised_by_their_marker_files(dirs, tmp_path, monkeypatch,
                                                          capsys):
    assert directory_kind(dirs["reps"]) == "replications"
    assert directory_kind(dirs["cmp"]) == "replicated_comparison"
    assert directory_kind(dirs["cmp"] / "first") == "replications"
    assert directory_kind(dirs["reps"] / "rep1") == "run"
    (tmp_path / "empty").mkdir()
    code, err = run_cli(monkeypatch, capsys, "plot", str(tmp_path / "empty"))
    assert_one_line_error(code, err, "no servesim results here", "replications.json",
                          "comparison_replications.csv")


def test_malformed_replications_file_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "replications.json").write_text(json.dumps({"scenario": "x"}))
    assert directory_kind(bad) == "replications"
    for command in ("plot", "report"):
        code, err = run_cli(monkeypatch, capsys, command, str(bad))
        assert_one_line_error(code, err, "replications.json", "not a replications result")


def test_cdf_on_the_grid_is_the_samples_own_cdf(dirs):
    rep = load_replicated(dirs["reps"])
    samples = [s.values for s in rep.tbt]
    distinct = np.unique(np.concatenate([s.values for s in samples]))
    assert len(distinct) > replicated.GRID_POINTS  # noise: every gap its own value
    assert len(common_grid(samples)) == replicated.GRID_POINTS
    grid = common_grid(samples, points=len(distinct))
    assert np.array_equal(grid, distinct)
    for sample in samples:
        at = cdf_at(sample, grid)
        assert at[-1] == 1.0 and np.all(np.diff(at) >= 0)
        for i in range(0, len(grid), max(1, len(grid) // 50)):
            assert at[i] == sample.fraction_at_most(grid[i])
    curves = np.array([cdf_at(s, grid) for s in samples])
    mixed = cdf_at(pooled(samples), grid)  # the pooled line lies inside the band
    assert np.all(curves.min(axis=0) <= mixed + 1e-12)
    assert np.all(mixed <= curves.max(axis=0) + 1e-12)
    thinned = common_grid(samples, points=40)  # many values: evenly spaced ranks, whole tail
    assert len(thinned) <= 40 and thinned[-1] == grid[-1]
    assert np.array_equal(thinned[-10:], grid[-10:])


def test_cdf_of_an_empty_sample_is_zero_not_a_division_by_zero():
    empty = WeightedSample(np.array([]), np.array([], dtype=np.int64))
    assert cdf_at(empty, np.array([1.0])).tolist() == [0.0]


def _errorbar_ends(ax: Any) -> list[float]:
    """Every horizontal error bar's two ends, left to right."""
    ends = []
    for coll in ax.collections:
        if isinstance(coll, LineCollection) and not isinstance(coll, FillBetweenPolyCollection):
            for seg in coll.get_segments():
                ends += [float(seg[0][0]), float(seg[1][0])]
    return sorted(ends)


def _bands(ax: Any) -> int:
    return sum(isinstance(c, FillBetweenPolyCollection) for c in ax.collections)


def test_replications_figures_have_bands_and_the_stated_intervals(dirs, tmp_path, figures):
    files = plot_results([dirs["reps"]], tmp_path / "out")
    assert [f.name for f in files] == ["cdf.png", "cdf.svg", "intervals.png", "intervals.svg"]
    fig = figures["cdf"]
    top_ttft, top_tbt, tail_ttft, tail_tbt = fig.axes[:4]
    assert [_bands(ax) for ax in fig.axes[:4]] == [1, 1, 1, 1]
    assert "range of the replications' CDFs" in fig._suptitle.get_text()
    metrics = json.loads((dirs["reps"] / "replications.json").read_text())["metrics"]
    assert tail_ttft.get_xlabel() == "TTFT (ms)" and tail_tbt.get_xlabel() == "TBT (ms)"
    for ax, key in ((top_ttft, "ttft_s"), (tail_ttft, "ttft_s"), (top_tbt, "tbt_s"),
                    (tail_tbt, "tbt_s")):
        stated = sorted(1e3 * v for p in ("p50", "p99") for v in metrics[key][p]["ci95"])
        assert _errorbar_ends(ax) == pytest.approx(stated)
    assert {t.get_text() for t in top_tbt.get_legend().get_texts()} >= {
        "small", "P50 ± 95% CI", "P99 ± 95% CI", "SLO 50 ms"}
    panels = figures["intervals"].axes
    assert [ax.get_title() for ax in panels] == ["TTFT", "TBT", "E2E latency"]


def test_replicated_comparison_overlays_variants_with_bands_and_ci_bars(dirs, tmp_path,
                                                                        figures):
    files = plot_results([dirs["cmp"]], tmp_path / "out")
    assert [f.name for f in files] == ["cdf.png", "cdf.svg", "headline.png", "headline.svg"]
    cdf = figures["cdf"]
    assert [_bands(ax) for ax in cdf.axes[:4]] == [2, 2, 2, 2]  # one per variant
    assert [t.get_text() for t in cdf.axes[1].get_legend().get_texts()][:2] == [
        "chunked", "first"]
    table = pd.read_csv(dirs["cmp"] / "comparison_replications.csv")
    tbt_panel = figures["headline"].axes[1]
    bars = [c for c in tbt_panel.containers if hasattr(c, "errorbar") and c.errorbar]
    assert len(bars) == 2  # P50 and P99, each with its error bars
    p99 = bars[1].errorbar.lines[2][0].get_segments()
    for seg, (_, row) in zip(p99, table.iterrows(), strict=True):
        assert (seg[0][1], seg[1][1]) == pytest.approx(
            (1e3 * row["tbt_p99_s_lo"], 1e3 * row["tbt_p99_s_hi"]))
    check_value_labels_clear_of_error_bars(figures["headline"])


def check_value_labels_clear_of_error_bars(fig: Any) -> None:
    """Each bar's number lies inside the axes and touches no error-bar cap or whisker and no
    legend, as drawn (a Line2D of caps spans every bar: each cap is boxed alone)."""
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    points = fig.dpi / 72
    for ax in fig.axes:
        legend = ax.get_legend()
        boxes = [legend.get_window_extent(renderer)] if legend else []
        for c in ax.containers:
            if not getattr(c, "errorbar", None):
                continue
            _, caps, (whiskers,) = c.errorbar.lines
            for seg in whiskers.get_segments():
                boxes.append(Bbox(ax.transData.transform(seg)).padded(1))
            for cap in caps:
                half_w = cap.get_markersize() * points / 2
                half_h = max(cap.get_markeredgewidth() * points / 2, 1)
                for x, y in ax.transData.transform(cap.get_xydata()):
                    boxes.append(Bbox([[x - half_w, y - half_h], [x + half_w, y + half_h]]))
        assert ax.texts, ax.get_title()  # the numbers are drawn
        for text in ax.texts:
            box = text.get_window_extent(renderer)
            assert ax.get_window_extent(renderer).contains(box.x0, box.y1), text.get_text()
            assert not [b for b in boxes if box.overlaps(b)], (text.get_text(), ax.get_title())


@pytest.mark.slow
def test_figures_are_written_and_byte_identical_when_drawn_twice(dirs, tmp_path):
    first = plot_results([dirs["cmp"]], tmp_path / "a")
    again = plot_results([dirs["cmp"]], tmp_path / "b")
    assert all(f.stat().st_size > 1000 for f in first)
    svg = first[1].read_text()
    assert svg.count('id="FillBetweenPolyCollection_') == 8  # 2 variants x 4 axes
    for a, b in zip(first, again, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_replications_report_has_the_interval_table_and_figures(dirs):
    from tests.outputs.test_report import check_self_contained

    page = check_self_contained(render_report(dirs["reps"]))
    assert len(page.images) == 2  # the CDFs and the intervals
    assert {"metric", "estimate", "95% CI", "replications"} <= set(page.headers)
    data = json.loads((dirs["reps"] / "replications.json").read_text())
    p99 = data["metrics"]["ttft_s"]["p99"]
    lo, hi = p99["ci95"]
    assert page.row("P99 TTFT") == ["P99 TTFT", "ms", number(1e3 * p99["estimate"]),
                                    f"[{number(1e3 * lo)}, {number(1e3 * hi)}]", "3",
                                    "bootstrap"]
    assert page.row("throughput")[4] == "3" and page.row("throughput")[5] == "t"
    assert "0 of 3 replications overloaded" in page.text
    assert [r[1] for r in page.rows if len(r) > 1 and r[1].startswith("rep")] == [
        "rep0", "rep1", "rep2"]  # each replication's own values
    assert (dirs["reps"] / "rep0" / "scenario.yaml").read_text() in page.pres


def test_replicated_comparison_report_shows_each_variant_with_intervals(dirs):
    from tests.outputs.test_report import check_self_contained

    page = check_self_contained(render_report(dirs["cmp"]))
    assert len(page.images) == 2  # CDFs and headline bars
    assert {"variant", "replications", "P99 TTFT (ms)", "P99 TBT (ms)",
            "overloaded replications"} <= set(page.headers)
    table = pd.read_csv(dirs["cmp"] / "comparison_replications.csv")
    row = table.set_index("variant").loc["first"]
    cells = page.row("first")
    assert cells[1] == "2"
    assert cells[3] == (f"{number(1e3 * row['ttft_p99_s'])}"  # estimate<br>[lo, hi]
                        f"[{number(1e3 * row['ttft_p99_s_lo'])}, "
                        f"{number(1e3 * row['ttft_p99_s_hi'])}]")
    assert "0 of 4 replications (2 variants) overloaded" in page.text
    assert len(page.pres) == 2  # each variant's resolved scenario
    assert sum(1 for h in page.headers if h == "95% CI") == 2  # each variant's full table

