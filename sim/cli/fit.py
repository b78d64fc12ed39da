"""`servesim fit-workload`: a generator fitted to a trace (`sim.studies.fit_workload`), written
as a scenario whose workload is `synthetic`, with the fit's report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, console, set_option


@app.command("fit-workload")
def fit_workload(
    scenario: Annotated[Path, typer.Argument(
        metavar="SCENARIO", help="a scenario whose workload is the trace to fit (its window, "
                                 "where and num_requests apply)")],
    out: Annotated[Path, typer.Option("--out", help="the scenario to write (YAML): this one "
                                                    "with the fitted workload")],
    set_: Annotated[list[str] | None, set_option("over the scenario file")] = None,
) -> None:
    """Fit a synthetic workload (arrival rate and burstiness, length percentiles and their
    correlation) to a trace;
    print how close it is (KS distances, burstiness, what it does not keep); write it."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.config.overrides import load_scenario, parse_overrides
    from sim.config.scenario import parse_scenario, scenario_yaml
    from sim.results.outdir import replace_text
    from sim.studies.fit_workload import fit_workload as fit

    if out.suffix not in (".yaml", ".yml"):
        raise InputError(COMMAND_LINE, "--out", str(out), "a scenario is a .yaml file")
    loaded = load_scenario(scenario, parse_overrides(set_))
    result = fit(loaded)
    fitted = parse_scenario({**loaded.model_dump(mode="json"), "workload": result.workload},
                            str(out))
    console.print(fit_table(result.report))
    header = "".join(f"# {line}\n" for line in fit_lines(scenario, result.report))
    try:
        replace_text(out, header + scenario_yaml(fitted))
    except OSError as exc:
        raise InputError(COMMAND_LINE, "--out", str(out),
                         f"cannot write there ({exc.strerror or exc})") from None
    console.print(f"written: {out} (run it: servesim simulate {out}; scale it: --set "
                  "workload.arrivals.qps=...)", soft_wrap=True)


def fit_table(report: dict[str, Any]) -> Table:
    """The fit, as the trace and the fitted generator each show it (80 columns)."""
    table = Table("", "trace", "fitted", "KS distance", box=box.SIMPLE_HEAD,
                  title=f"{report['num_requests']:,} requests over {report['span_s']:,.1f} s")
    ks = report["ks"]
    table.add_row("prompt tokens", "", "percentiles", f"{ks['prompt_tokens']:.3f}")
    table.add_row("output tokens", "", "percentiles", f"{ks['output_tokens']:.3f}")
    cv = report["burstiness_cv"]
    table.add_row("gaps between arrivals", "", "", f"{ks['gap_s']:.3f}")
    table.add_row("burstiness (CV of gaps)", f"{cv['trace']:.2f}", f"{cv['fitted']:.2f}", "")
    corr = report["length_rank_correlation"]
    table.add_row("prompt-output rank corr.", _number(corr["trace"]), _number(corr["fitted"]),
                  "")
    if report["prefix_block_reuse"] is not None:
        table.add_row("prefix blocks reused", f"{100 * report['prefix_block_reuse']:.1f}%",
                      "none", "")
    if (sessions := report.get("sessions")) is not None:
        table.add_row("requests continuing one", f"{100 * sessions['continuing_share']:.1f}%",
                      "none", "")
        table.add_row("turns per session P50/max",
                      f"{sessions['turns_p50']:g}/{sessions['turns_max']}", "", "")
    return table


def fit_lines(source: Path, report: dict[str, Any]) -> list[str]:
    """The fit's report, as the comment heading the written scenario."""
    ks, cv = report["ks"], report["burstiness_cv"]
    lines = [f"servesim fit-workload {source}: {report['num_requests']} requests over "
             f"{report['span_s']:.1f} s",
             f"KS distance, trace vs fitted: prompt {ks['prompt_tokens']:.3f}, output "
             f"{ks['output_tokens']:.3f}, gaps {ks['gap_s']:.3f}; burstiness (CV of gaps) "
             f"{cv['trace']:.2f} vs {cv['fitted']:.2f}",
             f"prompt-output rank correlation "
             f"{_number(report['length_rank_correlation']['trace'])} vs "
             f"{_number(report['length_rank_correlation']['fitted'])}"]
    if report["prefix_block_reuse"] is not None:
        lines.append(f"not kept: prefix blocks reused {100 * report['prefix_block_reuse']:.1f}%"
                     " (retime the trace to keep them)")
    if (sessions := report.get("sessions")) is not None:
        gap = sessions["gap_between_turns_p50_s"]
        lines.append(f"not kept: sessions ({100 * sessions['continuing_share']:.1f}% of "
                     f"requests continue an earlier one; turns P50 {sessions['turns_p50']:g}, "
                     f"max {sessions['turns_max']}"
                     + (f"; {gap:.3g} s between turns P50" if gap is not None else "") + ")")
    return lines


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"
