"""`servesim report`: one self-contained HTML page per result directory, checked by parsing it
(figures inline, nothing fetched, the scenario, verdict and tables there, units applied) and,
where Chromium is installed, by rendering it headless (a page that shows something and logs
nothing on the console)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from sim.config.scenario import load_scenario, parse_scenario
from sim.report import render_report, write_report
from sim.report.markup import header, number, pre, scale
from sim.runner import run_scenario
from sim.studies.compare import compare
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from tests.helpers import ONE_AT_A_TIME, REPO, assert_one_line_error, run_cli, run_cli_out
from tests.studies.test_outputs import one_at_a_time_sweep

TINY = {  # 200 requests of varied lengths on one roofline H100: a second's run
    "name": "tiny", "seed": 0,
    "workload": {"format": "synthetic", "num_requests": 200,
                 "arrivals": {"process": "poisson", "qps": 5.0},
                 "lengths": {"prompt": {"dist": "lognormal", "mean": 500, "std": 300,
                                        "min": 1, "max": 4000},
                             "output": {"dist": "lognormal", "mean": 100, "std": 80,
                                        "min": 1, "max": 500}}},
    "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                "scheduler": {"name": "chunked_prefill"}, "latency": {"kind": "roofline"}},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A real run, sweep (two seeds a point, one point overloaded) and comparison."""
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    run_scenario(load_scenario(tmp / "tiny.yaml")).write(tmp / "run")
    sweep = one_at_a_time_sweep(tmp, [3.0, 30.0])
    sweep.write_text(sweep.read_text() + "seeds: [0, 1]\n")
    run_sweep(load_sweep(sweep)[1], tmp / "sweep")
    base = parse_scenario(ONE_AT_A_TIME, "test")
    heavy = base.model_copy(update={"workload": base.workload.model_copy(update={
        "arrivals": base.workload.arrivals.model_copy(update={"qps": 30.0})})})
    compare({"light": base, "heavy": heavy}, tmp / "cmp")
    return {"run": tmp / "run", "sweep": tmp / "sweep", "comparison": tmp / "cmp"}


@pytest.fixture(scope="module")
def reports(dirs, tmp_path_factory) -> dict[str, Path]:
    """Each directory's report, written once (drawing the figures takes a second or two)."""
    tmp = tmp_path_factory.mktemp("pages")
    return {kind: write_report(d, tmp / f"{kind}.html") for kind, d in dirs.items()}


