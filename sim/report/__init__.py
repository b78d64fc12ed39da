"""One self-contained HTML page for a result directory (a run, a sweep, a comparison, a
capacity search, replications or a replicated comparison): its figures embedded as PNG data
URIs, its tables with units (replications': estimates with 95% intervals), the overload
verdict, the resolved scenario, recorded input hashes and versions. No script and nothing
fetched from elsewhere, so it opens offline; the same directory gives the same page (no
timestamps are added; the figures' bytes are whatever `sim.plots` writes)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from sim.config.errors import InputError
from sim.report import markup as m
from sim.report import sections as s
from sim.report.replicated import replicated_comparison_body, replications_body
from sim.results.labels import label, param_label
from sim.results.outdir import REPORT_FILE, check_not_a_result_file, replace_text
from sim.results.read import Kind, directory_kind, read_csv, read_json

TITLES: dict[Kind, str] = {"run": "run", "sweep": "sweep", "comparison": "comparison",
                           "capacity": "capacity search", "replications": "replications",
                           "replicated_comparison": "replicated comparison",
                           "plan": "plan (fleet sizing)"}


def refuse_validation_dir(results: Path) -> None:
    """A `servesim validate` directory is not one result: say where its table and figure are
    and which runs can be drawn (it was 'no servesim results here')."""
    if not ((results / "meta.json").is_file()
            and ((results / "errors.csv").is_file() or (results / "runs").is_dir())):
        return
    runs = sorted((results / "runs").glob("*/load_*/replay_1"))
    what = (f"its table is {results / 'table.txt'} and its figure {results / 'validation.png'}"
            if (results / "table.txt").is_file()
            else "an interrupted sitting (meta.json: complete false), no tables")
    raise InputError(results, "RESULTS", str(results), (
        f"a `servesim validate` directory: {what}; report or plot one of its runs"
        + (f", e.g. {runs[0]}" if runs else "")))


def render_report(results: Path) -> str:
    """The report of `results` as one HTML document; `InputError` if it holds no results."""
    kind = directory_kind(results)
    body = BODIES[kind](results)
    with tempfile.TemporaryDirectory(prefix="servesim-report-") as tmp:
        from sim.plots import plot_results

        pngs = [p for p in plot_results([results], Path(tmp)) if p.suffix == ".png"]
        figures = [m.figure(p) for p in pngs]
    if figures:
        body.insert(2, m.section("Figures", *figures))
    name = results.absolute().name
    return m.page(f"servesim {TITLES[kind]}: {name}", f"results in {results}", body)


def write_report(results: Path, out: Path | None = None) -> Path:
    """Write the report of `results` to `out` (default `results/report.html`); return it."""
    refuse_validation_dir(results)
    directory_kind(results)  # not results: say so before checking where the page goes
    out = out if out is not None else results / REPORT_FILE
    check_not_a_result_file(out, results)
    _check_writable(out)
    text = render_report(results)
    try:  # whole or not at all: a reader never sees half a page
        replace_text(out, text)
    except OSError as exc:
        raise InputError(out, "--out", str(out), _cannot(exc)) from None
    return out


def _check_writable(out: Path) -> None:
    """Fail before drawing anything if the page cannot be written at `out`."""
    if out.is_dir():
        raise InputError(out, "--out", str(out), "is a directory: name an .html file")
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.absolute().parent).close()
    except OSError as exc:
        raise InputError(out, "--out", str(out), _cannot(exc)) from None
    if out.exists() and not os.access(out, os.W_OK):
        raise InputError(out, "--out", str(out), "cannot write there: permission denied")


def _cannot(exc: OSError) -> str:
    return f"cannot write there: {(exc.strerror or str(exc)).lower()}"


def _run(run_dir: Path) -> list[str]:
    summary = read_json(run_dir / "summary.json")
    replayed = ([m.section("Replay: measured, not simulated", s.replay_measured(summary))]
                if isinstance(summary.get("replay"), dict) else [])
    return [
        m.section("Overload verdict", s.overload_verdict(summary)),
        m.section("Headline metrics", s.run_headline(summary),
                  *([m.paragraph("By request class:"), s.class_metrics(summary)]
                    if summary.get("classes") else [])),
        *replayed,
        m.section("Run", s.run_setup(summary)),
        m.section("Resolved scenario", s.scenarios([("scenario.yaml",
                                                     run_dir / "scenario.yaml")])),
        m.section("Inputs and versions", s.inputs_and_versions([run_dir])),
    ]


def _sweep(sweep_dir: Path) -> list[str]:
    table, tables = s.sweep_tables(sweep_dir)
    keys = [str(k) for k in table["key"]]
    varied = [c for c in table.columns if "." in c]
    runs = [sweep_dir / "runs" / k for k in dict.fromkeys(keys)]
    note = ("The first point's scenario; the others differ in "
            + (", ".join(param_label(c) for c in varied) if varied else "their seeds")
            + " (see the table).")
    return [
        m.section("Overload verdict", _counts(table, "runs")),
        m.section("Results", tables),
        m.section("Resolved scenario", s.scenarios(
            [(f"runs/{runs[0].name}/scenario.yaml", runs[0] / "scenario.yaml")], note)
            if runs else m.paragraph("The sweep has no runs.")),
        m.section("Inputs and versions", s.inputs_and_versions(runs)),
    ]


def _comparison(compare_dir: Path) -> list[str]:
    table = s.comparison_table(compare_dir)
    variants = [compare_dir / str(v) for v in table["variant"]]
    return [
        m.section("Overload verdict", _counts(table, "variants")),
        m.section("Results", m.frame_table(table, 3 if "scheduler" in table else 1)),
        m.section("Resolved scenarios", s.scenarios(
            [(f"{v.name}/scenario.yaml", v / "scenario.yaml") for v in variants],
            "One per variant (open each below).")),
        m.section("Inputs and versions", s.inputs_and_versions(variants)),
    ]


def _capacity(cap_dir: Path) -> list[str]:
    result, tables = s.capacity_tables(cap_dir)
    trials_path = cap_dir / "trials.csv"
    verdict = (_counts(read_csv(trials_path), "trial runs") if trials_path.is_file()
               else m.paragraph("No trials.csv: no per-run verdicts recorded."))
    source = result.get("source") or "its scenario file"
    searched = (f"It searched {label(str(result.get('knob', 'qps')))} of scenario "
                f"{result.get('scenario', '?')} from {source}")
    scenario = (s.scenarios([("scenario.yaml", cap_dir / "scenario.yaml")],
                            searched + "; the file holds its starting rate.")
                if (cap_dir / "scenario.yaml").is_file()
                else m.paragraph(f"No scenario.yaml (written before searches kept one). "
                                 f"{searched}."))
    return [
        m.section("Overload verdict", verdict),
        m.section("Capacity", tables),
        m.section("Resolved scenario", scenario),
        m.section("Inputs and versions", s.inputs_and_versions([])),
    ]


def _plan(plan_dir: Path) -> list[str]:
    """A plan's answer (as `servesim plan` prints it), each kind's smallest deployment that
    holds, the counts and the plan itself."""
    import yaml
    from rich.text import Text

    from sim.cli.plan import answer_lines

    record = read_json(plan_dir / "plan.json", missing="no plan.json: the plan did not finish "
                                                       "(run it again; its runs are cached)")
    answer = [m.paragraph(Text.from_markup(line).plain)
              for line in answer_lines(None, record["answer"])]
    limit = record["plan"]["search"]["max_replicas"]
    rows = [(k["kind"], k["refused"] or ("" if k["best"] else
                                         f"costs more than {k['beyond']:,.4g} (1.5x the best)"
                                         if k.get("beyond") else
                                         f"none holds up to {limit} replicas"),
             *((k["best"]["replicas"], k["best"]["num_gpus"], k["best"]["usd_per_hour"])
               if k["best"] else ("-", "-", "-")), k["runs"])
            for k in record["kinds"]]
    counts = record["counts"]
    refused = counts["refused"]
    return [
        m.section("Answer", *answer),
        m.section("Deployments searched", m.paragraph(
            f"{counts.get('candidates', '?')} candidate deployments in {counts['kinds']} kinds; "
            f"{refused} kind{'s' if refused != 1 else ''} refused unsimulated; "
            f"{counts['runs']} runs "
            f"({counts['cached']} cached) in {record['seconds']:.1f} s."),
            m.table(["kind", "refused", "replicas", "GPUs", "USD an hour", "runs"], rows,
                    text_columns=2)),
        m.section("Plan", m.pre(yaml.safe_dump(record["plan"], sort_keys=False))),
        m.section("Inputs and versions", s.inputs_and_versions([])),
    ]


def _counts(table: pd.DataFrame, what: str) -> str:
    if "overload" not in table:
        return m.paragraph("No overload verdicts in these results (written before verdicts).")
    return s.verdict_counts(table["overload"], what)


BODIES: dict[Kind, Callable[[Path], list[str]]] = {
    "run": _run, "sweep": _sweep, "comparison": _comparison, "capacity": _capacity,
    "replications": replications_body, "replicated_comparison": replicated_comparison_body,
    "plan": _plan}