class Page(HTMLParser):
    """What the checks need from a page: image sources, links, table headers and rows,
    <pre> text and all text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []
        self.tags: set[str] = set()
        self.headers: list[str] = []
        self.rows: list[list[str]] = []
        self.pres: list[str] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self._pre: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src") or "")
        self.links += [v for k, v in attrs if k in ("href", "src", "srcset", "action") and v
                       and tag != "img"]
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "pre":
            self._pre = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            cell = " ".join("".join(self._cell).split())
            (self.headers if tag == "th" else self.rows[-1]).append(cell)
            self._cell = None
        elif tag == "pre" and self._pre is not None:
            self.pres.append("".join(self._pre))
            self._pre = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        for part in (self._cell, self._pre):
            if part is not None:
                part.append(data)

    def row(self, first: str) -> list[str]:
        return next(r for r in self.rows if r and r[0] == first)


RAW_KEY = re.compile(r"\w\.\w|_s\b|_")  # a dotted scenario path, a `*_s` key, any snake_case


def check_readable_headers(page: Page) -> None:
    """Every table heading is a name from `sim.results.labels` (as the CLI tables and figures say
    it), never a raw column key."""
    raw = sorted({h for h in page.headers if RAW_KEY.search(h)})
    assert not raw, raw


def check_self_contained(html: str) -> Page:
    page = Page(html)
    assert page.images, "no figure"
    for src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:60]
        png = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert png.format == "PNG" and png.size[0] > 300
    assert not page.links, page.links  # no stylesheet, script or link to fetch
    assert "script" not in page.tags and "link" not in page.tags
    assert "http://" not in html and "https://" not in html
    check_readable_headers(page)
    return page


def test_run_report_shows_scenario_verdict_and_metrics_in_ms(dirs, reports):
    run = dirs["run"]
    page = check_self_contained(reports["run"].read_text())
    assert (run / "scenario.yaml").read_text() in page.pres  # whole, unescaped back
    summary = json.loads((run / "summary.json").read_text())
    verdict = summary["overload"]
    assert f"{verdict['verdict']}: {verdict['detail']}" in "".join(page.text)
    assert {"metric", "count", "p50 (ms)", "p99 (ms)", "max (ms)"} <= set(page.headers)
    ttft = page.row("TTFT")
    assert ttft[1] == number(summary["ttft_s"]["count"])
    assert ttft[4] == number(1e3 * summary["ttft_s"]["p90"])  # seconds shown as ms
    assert page.row("python")[1] and page.row("numpy")[1] and page.row("simpy")[1]
    assert "read no input files" in "".join(page.text)  # said, not left blank
    recorded = json.loads((run / "inputs.json").read_text())
    line = next(t for t in page.text if t.startswith("Recorded with the results: "))
    assert f"servesim {recorded['servesim']}" in line
    assert f"numpy {recorded['versions']['numpy']}" in line


def test_sweep_report_has_both_tables_with_intervals_and_recorded_versions(dirs, reports):
    page = check_self_contained(reports["sweep"].read_text())
    assert page.headers.count("arrival rate (req/s)") == 2  # interval table, per-run table
    assert {"seeds", "overload verdict", "P99 TBT (ms)", "P99 E2E latency (s)",
            "output throughput (tokens/s)"} <= set(page.headers)
    assert "2 of 4 runs overloaded" in page.text
    assert page.row("30")[6].count("[") == 1  # TTFT p50 with its interval beside it
    fingerprint = json.loads(next((dirs["sweep"] / "runs").glob("*/inputs.json")).read_text())
    line = next(t for t in page.text if t.startswith("Recorded with the results: "))
    assert f"servesim {fingerprint['servesim']}" in line
    assert len(page.pres) == 1 and "qps" in page.pres[0]


def test_comparison_report_shows_each_variant(reports):
    page = check_self_contained(reports["comparison"].read_text())
    assert {"variant", "overload verdict", "P99 TTFT (ms)", "SLO attainment (%)"} <= set(
        page.headers)
    assert page.row("heavy")[3] == "overloaded" and page.row("light")[3] == "stable"
    assert "1 of 2 variants overloaded" in page.text
    assert len(page.pres) == 2  # each variant's resolved scenario


def test_capacity_report_shows_the_answer_and_each_rate(tmp_path, monkeypatch, capsys):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(ONE_AT_A_TIME))
    code, _ = run_cli_out(monkeypatch, capsys, "capacity", str(tmp_path / "s.yaml"),
                          "--sched-delay-p50", "0.5", "--precision", "0.2", "--seeds", "2",
                          "--out", str(tmp_path / "cap"))
    assert code == 0
    page = check_self_contained(render_report(tmp_path / "cap"))
    result = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert page.row("capacity")[1:] == ["req/s", number(result["capacity_qps"])]
    assert page.row("SLO targets")[2] == "P50 scheduling delay <= 500 ms"
    low, high = result["interval_qps"]  # two seeds a rate: a confidence bound at each end
    assert page.row("interval: 95% confidence bound at each end")[1:] == [
        "req/s", f"[{number(low)}, {number(high)}]"]
    assert result["interval_meaning"] in page.text
    assert [r[2] for r in page.rows if len(r) > 2 and r[2] in ("holds", "fails")] == [
        r["decision"] for r in result["rates"]]
    over = sum(1 for r in page.rows if len(r) > 4 and r[4] == "overloaded")
    assert over > 0 and f"{over} of {result['num_runs']} trial runs overloaded" in page.text
    # Each trial "met the SLO": yes or no, as a reader says it (it read True / False).
    cells = {cell for row in page.rows for cell in row}
    assert {"yes", "no"} <= cells and not {"True", "False"} & cells


def test_headers_are_the_labels_the_cli_and_figures_use():
    assert [header(c) for c in ("workload.arrivals.qps", "tbt_p99_s", "output_tokens_per_s",
                                "slo_attainment", "e2e_p99_s", "replica.scheduler.token_budget",
                                "num_seeds", "some_new_time_s", "variant")] == [
        "arrival rate (req/s)", "P99 TBT (ms)", "output throughput (tokens/s)",
        "SLO attainment (%)", "P99 E2E latency (s)", "token budget (tokens)", "seeds",
        "some new time (s)", "variant"]
    assert scale("tbt_p99_s") == 1e3 and scale("e2e_p99_s") == 1.0  # as the heading says
    with pytest.raises(AssertionError, match="tbt_p99"):  # the page check sees a raw key
        check_readable_headers(Page("<table><tr><th>tbt_p99 (ms)</th></tr></table>"))


def test_the_same_directory_gives_the_same_page(dirs, reports):
    assert render_report(dirs["sweep"]) == reports["sweep"].read_text()


def test_text_from_files_is_escaped():
    assert pre("a: <b>&") == "<pre><code>a: &lt;b&gt;&amp;</code></pre>"


def test_cli_writes_next_to_the_results_by_default(dirs, monkeypatch, capsys):
    code, printed = run_cli_out(monkeypatch, capsys, "report", str(dirs["comparison"]))
    assert code == 0 and printed.strip() == str(dirs["comparison"] / "report.html")
    assert (dirs["comparison"] / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_bad_directory_or_output_is_a_one_line_error(dirs, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = run_cli(monkeypatch, capsys, "report", str(empty))
    assert_one_line_error(code, err, "no servesim results here")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, needle in ((a_file / "r.html", "cannot write there"), (empty, "is a directory")):
        code, err = run_cli(monkeypatch, capsys, "report", str(dirs["run"]), "--out", str(out))
        assert_one_line_error(code, err, "--out", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]


@pytest.mark.parametrize(("kind", "table", "column", "value", "problem"), [
    ("comparison", "comparison.csv", "ttft_p99_s", -1.0, "not negative"),
    ("comparison", "comparison.csv", "num_preemptions", -3, "not negative"),
    ("sweep", "results.parquet", "tbt_p99_s", -0.5, "not negative"),
    # A variant's own run, drawn in the comparison's CDFs.
    ("comparison", "heavy/requests.parquet", "ttft_s", -1.0, "a first token before its arrival"),
])
def test_an_edited_study_table_is_refused_by_report_and_plot(dirs, tmp_path, monkeypatch, capsys,
                                                             kind, table, column, value, problem):
    # Was a report (and a figure) with a negative latency drawn as if measured: a study's
    # tables were checked for kinds only, and its runs not at all.
    edited = tmp_path / kind
    shutil.copytree(dirs[kind], edited)
    path = edited / table
    frame = pd.read_csv(path) if table.endswith(".csv") else pd.read_parquet(path)
    frame.loc[1, column] = value
    frame.to_csv(path, index=False) if table.endswith(".csv") else frame.to_parquet(path)
    for args in (("report", str(edited), "--out", str(tmp_path / "r.html")),
                 ("plot", str(edited), "--out", str(tmp_path / "plots"))):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, table, f"{column}={value}", problem, "row 1")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "plots").exists()


# Rendering in a browser -----------------------------------------------------------------------

def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("chromium not installed: `apt-get install chromium` to render the reports")
    return found


def render(page: Path, png: Path) -> tuple[np.ndarray, list[str]]:
    """Chromium's screenshot of `page` (RGB) and the console lines it logged. With
    `--enable-logging=stderr`, each console message (console.error, an uncaught exception)
    is a log line tagged `:CONSOLE`; `test_console_check_sees_a_script_error` proves it."""
    done = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", f"--screenshot={png}", "--window-size=1280,2000",
         page.absolute().as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return np.asarray(Image.open(png).convert("RGB"), dtype=float), console


def test_console_check_sees_a_script_error(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><p>x</p><script>undefinedFunction();</script>")
    _, console = render(bad, tmp_path / "bad.png")
    assert any("Uncaught ReferenceError" in line for line in console), console


@pytest.mark.parametrize("kind", ["run", "sweep"])
def test_report_renders_in_chromium(reports, tmp_path, kind):
    pixels, console = render(reports[kind], tmp_path / f"{kind}.png")
    assert not console, console
    assert pixels.shape == (2000, 1280, 3)
    grey = pixels.mean(axis=2)
    # A blank page has no pixel below 245 and a page of one word 0.01%; these have 3-8%.
    assert (grey < 245).mean() > 0.02 and grey.std() > 10
    assert (grey[1000:] < 245).mean() > 0.01  # the lower half too
    # Saturated colour comes only from the figures' lines and bars (text is grey, the
    # verdict's box pale): 0 if no image decoded, 0.2-2% of the page when they show.
    assert ((pixels.max(axis=2) - pixels.min(axis=2)) > 60).mean() > 0.0005


def test_a_validation_directory_says_where_its_table_is(tmp_path, monkeypatch, capsys):
    """`servesim report` and `plot` of `servesim validate`'s output said 'no servesim results
    here', of a directory servesim wrote: they name its table and figure, and its runs."""
    shutil.copytree(REPO / "validation" / "azure_conv",
                    tmp_path / "v")
    run = tmp_path / "v" / "runs" / "chunked_prefill" / "load_0.50" / "replay_1"
    run.mkdir(parents=True)
    for command in ("report", "plot"):
        code, err = run_cli(monkeypatch, capsys, command, str(tmp_path / "v"))
        assert_one_line_error(code, err, "a `servesim validate` directory",
                              f"its table is {tmp_path / 'v' / 'table.txt'}",
                              "validation.png", f"e.g. {run}")
    assert not (tmp_path / "v" / "report.html").exists()
    assert not (tmp_path / "v" / "plots").exists()


def test_a_run_with_timeouts_and_sessions_shows_them(tmp_path):
    data = {"workload": {"format": "prefix", "num_conversations": 30, "num_turns": 3,
                         "arrivals": {"qps": 20.0}, "question_tokens": 300,
                         "output_tokens": 300, "think_time_s": 0.1, "timeout_s": 4.0,
                         "hash_block_tokens": 16},
            "replica": {"scheduler": {"name": "vllm_v1", "max_num_seqs": 4}}}
    run_scenario(parse_scenario(data, "test"), out_dir=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests"]["failed"] > 0
    page = Page(render_report(tmp_path / "run"))
    counts = page.row("requests finished / rejected / failed / unfinished")
    req = summary["requests"]
    assert counts[-1] == " / ".join(str(req[k]) for k in ("finished", "rejected", "failed",
                                                          "unfinished"))
    sessions = summary["sessions"]
    assert page.row("sessions completed / all")[-1] == (f"{sessions['num_completed']} / "
                                                        f"{sessions['num_sessions']}")
